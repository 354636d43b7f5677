"""Row-level helpers shared by the parts of the Registry: look-ups by name or id, get-or-create, queueing
jobs with their first event, status transitions and the audit trail.

Each takes the session (and so the transaction) it runs in; none opens one of its own.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, undefer

from services.registry.actor import current_actor
from services.registry.errors import (
    LeaseLostError,
    RegistryValidationError,
    UnknownBackboneError,
    UnknownJobError,
    UnknownTaskError,
)
from services.registry.models import (
    DEFAULT_JOB_DEVICE,
    TERMINAL_STATUSES,
    AuditEvent,
    Backbone,
    Job,
    JobEvent,
    JobStatus,
    Method,
    Sweep,
    Task,
)

MAX_ERROR_CHARS = 20_000
MAX_AUDIT_TARGET_CHARS = 300  # an audit event's target (the column's width)
MAX_AUDIT_TEXT_CHARS = 300  # each string in an audit event's detail
MAX_AUDIT_ITEMS = 50  # entries of each list or mapping in an audit event's detail
MAX_AUDIT_DEPTH = 4  # nesting of an audit event's detail

_T = TypeVar("_T")
_Named = TypeVar("_Named", Task, Method, Backbone)


# --- look-ups ------------------------------------------------------------------------------------


def find_task(session: Session, name: str) -> Task:
    """The task of that name (UnknownTaskError lists the known ones)."""
    row = session.scalar(select(Task).where(Task.name == name))
    if row is None:
        raise UnknownTaskError("task", name, session.scalars(select(Task.name).order_by(Task.name)))
    return row


def find_backbone(session: Session, name: str) -> Backbone:
    """The backbone of that name (UnknownBackboneError lists the known ones)."""
    row = session.scalar(select(Backbone).where(Backbone.name == name))
    if row is None:
        raise UnknownBackboneError(
            "backbone", name, session.scalars(select(Backbone.name).order_by(Backbone.name))
        )
    return row


def backbone_filter_ids(session: Session, name: str) -> list[int]:
    """The ids of the backbones `name` means, for filtering jobs or results by it: the registered one of
    that name; for a packaged backbone (`pelt_core.backbones`: its name or an alias), every registered row
    under any of its names (jobs submitted as `minilm` are found by `all-minilm-l6-v2`), none while no
    submit has registered it (the filter matches nothing); UnknownBackboneError for any other name."""
    from pelt_core.backbone_names import BACKBONE_ALIASES, PACKAGED_BACKBONES

    canonical = BACKBONE_ALIASES.get(name, name)
    if canonical not in PACKAGED_BACKBONES:
        return [find_backbone(session, name).id]  # raises, listing the registered backbones
    names = {canonical} | {alias for alias, target in BACKBONE_ALIASES.items() if target == canonical}
    return list(session.scalars(select(Backbone.id).where(Backbone.name.in_(names))))


def find_job(session: Session, job_id: int, *, lock: bool = False, loss_history: bool = False) -> Job:
    """The job of that id, locked `FOR UPDATE` when asked (UnknownJobError when there is none); with
    `loss_history`, its loss curve loaded in the same query (a deferred column)."""
    if isinstance(job_id, bool) or not isinstance(job_id, int):
        raise RegistryValidationError("job_id", f"must be a whole number, got {job_id!r}")
    options = [undefer(Job.loss_history)] if loss_history else None
    job = session.get(Job, job_id, with_for_update=lock or None, options=options)
    if job is None:
        raise UnknownJobError(job_id)
    return job


def held_job(session: Session, job_id: int, worker_id: str, *, loss_history: bool = False) -> Job:
    """The job, locked, if `worker_id` holds its lease; LeaseLostError otherwise (`loss_history`: see
    `find_job`)."""
    job = find_job(session, job_id, lock=True, loss_history=loss_history)
    if job.status != JobStatus.RUNNING or job.lease_owner != worker_id:
        holder = f"held by {job.lease_owner}" if job.lease_owner else "not held by anyone"
        raise LeaseLostError(job_id, f"worker {worker_id!r} does not hold it (it is {job.status}, {holder})")
    return job


def worker_ever_held(session: Session, job_id: int, worker_id: str) -> bool:
    """Whether `worker_id` ever claimed the job."""
    query = select(JobEvent.id).where(
        JobEvent.job_id == job_id,
        JobEvent.to_status == JobStatus.RUNNING.value,
        JobEvent.worker_id == worker_id,
    )
    return session.scalar(query.limit(1)) is not None


def submitted_by_current_actor(model: type[Job] | type[Sweep]) -> ColumnElement[bool]:
    """A filter for the rows of `model` the current actor submitted: its token's name, or no token (NULL)
    outside any `acting_as` (idempotency keys are scoped by it)."""
    actor = current_actor()
    return model.submitted_by.is_(None) if actor is None else model.submitted_by == actor


def sweep_job_ids(session: Session, sweep_id: int) -> list[int]:
    """The ids of a sweep's jobs, in submission order."""
    return list(session.scalars(select(Job.id).where(Job.sweep_id == sweep_id).order_by(Job.id)))


# --- writes --------------------------------------------------------------------------------------


def get_or_create(
    session: Session, model: type[_Named], name: str, make: Callable[[], _Named]
) -> tuple[_Named, bool]:
    """(the row of `model` named `name`, False), or (a new row from `make()`, added and flushed, True).

    Two writers may both find no row: the second one's flush raises IntegrityError, which ends its
    transaction; run the whole write again with `retry_once_on_conflict` to find the winner's row."""
    existing = session.scalar(select(model).where(model.name == name))
    if existing is not None:
        return existing, False
    row = make()
    session.add(row)
    session.flush()
    return row, True


def retry_once_on_conflict(write: Callable[[], _T]) -> _T:
    """Run a write transaction that uses get_or_create; if a concurrent writer inserted the same unique
    key first (PostgreSQL), run it again: the second run finds that row and compares against it."""
    try:
        return write()
    except IntegrityError:
        return write()


@dataclass(frozen=True)
class PlannedJob:
    """One job a submit is about to queue: everything that differs between the jobs of a sweep."""

    method: Method
    method_fingerprint: str
    seed: int
    k_shot: int | None
    train_config: dict[str, Any]
    method_spec: dict[str, Any]
    hyperparameters: dict[str, Any]


def queue_jobs(
    session: Session,
    plans: Sequence[PlannedJob],
    *,
    task_id: int,
    backbone_id: int,
    priority: int,
    max_attempts: int,
    now: datetime,
    reason: str,
    device: str = DEFAULT_JOB_DEVICE,
    sweep_id: int | None = None,
    idempotency_key: str | None = None,
) -> list[Job]:
    """Add the planned jobs as queued on `device`, each with its first event (`reason`), submitted by the
    current actor; returns the flushed rows (ids set). The events go in one multi-row insert (big sweeps)."""
    jobs = [
        Job(
            task_id=task_id,
            method_id=plan.method.id,
            method_fingerprint=plan.method_fingerprint,
            backbone_id=backbone_id,
            sweep_id=sweep_id,
            hyperparameters=plan.hyperparameters,
            train_config=plan.train_config,
            method_spec=plan.method_spec,
            seed=plan.seed,
            k_shot=plan.k_shot,
            priority=priority,
            device=device,
            status=JobStatus.QUEUED.value,
            attempts=0,
            max_attempts=max_attempts,
            cancel_requested=False,
            idempotency_key=idempotency_key,
            submitted_by=current_actor(),
            created_at=now,
            updated_at=now,
        )
        for plan in plans
    ]
    session.add_all(jobs)
    session.flush()
    first_events = [
        {
            "job_id": job.id,
            "at": now,
            "from_status": None,
            "to_status": JobStatus.QUEUED.value,
            "reason": reason,
        }
        for job in jobs
    ]
    session.execute(JobEvent.__table__.insert(), first_events)
    return jobs


def transition(
    session: Session,
    job: Job,
    to: JobStatus,
    now: datetime,
    reason: str,
    worker_id: str | None = None,
    *,
    detail: str | None = None,
) -> None:
    """Move the job to `to` and write the event, in the caller's transaction."""
    session.add(
        JobEvent(
            job_id=job.id,
            at=now,
            from_status=job.status,
            to_status=to.value,
            reason=reason,
            worker_id=worker_id,
            detail=detail,
        )
    )
    job.status = to.value
    job.updated_at = now
    if to != JobStatus.RUNNING:
        job.lease_owner = None
        job.lease_expires_at = None
    if to in TERMINAL_STATUSES:
        job.finished_at = now
        job.not_before = None


def audit(
    session: Session, at: datetime, action: str, target: str, detail: Mapping[str, Any] | None = None
) -> AuditEvent:
    """Add an audit event by the current actor to the caller's transaction. Its fields are bounded: the
    target to MAX_AUDIT_TARGET_CHARS, the detail to structured JSON whose every string, list and mapping
    is bounded (`bounded_detail`), so no request can write a large text into the trail."""
    row = AuditEvent(
        at=at,
        actor=current_actor(),
        action=action,
        target=target[:MAX_AUDIT_TARGET_CHARS],
        detail=jsonable(bounded_detail(detail or {})),
    )
    session.add(row)
    return row


def bounded_detail(value: Any, depth: int = 0) -> Any:
    """An audit event's detail with every string cut to MAX_AUDIT_TEXT_CHARS, every sequence and mapping
    to its first MAX_AUDIT_ITEMS entries (keys as strings) and nesting to MAX_AUDIT_DEPTH (deeper: "…"),
    before it is turned into JSON, so the work is bounded too."""
    if isinstance(value, str):
        return value if len(value) <= MAX_AUDIT_TEXT_CHARS else value[: MAX_AUDIT_TEXT_CHARS - 1] + "…"
    if isinstance(value, Mapping | list | tuple) and depth >= MAX_AUDIT_DEPTH:
        return "…"
    if isinstance(value, Mapping):
        items = itertools.islice(value.items(), MAX_AUDIT_ITEMS)
        return {bounded_detail(str(k)): bounded_detail(v, depth + 1) for k, v in items}
    if isinstance(value, list | tuple):
        return [bounded_detail(v, depth + 1) for v in value[:MAX_AUDIT_ITEMS]]
    return value


# --- values --------------------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """The value as it comes back from a JSON column (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value, sort_keys=True))


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Long errors (tracebacks) keep their head and their tail, where the cause usually is."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n… [{len(text) - limit} characters cut] …\n{text[-half:]}"


def check_worker(worker_id: str) -> None:
    """A worker id: a non-empty string of at most 200 characters."""
    if not isinstance(worker_id, str) or not worker_id or len(worker_id) > 200:
        raise RegistryValidationError(
            "worker_id", f"must be a non-empty string of at most 200 characters, got {worker_id!r}"
        )


def distinct_list(values: Any, field: str, check: Callable[[Any, str], Any]) -> list[Any]:
    """A non-empty list without duplicates, each item passing `check(item, field[i])`."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | set | frozenset):
        raise RegistryValidationError(field, f"expected a list, got {values!r}")
    items = list(values)
    if not items:
        raise RegistryValidationError(field, "must not be empty")
    for index, value in enumerate(items):
        check(value, f"{field}[{index}]")
    if len(set(items)) != len(items):
        raise RegistryValidationError(field, f"has duplicates: {items!r}")
    return items


__all__ = [
    "MAX_AUDIT_ITEMS",
    "MAX_AUDIT_TEXT_CHARS",
    "MAX_ERROR_CHARS",
    "PlannedJob",
    "audit",
    "backbone_filter_ids",
    "bounded_detail",
    "check_worker",
    "clip",
    "distinct_list",
    "find_backbone",
    "find_job",
    "find_task",
    "get_or_create",
    "held_job",
    "jsonable",
    "queue_jobs",
    "retry_once_on_conflict",
    "submitted_by_current_actor",
    "sweep_job_ids",
    "transition",
    "worker_ever_held",
]
