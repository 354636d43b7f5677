"""/v1/sweeps: queue methods × seeds × K values for one task at once, read and cancel a sweep."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Response
from fastapi import Path as PathParam

from pelt_core.limits import INT32_MAX
from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import READ, WRITE, Caller, Operations
from services.api.schemas import SweepCancelOut, SweepCheckOut, SweepIn, SweepOut

router = APIRouter(tags=["sweeps"], route_class=BoundedJsonRoute)  # JSON nests at most MAX_JSON_DEPTH deep

SweepId = Annotated[int, PathParam(ge=1, le=INT32_MAX, description="a sweep id")]


@router.post("/sweeps", response_model=SweepOut, status_code=201, dependencies=[WRITE])
def submit_sweep(operations: Operations, body: SweepIn, response: Response) -> Any:
    """Queue methods × seeds × K values for one task (all jobs or none): 201. The same sweep as one
    already queued, running or done (or the same idempotency key) answers with that sweep, 200 and
    `already_submitted`, unless `again` asks for new runs."""
    sweep = operations.submit_sweep(**body.model_dump())
    if sweep.already_submitted:
        response.status_code = 200
    return sweep


@router.post("/sweeps/check", response_model=SweepCheckOut, dependencies=[WRITE])
def check_sweep(operations: Operations, body: SweepIn) -> Any:
    """Check a sweep as submitting it would (names, each K against the task's rows, ranges) and queue
    nothing: 200 with the number of jobs it holds, or the error its submission would get."""
    return {"task": body.task, "jobs": operations.check_sweep(**body.model_dump())}


@router.get("/sweeps/{sweep_id}", response_model=SweepOut, dependencies=[READ])
def get_sweep(operations: Operations, sweep_id: SweepId) -> Any:
    return operations.get_sweep(sweep_id)


@router.post("/sweeps/{sweep_id}/cancel", response_model=SweepCancelOut, dependencies=[WRITE])
def cancel_sweep(operations: Operations, sweep_id: SweepId, caller: Caller) -> Any:
    """Cancel every unfinished job of the sweep. Another token's sweep needs the admin scope (403 naming
    it and whose sweep it is; nothing is cancelled)."""
    cancelled = operations.cancel_sweep(sweep_id, own_only=not caller.allows("admin"))
    return SweepCancelOut(sweep_id=sweep_id, cancelled=cancelled)
