"""/v1/fusions: queue an AdapterFusion job over stored adapters (it is then a job like any other)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import WRITE, Operations
from services.api.schemas import FusionIn, JobOut

router = APIRouter(tags=["jobs"], route_class=BoundedJsonRoute)


@router.post("/fusions", response_model=JobOut, status_code=201, dependencies=[WRITE])
def submit_fusion(operations: Operations, body: FusionIn) -> Any:
    """Fuse the named source deltas for the target task: each is resolved (its sha256 recorded on the job)
    and checked before anything is queued; the job trains, is retried and cancelled as any job, and its delta
    is a version of kind `fusion` of the target task."""
    fields = body.model_dump()
    return operations.submit_fusion(fields.pop("task"), fields.pop("sources"), **fields)
