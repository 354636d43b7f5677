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
    """Readiness without a token: 200 when the registry's database and the delta store answer now, else
    503 with Retry-After saying which did not (no addresses; the reasons go to the service's log)."""
    answers = operations.readiness()
    body = ReadyOut(status="ready", **answers)
    if all(answer in (None, "ok") for answer in answers.values()):
        return body
    body.status = "not ready"
    headers = {"Retry-After": str(READY_RETRY_AFTER_SECONDS)}
    return JSONResponse(body.model_dump(), status_code=503, headers=headers)
