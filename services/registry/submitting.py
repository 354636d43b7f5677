"""The Registry's submits: one job or a sweep (methods × seeds × K values), validated before anything is
written, idempotent by key, capped per actor.

An idempotency key belongs to whoever submitted under it: it names a job (or a sweep) of that token only,
so another token's key, however predictable, never answers for or blocks this token's submits. Submits
without a token (library calls, commands run next to the registry) share one scope of their own.

A job's `device` (`any`, `cpu`, `gpu`) is placement, not part of what the job is: an idempotent retry
compares the task, method, backbone, seed, K and hyperparameters only, so resubmitting under the same key
with another device returns the jobs already made, on the device they were first given.

A sweep submitted without a key is idempotent too: its key is then derived from the identities of the jobs
it plans (`_job_identity`, the same tuple an idempotent retry of a job compares), so the same sweep again
answers with the sweep already queued, running or done (`already_submitted`) instead of queueing its jobs
twice. `again=True` queues new runs (the derived key moves to the new sweep), and so does a repeat of a
sweep whose every job failed or was cancelled. The derived key is scoped per token like any other: another
token's identical sweep is not this token's (it could not cancel it, its quota did not pay for it, and its
`again` would take that sweep's identity away), so the same sweep by another token queues its own jobs."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pelt_core.limits import SEED, TRAIN_RANGES, fitted_max_length
from services.registry import presets
from services.registry.actor import current_actor
from services.registry.core import RegistryCore
from services.registry.errors import (
    IdempotencyConflictError,
    QuotaExceededError,
    RegistryValidationError,
    UnknownSweepError,
)
from services.registry.models import (
    DEFAULT_JOB_DEVICE,
    ApiToken,
    Backbone,
    DispatcherLeader,
    Job,
    JobStatus,
    Sweep,
    Task,
)
from services.registry.records import JobRecord, SweepRecord
from services.registry.rows import (
    PlannedJob,
    audit,
    distinct_list,
    find_backbone,
    find_task,
    jsonable,
    queue_jobs,
    retry_once_on_conflict,
    submitted_by_current_actor,
    sweep_job_ids,
)
from services.registry.task_data import held_out_rows
from services.registry.validation import (
    canonical_hyperparameters,
    check_against_backbone,
    check_device,
    check_int,
    check_key,
    check_name,
    check_range,
    resolve_method_spec,
    resolve_train_config,
    split_hyperparameters,
)

log = logging.getLogger("pelt.registry")

MAX_ATTEMPTS_LIMIT = 100

Hyperparameters = tuple[dict[str, Any], dict[str, Any], dict[str, str]]
"""split_hyperparameters' answer: (training values, method-spec overrides, given names)."""


@dataclass(frozen=True)
class _SweepRequest:
    """A sweep's arguments, checked: what is stored on the sweep, and each method's hyperparameters."""

    methods: list[str]
    seeds: list[int]
    k_values: list[int | None]
    hyperparameters: dict[str, Any]
    method_hyperparameters: dict[str, dict[str, Any]]
    split: dict[str, Hyperparameters]

    def stored(self) -> dict[str, Any]:
        """The columns of the sweep row that describe the request (compared on an idempotent retry)."""
        return {
            "methods": self.methods,
            "seeds": self.seeds,
            "k_values": self.k_values,
            "hyperparameters": self.hyperparameters,
            "method_hyperparameters": self.method_hyperparameters,
        }


class Submissions(RegistryCore):
    """submit_job, submit_sweep and the sweeps they make: one part of `Registry`."""

    def submit_job(
        self,
        task: str,
        method: str,
        backbone: str,
        hyperparameters: Mapping[str, Any] | None = None,
        seed: int = 0,
        k_shot: int | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        device: str = DEFAULT_JOB_DEVICE,
        fusion_spec: Mapping[str, Any] | None = None,
    ) -> JobRecord:
        """Validate, then queue one job. Hyperparameters are flat `key: value` pairs: training ones
        (learning_rate/lr, epochs, batch_size, …) and method-spec overrides (r, bottleneck, q.size, …).
        `device`: where it may run, `any` (default), `cpu` or `gpu`; only workers with that device claim it.
        The same idempotency key from the same token returns the job it made (a different request under
        it is an error; a different `device` is not: placement is not part of a job's identity, see the
        module's doc); another token's key of the same text is another key. `fusion_spec`: the spec of an
        AdapterFusion job (method `fusion`), built from its sources by `PeltOperations.submit_fusion`."""
        if (fusion_spec is not None) != (method == presets.FUSION):
            raise RegistryValidationError("method", presets.FUSION_HOW)
        seed, k_shot, priority, max_attempts, key = self._check_job_args(
            seed, k_shot, priority, max_attempts, idempotency_key
        )
        device = check_device(device)
        split = split_hyperparameters(hyperparameters)

        def write() -> JobRecord:
            with self._writing() as session:
                now = self._now()
                task_row, backbone_row = find_task(session, task), find_backbone(session, backbone)
                (plan,) = self._plan_method(
                    session, method, split, task_row, backbone_row, [seed], [k_shot], now, fusion_spec, device
                )
                if key is not None:
                    mine = submitted_by_current_actor(Job)
                    existing = session.scalar(select(Job).where(Job.idempotency_key == key, mine))
                    if existing is not None:
                        _check_same_job(existing, plan, task_row, backbone_row, key)
                        return self._job_records(session, [existing])[0]
                self._check_queue_quota(session, 1)
                (job,) = queue_jobs(
                    session,
                    [plan],
                    task_id=task_row.id,
                    backbone_id=backbone_row.id,
                    priority=priority,
                    max_attempts=max_attempts,
                    now=now,
                    reason="submitted",
                    device=device,
                    idempotency_key=key,
                )
                names = {"task": task_row.name, "method": plan.method.name, "backbone": backbone_row.name}
                audit(session, now, "job.submit", f"job {job.id}", names)
                return self._job_records(session, [job])[0]

        return retry_once_on_conflict(write)

    def submit_sweep(
        self,
        task: str,
        methods: Sequence[str],
        seeds: Sequence[int],
        k_values: Sequence[int | None],
        backbone: str,
        hyperparameters: Mapping[str, Any] | None = None,
        *,
        method_hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        device: str = DEFAULT_JOB_DEVICE,
        again: bool = False,
    ) -> SweepRecord:
        """Queue methods × seeds × K values for one task in one transaction (all jobs or none).

        `k_values` entries of None mean the full training set. `hyperparameters` apply to every
        method; `method_hyperparameters[method]` add to or override them for one method (e.g. a rank
        that only LoRA has). `device` (`any`, `cpu`, `gpu`) applies to every job. The same token's
        idempotency key returns the sweep it made, whatever `device` the retry names. Without a key, the
        same sweep as one of this token's already queued, running or done returns that sweep
        (`already_submitted`), unless `again` (module docstring); `again` with an idempotency key is
        refused."""
        request, priority, max_attempts, key, device = self._check_sweep_args(
            methods,
            seeds,
            k_values,
            hyperparameters,
            method_hyperparameters,
            priority,
            max_attempts,
            idempotency_key,
            device,
            again,
        )

        def write() -> SweepRecord:
            with self._writing() as session:
                now = self._now()
                task_row, backbone_row = find_task(session, task), find_backbone(session, backbone)
                planned = self._plan_sweep(session, request, task_row, backbone_row, now, device)
                stored_key, mine = key, submitted_by_current_actor(Sweep)
                if key is not None:
                    existing = session.scalar(select(Sweep).where(Sweep.idempotency_key == key, mine))
                    if existing is not None:
                        _check_same_sweep(existing, task_row, backbone_row, request, key)
                        return SweepRecord.of(existing, sweep_job_ids(session, existing.id), True)
                else:
                    stored_key = _derived_sweep_key(task_row, backbone_row, planned)
                    existing = session.scalar(select(Sweep).where(Sweep.idempotency_key == stored_key, mine))
                    if existing is not None:
                        if not again and _has_live_jobs(session, existing):
                            return SweepRecord.of(existing, sweep_job_ids(session, existing.id), True)
                        existing.idempotency_key = None  # the identity moves to the new runs
                        session.flush()
                self._check_queue_quota(session, len(planned))
                return self._queue_sweep(
                    session,
                    request,
                    planned,
                    task_row,
                    backbone_row,
                    priority,
                    max_attempts,
                    device,
                    stored_key,
                    now,
                )

        return retry_once_on_conflict(write)

    def get_sweep(self, sweep_id: int) -> SweepRecord:
        """The sweep and the ids of its jobs."""
        with self._reading() as session:
            sweep = session.get(Sweep, sweep_id)
            if sweep is None:
                raise UnknownSweepError(sweep_id)
            return SweepRecord.of(sweep, sweep_job_ids(session, sweep_id))

    # --- the steps of a submit -------------------------------------------------------------------

    def _check_job_args(
        self, seed: Any, k_shot: Any, priority: Any, max_attempts: Any, idempotency_key: Any
    ) -> tuple[int, int | None, int, int, str | None]:
        seed = check_range(SEED, seed, "seed")
        k_shot = None if k_shot is None else check_range(TRAIN_RANGES["k_shot"], k_shot, "k_shot")
        priority = check_int(priority, "priority", minimum=-1_000_000, maximum=1_000_000)
        attempts = self.max_attempts if max_attempts is None else max_attempts
        attempts = check_int(attempts, "max_attempts", minimum=1, maximum=MAX_ATTEMPTS_LIMIT)
        return seed, k_shot, priority, attempts, check_key(idempotency_key)

    def _check_sweep_request(
        self,
        methods: Sequence[str],
        seeds: Sequence[int],
        k_values: Sequence[int | None],
        hyperparameters: Mapping[str, Any] | None,
        method_hyperparameters: Mapping[str, Mapping[str, Any]] | None,
    ) -> _SweepRequest:
        """The sweep's lists (distinct, in range), its size under PELT_MAX_SWEEP_JOBS, and each method's
        hyperparameters (the common ones, then the method's own)."""
        method_names = distinct_list(methods, "methods", lambda m, f: check_name(m, f))
        seed_list = distinct_list(seeds, "seeds", lambda s, f: check_range(SEED, s, f))
        k_list = distinct_list(
            k_values,
            "k_values",
            lambda k, f: None if k is None else check_range(TRAIN_RANGES["k_shot"], k, f),
        )
        total = len(method_names) * len(seed_list) * len(k_list)
        if total > self.max_sweep_jobs:
            raise RegistryValidationError(
                "methods",
                f"the sweep would make {total} jobs; at most {self.max_sweep_jobs} (PELT_MAX_SWEEP_JOBS)",
            )
        per_method = dict(method_hyperparameters or {})
        for name, values in per_method.items():
            if name not in method_names:
                raise RegistryValidationError(
                    f"method_hyperparameters.{name}",
                    f"{name!r} is not one of the sweep's methods ({', '.join(method_names)})",
                )
            if not isinstance(values, Mapping):
                raise RegistryValidationError(f"method_hyperparameters.{name}", "expected a mapping")
        common = dict(hyperparameters or {})
        return _SweepRequest(
            methods=method_names,
            seeds=seed_list,
            k_values=k_list,
            hyperparameters=jsonable(common),
            method_hyperparameters=jsonable({name: dict(values) for name, values in per_method.items()}),
            split={
                name: split_hyperparameters({**common, **per_method.get(name, {})}) for name in method_names
            },
        )

    def check_sweep(
        self,
        task: str,
        methods: Sequence[str],
        seeds: Sequence[int],
        k_values: Sequence[int | None],
        backbone: str,
        hyperparameters: Mapping[str, Any] | None = None,
        *,
        method_hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        device: str = DEFAULT_JOB_DEVICE,
        again: bool = False,
    ) -> int:
        """Check a sweep as `submit_sweep` checks it (its arguments, names, each K against the task's rows
        and held-out rows, the ranges that depend on the backbone), writing nothing: how many jobs it
        holds, or the error submitting it would raise. The queue quota is not checked (it changes as
        jobs end)."""
        request, *_ = self._check_sweep_args(
            methods,
            seeds,
            k_values,
            hyperparameters,
            method_hyperparameters,
            priority,
            max_attempts,
            idempotency_key,
            device,
            again,
        )

        def plan() -> int:
            try:
                with self._writing() as session:  # planning may make a built-in method's row: rolled back
                    task_row, backbone_row = find_task(session, task), find_backbone(session, backbone)
                    planned = self._plan_sweep(session, request, task_row, backbone_row, self._now(), device)
                    raise _Checked(len(planned))
            except _Checked as checked:
                return checked.jobs

        return retry_once_on_conflict(plan)

    def _check_sweep_args(
        self,
        methods: Sequence[str],
        seeds: Sequence[int],
        k_values: Sequence[int | None],
        hyperparameters: Mapping[str, Any] | None,
        method_hyperparameters: Mapping[str, Mapping[str, Any]] | None,
        priority: Any,
        max_attempts: Any,
        idempotency_key: Any,
        device: Any,
        again: Any,
    ) -> tuple[_SweepRequest, int, int, str | None, str]:
        """A sweep's arguments checked before anything is read: (request, priority, max_attempts, key,
        device)."""
        request = self._check_sweep_request(methods, seeds, k_values, hyperparameters, method_hyperparameters)
        _, _, priority, max_attempts, key = self._check_job_args(
            0, None, priority, max_attempts, idempotency_key
        )
        if key is not None and key.startswith(SWEEP_KEY_PREFIX):
            raise RegistryValidationError(
                "idempotency_key",
                f"keys starting {SWEEP_KEY_PREFIX!r} are the service's own (a sweep's identity)",
            )
        device = check_device(device)
        if not isinstance(again, bool):
            raise RegistryValidationError("again", f"must be true or false, got {again!r}")
        if again and key is not None:
            raise RegistryValidationError(
                "again",
                "an idempotency_key names one sweep, so it cannot be submitted again under it: "
                "drop the key, or drop again",
            )
        return request, priority, max_attempts, key, device

    def _plan_sweep(
        self,
        session: Session,
        request: _SweepRequest,
        task: Task,
        backbone: Backbone,
        now: datetime,
        device: str = DEFAULT_JOB_DEVICE,
    ) -> list[PlannedJob]:
        """Every job of the sweep, validated (`_plan_method` for each method)."""
        return [
            plan
            for name in request.methods
            for plan in self._plan_method(
                session,
                name,
                request.split[name],
                task,
                backbone,
                request.seeds,
                request.k_values,
                now,
                device=device,
            )
        ]

    def _plan_method(
        self,
        session: Session,
        method: str,
        hyperparameters: Hyperparameters,
        task: Task,
        backbone: Backbone,
        seeds: list[int],
        k_values: list[int | None],
        now: datetime,
        fusion_spec: Mapping[str, Any] | None = None,
        device: str = DEFAULT_JOB_DEVICE,
    ) -> list[PlannedJob]:
        """The jobs of one method for every seed and K (seed first), validated: its spec with the
        overrides, each K's training config, and the ranges that depend on the backbone."""
        train, overrides, given = hyperparameters
        if fusion_spec is not None:
            base = presets.fusion_method(session, fusion_spec, now)
        else:
            base = presets.job_method(session, method, now)
        spec = resolve_method_spec(method, base.spec, overrides)
        if fusion_spec is not None:
            _check_frozen_sources(base.spec, spec, overrides)
        facts = backbone.facts
        # validate once per K: the seed changes nothing else in the config
        by_k = {
            k: resolve_train_config(
                train,
                given,
                seed=seeds[0],
                k_shot=k,
                task_max_length=fitted_max_length(task.max_length, facts),
                task_train_size=task.train_size,
                held_out=held_out_rows(task.split_sizes, task.train_size),
            )
            for k in k_values
        }
        budget, budget_source = self._memory_budget(session, device)
        check_against_backbone(
            method,
            base.spec,
            overrides,
            spec,
            by_k[k_values[0]],
            given,
            facts,
            memory_budget=budget,
            budget_source=budget_source,
        )
        stored = {k: canonical_hyperparameters(train, config, overrides) for k, config in by_k.items()}
        return [
            PlannedJob(base.row, base.fingerprint, seed, k, {**by_k[k], "seed": seed}, spec, stored[k])
            for seed in seeds
            for k in k_values
        ]

    def _memory_budget(self, session: Session, device: str) -> tuple[int, str]:
        """(bytes, what they are) a job's memory estimate is checked against: the largest worker that could
        run it as the leading dispatchers report them (`gpu` jobs: GPU workers, `cpu`: CPU workers, `any`:
        either), else PELT_WORKER_MEMORY_BYTES (no report yet, or none of that kind: one may join)."""
        kinds = {"gpu": ("gpu",), "cpu": ("cpu",)}.get(device, ("cpu", "gpu"))
        largest, largest_kind = 0, None
        leaders = session.scalars(select(DispatcherLeader).where(DispatcherLeader.expires_at > self._now()))
        for row in leaders:
            for kind in kinds:
                memory = int((row.worker_memory or {}).get(kind) or 0)
                if memory > largest:
                    largest, largest_kind = memory, kind
        if largest_kind is None:
            return self.worker_memory_bytes, "PELT_WORKER_MEMORY_BYTES"
        return largest, f"the cluster's largest {largest_kind.upper()} worker: {largest / 2**30:.1f} GiB"

    def _queue_sweep(
        self,
        session: Session,
        request: _SweepRequest,
        planned: list[PlannedJob],
        task: Task,
        backbone: Backbone,
        priority: int,
        max_attempts: int,
        device: str,
        key: str | None,
        now: datetime,
    ) -> SweepRecord:
        """Write the sweep row, its queued jobs and the audit event."""
        sweep = Sweep(
            task_id=task.id,
            backbone_id=backbone.id,
            priority=priority,
            idempotency_key=key,
            submitted_by=current_actor(),
            created_at=now,
            **request.stored(),
        )
        session.add(sweep)
        session.flush()
        jobs = queue_jobs(
            session,
            planned,
            task_id=task.id,
            backbone_id=backbone.id,
            priority=priority,
            max_attempts=max_attempts,
            now=now,
            reason=f"submitted by sweep {sweep.id}",
            device=device,
            sweep_id=sweep.id,
        )
        job_ids = [job.id for job in jobs]
        detail = {"task": task.name, "methods": request.methods, "jobs": len(job_ids)}
        audit(session, now, "sweep.submit", f"sweep {sweep.id}", detail)
        log.info("sweep %s: queued %d jobs for task %s", sweep.id, len(job_ids), task.name)
        return SweepRecord.of(sweep, job_ids)

    def _check_queue_quota(self, session: Session, adding: int) -> None:
        """QuotaExceededError when the current actor would have more than max_queued_jobs_per_token queued
        jobs after adding `adding` (jobs submitted without an actor are not capped).

        Counting and then inserting is atomic only if one submit of an actor runs at a time: SQLite's write
        gate serializes every write; on PostgreSQL (READ COMMITTED) the submit first locks its token's row
        (`SELECT … FOR UPDATE`; an actor without one, e.g. `cli:<user>`, a transaction-scoped advisory lock
        on its name), so a second submit of the same token waits and then counts the first one's jobs."""
        actor = current_actor()
        if actor is None:
            return
        if session.get_bind().dialect.name == "postgresql":
            token_row = session.scalar(select(ApiToken.id).where(ApiToken.name == actor).with_for_update())
            if token_row is None:
                session.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"pelt-queue:{actor}"))))
        queued = (
            session.scalar(
                select(func.count())
                .select_from(Job)
                .where(Job.submitted_by == actor, Job.status == JobStatus.QUEUED.value)
            )
            or 0
        )
        cap = self.max_queued_jobs_per_token
        if queued + adding > cap:
            raise QuotaExceededError(
                "jobs",
                f"token {actor!r} has {queued} queued jobs and this request adds {adding}; at most {cap} "
                "may wait at once (PELT_MAX_QUEUED_JOBS_PER_TOKEN): wait for some to start, or cancel some",
            )


def _check_frozen_sources(
    base: Mapping[str, Any], spec: Mapping[str, Any], overrides: Mapping[str, Any]
) -> None:
    """A fusion's overrides change its own adapter (`adapter.size`, ...) and training, never the modules it
    holds from its sources: those are the stored deltas it names."""
    frozen = {role for source in base["fusion"]["sources"] for role in source["roles"]}
    for role in sorted(frozen):
        if spec["modules"][role] != base["modules"][role]:
            given = ", ".join(sorted(overrides)) or "none"
            raise RegistryValidationError(
                "hyperparameters",
                f"the overrides ({given}) change {role!r}, a module a fusion holds frozen from a source delta; "
                "a fusion's overrides may change its own adapter only (adapter.size=..., adapter.dropout=...)",
            )


def _job_identity(plan: PlannedJob, task: Task, backbone: Backbone) -> tuple[Any, ...]:
    """What a job is, for idempotency: task, method, backbone, seed, K and hyperparameters (its device,
    priority and attempts are how it runs, not what it is); and a fusion's method spec (its sources)."""
    identity = (task.id, plan.method.id, backbone.id, plan.seed, plan.k_shot, jsonable(plan.hyperparameters))
    return (*identity, jsonable(plan.method_spec)) if plan.method_spec.get("fusion") else identity


def _check_same_job(existing: Job, plan: PlannedJob, task: Task, backbone: Backbone, key: str) -> None:
    """IdempotencyConflictError unless the job made under `key` was this same request (its device is
    placement, not identity: not compared)."""
    found = (
        existing.task_id,
        existing.method_id,
        existing.backbone_id,
        existing.seed,
        existing.k_shot,
        jsonable(existing.hyperparameters),
    )
    if existing.method_spec.get("fusion"):
        found = (*found, jsonable(existing.method_spec))
    if _job_identity(plan, task, backbone) != found:
        raise IdempotencyConflictError(key, "job")


SWEEP_KEY_PREFIX = "sweep:"


def _derived_sweep_key(task: Task, backbone: Backbone, planned: Sequence[PlannedJob]) -> str:
    """The idempotency key of a sweep submitted without one: a digest of its jobs' identities, in no
    particular order (the same methods, seeds and K values listed in another order are the same sweep)."""
    identities = sorted(  # the preset's fingerprint too: a preset changed by an upgrade is a new sweep
        json.dumps(
            [*_job_identity(plan, task, backbone), plan.method_fingerprint], sort_keys=True, default=str
        )
        for plan in planned
    )
    return SWEEP_KEY_PREFIX + hashlib.sha256("\n".join(identities).encode()).hexdigest()


def _has_live_jobs(session: Session, sweep: Sweep) -> bool:
    """Whether some job of the sweep is queued, running or succeeded (not every one failed or cancelled)."""
    ended_badly = [JobStatus.FAILED.value, JobStatus.CANCELLED.value]
    query = select(Job.id).where(Job.sweep_id == sweep.id, Job.status.not_in(ended_badly)).limit(1)
    return session.scalar(query) is not None


class _Checked(Exception):
    """Ends `check_sweep`'s transaction (rolled back) with the count of jobs it planned."""

    def __init__(self, jobs: int) -> None:
        super().__init__(jobs)
        self.jobs = jobs


def _check_same_sweep(
    existing: Sweep, task: Task, backbone: Backbone, request: _SweepRequest, key: str
) -> None:
    """IdempotencyConflictError unless the sweep made under `key` was this same request (device not
    compared, as for a job)."""
    found = {
        "methods": existing.methods,
        "seeds": existing.seeds,
        "k_values": existing.k_values,
        "hyperparameters": jsonable(existing.hyperparameters),
        "method_hyperparameters": jsonable(existing.method_hyperparameters),
    }
    if existing.task_id != task.id or existing.backbone_id != backbone.id or found != request.stored():
        raise IdempotencyConflictError(key, "sweep")


__all__ = ["MAX_ATTEMPTS_LIMIT", "Submissions"]
