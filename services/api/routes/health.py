"""/health (liveness) and /ready (readiness): the routes that answer without a token."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.api.dependencies import Operations
from services.api.schemas import HealthOut, ReadyOut

READY_RETRY_AFTER_SECONDS = 5

router = APIRouter(tags=["health"])


@router.get("/health", response_model=HealthOut)
def health(operations: Operations, request: Request) -> Any:
    """Liveness without a token: the service's version and the kinds of stores it uses (no addresses)."""
    store, dispatcher = operations.store, request.app.state.dispatcher
    return HealthOut(
        status="ok",
        version=request.app.version,
        registry=operations.registry.engine.url.get_backend_name(),
        delta_store=None if store is None else ("mlflow-server" if store.is_server else "mlflow-embedded"),
        dispatcher=None if dispatcher is None else {"workers": len(dispatcher.workers)},
    )


@router.get("/ready", response_model=ReadyOut, responses={503: {"model": ReadyOut}})
def ready(operations: Operations) -> Any:
    """Readiness without a token: 200 "ready" when the registry's database and the delta store answer now;
    200 "degraded" when only the delta store does not (every route but the deltas' still works, so the API
    stays in its Service's endpoints); 503 "not ready" with Retry-After when the database does not. No
    addresses; the reasons go to the service's log."""
    answers = operations.readiness()
    body = ReadyOut(status="ready", **answers)
    if answers["registry"] == "ok":
        if answers["delta_store"] not in (None, "ok"):
            body.status = "degraded"
        return body
    body.status = "not ready"
    headers = {"Retry-After": str(READY_RETRY_AFTER_SECONDS)}
    return JSONResponse(body.model_dump(), status_code=503, headers=headers)
