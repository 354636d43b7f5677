"""Predicting by task name: the service side of `POST /v1/tasks/{task}/predict`.

A request names a task, texts (or text pairs) and which version answers (an alias, `best` by default,
`best-<method>`, or a version number). The service checks the rows against the limits table, resolves
the version in the registry and delta store at every request (a new best answers from the next request
on; an archived version answers to no alias), and sends (task, version, sha256) with the rows to the
Ray Serve application of the backbone the version was trained on (`workers.serving`), starting that
application at its first request. The replica checks the delta's file against the sha256 the store
recorded before it serves it. Nothing here loads torch: the replicas do.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pelt_core.limits import MAX_PREDICT_ROWS, MAX_PREDICT_TEXT_CHARS
from services.errors import ServiceError
from services.settings import Settings

log = logging.getLogger(__name__)

SERVE_NAMESPACE_APPS = "pelt"  # Ray namespace the API joins to reach Serve


@dataclass(frozen=True)
class Prediction:
    """An answer: the version that gave it and one prediction per row, in order."""

    task: str
    version: str
    method: str | None
    kind: str
    sha256: str
    backbone: str
    rows: list[dict[str, Any]]


class VersionFetcher:
    """What a replica calls to get a version's files: the delta store's download (checked against the
    sha256 the store recorded) into `dest`. Picklable: the store's URIs travel to the replica."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __call__(self, key: Any, dest: Path) -> Path:
        return self.store.download(key.task, key.version, dest=dest / "delta")


def check_rows(texts: Any) -> list[str | tuple[str, str]]:
    """The request's rows as texts and (text, text_pair) tuples; a ServiceError naming `texts` (422, or
    413 beyond MAX_PREDICT_ROWS rows) for anything else, before any model work."""
    if not isinstance(texts, list) or not texts:
        raise ServiceError("give at least one text to predict", status=422, field="texts")
    if len(texts) > MAX_PREDICT_ROWS:
        raise ServiceError(
            f"{len(texts)} rows; one request takes at most {MAX_PREDICT_ROWS} (split the rest into more "
            "requests; `pelt predict --file` does)",
            status=413,
            field="texts",
        )
    rows: list[str | tuple[str, str]] = []
    for position, text in enumerate(texts):
        parts = [text] if isinstance(text, str) else text
        if not (
            isinstance(parts, list | tuple)
            and len(parts) in (1, 2)
            and all(isinstance(p, str) for p in parts)
        ) or (not isinstance(text, str) and len(parts) != 2):
            raise ServiceError(
                f"texts[{position}]: a text or a [text, text_pair] pair of strings, got {type(text).__name__}",
                status=422,
                field="texts",
            )
        for part in parts:
            if len(part) > MAX_PREDICT_TEXT_CHARS:
                raise ServiceError(
                    f"texts[{position}]: {len(part):,} characters; a text holds at most "
                    f"{MAX_PREDICT_TEXT_CHARS:,}",
                    status=413,
                    field="texts",
                )
        rows.append(text if isinstance(text, str) else (parts[0], parts[1]))
    return rows


def version_reference(task: str, version: str | int | None) -> Any:
    """The store's reference for `version`: a number, an alias (`best`, `best-lora`, one you set), or
    None for `best`."""
    from services.delta_store import DeltaRef

    if version is None or str(version).strip() == "":
        return DeltaRef(task)
    text = str(version).strip()
    if text.isdigit():
        return DeltaRef(task, version=text)
    return DeltaRef(task, alias=text)


class PredictionService:
    """Resolves versions and sends rows to the backbones' Serve applications (one per backbone, started
    at its first request). `operations`: the service layer (registry, delta store, settings)."""

    def __init__(self, operations: Any, settings: Settings) -> None:
        self.operations, self.settings = operations, settings
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()

    def predict(self, task: str, texts: Any, version: str | int | None = None) -> Prediction:
        rows = check_rows(texts)
        self.operations.get_task(task)  # an unknown task: 404 naming the known ones
        info = self._resolve(task, version)
        if info.archived:  # it answers to its number for pulls, never for predictions
            raise ServiceError(
                f"{task} version {info.version} is archived; it is not served (predict with another "
                "version, or `best`)",
                status=404,
                field="version",
            )
        if info.kind == "multi_task":
            raise ServiceError(
                f"{task} version {info.version} is a multi-task bundle; predict with each of its tasks' "
                "own versions",
                status=409,
                field="version",
            )
        backbone = self._backbone_of(info)
        from pelt_core.serving import DeltaKey

        key = DeltaKey(info.task, int(info.version), info.sha256)
        answer = self._call(backbone, key, rows)
        if "error" in answer:
            raise self._replica_error(info, answer)
        return Prediction(
            task=info.task,
            version=str(info.version),
            method=info.method,
            kind=info.kind,
            sha256=info.sha256,
            backbone=backbone.name,
            rows=answer["rows"],
        )

    # --- internals -------------------------------------------------------------------------------

    def _resolve(self, task: str, version: str | int | None) -> Any:
        """The version that answers, resolved now (a new best answers from the next request on)."""
        from services.delta_store import DeltaNotFoundError

        try:
            return self.operations.delta_info(version_reference(task, version))
        except DeltaNotFoundError:
            if not self.operations.delta_versions(task):
                raise ServiceError(
                    f"task {task!r} has no trained version yet: predict once one of its jobs has succeeded",
                    status=404,
                    field="version",
                ) from None
            raise

    def _backbone_of(self, info: Any) -> Any:
        """The registered backbone the version was trained on: a 409 naming both when the registry's
        backbone of that name is another checkpoint now, or has gone."""
        from services.delta_store.values import TAG_BACKBONE, TAG_BACKBONE_HASH
        from services.registry import UnknownBackboneError

        name, trained_on = info.tags.get(TAG_BACKBONE), info.tags.get(TAG_BACKBONE_HASH)
        if not name or not trained_on:
            raise ServiceError(
                f"{info.task} version {info.version} does not record its backbone; it cannot be served",
                status=409,
                field="version",
            )
        try:
            record = self.operations.registry.get_backbone(name)  # its real source (the API shows another)
        except UnknownBackboneError:
            raise ServiceError(
                f"{info.task} version {info.version} was trained on backbone {name!r}, which this service "
                "no longer has (`pelt backbones` lists them)",
                status=409,
                field="version",
            ) from None
        if record.content_hash != trained_on:
            raise ServiceError(
                f"{info.task} version {info.version} was trained on backbone {name!r} with content hash "
                f"{trained_on[:12]}…, but {name!r} is now {record.content_hash[:12]}…: no replica holds "
                "the backbone it needs",
                status=409,
                field="version",
            )
        return record

    def _call(self, backbone: Any, key: Any, rows: Sequence[Any]) -> dict[str, Any]:
        from ray.serve.exceptions import BackPressureError

        handle = self._handle(backbone)
        try:
            return handle.predict.remote((key, list(rows))).result(
                timeout_s=self.settings.predict_timeout_seconds
            )
        except BackPressureError:
            raise ServiceError(
                "the prediction replicas are busy (PELT_PREDICT_MAX_QUEUED requests wait already); try again",
                status=503,
                retry_after=1,
            ) from None
        except TimeoutError:
            raise ServiceError(
                f"the prediction took longer than {self.settings.predict_timeout_seconds:g} s "
                "(PELT_PREDICT_TIMEOUT_SECONDS); try again",
                status=503,
                retry_after=5,
            ) from None

    def _handle(self, backbone: Any) -> Any:
        with self._lock:
            handle = self._handles.get(backbone.name)
            if handle is None:
                handle = self._deploy(backbone)
                self._handles[backbone.name] = handle
            return handle

    def _deploy(self, backbone: Any) -> Any:
        """Start (or join) the backbone's Serve application; a 503 naming the cause when it cannot start."""
        from ray import serve

        from services.dispatcher import connect_ray
        from workers.serving import ReplicaConfig, app_name, predict_application

        connect_ray(self.settings, namespace=SERVE_NAMESPACE_APPS, log_to_driver=False)
        serve.start(proxy_location="Disabled")
        name = app_name(backbone.name)
        config = ReplicaConfig(
            backbone_name=backbone.name,
            backbone_source=backbone.source,
            content_hash=backbone.content_hash,
            max_deltas=self.settings.predict_max_deltas,
            max_delta_bytes=self.settings.predict_max_delta_bytes,
            threads=self.settings.predict_threads,
        )
        app = predict_application(
            config,
            VersionFetcher(self.operations.store),
            replicas=self.settings.predict_replicas,
            cpus_per_replica=self.settings.predict_cpus_per_replica,
            max_queued_requests=self.settings.predict_max_queued,
        )
        log.info("starting the prediction replicas of backbone %s (%s)", backbone.name, name)
        try:
            return serve.run(app, name=name, route_prefix=None)
        except Exception as exc:
            with contextlib.suppress(Exception):  # already gone
                serve.delete(name)
            raise ServiceError(
                f"the prediction replicas of backbone {backbone.name!r} did not start: {exc}",
                status=503,
                retry_after=30,
            ) from None

    def _replica_error(self, info: Any, answer: dict[str, Any]) -> Exception:
        from services.delta_store.errors import DeltaIntegrityError

        kind, message = answer.get("type"), answer.get("error", "")
        if kind in ("DeltaError", "DeltaIntegrityError"):
            return DeltaIntegrityError(f"{info.task} version {info.version}: {message}; it is not served")
        if kind == "ValueError":
            return ServiceError(message, status=422, field="texts")
        return ServiceError(f"{info.task} version {info.version} failed to predict: {message}", status=500)


__all__ = ["Prediction", "PredictionService", "VersionFetcher", "check_rows", "version_reference"]
