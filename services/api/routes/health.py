"""/health: liveness, the one route that answers without a token."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from services.api.dependencies import Operations
from services.api.schemas import HealthOut

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
