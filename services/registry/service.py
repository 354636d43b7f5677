"""The registry's service layer: the only code that speaks SQL. Everything else calls `Registry`.

Job lifecycle (every status change writes a job event in the same transaction):

    submit ──▶ queued ──claim──▶ running ──complete──▶ succeeded (one result row, ever)
                 ▲                 │ fail (retryable, attempts left) / lease expired / release
                 └─────────────────┤
                                   ├─ fail (not retryable, or attempts used up) ──▶ failed
                                   └─ cancel (a flag the worker sees at heartbeat) ──▶ cancelled

`attempts` counts the times a job was started; a job fails for good once `max_attempts` starts have
failed. A retry waits `retry_backoff_seconds * 2**(attempts-1)` (capped). Claims are atomic:
`SELECT … FOR UPDATE SKIP LOCKED` on PostgreSQL, a `BEGIN IMMEDIATE` transaction on SQLite.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import URL, Engine, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pelt_core.limits import SEED, TRAIN_RANGES, fitted_max_length
from services.redaction import error_summary
from services.registry import dataset_probe
from services.registry.actor import current_actor
from services.registry.db import (
    busy_as_registry_error,
    check_schema_current,
    hold_write_turn,
    make_engine,
    session_factory,
    write_gate,
)
from services.registry.errors import (
    AlreadyExistsError,
    IdempotencyConflictError,
    JobStateError,
    LeaseLostError,
    NotFoundError,
    QuotaExceededError,
    RegistryBusyError,
    RegistryValidationError,
    UnknownBackboneError,
    UnknownJobError,
    UnknownMethodError,
    UnknownSweepError,
    UnknownTaskError,
)
from services.registry.leaderboard import LeaderboardRow, OrderBy, Run, rank_methods
from services.registry.models import (
    TERMINAL_STATUSES,
    TOKEN_SCOPES,
    ApiToken,
    AuditEvent,
    Backbone,
    Job,
    JobEvent,
    JobStatus,
    Method,
    Result,
    Sweep,
    Task,
    utcnow,
)
from services.registry.records import (
    ApiTokenRecord,
    AuditEventRecord,
    BackboneRecord,
    JobEventRecord,
    JobRecord,
    MethodRecord,
    ResultRecord,
    SweepRecord,
    TaskRecord,
)
from services.registry.task_data import check_task_against_data, held_out_rows
from services.registry.validation import (
    canonical_hyperparameters,
    check_against_backbone,
    check_int,
    check_key,
    check_method_spec,
    check_name,
    check_progress,
    check_range,
    check_result,
    check_task_definition,
    resolve_method_spec,
    resolve_train_config,
    split_hyperparameters,
)
from services.settings import Settings, get_settings

log = logging.getLogger("pelt.registry")

MAX_ATTEMPTS_LIMIT = 100
MAX_ERROR_CHARS = 20_000
_T = TypeVar("_T")


class Registry:
    """Tasks, methods, backbones, the durable job queue, results and leaderboards.

    `Registry(url)` opens (and owns) an engine; `Registry(engine)` uses the caller's. Start-up refuses
    a database whose schema is behind the code (SchemaOutOfDateError naming `pelt db upgrade`).
    Queue knobs default to the settings (PELT_LEASE_SECONDS, PELT_MAX_ATTEMPTS, …); `clock` returns
    the current timezone-aware time and exists for tests. Claims take back expired leases at most
    once per `reap_interval_seconds` (`requeue_expired_leases` does it at once).

    Who acts is `services.registry.actor.current_actor()` (the API sets it to the request's token):
    jobs record it as `submitted_by`, and every write of a registration, submit, cancel or token change
    adds an audit event in its own transaction (`audit_events`). One actor may have at most
    PELT_MAX_QUEUED_JOBS_PER_TOKEN queued jobs; a submit beyond is a QuotaExceededError, nothing written.
    """

    def __init__(
        self,
        engine_or_url: Engine | str | URL | None = None,
        *,
        settings: Settings | None = None,
        lease_seconds: float | None = None,
        max_attempts: int | None = None,
        retry_backoff_seconds: float | None = None,
        retry_backoff_max_seconds: float | None = None,
        clock: Callable[[], datetime] = utcnow,
        check_schema: bool = True,
        reap_interval_seconds: float = 1.0,
    ) -> None:
        settings = settings or get_settings()
        if isinstance(engine_or_url, Engine):
            self.engine, self._owns_engine = engine_or_url, False
        else:
            url = engine_or_url if engine_or_url is not None else settings.database_url
            self.engine = make_engine(url, busy_timeout_seconds=settings.db_busy_timeout_seconds)
            self._owns_engine = True
        self.lease_seconds = float(lease_seconds if lease_seconds is not None else settings.lease_seconds)
        self.max_attempts = int(max_attempts if max_attempts is not None else settings.max_attempts)
        self.retry_backoff_seconds = float(
            retry_backoff_seconds if retry_backoff_seconds is not None else settings.retry_backoff_seconds
        )
        self.retry_backoff_max_seconds = float(
            retry_backoff_max_seconds
            if retry_backoff_max_seconds is not None
            else settings.retry_backoff_max_seconds
        )
        self.max_queued_jobs_per_token = settings.max_queued_jobs_per_token
        self.max_sweep_jobs = settings.max_sweep_jobs  # PELT_MAX_SWEEP_JOBS
        self.worker_memory_bytes = settings.worker_memory_bytes  # PELT_WORKER_MEMORY_BYTES
        self._clock = clock
        self.dataset_limits = dataset_probe.DatasetLimits(
            settings.max_dataset_rows, settings.max_dataset_bytes
        )
        self._names: dict[str, dict[int, str]] = {}  # table → id → name (names never change)
        self._task_metrics: dict[int, str] = {}
        self._reap_interval = timedelta(seconds=reap_interval_seconds)
        self._next_reap: datetime | None = None
        self._gate = write_gate(self.engine, settings.db_busy_timeout_seconds)
        self._read_sessions = session_factory(self.engine)
        self._write_sessions = session_factory(self.engine, write=True)
        if check_schema:
            try:
                check_schema_current(self.engine)
            except Exception:
                self.close()
                raise

    # --- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the connections (only of an engine the registry created)."""
        if self._gate is not None:
            self._gate.close()
        if self._owns_engine:
            self.engine.dispose()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Registry({self.engine.url.render_as_string(hide_password=True)!r})"

    @contextmanager
    def _reading(self) -> Iterator[Session]:
        with self._read_sessions() as session, session.begin():
            yield session

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        """A write transaction (BEGIN IMMEDIATE on SQLite); committed on success, rolled back on error.
        RegistryBusyError when no write turn comes within the busy timeout."""
        with (
            busy_as_registry_error(),
            hold_write_turn(self._gate),
            self._write_sessions() as session,
            session.begin(),
        ):
            yield session

    def _job_records(self, session: Session, jobs: Iterable[Job]) -> list[JobRecord]:
        """Records of job rows (see _cache_names)."""
        jobs = list(jobs)
        self._cache_names(session, jobs)
        return [self._job_record(job) for job in jobs]

    def _cache_names(self, session: Session, jobs: list[Job]) -> None:
        """Load the task, method and backbone names the jobs need that are not cached yet."""
        for model, attribute in ((Task, "task_id"), (Method, "method_id"), (Backbone, "backbone_id")):
            cache = self._names.setdefault(model.__tablename__, {})
            missing = {getattr(job, attribute) for job in jobs} - cache.keys()
            if missing:
                rows = session.execute(select(model.id, model.name).where(model.id.in_(missing)))
                cache.update({row_id: name for row_id, name in rows})

    def _job_record(self, job: Job) -> JobRecord:
        """A job's record from a loaded row (no database access: it may run after the commit)."""
        names = (
            self._names["tasks"][job.task_id],
            self._names["methods"][job.method_id],
            self._names["backbones"][job.backbone_id],
        )
        return JobRecord.of(job, names)

    def _task_metric(self, session: Session, task_id: int) -> str:
        if task_id not in self._task_metrics:
            self._task_metrics[task_id] = session.scalar(select(Task.metric).where(Task.id == task_id))
        return self._task_metrics[task_id]

    def _now(self) -> datetime:
        now = self._clock()
        if now.tzinfo is None:
            raise ValueError("the registry's clock must return timezone-aware datetimes")
        return now

    # --- tasks -----------------------------------------------------------------------------------

    def register_task(
        self,
        name: str,
        source: str | Path | Mapping[str, str | Path],
        *,
        text_fields: Sequence[str] | str,
        label_field: str = "label",
        problem_type: str = "single_label_classification",
        metric: str = "accuracy",
        metric_direction: str | None = None,
        label_names: Sequence[str] | None = None,
        max_length: int = 128,
        description: str = "",
        prober: Callable[..., dataset_probe.DatasetProbe] | None = None,
    ) -> TaskRecord:
        """Register a task after checking its fields against the data (train rows are counted, label
        names inferred for classification when not given). Re-registering the same definition returns
        the existing task; a different one under the same name is an AlreadyExistsError. `prober`
        (source, label_field, limits) -> DatasetProbe reads the data (default: `dataset_probe.probe_dataset`
        in this process; uploads use `probe_dataset_in_child`)."""
        check_name(name)
        definition = check_task_definition(
            text_fields=text_fields,
            label_field=label_field,
            problem_type=problem_type,
            metric=metric,
            metric_direction=metric_direction,
            label_names=label_names,
            max_length=max_length,
        )
        if not isinstance(description, str):
            raise RegistryValidationError("description", "must be a string")
        resolved = dataset_probe.resolve_source(source)
        probe = (prober or dataset_probe.probe_dataset)(resolved, definition.label_field, self.dataset_limits)
        names = check_task_against_data(definition, probe, "the train split")
        values: dict[str, Any] = {
            "name": name,
            "source_kind": resolved.kind,
            "source": dict(resolved.paths),
            "split_sizes": dict(probe.split_sizes),
            "train_size": probe.train_rows,
            "text_fields": definition.text_fields,
            "label_field": definition.label_field,
            "problem_type": definition.problem_type,
            "metric": definition.metric,
            "metric_direction": definition.metric_direction,
            "label_names": names,
            "max_length": definition.max_length,
            "description": description,
        }

        def write() -> TaskRecord:
            with self._writing() as session:
                existing = session.scalar(select(Task).where(Task.name == name))
                if existing is not None:
                    differences = [
                        key
                        for key, value in values.items()
                        if _jsonable(getattr(existing, key)) != _jsonable(value)
                    ]
                    if differences:
                        raise AlreadyExistsError(
                            "name", f"task {name!r} already exists with a different {', '.join(differences)}"
                        )
                    return TaskRecord.of(existing)
                row = Task(**values, created_at=self._now())
                session.add(row)
                session.flush()
                _audit(session, row.created_at, "task.register", name, {"source_kind": resolved.kind})
                return TaskRecord.of(row)

        return _retry_once_on_conflict(write)

    def get_task(self, name: str) -> TaskRecord:
        """The task of that name (UnknownTaskError lists the known ones)."""
        with self._reading() as session:
            return TaskRecord.of(_task_row(session, name))

    def list_tasks(self) -> list[TaskRecord]:
        """Every task, by name."""
        with self._reading() as session:
            return [TaskRecord.of(row) for row in session.scalars(select(Task).order_by(Task.name))]

    # --- methods ---------------------------------------------------------------------------------

    def register_method(self, spec: Mapping[str, Any], *, replace: bool = False) -> MethodRecord:
        """Store a user-defined preset (validated by pelt_core.get_method). The same spec again returns
        the existing row; a different spec needs `replace=True` (queued jobs keep their own copy).
        Built-in presets cannot be replaced."""
        normalized = check_method_spec(spec)
        name = normalized["name"]

        def write() -> MethodRecord:
            with self._writing() as session:
                existing = session.scalar(select(Method).where(Method.name == name))
                if existing is None:
                    row = Method(
                        name=name,
                        spec=normalized,
                        builtin=False,
                        description=normalized.get("description", ""),
                        created_at=self._now(),
                    )
                    session.add(row)
                    session.flush()
                    _audit(session, row.created_at, "method.register", name)
                    return MethodRecord.of(row)
                if _jsonable(existing.spec) == _jsonable(normalized):
                    return MethodRecord.of(existing)
                if existing.builtin:
                    raise AlreadyExistsError(
                        "name", f"{name!r} is a built-in method; give your preset another name"
                    )
                if not replace:
                    raise AlreadyExistsError(
                        "name",
                        f"method {name!r} already exists with a different spec; pass replace=True to change it",
                    )
                existing.spec = normalized
                existing.description = normalized.get("description", "")
                _audit(session, self._now(), "method.register", name, {"replaced": True})
                return MethodRecord.of(existing)

        return _retry_once_on_conflict(write)

    def get_method(self, name: str) -> MethodRecord:
        """The method preset of that name (UnknownMethodError lists the known ones)."""
        with self._reading() as session:
            return MethodRecord.of(_method_row(session, name))

    def list_methods(self, *, builtin: bool | None = None) -> list[MethodRecord]:
        """Method presets: built-ins in their seeded order, then user-defined ones in registration order."""
        query = select(Method).order_by(Method.builtin.desc(), Method.id)
        if builtin is not None:
            query = query.where(Method.builtin.is_(builtin))
        with self._reading() as session:
            return [MethodRecord.of(row) for row in session.scalars(query)]

    # --- backbones -------------------------------------------------------------------------------

    def register_backbone(
        self, name: str, source: str, content_hash: str, facts: Mapping[str, Any] | None = None
    ) -> BackboneRecord:
        """Record a backbone. The same name, source and hash again returns it; another source or hash
        under the same name is an AlreadyExistsError (a changed model needs a new name). `facts`: the
        backbone's shape ({hidden_size: 384, ...}, numbers and short strings), kept as given."""
        check_name(name)
        for field, value in (("source", source), ("content_hash", content_hash)):
            if not isinstance(value, str) or not value.strip():
                raise RegistryValidationError(field, f"must be a non-empty string, got {value!r}")
        if len(content_hash) > 200:
            raise RegistryValidationError("content_hash", "at most 200 characters")
        facts = _backbone_facts(facts)

        def write() -> BackboneRecord:
            with self._writing() as session:
                existing = session.scalar(select(Backbone).where(Backbone.name == name))
                if existing is None:
                    row = Backbone(
                        name=name,
                        source=source,
                        content_hash=content_hash,
                        facts=facts,
                        created_at=self._now(),
                    )
                    session.add(row)
                    session.flush()
                    _audit(session, row.created_at, "backbone.register", name)
                    return BackboneRecord.of(row)
                if existing.source != source:  # the message names no source: it may be a server path
                    raise AlreadyExistsError(
                        "source",
                        f"backbone {name!r} is registered from another source; register this one under "
                        "a new name",
                    )
                if existing.content_hash != content_hash:
                    raise AlreadyExistsError(
                        "content_hash",
                        f"backbone {name!r} is registered with content_hash {existing.content_hash!r}, "
                        f"not {content_hash!r}",
                    )
                return BackboneRecord.of(existing)

        return _retry_once_on_conflict(write)

    def set_backbone_facts(self, name: str, facts: Mapping[str, Any]) -> BackboneRecord:
        """Record the facts of a backbone registered without them (before migration 0006). Facts once
        recorded stay: a backbone's shape never changes under its name."""
        checked = _backbone_facts(facts)
        if checked is None:
            raise RegistryValidationError(
                "facts", "must be a mapping of names to numbers or strings, got None"
            )
        with self._writing() as session:
            row = _backbone_row(session, name)
            if row.facts is None:
                row.facts = checked
            return BackboneRecord.of(row)

    def get_backbone(self, name: str) -> BackboneRecord:
        """The backbone of that name (UnknownBackboneError lists the known ones)."""
        with self._reading() as session:
            return BackboneRecord.of(_backbone_row(session, name))

    def list_backbones(self) -> list[BackboneRecord]:
        """Every backbone, by name."""
        with self._reading() as session:
            return [
                BackboneRecord.of(row) for row in session.scalars(select(Backbone).order_by(Backbone.name))
            ]

    # --- submitting ------------------------------------------------------------------------------

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
    ) -> JobRecord:
        """Validate, then queue one job. Hyperparameters are flat `key: value` pairs: training ones
        (learning_rate/lr, epochs, batch_size, …) and method-spec overrides (r, bottleneck, q.size, …).
        The same idempotency key returns the job it made (a different request under it is an error)."""
        seed, k_shot, priority, max_attempts, key = self._check_job_args(
            seed, k_shot, priority, max_attempts, idempotency_key
        )
        train, overrides, given = split_hyperparameters(hyperparameters)

        def write() -> JobRecord:
            with self._writing() as session:
                task_row = _task_row(session, task)
                method_row = _method_row(session, method)
                backbone_row = _backbone_row(session, backbone)
                spec = resolve_method_spec(method_row.name, method_row.spec, overrides)
                facts = getattr(backbone_row, "facts", None)
                config = resolve_train_config(
                    train,
                    given,
                    seed=seed,
                    k_shot=k_shot,
                    task_max_length=fitted_max_length(task_row.max_length, facts),
                    task_train_size=task_row.train_size,
                    held_out=held_out_rows(task_row.split_sizes, task_row.train_size),
                )
                check_against_backbone(
                    method_row.name,
                    method_row.spec,
                    overrides,
                    spec,
                    config,
                    given,
                    facts,
                    memory_budget=self.worker_memory_bytes,
                )
                stored = canonical_hyperparameters(train, config, overrides)
                if key is not None:
                    existing = session.scalar(select(Job).where(Job.idempotency_key == key))
                    if existing is not None:
                        request = (
                            task_row.id,
                            method_row.id,
                            backbone_row.id,
                            seed,
                            k_shot,
                            _jsonable(stored),
                        )
                        found = (
                            existing.task_id,
                            existing.method_id,
                            existing.backbone_id,
                            existing.seed,
                            existing.k_shot,
                            _jsonable(existing.hyperparameters),
                        )
                        if request != found:
                            raise IdempotencyConflictError(key, "job")
                        return self._job_records(session, [existing])[0]
                self._check_queue_quota(session, 1)
                now = self._now()
                job = Job(
                    task=task_row,
                    method=method_row,
                    backbone=backbone_row,
                    hyperparameters=stored,
                    train_config=config,
                    method_spec=spec,
                    seed=seed,
                    k_shot=k_shot,
                    priority=priority,
                    status=JobStatus.QUEUED.value,
                    attempts=0,
                    max_attempts=max_attempts,
                    cancel_requested=False,
                    idempotency_key=key,
                    submitted_by=current_actor(),
                    created_at=now,
                    updated_at=now,
                )
                session.add(job)
                session.flush()
                _audit(
                    session,
                    now,
                    "job.submit",
                    f"job {job.id}",
                    {"task": task_row.name, "method": method_row.name, "backbone": backbone_row.name},
                )
                session.add(
                    JobEvent(
                        job_id=job.id,
                        at=now,
                        from_status=None,
                        to_status=JobStatus.QUEUED.value,
                        reason="submitted",
                    )
                )
                return self._job_records(session, [job])[0]

        return _retry_once_on_conflict(write)

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
    ) -> SweepRecord:
        """Queue methods × seeds × K values for one task in one transaction (all jobs or none).

        `k_values` entries of None mean the full training set. `hyperparameters` apply to every
        method; `method_hyperparameters[method]` add to or override them for one method (e.g. a rank
        that only LoRA has). The same idempotency key returns the sweep it made."""
        method_names = _distinct_list(methods, "methods", lambda m, f: check_name(m, f))
        seed_list = _distinct_list(seeds, "seeds", lambda s, f: check_range(SEED, s, f))
        k_list = _distinct_list(
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
        _, _, priority, max_attempts, key = self._check_job_args(
            0, None, priority, max_attempts, idempotency_key
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
        split = {name: split_hyperparameters({**common, **per_method.get(name, {})}) for name in method_names}
        request = {
            "methods": method_names,
            "seeds": seed_list,
            "k_values": k_list,
            "hyperparameters": _jsonable(common),
            "method_hyperparameters": _jsonable({name: dict(values) for name, values in per_method.items()}),
        }

        def write() -> SweepRecord:
            with self._writing() as session:
                task_row = _task_row(session, task)
                backbone_row = _backbone_row(session, backbone)
                method_rows = {name: _method_row(session, name) for name in method_names}
                planned = []
                for name in method_names:
                    train, overrides, given = split[name]
                    spec = resolve_method_spec(name, method_rows[name].spec, overrides)
                    facts = getattr(backbone_row, "facts", None)
                    # validate once per K: the seed (checked above) changes nothing else in the config
                    by_k = {
                        k: resolve_train_config(
                            train,
                            given,
                            seed=seed_list[0],
                            k_shot=k,
                            task_max_length=fitted_max_length(task_row.max_length, facts),
                            task_train_size=task_row.train_size,
                            held_out=held_out_rows(task_row.split_sizes, task_row.train_size),
                        )
                        for k in k_list
                    }
                    check_against_backbone(
                        name,
                        method_rows[name].spec,
                        overrides,
                        spec,
                        by_k[k_list[0]],
                        given,
                        facts,
                        memory_budget=self.worker_memory_bytes,
                    )
                    stored = {
                        k: canonical_hyperparameters(train, config, overrides) for k, config in by_k.items()
                    }
                    for seed in seed_list:
                        for k in k_list:
                            planned.append(
                                (method_rows[name], seed, k, {**by_k[k], "seed": seed}, spec, stored[k])
                            )
                if key is not None:
                    existing = session.scalar(select(Sweep).where(Sweep.idempotency_key == key))
                    if existing is not None:
                        found = {
                            "methods": existing.methods,
                            "seeds": existing.seeds,
                            "k_values": existing.k_values,
                            "hyperparameters": _jsonable(existing.hyperparameters),
                            "method_hyperparameters": _jsonable(existing.method_hyperparameters),
                        }
                        if (
                            existing.task_id != task_row.id
                            or existing.backbone_id != backbone_row.id
                            or found != request
                        ):
                            raise IdempotencyConflictError(key, "sweep")
                        return SweepRecord.of(existing, _sweep_job_ids(session, existing.id))
                self._check_queue_quota(session, len(planned))
                now = self._now()
                sweep = Sweep(
                    task_id=task_row.id,
                    backbone_id=backbone_row.id,
                    priority=priority,
                    idempotency_key=key,
                    created_at=now,
                    **request,
                )
                session.add(sweep)
                session.flush()
                jobs = [
                    Job(
                        task_id=task_row.id,
                        method_id=method_row.id,
                        backbone_id=backbone_row.id,
                        sweep_id=sweep.id,
                        hyperparameters=stored,
                        train_config=config,
                        method_spec=spec,
                        seed=seed,
                        k_shot=k,
                        priority=priority,
                        status=JobStatus.QUEUED.value,
                        attempts=0,
                        max_attempts=max_attempts,
                        cancel_requested=False,
                        submitted_by=current_actor(),
                        created_at=now,
                        updated_at=now,
                    )
                    for method_row, seed, k, config, spec, stored in planned
                ]
                session.add_all(jobs)
                session.flush()
                job_ids = [job.id for job in jobs]
                session.execute(
                    JobEvent.__table__.insert(),
                    [
                        {
                            "job_id": job_id,
                            "at": now,
                            "from_status": None,
                            "to_status": "queued",
                            "reason": f"submitted by sweep {sweep.id}",
                        }
                        for job_id in job_ids
                    ],
                )
                _audit(
                    session,
                    now,
                    "sweep.submit",
                    f"sweep {sweep.id}",
                    {"task": task_row.name, "methods": method_names, "jobs": len(job_ids)},
                )
                log.info("sweep %s: queued %d jobs for task %s", sweep.id, len(job_ids), task_row.name)
                return SweepRecord.of(sweep, job_ids)

        return _retry_once_on_conflict(write)

    def get_sweep(self, sweep_id: int) -> SweepRecord:
        """The sweep and the ids of its jobs."""
        with self._reading() as session:
            sweep = session.get(Sweep, sweep_id)
            if sweep is None:
                raise UnknownSweepError(sweep_id)
            return SweepRecord.of(sweep, _sweep_job_ids(session, sweep_id))

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

    def _check_job_args(
        self, seed: Any, k_shot: Any, priority: Any, max_attempts: Any, idempotency_key: Any
    ) -> tuple[int, int | None, int, int, str | None]:
        seed = check_range(SEED, seed, "seed")
        k_shot = None if k_shot is None else check_range(TRAIN_RANGES["k_shot"], k_shot, "k_shot")
        priority = check_int(priority, "priority", minimum=-1_000_000, maximum=1_000_000)
        attempts = self.max_attempts if max_attempts is None else max_attempts
        attempts = check_int(attempts, "max_attempts", minimum=1, maximum=MAX_ATTEMPTS_LIMIT)
        return seed, k_shot, priority, attempts, check_key(idempotency_key)

    # --- the queue -------------------------------------------------------------------------------

    def claim_job(
        self, worker_id: str, lease_seconds: float | None = None, backbones: Iterable[str] | None = None
    ) -> JobRecord | None:
        """Take the next runnable job (highest priority, then oldest) for `worker_id`, or None.

        Expired leases are taken back first. `backbones`: only jobs on these backbones (the ones
        the worker holds). Jobs waiting out a retry backoff (`not_before`) are skipped."""
        claimed = self.claim_jobs(worker_id, 1, lease_seconds=lease_seconds, backbones=backbones)
        return claimed[0] if claimed else None

    def claim_jobs(
        self,
        worker_id: str,
        limit: int,
        *,
        lease_seconds: float | None = None,
        backbones: Iterable[str] | None = None,
    ) -> list[JobRecord]:
        """Take up to `limit` runnable jobs at once (see claim_job), in queue order."""
        _check_worker(worker_id)
        check_int(limit, "limit", minimum=1, maximum=10_000)
        lease = self._lease(lease_seconds)
        backbone_names = None if backbones is None else sorted(set(backbones))
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
                _transition(
                    session,
                    job,
                    JobStatus.RUNNING,
                    now,
                    f"claimed (attempt {job.attempts} of {job.max_attempts})",
                    worker_id,
                )
            self._cache_names(session, jobs)
        return [self._job_record(job) for job in jobs]  # built after the commit: the write turn is short

    def heartbeat(
        self,
        job_id: int,
        worker_id: str,
        progress: float | Mapping[str, Any] | None = None,
        lease_seconds: float | None = None,
    ) -> bool:
        """Renew the lease and record progress; returns True when cancellation was requested.

        `progress`: a fraction in [0, 1], or the worker's report {step, total, loss, tokens_per_second,
        epoch, learning_rate} (kept as `progress_detail`; the fraction becomes step / total).
        Raises LeaseLostError when the worker no longer holds the job: it must stop."""
        _check_worker(worker_id)
        fraction, detail = check_progress(progress)
        lease = self._lease(lease_seconds)
        with self._writing() as session:
            job = _held_job(session, job_id, worker_id)
            now = self._now()
            job.lease_expires_at = now + timedelta(seconds=lease)
            job.heartbeat_at = now
            job.updated_at = now
            if fraction is not None:
                job.progress = fraction
                job.progress_detail = detail
            return job.cancel_requested

    def complete_job(self, job_id: int, worker_id: str, result: Mapping[str, Any]) -> ResultRecord:
        """Record the job's result and mark it succeeded; exactly one result row per job, ever.

        A repeated completion returns the stored result and writes nothing. A worker whose lease
        lapsed may still complete a job that has not ended (the work is done; the job's current
        holder learns at its next heartbeat). Completing a cancelled or failed job is a JobStateError.
        `result`: metrics (with the task's metric), trainable_params, trainable_percent or
        total_params, train_seconds, and optionally peak_memory_bytes, delta_uri, delta_sha256,
        mlflow_run_id, mlflow_model_version, primary_metric."""
        _check_worker(worker_id)

        def write() -> ResultRecord:
            with self._writing() as session:
                job = _job_row(session, job_id, lock=True)
                if job.status == JobStatus.SUCCEEDED and job.result is not None:
                    return ResultRecord.of(job.result)
                if job.status in (JobStatus.CANCELLED, JobStatus.FAILED):
                    raise JobStateError(job_id, f"is {job.status}; its result was not recorded")
                holder = job.status == JobStatus.RUNNING and job.lease_owner == worker_id
                if not holder and not _worker_held(session, job_id, worker_id):
                    raise LeaseLostError(job_id, f"was never held by worker {worker_id!r}")
                values = check_result(result, self._task_metric(session, job.task_id))
                now = self._now()
                row = Result(
                    job_id=job.id, worker_id=worker_id, attempt=max(job.attempts, 1), created_at=now, **values
                )
                session.add(row)
                job.progress = 1.0
                reason = "completed" if holder else f"completed by {worker_id}, whose lease had lapsed"
                _transition(session, job, JobStatus.SUCCEEDED, now, reason, worker_id)
            return ResultRecord.of(row)  # built after the commit (the row's id came with the flush)

        try:
            return write()
        except IntegrityError:  # a concurrent completion won the race: return its result
            stored = self.get_result(job_id)
            if stored is None:
                raise
            return stored

    def fail_job(self, job_id: int, worker_id: str, error: str, retryable: bool = True) -> JobRecord:
        """The attempt failed: back to the queue after a backoff while attempts remain (and the error is
        retryable), else failed with this error. A job whose cancellation was requested ends cancelled.

        `error` may be a whole traceback: the job's `last_error` and its event's reason keep one line
        (the exception's message, server paths cut: `services.redaction.error_summary`); the full text
        goes to the event's `detail`, which only admin tokens see."""
        _check_worker(worker_id)
        full = _clip(str(error))
        summary = error_summary(full)
        with self._writing() as session:
            job = _held_job(session, job_id, worker_id)
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
        _check_worker(worker_id)
        with self._writing() as session:
            job = _held_job(session, job_id, worker_id)
            now = self._now()
            if job.cancel_requested:
                _transition(session, job, JobStatus.CANCELLED, now, f"cancelled ({reason})", worker_id)
            else:
                job.attempts = max(job.attempts - 1, 0)
                job.not_before = None
                _transition(session, job, JobStatus.QUEUED, now, reason, worker_id)
            return self._job_records(session, [job])[0]

    def confirm_cancelled(self, job_id: int, worker_id: str) -> JobRecord:
        """The worker saw the cancel flag and stopped: the job ends cancelled."""
        _check_worker(worker_id)
        with self._writing() as session:
            job = _held_job(session, job_id, worker_id)
            if not job.cancel_requested:
                raise JobStateError(job_id, "no cancellation was requested")
            _transition(
                session, job, JobStatus.CANCELLED, self._now(), "cancelled; the worker stopped", worker_id
            )
            return self._job_records(session, [job])[0]

    def cancel_job(self, job_id: int, reason: str = "cancelled by request") -> JobRecord:
        """Cancel a job: a queued one ends cancelled at once (it never runs); a running one gets a
        flag its worker sees at its next heartbeat. An ended job is returned unchanged."""
        with self._writing() as session:
            job = _job_row(session, job_id, lock=True)
            now = self._now()
            if self._cancel(session, job, now, reason):
                _audit(session, now, "job.cancel", f"job {job_id}")
            return self._job_records(session, [job])[0]

    def cancel_sweep(self, sweep_id: int, reason: str = "sweep cancelled by request") -> int:
        """Cancel every job of a sweep that has not ended; returns how many were cancelled or flagged."""
        with self._writing() as session:
            if session.get(Sweep, sweep_id) is None:
                raise UnknownSweepError(sweep_id)
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
                _audit(session, now, "sweep.cancel", f"sweep {sweep_id}", {"jobs": cancelled})
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
        too; a dispatcher may call it on a timer."""
        with self._writing() as session:
            jobs = self._reap_expired(session, now or self._now())
            return self._job_records(session, jobs)

    def _reap_expired(self, session: Session, now: datetime) -> list[Job]:
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
            _transition(
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
            _transition(
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
            _transition(
                session, job, JobStatus.FAILED, now, f"{reason} ({why}): {error}", worker_id, detail=detail
            )

    def _cancel(self, session: Session, job: Job, now: datetime, reason: str) -> bool:
        if job.status == JobStatus.QUEUED:
            _transition(session, job, JobStatus.CANCELLED, now, reason)
            return True
        if job.status == JobStatus.RUNNING and not job.cancel_requested:
            job.cancel_requested = True
            _transition(session, job, JobStatus.RUNNING, now, f"cancel requested: {reason}")
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

    # --- reading jobs and results ----------------------------------------------------------------

    def get_job(self, job_id: int) -> JobRecord:
        """The job (UnknownJobError when there is none)."""
        with self._reading() as session:
            return self._job_records(session, [_job_row(session, job_id)])[0]

    def list_jobs(
        self,
        *,
        task: str | None = None,
        status: str | Iterable[str] | None = None,
        method: str | None = None,
        backbone: str | None = None,
        sweep_id: int | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[JobRecord]:
        """Jobs matching every filter given, oldest first."""
        check_int(limit, "limit", minimum=1, maximum=100_000)
        check_int(offset, "offset", minimum=0)
        with self._reading() as session:
            query = self._job_filter(session, select(Job), task, status, method, backbone, sweep_id)
            query = query.order_by(Job.id).limit(limit).offset(offset)
            return self._job_records(session, session.scalars(query))

    def job_counts(
        self, *, task: str | None = None, sweep_id: int | None = None, backbone: str | None = None
    ) -> dict[str, int]:
        """How many jobs are in each status (every status present, zeros included)."""
        with self._reading() as session:
            query = self._job_filter(
                session,
                select(Job.status, func.count()).group_by(Job.status),
                task,
                None,
                None,
                backbone,
                sweep_id,
            )
            counts = {status.value: 0 for status in JobStatus}
            counts.update({status: count for status, count in session.execute(query)})
            return counts

    def _job_filter(
        self,
        session: Session,
        query: Any,
        task: str | None,
        status: str | Iterable[str] | None,
        method: str | None,
        backbone: str | None,
        sweep_id: int | None,
    ) -> Any:
        if task is not None:
            query = query.where(Job.task_id == _task_row(session, task).id)
        if method is not None:
            query = query.where(Job.method_id == _method_row(session, method).id)
        if backbone is not None:
            query = query.where(Job.backbone_id == _backbone_row(session, backbone).id)
        if sweep_id is not None:
            query = query.where(Job.sweep_id == sweep_id)
        if status is not None:
            statuses = [status] if isinstance(status, str) else list(status)
            for value in statuses:
                if value not in JobStatus.__members__.values():
                    raise RegistryValidationError("status", f"{value!r} is not one of {', '.join(JobStatus)}")
            query = query.where(Job.status.in_([str(value) for value in statuses]))
        return query

    def job_events(self, job_id: int) -> list[JobEventRecord]:
        """The job's history: every status change (and cancel request), oldest first."""
        with self._reading() as session:
            _job_row(session, job_id)
            rows = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
            return [JobEventRecord.of(row) for row in rows]

    def get_result(self, job_id: int) -> ResultRecord | None:
        """The job's result, or None while it has none."""
        with self._reading() as session:
            _job_row(session, job_id)
            row = session.scalar(select(Result).where(Result.job_id == job_id))
            return None if row is None else ResultRecord.of(row)

    # --- leaderboard -----------------------------------------------------------------------------

    def leaderboard(
        self,
        task: str,
        k_shot: int | None = None,
        *,
        backbone: str | None = None,
        order_by: OrderBy = "best",
    ) -> list[LeaderboardRow]:
        """One row per method over the task's succeeded jobs (only K = `k_shot` when given; all runs,
        whatever their K, when None): best and mean ± std of the primary metric, run count, trainable
        percentage, median train time and the job and delta behind the best. Best first by the
        metric's direction; ties go to fewer trainable parameters."""
        if k_shot is not None:
            check_int(k_shot, "k_shot", minimum=1)
        with self._reading() as session:
            task_row = _task_row(session, task)
            query = (
                select(
                    Method.name,
                    Job.id,
                    Job.seed,
                    Job.k_shot,
                    Result.primary_metric,
                    Result.trainable_params,
                    Result.trainable_percent,
                    Result.train_seconds,
                    Result.delta_uri,
                    Result.delta_sha256,
                )
                .select_from(Result)
                .join(Job, Result.job_id == Job.id)
                .join(Method, Job.method_id == Method.id)
                .where(Job.task_id == task_row.id, Job.status == JobStatus.SUCCEEDED.value)
            )
            if k_shot is not None:
                query = query.where(Job.k_shot == k_shot)
            if backbone is not None:
                query = query.where(Job.backbone_id == _backbone_row(session, backbone).id)
            runs = [Run(*row) for row in session.execute(query)]
            direction = task_row.metric_direction
        return rank_methods(runs, direction, order_by)

    # --- API tokens ------------------------------------------------------------------------------

    def create_api_token(self, name: str, scope: str = "write") -> tuple[ApiTokenRecord, str]:
        """A new bearer token for the HTTP API: (its record, the secret). Only the secret's SHA-256 is
        stored, so the secret cannot be shown again. Names are unique, also among revoked tokens.

        scope: `read` (every GET), `write` (read + submit, cancel, register tasks and methods, compose)
        or `admin` (write + register backbones, full job errors, the audit trail)."""
        check_name(name, "name")
        if scope not in TOKEN_SCOPES:
            raise RegistryValidationError("scope", f"must be one of {', '.join(TOKEN_SCOPES)}, got {scope!r}")
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)

        def write() -> ApiTokenRecord:
            with self._writing() as session:
                if session.scalar(select(ApiToken.id).where(ApiToken.name == name)) is not None:
                    raise AlreadyExistsError("name", f"a token named {name!r} already exists")
                row = ApiToken(
                    name=name,
                    scope=scope,
                    token_hash=_token_hash(secret),
                    prefix=secret[: len(TOKEN_PREFIX) + 6],
                    created_at=self._now(),
                )
                session.add(row)
                session.flush()
                _audit(session, row.created_at, "token.create", name, {"scope": scope})
                return ApiTokenRecord.of(row)

        return write(), secret

    def authenticate(self, secret: str) -> ApiTokenRecord | None:
        """The active token whose secret this is, or None (unknown or revoked). Marks it used at most
        once a minute (a write per request would serialise readers on SQLite)."""
        if not isinstance(secret, str) or not secret.startswith(TOKEN_PREFIX) or len(secret) > 200:
            return None
        with self._reading() as session:
            row = session.scalar(select(ApiToken).where(ApiToken.token_hash == _token_hash(secret)))
            if row is None or row.revoked_at is not None:
                return None
            record = ApiTokenRecord.of(row)
        now = self._now()
        if record.last_used_at is None or now - record.last_used_at > timedelta(minutes=1):
            with (
                contextlib.suppress(RegistryBusyError),
                self._writing() as session,
            ):  # a busy registry: next time
                session.execute(
                    ApiToken.__table__.update().where(ApiToken.id == record.id).values(last_used_at=now)
                )
        return record

    def revoke_api_token(self, name: str) -> ApiTokenRecord:
        """Revoke a token by name (revoking twice is harmless); NotFoundError lists the known names."""
        with self._writing() as session:
            row = session.scalar(select(ApiToken).where(ApiToken.name == name))
            if row is None:
                known = session.scalars(select(ApiToken.name).order_by(ApiToken.name))
                raise NotFoundError("name", name, known)
            if row.revoked_at is None:
                row.revoked_at = self._now()
                _audit(session, row.revoked_at, "token.revoke", name)
            session.flush()
            return ApiTokenRecord.of(row)

    def list_api_tokens(self) -> list[ApiTokenRecord]:
        """Every token (active and revoked), by name; no secrets."""
        with self._reading() as session:
            return [
                ApiTokenRecord.of(row) for row in session.scalars(select(ApiToken).order_by(ApiToken.name))
            ]

    # --- audit trail -----------------------------------------------------------------------------

    def record_audit(
        self, action: str, target: str, detail: Mapping[str, Any] | None = None
    ) -> AuditEventRecord:
        """Record an action done outside the registry (e.g. a composition in the delta store) by the
        current actor. The registry's own writes record theirs in the same transaction."""
        with self._writing() as session:
            row = _audit(session, self._now(), action, target, detail)
            session.flush()
            return AuditEventRecord.of(row)

    def audit_events(self, *, limit: int = 100, offset: int = 0) -> list[AuditEventRecord]:
        """The audit trail, newest first."""
        check_int(limit, "limit", minimum=1, maximum=10_000)
        check_int(offset, "offset", minimum=0)
        query = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit).offset(offset)
        with self._reading() as session:
            return [AuditEventRecord.of(row) for row in session.scalars(query)]


# --- helpers (module level: they take the session they run in) -----------------------------------


def _task_row(session: Session, name: str) -> Task:
    row = session.scalar(select(Task).where(Task.name == name))
    if row is None:
        raise UnknownTaskError("task", name, session.scalars(select(Task.name).order_by(Task.name)))
    return row


def _method_row(session: Session, name: str) -> Method:
    row = session.scalar(select(Method).where(Method.name == name))
    if row is None:
        known = session.scalars(select(Method.name).order_by(Method.builtin.desc(), Method.id))
        raise UnknownMethodError("method", name, known)
    return row


def _backbone_row(session: Session, name: str) -> Backbone:
    row = session.scalar(select(Backbone).where(Backbone.name == name))
    if row is None:
        raise UnknownBackboneError(
            "backbone", name, session.scalars(select(Backbone.name).order_by(Backbone.name))
        )
    return row


def _backbone_facts(facts: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A backbone's facts as stored: a flat mapping of short names to numbers or short strings."""
    if facts is None:
        return None
    if not isinstance(facts, Mapping) or len(facts) > 50:
        raise RegistryValidationError("facts", "must be a mapping of at most 50 names to numbers or strings")
    for key, value in facts.items():
        if not isinstance(key, str) or not 0 < len(key) <= 100:
            raise RegistryValidationError("facts", f"names are strings of 1 to 100 characters, got {key!r}")
        if not (
            value is None or isinstance(value, int | float) or (isinstance(value, str) and len(value) <= 200)
        ):
            raise RegistryValidationError(
                f"facts.{key}", f"must be a number or a short string, got {value!r}"
            )
    return dict(facts)


def _job_row(session: Session, job_id: int, *, lock: bool = False) -> Job:
    if isinstance(job_id, bool) or not isinstance(job_id, int):
        raise RegistryValidationError("job_id", f"must be a whole number, got {job_id!r}")
    job = session.get(Job, job_id, with_for_update=lock or None)
    if job is None:
        raise UnknownJobError(job_id)
    return job


def _held_job(session: Session, job_id: int, worker_id: str) -> Job:
    """The job, locked, if `worker_id` holds its lease; LeaseLostError otherwise."""
    job = _job_row(session, job_id, lock=True)
    if job.status != JobStatus.RUNNING or job.lease_owner != worker_id:
        holder = f"held by {job.lease_owner}" if job.lease_owner else "not held by anyone"
        raise LeaseLostError(job_id, f"worker {worker_id!r} does not hold it (it is {job.status}, {holder})")
    return job


def _worker_held(session: Session, job_id: int, worker_id: str) -> bool:
    """Whether `worker_id` ever claimed the job."""
    query = select(JobEvent.id).where(
        JobEvent.job_id == job_id,
        JobEvent.to_status == JobStatus.RUNNING.value,
        JobEvent.worker_id == worker_id,
    )
    return session.scalar(query.limit(1)) is not None


def _transition(
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


def _sweep_job_ids(session: Session, sweep_id: int) -> list[int]:
    return list(session.scalars(select(Job.id).where(Job.sweep_id == sweep_id).order_by(Job.id)))


def _check_worker(worker_id: str) -> None:
    if not isinstance(worker_id, str) or not worker_id or len(worker_id) > 200:
        raise RegistryValidationError(
            "worker_id", f"must be a non-empty string of at most 200 characters, got {worker_id!r}"
        )


def _distinct_list(values: Any, field: str, check: Callable[[Any, str], Any]) -> list[Any]:
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


def _audit(
    session: Session, at: datetime, action: str, target: str, detail: Mapping[str, Any] | None = None
) -> AuditEvent:
    """Add an audit event by the current actor to the caller's transaction."""
    row = AuditEvent(
        at=at, actor=current_actor(), action=action, target=target[:300], detail=_jsonable(detail or {})
    )
    session.add(row)
    return row


def _clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Long errors (tracebacks) keep their head and their tail, where the cause usually is."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n… [{len(text) - limit} characters cut] …\n{text[-half:]}"


def _jsonable(value: Any) -> Any:
    """The value as it comes back from a JSON column (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value, sort_keys=True))


TOKEN_PREFIX = "pelt_"


def _token_hash(secret: str) -> str:
    """Tokens are 256-bit random strings, so a plain SHA-256 (no salt, no stretching) is enough."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _retry_once_on_conflict(write: Callable[[], _T]) -> _T:
    """Run a get-or-create write; if a concurrent writer inserted the same unique key first
    (PostgreSQL), run it again: the second run finds that row and compares against it."""
    try:
        return write()
    except IntegrityError:
        return write()


__all__ = ["Registry"]
