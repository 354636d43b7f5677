"""The HTTP API: thin FastAPI routes over `services.service.PeltService`.

Every route under /v1 needs `Authorization: Bearer <token>` (tokens: `pelt token create`; only their
SHA-256 is stored); /health answers without one. Each route declares the scope it needs with one of
READ, WRITE, ADMIN (`requires`): read < write < admin; a token without it gets a 403 naming the scope.
Errors are JSON {"error": {status, type, field, message}}, their messages without server paths or store
URIs (`services.redaction`); an unexpected error is a 500 that keeps the connection open (`CatchAll`).
Bodies are bounded: PELT_MAX_REQUEST_BYTES for JSON, PELT_MAX_UPLOAD_BYTES for a dataset upload. The
OpenAPI schema is at /openapi.json (a token needed); /docs and /redoc exist only with PELT_API_DOCS=true
(they load their assets from a CDN, and /openapi.json then answers without a token).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from importlib.metadata import version as package_version
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pelt_core.limits import INT32_MAX
from services.api.bodies import BoundedJsonRoute, check_json_depth, known_form_fields
from services.api.schemas import (
    AuditEventOut,
    BackboneIn,
    BackboneOut,
    ComposeIn,
    ComposeOut,
    ErrorOut,
    EventOut,
    HealthOut,
    JobIn,
    JobOut,
    LeaderboardOut,
    LeaderboardRowOut,
    MethodIn,
    MethodOut,
    ProgressOut,
    ResultOut,
    SweepCancelOut,
    SweepIn,
    SweepOut,
    TaskDefinition,
    TaskOut,
    VersionOut,
)
from services.errors import ErrorView, ServiceError, classify, expected_errors
from services.redaction import public_uri, redact
from services.registry import ApiTokenRecord, JobStatus, acting_as
from services.service import PeltService
from services.settings import Settings
from services.uploads import FIELDS as UPLOAD_FIELDS
from services.uploads import Upload

log = logging.getLogger("pelt.api")

JobId = Annotated[int, PathParam(ge=1, le=INT32_MAX, description="a job id")]
SweepId = Annotated[int, PathParam(ge=1, le=INT32_MAX, description="a sweep id")]
Name = Annotated[str, PathParam(min_length=1, max_length=200)]
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 404, 409, 413, 422, 429)
}
UPLOAD_PATHS = ("/v1/tasks",)
OPENAPI_PATH = "/openapi.json"
UNAUTHORIZED = (
    "missing, unknown or revoked token: send 'Authorization: Bearer <token>' (create one with "
    "`pelt token create`)"
)
RefQuery = Annotated[str | None, Query(max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")]
VersionQuery = Annotated[str | None, Query(pattern=r"^[0-9]{1,9}$", description="a version number")]
bearer = HTTPBearer(auto_error=False, description="a token from `pelt token create`")


async def authenticated(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> ApiTokenRecord:
    """The route's caller: the token the gate (`Gate`) already checked for this request; 401 without one.
    (The bearer scheme is declared here so that the OpenAPI schema shows it.)"""
    token = request.scope.get("state", {}).get("token")
    if token is None:
        raise ServiceError(UNAUTHORIZED, status=401, field="Authorization")
    return token


def requires(scope: str) -> Any:
    """The dependency by which a route declares the scope it needs (read < write < admin): a token
    without it gets a 403 naming the scope."""

    async def check(token: Annotated[ApiTokenRecord, Depends(authenticated)]) -> ApiTokenRecord:
        if not token.allows(scope):
            raise ServiceError(
                f"this needs a token with the {scope!r} scope; token {token.name!r} has the "
                f"{token.scope!r} scope (an admin creates tokens: `pelt token create NAME "
                f"--scope {scope}`)",
                status=403,
                field="Authorization",
            )
        return token

    return Depends(check)


READ, WRITE, ADMIN = requires("read"), requires("write"), requires("admin")
Caller = Annotated[ApiTokenRecord, Depends(authenticated)]


def create_app(
    service: PeltService, settings: Settings | None = None, *, dispatcher: Any = None, lifespan: Any = None
) -> FastAPI:
    """The API over a service. `dispatcher`, when given, is reported by /health."""
    settings = settings or service.settings
    docs = settings.api_docs
    app = FastAPI(
        title="pelt",
        version=package_version("pelt"),
        lifespan=lifespan,
        openapi_url=OPENAPI_PATH,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        description="Parameter-efficient tuning of one shared backbone for many tasks: tasks, "
        "methods, jobs and sweeps, leaderboards, deltas and their composition.",
    )
    app.state.service = service

    v1 = APIRouter(
        prefix="/v1", dependencies=[Depends(authenticated)], responses=ERRORS, route_class=BoundedJsonRoute
    )  # JSON bodies nest at most limits.MAX_JSON_DEPTH deep

    # --- tasks -----------------------------------------------------------------------------------

    @v1.post(
        "/tasks",
        response_model=TaskOut,
        status_code=201,
        tags=["tasks"],
        dependencies=[WRITE, Depends(known_form_fields(UPLOAD_FIELDS))],
    )
    def register_task(
        name: Annotated[str, Form(min_length=1, max_length=100, description="task name")],
        definition: Annotated[str, Form(max_length=100_000, description="TaskDefinition as JSON")],
        train: Annotated[UploadFile | None, File(description="JSON Lines, CSV/TSV or Parquet")] = None,
        validation: Annotated[UploadFile | None, File()] = None,
        test: Annotated[UploadFile | None, File()] = None,
        dataset: Annotated[
            UploadFile | None, File(description="zip/tar.gz of a datasets save_to_disk folder")
        ] = None,
    ) -> Any:
        """Register a task from uploaded data; fields and labels are checked against it (nothing is kept
        when they do not fit). Another form field than these, or one sent twice, is a 422 naming it."""
        check_json_depth(definition, "definition")
        try:
            parsed = TaskDefinition.model_validate(json.loads(definition))
        except json.JSONDecodeError as exc:
            raise ServiceError(f"definition: not JSON ({exc})", status=422, field="definition") from None
        except ValidationError as exc:
            raise _validation_error(exc, "definition") from None
        uploads = {
            key: Upload(f.filename or "", f.file)
            for key, f in (("train", train), ("validation", validation), ("test", test), ("dataset", dataset))
            if f
        }
        return service.register_task(name, uploads, parsed.model_dump(exclude_unset=True))

    @v1.get("/tasks", response_model=list[TaskOut], tags=["tasks"], dependencies=[READ])
    def list_tasks() -> Any:
        return service.list_tasks()

    @v1.get("/tasks/{name}", response_model=TaskOut, tags=["tasks"], dependencies=[READ])
    def get_task(name: Name) -> Any:
        return service.get_task(name)

    @v1.get(
        "/tasks/{name}/leaderboard", response_model=LeaderboardOut, tags=["leaderboard"], dependencies=[READ]
    )
    def leaderboard(
        name: Name,
        k_shot: Annotated[int | None, Query(ge=1, le=INT32_MAX)] = None,
        backbone: Annotated[str | None, Query(max_length=100)] = None,
    ) -> Any:
        """One row per method over the task's succeeded jobs, best first (only K = k_shot when given)."""
        task = service.get_task(name)
        rows = service.leaderboard(name, k_shot, backbone)
        return LeaderboardOut(
            task=name,
            metric=task.metric,
            metric_direction=task.metric_direction,
            k_shot=k_shot,
            rows=[
                LeaderboardRowOut.model_validate(
                    dataclasses.replace(row, best_delta_uri=public_uri(row.best_delta_uri))
                )
                for row in rows
            ],
        )

    # --- methods and backbones -------------------------------------------------------------------

    @v1.get("/methods", response_model=list[MethodOut], tags=["methods"], dependencies=[READ])
    def list_methods(builtin: bool | None = None) -> Any:
        return service.list_methods(builtin)

    @v1.post("/methods", response_model=MethodOut, status_code=201, tags=["methods"], dependencies=[WRITE])
    def register_method(body: MethodIn) -> Any:
        """A user preset: a method spec as data (see `pelt methods`)."""
        return service.register_method(body.spec, body.replace)

    @v1.get("/methods/{name}", response_model=MethodOut, tags=["methods"], dependencies=[READ])
    def get_method(name: Name) -> Any:
        return service.get_method(name)

    @v1.get("/backbones", response_model=list[BackboneOut], tags=["backbones"], dependencies=[READ])
    def list_backbones() -> Any:
        return service.list_backbones()

    @v1.post(
        "/backbones", response_model=BackboneOut, status_code=201, tags=["backbones"], dependencies=[ADMIN]
    )
    def register_backbone(body: BackboneIn) -> Any:
        """Register a packaged backbone alias or a model folder inside one of the service's backbone folders
        (PELT_BACKBONE_DIRS; never its data directory). It is loaded once, in a child process with memory
        and time limits, for its content hash and facts; a config beyond the size limits is refused."""
        return service.register_backbone(body.name, body.source)

    @v1.get("/backbones/{name}", response_model=BackboneOut, tags=["backbones"], dependencies=[READ])
    def get_backbone(name: Name) -> Any:
        return service.get_backbone(name)

    # --- jobs and sweeps -------------------------------------------------------------------------

    @v1.post("/jobs", response_model=JobOut, status_code=201, tags=["jobs"], dependencies=[WRITE])
    def submit_job(body: JobIn) -> Any:
        return service.submit_job(**body.model_dump())

    @v1.get("/jobs", response_model=list[JobOut], tags=["jobs"], dependencies=[READ])
    def list_jobs(
        task: Annotated[str | None, Query(max_length=200)] = None,
        status: Annotated[list[JobStatus] | None, Query()] = None,
        method: Annotated[str | None, Query(max_length=200)] = None,
        backbone: Annotated[str | None, Query(max_length=200)] = None,
        sweep_id: Annotated[int | None, Query(ge=1, le=INT32_MAX)] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
        offset: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0,
    ) -> Any:
        """Jobs matching every filter given, oldest first."""
        return service.list_jobs(
            task=task,
            status=[s.value for s in status or []],
            method=method,
            backbone=backbone,
            sweep_id=sweep_id,
            limit=limit,
            offset=offset,
        )

    @v1.get("/jobs/{job_id}", response_model=JobOut, tags=["jobs"], dependencies=[READ])
    def get_job(job_id: JobId) -> Any:
        return service.get_job(job_id)

    @v1.get("/jobs/{job_id}/progress", response_model=ProgressOut, tags=["jobs"], dependencies=[READ])
    def job_progress(job_id: JobId) -> Any:
        """Status and the worker's last report (step, total, loss, tokens/s)."""
        return service.get_job(job_id)

    @v1.post("/jobs/{job_id}/cancel", response_model=JobOut, tags=["jobs"], dependencies=[WRITE])
    def cancel_job(job_id: JobId) -> Any:
        """Cancel a queued job at once, a running one within seconds; a cancelled job is never retried."""
        return service.cancel_job(job_id)

    @v1.get("/jobs/{job_id}/events", response_model=list[EventOut], tags=["jobs"], dependencies=[READ])
    def job_events(job_id: JobId, caller: Caller) -> Any:
        """The job's status changes, oldest first; `detail` (a failure's traceback) for admin tokens only."""
        service.get_job(job_id)
        events = service.job_events(job_id)
        return (
            events
            if caller.allows("admin")
            else [dataclasses.replace(event, detail=None) for event in events]
        )

    @v1.get("/jobs/{job_id}/result", response_model=ResultOut, tags=["jobs"], dependencies=[READ])
    def job_result(job_id: JobId) -> Any:
        result = service.get_result(job_id)
        if result is None:
            status = service.get_job(job_id).status
            raise ServiceError(f"job {job_id} has no result (it is {status})", status=404, field="job_id")
        return dataclasses.replace(result, delta_uri=public_uri(result.delta_uri))  # no server folder

    @v1.post("/sweeps", response_model=SweepOut, status_code=201, tags=["jobs"], dependencies=[WRITE])
    def submit_sweep(body: SweepIn) -> Any:
        """Queue methods × seeds × K values for one task (all jobs or none)."""
        return service.submit_sweep(**body.model_dump())

    @v1.get("/sweeps/{sweep_id}", response_model=SweepOut, tags=["jobs"], dependencies=[READ])
    def get_sweep(sweep_id: SweepId) -> Any:
        return service.get_sweep(sweep_id)

    @v1.post("/sweeps/{sweep_id}/cancel", response_model=SweepCancelOut, tags=["jobs"], dependencies=[WRITE])
    def cancel_sweep(sweep_id: SweepId) -> Any:
        service.get_sweep(sweep_id)
        return SweepCancelOut(sweep_id=sweep_id, cancelled=service.cancel_sweep(sweep_id))

    # --- deltas ----------------------------------------------------------------------------------

    def reference(task: str, version: str | None, alias: str | None, method: str | None) -> str:
        given = [x for x in (version, alias, method) if x]
        if len(given) > 1:
            raise ServiceError("give at most one of version, alias and method", status=422, field="version")
        if version:
            return f"{task}/{version}"
        if method:
            return f"{task}@best-{method.replace('.', '_')}"
        return f"{task}@{alias}" if alias else task

    @v1.get("/tasks/{name}/deltas", response_model=list[VersionOut], tags=["deltas"], dependencies=[READ])
    def delta_versions(name: Name) -> Any:
        """Every stored delta version of the task, newest first, with aliases (best, best-<method>)."""
        return [_version(info) for info in service.delta_versions(name)]

    @v1.get("/tasks/{name}/deltas/info", response_model=VersionOut, tags=["deltas"], dependencies=[READ])
    def delta_info(
        name: Name, version: VersionQuery = None, alias: RefQuery = None, method: RefQuery = None
    ) -> Any:
        """Which version a reference resolves to: the task's best by default."""
        return _version(service.delta_info(reference(name, version, alias, method)))

    @v1.get(
        "/tasks/{name}/deltas/download",
        tags=["deltas"],
        dependencies=[READ],
        responses={200: {"content": {"application/zip": {}}, "description": "the version's files, zipped"}},
    )
    def delta_download(
        name: Name, version: VersionQuery = None, alias: RefQuery = None, method: RefQuery = None
    ) -> Response:
        """The version's files as a zip (delta.safetensors + manifest.json, or a multi-task bundle);
        headers X-Pelt-Version, X-Pelt-Sha256 (of the delta file) and X-Pelt-Kind."""
        archive = service.delta_archive(reference(name, version, alias, method))
        info = archive.info
        return Response(
            archive.content,
            media_type="application/zip",
            headers={
                "Content-Disposition": f'attachment; filename="{archive.filename}"',
                "X-Pelt-Version": str(info.version),
                "X-Pelt-Sha256": info.sha256 or "",
                "X-Pelt-Kind": info.kind,
            },
        )

    @v1.post("/compose", response_model=ComposeOut, status_code=201, tags=["deltas"], dependencies=[WRITE])
    def compose(body: ComposeIn) -> Any:
        """Compose stored deltas into a new version of `into` (merge: linear, TIES, DARE; average;
        merge_lora_svd; multi_task bundle)."""
        composed = service.compose(
            body.op, body.sources, body.into, body.options, body.aliases, body.description
        )
        return ComposeOut(
            task=composed.task,
            version=composed.version,
            sha256=composed.stored.sha256,
            provenance=composed.provenance,
        )

    # --- audit -----------------------------------------------------------------------------------

    @v1.get("/audit", response_model=list[AuditEventOut], tags=["audit"], dependencies=[ADMIN])
    def audit(
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
        offset: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0,
    ) -> Any:
        """Who registered, submitted, cancelled, composed, created or revoked what, newest first."""
        return service.audit_events(limit=limit, offset=offset)

    @app.get("/health", response_model=HealthOut, tags=["health"])
    def health() -> Any:
        """Liveness without a token: the service's version and the kinds of stores it uses (no addresses)."""
        return HealthOut(
            status="ok",
            version=app.version,
            registry=service.registry.engine.url.get_backend_name(),
            delta_store=None
            if service.store is None
            else ("mlflow-server" if service.store.is_server else "mlflow-embedded"),
            dispatcher=None if dispatcher is None else {"workers": len(dispatcher.workers)},
        )

    app.include_router(v1)
    _install_error_handlers(app)
    app.add_middleware(
        Gate,
        service=service,
        limit=settings.max_request_bytes,
        upload_limit=settings.max_upload_bytes + (1 << 20),
        open_schema=docs,
    )
    app.add_middleware(CatchAll)  # outermost of ours: it also answers for an error in the Gate
    return app


def _version(info: Any) -> VersionOut:
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
    )


def _validation_error(exc: ValidationError | RequestValidationError, prefix: str = "") -> ServiceError:
    first = exc.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    field = ".".join([prefix, *location] if prefix else location) or prefix or None
    message = first.get("msg", "invalid")
    return ServiceError(f"{field}: {message}" if field else message, status=422, field=field)


def _install_error_handlers(app: FastAPI) -> None:
    def respond(view: ErrorView) -> JSONResponse:
        headers = {**({"WWW-Authenticate": "Bearer"} if view.status == 401 else {}), **(view.headers or {})}
        view = dataclasses.replace(view, message=redact(view.message))  # no server path or store URI, ever
        return JSONResponse(view.body(), status_code=view.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        return respond(ErrorView(422, "RequestValidationError", str(error), error.field))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(ErrorView(exc.status_code, "HTTPError", str(exc.detail)))

    async def expected(request: Request, exc: Exception) -> JSONResponse:
        view = classify(exc)
        if view is None:  # a subclass classify does not know: a bug, not the caller's fault
            log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
            view = _internal_error(exc)
        return respond(view)

    for error_class in expected_errors():
        app.add_exception_handler(error_class, expected)
    # Any other exception is answered by CatchAll: an `Exception` handler here would run in Starlette's
    # ServerErrorMiddleware, which re-raises after answering, and uvicorn then drops the connection.


def _internal_error(exc: BaseException) -> ErrorView:
    return ErrorView(500, "InternalError", f"internal error ({type(exc).__name__}); see the service log")


class CatchAll:
    """An unexpected error becomes a JSON 500 on a connection that stays open for the client's next
    request; the traceback goes to the service log. (Once the answer has started, the only way to end
    it is to close the connection, so the error is passed on.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            log.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=exc)
            await JSONResponse(_internal_error(exc).body(), status_code=500)(scope, receive, send)


class Gate:
    """Before the app reads any of a request's body: refuse a /v1 request (and one for the OpenAPI schema,
    unless `open_schema`) without a valid token (401), so nobody without one can make the service read an
    upload, and a body above its bound (413), by Content-Length when sent, else by counting the streamed
    bytes. Dataset uploads (POST /v1/tasks) get the upload bound. The request then runs `acting_as` its
    token's name, which the registry records. (The routes check the token again, and its scope, as
    dependencies that the OpenAPI schema shows.)"""

    def __init__(
        self, app: ASGIApp, service: PeltService, limit: int, upload_limit: int, open_schema: bool = False
    ) -> None:
        self.app, self.service, self.limit, self.upload_limit = app, service, limit, upload_limit
        self.open_schema = open_schema

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        token = None
        if scope["path"].startswith("/v1/") or (scope["path"] == OPENAPI_PATH and not self.open_schema):
            token = await self._authenticated(headers.get(b"authorization"))
            if token is None:
                view = ErrorView(401, "ServiceError", UNAUTHORIZED, "Authorization")
                await JSONResponse(view.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send
                )
                return
            scope.setdefault("state", {})["token"] = token  # the routes' `authenticated` dependency reads it
        limit = self.upload_limit if scope["path"] in UPLOAD_PATHS else self.limit
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _too_large(limit)(scope, receive, send)
            return
        seen, exceeded, answered = 0, False, False

        async def bounded() -> Message:
            nonlocal seen, exceeded
            if exceeded:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    exceeded = True
                    return {"type": "http.disconnect"}  # the app stops reading; its answer is replaced below
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal answered
            if not exceeded:
                await send(message)
            elif not answered:
                answered = True
                await _too_large(limit)(scope, receive, send)

        with acting_as(None if token is None else token.name):
            await self.app(scope, bounded, guarded_send)

    async def _authenticated(self, header: bytes | None) -> ApiTokenRecord | None:
        scheme, _, secret = (header or b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            return None
        return await anyio.to_thread.run_sync(self.service.registry.authenticate, secret.strip())


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse(
        ErrorView(413, "TooLargeError", f"request body larger than {limit} bytes", "body").body(),
        status_code=413,
    )


__all__ = ["create_app"]
