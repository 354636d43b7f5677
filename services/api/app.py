"""The HTTP API: FastAPI routes by resource (`services.api.routes`) over the service layer
(`services.operations.PeltOperations`).

Every route under /v1 needs `Authorization: Bearer <token>` (tokens: `pelt token create`; only their
SHA-256 is stored); /health answers without one. Each route declares the scope it needs with one of
READ, PREDICT, WRITE, ADMIN (`services.api.dependencies`): read < predict < write < admin; a token without it gets a 403
naming the scope, from the request's headers before any of its body is read (so are the body bounds and
the upload slots: `services.api.middleware`; a refused request's connection is closed). Errors are JSON
{"error": {status, type, field, message}}, their messages without server paths or store URIs
(`services.api.error_handlers`); an unexpected error is a 500 that keeps the connection open
(`services.api.middleware.InternalErrorMiddleware`). Bodies are bounded:
PELT_MAX_REQUEST_BYTES for JSON, PELT_MAX_UPLOAD_BYTES for a dataset upload. The OpenAPI schema is at
/openapi.json (a token needed); /docs and /redoc exist only with PELT_API_DOCS=true (they load their
assets from a CDN, and /openapi.json then answers without a token).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pelt_core import __version__ as pelt_version
from services.api.error_handlers import install_error_handlers
from services.api.middleware import (
    BodySizeLimitMiddleware,
    InternalErrorMiddleware,
    TokenAuthMiddleware,
    UploadSlotMiddleware,
    declared_scopes,
)
from services.api.routes import API_PREFIX, UPLOAD_PATHS, V1_ROUTERS, include_routes
from services.operations import PeltOperations
from services.settings import Settings

OPENAPI_PATH = "/openapi.json"


def create_app(
    operations: PeltOperations,
    settings: Settings | None = None,
    *,
    dispatcher: Any = None,
    lifespan: Any = None,
) -> FastAPI:
    """The API over the service layer. `dispatcher`, when given, is reported by /health."""
    settings = settings or operations.settings
    docs = settings.api_docs
    app = FastAPI(
        title="pelt",
        version=pelt_version,  # not the installed package's metadata: pelt also runs from a source tree
        lifespan=lifespan,
        openapi_url=OPENAPI_PATH,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        description="Parameter-efficient tuning of one shared backbone for many tasks: tasks, "
        "methods, jobs and sweeps, leaderboards, deltas and their composition.",
    )
    app.state.operations = operations
    app.state.dispatcher = dispatcher
    include_routes(app)
    install_error_handlers(app)
    # Middleware added last runs first: the error guard, the token and scope check, the body bound, the
    # upload slots; all from the request's headers, before any of its body is read.
    app.add_middleware(UploadSlotMiddleware, slot=operations.uploads.probe_slot, upload_paths=UPLOAD_PATHS)
    app.add_middleware(
        BodySizeLimitMiddleware,
        limit=settings.max_request_bytes,
        upload_limit=settings.max_upload_bytes + (1 << 20),
        upload_paths=UPLOAD_PATHS,
    )
    app.add_middleware(
        TokenAuthMiddleware,
        authenticate=operations.registry.authenticate,
        schema_path=None if docs else OPENAPI_PATH,
        declared=declared_scopes(V1_ROUTERS, API_PREFIX),  # each route's READ/WRITE/ADMIN, checked first
    )
    app.add_middleware(InternalErrorMiddleware)  # it also answers for an error in the checks
    return app


__all__ = ["OPENAPI_PATH", "create_app"]
