"""The Registry's job queue: claims, leases and heartbeats, completion, failure and retry with backoff,
release, cancellation and taking back expired leases. Every status change writes a job event in the same
transaction (`rows.transition`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from services.redaction import error_summary
from services.registry.actor import current_actor
from services.registry.core import RegistryCore
from services.registry.errors import (
    JobStateError,
    LeaseLostError,
    NotOwnerError,
    RegistryValidationError,
    UnknownSweepError,
)
from services.registry.models import JOB_DEVICES, Backbone, Job, JobStatus, Result, Sweep
from services.registry.records import JobRecord, ResultRecord
from services.registry.rows import (
    audit,
    check_worker,
    clip,
    find_job,
    held_job,
    transition,
    worker_ever_held,
)
from services.registry.validation import (
    check_devices,
    check_int,
    check_loss_points,
    check_progress,
    check_result,
)

log = logging.getLogger("pelt.registry")

LOSS_HISTORY_POINTS = 256  # a job's loss curve keeps at most this many [step, loss] points


class JobQueue(RegistryCore):
    """The durable queue's operations: one part of `Registry`."""

    def claim_job(
        self,
        worker_id: str,
        lease_seconds: float | None = None,
        backbones: Iterable[str] | None = None,
        devices: Iterable[str] | None = None,
    ) -> JobRecord | None:
        """Take the next runnable job (highest priority, then oldest) for `worker_id`, or None.

        Expired leases are taken back first. `backbones`: only jobs on these backbones (the ones
        the worker holds). `devices`: only jobs whose device is one of these (`any`, `cpu`, `gpu`; a
        GPU worker that also takes unplaced jobs passes ["any", "gpu"]); None: any job; empty: none.
        Jobs waiting out a retry backoff (`not_before`) are skipped."""
        claimed = self.claim_jobs(
            worker_id, 1, lease_seconds=lease_seconds, backbones=backbones, devices=devices
        )
        return claimed[0] if claimed else None

    def claim_jobs(
        self,
        worker_id: str,
        limit: int,
        *,
        lease_seconds: float | None = None,
        backbones: Iterable[str] | None = None,
        devices: Iterable[str] | None = None,
    ) -> list[JobRecord]:
        """Take up to `limit` runnable jobs at once (see claim_job), in queue order."""
        check_worker(worker_id)
        check_int(limit, "limit", minimum=1, maximum=10_000)
        lease = self._lease(lease_seconds)
        backbone_names = None if backbones is None else sorted(set(backbones))
        device_names = check_devices(devices)
        with self._writing() as session:
            now = self._now()
            if self._next_reap is None or now >= self._next_reap:
                self._reap_expired(session, now)
                self._next_reap = now + self._reap_interval
            query = (
                select(Job)
                .where(
                    Job.status == JobStatus.QUEUED.value, or_(Job.not_before.is_(None), Job.not_before <= now)
                )
                .order_by(Job.priority.desc(), Job.created_at, Job.id)
                .limit(limit)
                .with_for_update(skip_locked=True, of=Job)
            )
            if backbone_names is not None:
                query = query.where(
                    Job.backbone_id.in_(select(Backbone.id).where(Backbone.name.in_(backbone_names)))
                )
            if device_names is not None:
                query = query.where(Job.device.in_(device_names))
            jobs = list(session.scalars(query))
            for job in jobs:
                job.attempts += 1
                job.lease_owner = worker_id
                job.lease_expires_at = now + timedelta(seconds=lease)
                job.heartbeat_at = now
                job.started_at = now
                job.not_before = None
                job.progress = None
                job.progress_detail = None
                job.loss_history = None  # a new attempt starts a new curve
                transition(
                    session,
                    job,
                    JobStatus.RUNNING,
                    now,
                    f"claimed (attempt {job.attempts} of {job.max_attempts})",
                    worker_id,
                )
            self._cache_names(session, jobs)
        return [self._job_record(job) for job in jobs]  # built after the commit: the write turn is short

    def queued_by_device(self) -> dict[str, int]:
        """How many queued jobs wait for each device: {"any": n, "cpu": n, "gpu": n}, zeros included (one
        query). Jobs waiting out a retry backoff count too: they are runnable soon, and a dispatcher
        sizing its workers should see them."""
        with self._reading() as session:
            query = (
                select(Job.device, func.count())
                .where(Job.status == JobStatus.QUEUED.value)
                .group_by(Job.device)
            )
            counts = dict.fromkeys(JOB_DEVICES, 0)
            counts.update({device: count for device, count in session.execute(query)})
            return counts

    def queued_by_device_and_backbone(self) -> dict[tuple[str, str], int]:
        """How many queued jobs wait for each (device, backbone name), only pairs with jobs (one query): what
        the dispatcher's scaling needs, since a pack that trains one backbone cannot take another's jobs."""
        with self._reading() as session:
            query = (
                select(Job.device, Backbone.name, func.count())
                .join(Backbone, Backbone.id == Job.backbone_id)
                .where(Job.status == JobStatus.QUEUED.value)
                .group_by(Job.device, Backbone.name)
            )
            return {(device, backbone): count for device, backbone, count in session.execute(query)}

    def heartbeat(
        self,
        job_id: int,
        worker_id: str,
        progress: float | Mapping[str, Any] | None = None,
        lease_seconds: float | None = None,
    ) -> bool:
        """Renew the lease and record progress; returns True when cancellation was requested.

        `progress`: a fraction in [0, 1], or the worker's report {step, total, loss, tokens_per_second,
        epoch, learning_rate} (kept as `progress_detail`; the fraction becomes step / total). A report
        with `losses` ([[step, loss], ...]: the worker's thinned per-step losses since its last report)
        adds those points to the attempt's loss curve (`loss_history`, at most LOSS_HISTORY_POINTS,
        see `with_loss_points`); a report without them adds its own (step, loss) when its step advanced
        and its loss is a finite number.
        Raises LeaseLostError when the worker no longer holds the job: it must stop."""
        check_worker(worker_id)
        fraction, detail = check_progress(progress)
        points = check_loss_points(progress)
        lease = self._lease(lease_seconds)
        with self._writing() as session:
            # a report may add to the loss curve: load it in the same locked read
            job = held_job(session, job_id, worker_id, loss_history=fraction is not None)
            now = self._now()
            job.lease_expires_at = now + timedelta(seconds=lease)
            job.heartbeat_at = now
            job.updated_at = now
            if fraction is not None:
                job.progress = fraction
                job.progress_detail = detail
                if points is not None:
                    job.loss_history = with_loss_points(job.loss_history, points)
                elif detail is not None:
                    job.loss_history = with_loss_point(job.loss_history, detail)
            return job.cancel_requested

    def complete_job(self, job_id: int, worker_id: str, result: Mapping[str, Any]) -> ResultRecord:
        """Record the job's result and mark it succeeded; exactly one result row per job, ever.

        A repeated completion returns the stored result and writes nothing. A worker whose lease
        lapsed may still complete a job that has not ended (the work is done; the job's current
        holder learns at its next heartbeat). Completing a cancelled or failed job is a JobStateError.
        `result`: metrics (with the task's metric), trainable_params, trainable_percent or
        total_params, train_seconds, and optionally peak_memory_bytes, job_memory_bytes, device (where it
        trained, e.g. "cuda:0 (NVIDIA H100 80GB HBM3)"), delta_uri, delta_sha256, mlflow_run_id,
        mlflow_model_version, primary_metric."""
        check_worker(worker_id)

        def write() -> ResultRecord:
            with self._writing() as session:
                job = find_job(session, job_id, lock=True)
                if job.status == JobStatus.SUCCEEDED and job.result is not None:
                    return ResultRecord.of(job.result)
                if job.status in (JobStatus.CANCELLED, JobStatus.FAILED):
                    raise JobStateError(job_id, f"is {job.status}; its result was not recorded")
                holder = job.status == JobStatus.RUNNING and job.lease_owner == worker_id
                if not holder and not worker_ever_held(session, job_id, worker_id):
                    raise LeaseLostError(job_id, f"was never held by worker {worker_id!r}")
                test_left_out = (job.train_config or {}).get("evaluate_test") is False
                values = check_result(result, self._task_metric(session, job.task_id), test_left_out)
                now = self._now()
                row = Result(
                    job_id=job.id, worker_id=worker_id, attempt=max(job.attempts, 1), created_at=now, **values
                )
                session.add(row)
                job.progress = 1.0
                reason = "completed" if holder else f"completed by {worker_id}, whose lease had lapsed"
                transition(session, job, JobStatus.SUCCEEDED, now, reason, worker_id)
            return ResultRecord.of(row)  # built after the commit (the row's id came with the flush)

        try:
            return write()
        except IntegrityError:  # a concurrent completion won the race: return its result
            with self._reading() as session:
                stored = session.scalar(select(Result).where(Result.job_id == job_id))
                if stored is None:
                    raise
                return ResultRecord.of(stored)

    def fail_job(self, job_id: int, worker_id: str, error: str, retryable: bool = True) -> JobRecord:
        """The attempt failed: back to the queue after a backoff while attempts remain (and the error is
        retryable), else failed with this error. A job whose cancellation was requested ends cancelled.

        `error` may be a whole traceback: the job's `last_error` and its event's reason keep one line
        (the exception's message, server paths cut: `services.redaction.error_summary`); the full text
        goes to the event's `detail`, which only admin tokens see."""
        check_worker(worker_id)
        full = clip(str(error))
        summary = error_summary(full)
        with self._writing() as session:
            job = held_job(session, job_id, worker_id)
            self._end_attempt(
                session,
                job,
                self._now(),
                summary,
                retryable=retryable,
                worker_id=worker_id,
                detail=None if full.strip() == summary else full,
            )
            return self._job_records(session, [job])[0]

    def release_job(self, job_id: int, worker_id: str, reason: str = "released by its worker") -> JobRecord:
        """Give a running job back without counting the attempt (graceful shutdown)."""
        check_worker(worker_id)
        with self._writing() as session:
            job = held_job(session, job_id, worker_id)
            now = self._now()
            if job.cancel_requested:
                transition(session, job, JobStatus.CANCELLED, now, f"cancelled ({reason})", worker_id)
            else:
                job.attempts = max(job.attempts - 1, 0)
                job.not_before = None
                transition(session, job, JobStatus.QUEUED, now, reason, worker_id)
            return self._job_records(session, [job])[0]

    def confirm_cancelled(self, job_id: int, worker_id: str) -> JobRecord:
        """The worker saw the cancel flag and stopped: the job ends cancelled."""
        check_worker(worker_id)
        with self._writing() as session:
            job = held_job(session, job_id, worker_id)
            if not job.cancel_requested:
                raise JobStateError(job_id, "no cancellation was requested")
            transition(
                session, job, JobStatus.CANCELLED, self._now(), "cancelled; the worker stopped", worker_id
            )
            return self._job_records(session, [job])[0]

    def cancel_job(
        self, job_id: int, reason: str = "cancelled by request", *, own_only: bool = False
    ) -> JobRecord:
        """Cancel a job: a queued one ends cancelled at once (it never runs); a running one gets a
        flag its worker sees at its next heartbeat. An ended job is returned unchanged.

        `own_only`: only if the current actor submitted it, else NotOwnerError and nothing changes (the API
        asks this for tokens without the admin scope; a job submitted without a token is nobody's own)."""
        with self._writing() as session:
            job = find_job(session, job_id, lock=True)
            owner = _check_owner(f"job {job_id}", job.submitted_by, own_only)
            now = self._now()
            if self._cancel(session, job, now, reason):
                audit(session, now, "job.cancel", f"job {job_id}", owner)
            return self._job_records(session, [job])[0]

    def cancel_sweep(
        self, sweep_id: int, reason: str = "sweep cancelled by request", *, own_only: bool = False
    ) -> int:
        """Cancel every job of a sweep that has not ended; returns how many were cancelled or flagged.
        `own_only`: as for cancel_job; another token's sweep is refused as a whole (nothing cancelled)."""
        with self._writing() as session:
            sweep = session.get(Sweep, sweep_id)
            if sweep is None:
                raise UnknownSweepError(sweep_id)
            owner = _check_owner(f"sweep {sweep_id}", sweep.submitted_by, own_only)
            query = (
                select(Job)
                .where(
                    Job.sweep_id == sweep_id,
                    Job.status.in_([JobStatus.QUEUED.value, JobStatus.RUNNING.value]),
                )
                .order_by(Job.id)
                .with_for_update(of=Job)
            )
            now = self._now()
            cancelled = sum(self._cancel(session, job, now, reason) for job in session.scalars(query))
            if cancelled:
                audit(session, now, "sweep.cancel", f"sweep {sweep_id}", {"jobs": cancelled, **owner})
            return cancelled

    def cancel_requests(self, job_ids: Iterable[int]) -> set[int]:
        """Which of these jobs are running with a cancellation requested (a dispatcher polls this to
        stop its workers' jobs promptly; one indexed read, no write)."""
        ids = sorted({check_int(job_id, "job_ids[]", minimum=1) for job_id in job_ids})
        if not ids:
            return set()
        found: set[int] = set()
        with self._reading() as session:
            for start in range(0, len(ids), 500):
                query = select(Job.id).where(
                    Job.id.in_(ids[start : start + 500]),
                    Job.status == JobStatus.RUNNING.value,
                    Job.cancel_requested.is_(True),
                )
                found.update(session.scalars(query))
        return found

    def requeue_expired_leases(self, now: datetime | None = None) -> list[JobRecord]:
        """Take back running jobs whose lease expired: queued again (after the backoff) or, once
        max_attempts starts are used up, failed with the lease expiry as last error. Claims do this
        too; a dispatcher may call it on a timer. Not for `reap_grace_seconds` after this registry saw
        its database away: the workers' heartbeats that failed meanwhile renew their leases first."""
        with self._writing() as session:
            jobs = self._reap_expired(session, now or self._now())
            return self._job_records(session, jobs)

    def _reap_expired(self, session: Session, now: datetime) -> list[Job]:
        if self._reap_paused():  # the database was away a moment ago: heartbeats that failed come first
            return []
        query = (
            select(Job)
            .where(Job.status == JobStatus.RUNNING.value, Job.lease_expires_at < now)
            .order_by(Job.id)
            .with_for_update(skip_locked=True, of=Job)
        )
        jobs = list(session.scalars(query))
        for job in jobs:
            owner = job.lease_owner
            error = (
                f"lease of worker {owner} expired at {job.lease_expires_at.isoformat() if job.lease_expires_at else '?'} "
                f"(attempt {job.attempts} of {job.max_attempts}); the worker stopped heartbeating"
            )
            self._end_attempt(
                session,
                job,
                now,
                error,
                retryable=True,
                worker_id=owner,
                reason="lease expired",
                failed_at=job.lease_expires_at,
            )
        if jobs:
            log.warning("took back %d job(s) whose lease expired: %s", len(jobs), [job.id for job in jobs])
        return jobs

    def _end_attempt(
        self,
        session: Session,
        job: Job,
        now: datetime,
        error: str,
        *,
        retryable: bool,
        worker_id: str | None,
        reason: str = "failed",
        failed_at: datetime | None = None,
        detail: str | None = None,
    ) -> None:
        """Close the current attempt: cancelled (if requested), queued again after the backoff (counted
        from `failed_at`, e.g. the lease's expiry, default now), or failed for good. `detail`: the full
        error behind `error` (a traceback), kept on the event."""
        job.last_error = error
        if job.cancel_requested:
            transition(
                session,
                job,
                JobStatus.CANCELLED,
                now,
                f"cancelled ({reason}: {error})",
                worker_id,
                detail=detail,
            )
        elif retryable and job.attempts < job.max_attempts:
            job.not_before = (failed_at or now) + timedelta(seconds=self._backoff(job.attempts))
            transition(
                session,
                job,
                JobStatus.QUEUED,
                now,
                f"{reason}: {error}; retry not before {job.not_before.isoformat()}",
                worker_id,
                detail=detail,
            )
        else:
            why = "not retryable" if not retryable else f"{job.attempts} of {job.max_attempts} attempts used"
            transition(
                session, job, JobStatus.FAILED, now, f"{reason} ({why}): {error}", worker_id, detail=detail
            )

    def _cancel(self, session: Session, job: Job, now: datetime, reason: str) -> bool:
        if job.status == JobStatus.QUEUED:
            transition(session, job, JobStatus.CANCELLED, now, reason)
            return True
        if job.status == JobStatus.RUNNING and not job.cancel_requested:
            job.cancel_requested = True
            transition(session, job, JobStatus.RUNNING, now, f"cancel requested: {reason}")
            return True
        return False

    def _backoff(self, attempts: int) -> float:
        delay = self.retry_backoff_seconds * 2 ** max(attempts - 1, 0)
        return min(delay, self.retry_backoff_max_seconds)

    def _lease(self, lease_seconds: float | None) -> float:
        lease = self.lease_seconds if lease_seconds is None else lease_seconds
        if isinstance(lease, bool) or not isinstance(lease, int | float) or not lease > 0:
            raise RegistryValidationError("lease_seconds", f"must be a number > 0, got {lease!r}")
        return float(lease)


def _check_owner(what: str, submitted_by: str | None, own_only: bool) -> dict[str, str | None]:
    """NotOwnerError when `own_only` and the current actor, a token, did not submit `what`; else the audit
    detail of its cancel: {"submitted_by": ...} when someone else submitted it, else {}."""
    actor = current_actor()
    if own_only and (actor is None or submitted_by != actor):
        raise NotOwnerError(what, submitted_by, actor)
    return {} if submitted_by == actor else {"submitted_by": submitted_by}


def with_loss_point(history: list[Any] | None, report: Mapping[str, Any]) -> list[Any] | None:
    """The loss curve `history` ([[step, loss], ...]) with the report's (step, loss) appended when its
    step is past the last point's and its loss a finite number; else `history` unchanged. A full curve
    (LOSS_HISTORY_POINTS) keeps every other point first: the whole curve at half the resolution, its
    first point kept. Returns a new list (a JSON column sees only reassignment)."""
    step, loss = report.get("step"), report.get("loss")
    if not isinstance(loss, float | int) or isinstance(loss, bool) or not math.isfinite(loss):
        return history
    points = list(history or [])
    if points and step <= points[-1][0]:
        return history
    if len(points) >= LOSS_HISTORY_POINTS:
        points = points[::2]
    return [*points, [step, float(loss)]]


def with_loss_points(history: list[Any] | None, points: Iterable[Any]) -> list[Any] | None:
    """The loss curve `history` with each [step, loss] point added as `with_loss_point` adds one."""
    for step, loss in points:
        history = with_loss_point(history, {"step": step, "loss": loss})
    return history


__all__ = ["LOSS_HISTORY_POINTS", "JobQueue", "with_loss_point", "with_loss_points"]
