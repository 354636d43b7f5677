"""The API's routes by resource, each module a thin `APIRouter` over the service layer
(`services.operations.PeltOperations`): tasks, predictions, leaderboard, methods, backbones, jobs, fusions, sweeps, deltas
(composition included), audit, and health (the one route without a token).

Every route under /v1 needs a token (`services.api.dependencies.authenticated`) and declares the scope
it needs (READ, PREDICT, WRITE, ADMIN); its error answers are documented as `ErrorOut`.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI

from services.api.dependencies import authenticated
from services.api.routes import (
    audit,
    backbones,
    deltas,
    fusions,
    health,
    jobs,
    leaderboard,
    methods,
    page,
    plots,
    predict,
    searches,
    sweeps,
    tasks,
    whoami,
)
from services.api.schemas import ErrorOut

API_PREFIX = "/v1"
UPLOAD_PATHS = (f"{API_PREFIX}/tasks",)  # POST /v1/tasks (tasks.register_task) takes dataset uploads
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 404, 409, 413, 422, 429)
}
V1_ROUTERS = (
    tasks.router,
    predict.router,
    leaderboard.router,
    plots.router,
    methods.router,
    backbones.router,
    jobs.router,
    fusions.router,
    sweeps.router,
    searches.router,
    deltas.router,
    audit.router,
    whoami.router,
)


def include_routes(app: FastAPI) -> None:
    """Add /health, the web page and every /v1 route to the app."""
    app.include_router(health.router)
    app.include_router(page.router)  # the web page's static shell, public like /health
    for router in V1_ROUTERS:
        app.include_router(router, prefix=API_PREFIX, dependencies=[Depends(authenticated)], responses=ERRORS)


__all__ = ["API_PREFIX", "ERRORS", "UPLOAD_PATHS", "V1_ROUTERS", "include_routes"]
