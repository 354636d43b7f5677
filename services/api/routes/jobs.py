"""/v1/jobs: submit one training job, list and follow jobs, cancel one, read its events and result."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi import Path as PathParam

from pelt_core.limits import INT32_MAX
from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import READ, WRITE, Caller, Limit, Offset, Operations
from services.api.schemas import EventOut, JobIn, JobOut, LossHistoryOut, ProgressOut, ResultOut
from services.errors import ServiceError
from services.redaction import public_uri
from services.registry import JobStatus

router = APIRouter(tags=["jobs"], route_class=BoundedJsonRoute)  # JSON nests at most MAX_JSON_DEPTH deep

JobId = Annotated[int, PathParam(ge=1, le=INT32_MAX, description="a job id")]


@router.post("/jobs", response_model=JobOut, status_code=201, dependencies=[WRITE])
def submit_job(operations: Operations, body: JobIn) -> Any:
    return operations.submit_job(**body.model_dump())


@router.get("/jobs", response_model=list[JobOut], dependencies=[READ])
def list_jobs(
    operations: Operations,
    task: Annotated[str | None, Query(max_length=200)] = None,
    status: Annotated[list[JobStatus] | None, Query()] = None,
    method: Annotated[str | None, Query(max_length=200)] = None,
    backbone: Annotated[str | None, Query(max_length=200)] = None,
    sweep_id: Annotated[int | None, Query(ge=1, le=INT32_MAX)] = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> Any:
    """Jobs matching every filter given, oldest first."""
    return operations.list_jobs(
        task=task,
        status=[s.value for s in status or []],
        method=method,
        backbone=backbone,
        sweep_id=sweep_id,
        limit=limit,
        offset=offset,
    )


@router.get("/jobs/{job_id}", response_model=JobOut, dependencies=[READ])
def get_job(operations: Operations, job_id: JobId) -> Any:
    return operations.get_job(job_id)


@router.get("/jobs/{job_id}/progress", response_model=ProgressOut, dependencies=[READ])
def job_progress(operations: Operations, job_id: JobId) -> Any:
    """Status and the worker's last report (step, total, loss, tokens/s)."""
    return operations.get_job(job_id)


@router.get("/jobs/{job_id}/loss", response_model=LossHistoryOut, dependencies=[READ])
def job_loss(operations: Operations, job_id: JobId) -> Any:
    """The loss curve of the job's current attempt: [step, loss] points, steps increasing."""
    return operations.loss_history(job_id)


@router.post("/jobs/{job_id}/cancel", response_model=JobOut, dependencies=[WRITE])
def cancel_job(operations: Operations, job_id: JobId, caller: Caller) -> Any:
    """Cancel a queued job at once, a running one within seconds; a cancelled job is never retried. A
    token cancels the jobs it submitted; another token's job (or one submitted without a token) needs
    the admin scope: 403 naming it and whose job it is."""
    return operations.cancel_job(job_id, own_only=not caller.allows("admin"))


@router.get("/jobs/{job_id}/events", response_model=list[EventOut], dependencies=[READ])
def job_events(operations: Operations, job_id: JobId, caller: Caller) -> Any:
    """The job's status changes, oldest first; `detail` (a failure's traceback) for admin tokens only."""
    operations.get_job(job_id)
    events = operations.job_events(job_id)
    return events if caller.allows("admin") else [dataclasses.replace(event, detail=None) for event in events]


@router.get("/jobs/{job_id}/result", response_model=ResultOut, dependencies=[READ])
def job_result(operations: Operations, job_id: JobId) -> Any:
    result = operations.get_result(job_id)
    if result is None:
        status = operations.get_job(job_id).status
        raise ServiceError(f"job {job_id} has no result (it is {status})", status=404, field="job_id")
    return dataclasses.replace(result, delta_uri=public_uri(result.delta_uri))  # no server folder
