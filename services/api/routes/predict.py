"""/v1/tasks/{name}/predict: predictions from a task's stored delta, served by the Ray Serve replicas of
its backbone (`services.predicting`). Needs the `predict` scope (read < predict < write < admin)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import PREDICT, Name, Operations
from services.api.schemas import PredictIn, PredictOut

router = APIRouter(tags=["predict"], route_class=BoundedJsonRoute)


@router.post("/tasks/{name}/predict", response_model=PredictOut, dependencies=[PREDICT])
async def predict(operations: Operations, name: Name, body: PredictIn) -> Any:
    """Label texts with a task's version (`best` by default; an alias or a version number): one
    prediction per row, and the version and method that answered. An unknown task or version is a 404
    naming it; too many rows or too long a text a 413 before any model work; a version trained on a
    backbone the service no longer has a 409; replicas too busy or still starting a 503 with Retry-After.
    Awaited without holding one of the API's threads."""
    answer = await operations.predict(name, body.texts, body.version)
    return PredictOut(
        task=answer.task,
        version=answer.version,
        method=answer.method,
        kind=answer.kind,
        backbone=answer.backbone,
        sha256=answer.sha256,
        predictions=answer.rows,
    )
