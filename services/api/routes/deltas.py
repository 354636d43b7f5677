"""/v1/tasks/{name}/deltas and /v1/compose: a task's stored delta versions, which one a reference
resolves to, their files as a zip, archiving one (an admin's), and new versions composed from stored
ones."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi import Path as PathParam
from fastapi.responses import FileResponse
from starlette.types import Receive, Scope, Send

from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import ADMIN, READ, WRITE, Name, Operations
from services.api.schemas import ComposeIn, ComposeOut, VersionOut
from services.delta_store import DeltaRef
from services.errors import ServiceError

router = APIRouter(tags=["deltas"], route_class=BoundedJsonRoute)  # JSON nests at most MAX_JSON_DEPTH deep

RefQuery = Annotated[str | None, Query(max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")]
VersionQuery = Annotated[str | None, Query(pattern=r"^[0-9]{1,9}$", description="a version number")]
VersionPath = Annotated[str, PathParam(pattern=r"^[0-9]{1,9}$", description="a version number")]


def reference(
    name: Name, version: VersionQuery = None, alias: RefQuery = None, method: RefQuery = None
) -> DeltaRef:
    """The store's reference to one version of task `name`: by its number, an alias or a method's best
    (at most one of them; default: the task's best, or a composition's latest). A method stays a method
    (not its alias), so an unknown one is refused as a method."""
    given = [x for x in (version, alias, method) if x]
    if len(given) > 1:
        raise ServiceError("give at most one of version, alias and method", status=422, field="version")
    return DeltaRef(name, version=version or None, alias=alias or None, method=method or None)


Reference = Annotated[DeltaRef, Depends(reference)]


class TemporaryFileResponse(FileResponse):
    """A temporary file's bytes, read from disk and sent in chunks (64 KiB), then `discard` removes the
    file: once the answer is sent, when the client goes away mid-answer, or when sending fails. The
    answer's memory does not grow with the file."""

    def __init__(self, path: Path, discard: Callable[[], None], **options: Any) -> None:
        super().__init__(path, stat_result=os.stat(path), **options)
        self.discard = discard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.discard()


def version_out(info: Any) -> VersionOut:
    """The API's view of a `services.delta_store.VersionInfo`."""
    return VersionOut(
        task=info.task,
        model_name=info.model_name,
        version=str(info.version),
        kind=info.kind,
        sha256=info.sha256,
        run_id=info.run_id,
        job_id=info.job_id,
        method=info.method,
        metric=info.metric,
        metric_value=info.metric_value,
        aliases=list(info.aliases),
        tags=dict(info.tags),
        created_at=info.created_at,
        uri=info.uri,
        archived=info.archived,
    )


@router.get("/tasks/{name}/deltas", response_model=list[VersionOut], dependencies=[READ])
def delta_versions(operations: Operations, name: Name) -> Any:
    """Every stored delta version of the task, newest first, with aliases (best, best-<method>)."""
    return [version_out(info) for info in operations.delta_versions(name)]


@router.get("/tasks/{name}/deltas/info", response_model=VersionOut, dependencies=[READ])
def delta_info(operations: Operations, ref: Reference) -> Any:
    """Which version a reference resolves to: the task's best by default."""
    return version_out(operations.delta_info(ref))


@router.get(
    "/tasks/{name}/deltas/download",
    dependencies=[READ],
    responses={200: {"content": {"application/zip": {}}, "description": "the version's files, zipped"}},
)
def delta_download(operations: Operations, ref: Reference) -> TemporaryFileResponse:
    """The version's files as a zip (delta.safetensors + manifest.json, or a multi-task bundle);
    headers X-Pelt-Version, X-Pelt-Sha256 (of the delta file) and X-Pelt-Kind. The zip is sent from a
    private temporary file, removed once sent or once the client went away."""
    archive = operations.delta_archive(ref)
    info = archive.info
    try:
        return TemporaryFileResponse(
            archive.path,
            archive.discard,
            media_type="application/zip",
            headers={
                "Content-Disposition": f'attachment; filename="{archive.filename}"',
                "X-Pelt-Version": str(info.version),
                "X-Pelt-Sha256": info.sha256 or "",
                "X-Pelt-Kind": info.kind,
            },
        )
    except BaseException:
        archive.discard()
        raise


@router.post("/tasks/{name}/deltas/{version}/archive", response_model=VersionOut, dependencies=[ADMIN])
def archive_version(operations: Operations, name: Name, version: VersionPath) -> Any:
    """Archive a version (admin; audited): its aliases go, no pull by name or alias answers with it
    again; its version number still pulls it."""
    return version_out(operations.archive_version(name, version))


@router.post("/compose", response_model=ComposeOut, status_code=201, dependencies=[WRITE])
def compose(operations: Operations, body: ComposeIn) -> Any:
    """Compose stored deltas into a new version of `into` (merge: linear, TIES, DARE; average;
    merge_lora_svd; multi_task bundle). `into` a registered task is refused (409) unless that task is
    among the sources or `allow_existing` is set."""
    composed = operations.compose(
        body.op,
        body.sources,
        body.into,
        body.options,
        body.aliases,
        body.description,
        allow_existing=body.allow_existing,
    )
    return ComposeOut(
        task=composed.task,
        version=composed.version,
        sha256=composed.stored.sha256,
        provenance=composed.provenance,
    )
