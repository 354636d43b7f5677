"""What every part of the Registry shares: the engine and its sessions, the write turn, the clock, the
queue's settings and the caches of names that never change."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, Self

from sqlalchemy import URL, Engine, select, text
from sqlalchemy.orm import Session

from services.registry import dataset_probe
from services.registry.db import (
    busy_as_registry_error,
    check_schema_current,
    hold_write_turn,
    make_engine,
    session_factory,
    unavailable_as_registry_error,
    write_gate,
)
from services.registry.models import Backbone, Job, Method, Task, utcnow
from services.registry.records import JobRecord
from services.settings import Settings, get_settings


class RegistryCore:
    """The connection, settings and caches of a Registry (see `services.registry.registry.Registry`).

    `RegistryCore(url)` opens (and owns) an engine; `RegistryCore(engine)` uses the caller's. Start-up
    refuses a database whose schema is behind the code (SchemaOutOfDateError naming `pelt db upgrade`).
    Queue knobs default to the settings (PELT_LEASE_SECONDS, PELT_MAX_ATTEMPTS, …); `clock` returns the
    current timezone-aware time and exists for tests. Claims take back expired leases at most once per
    `reap_interval_seconds`."""

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
        self.lease_seconds = float(_or_default(lease_seconds, settings.lease_seconds))
        self.max_attempts = int(_or_default(max_attempts, settings.max_attempts))
        self.retry_backoff_seconds = float(_or_default(retry_backoff_seconds, settings.retry_backoff_seconds))
        self.retry_backoff_max_seconds = float(
            _or_default(retry_backoff_max_seconds, settings.retry_backoff_max_seconds)
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
        # rankings kept while their task's results stay the same (services.registry.results `_ranked`)
        self._leaderboards: dict[tuple, tuple[tuple, Any]] = {}
        self._leaderboards_lock = threading.Lock()
        self._reap_interval = timedelta(seconds=reap_interval_seconds)
        self._next_reap: datetime | None = None
        # after an outage, a heartbeat's time and some: the workers' beats that failed get through first
        self.reap_grace_seconds = 2.0 * settings.heartbeat_seconds
        self._reap_paused_until = 0.0
        self._gate = write_gate(self.engine, settings.db_busy_timeout_seconds)
        self._read_sessions = session_factory(self.engine)
        self._write_sessions = session_factory(self.engine, write=True)
        if check_schema:
            try:
                with unavailable_as_registry_error(self._outage_seen):
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine.url.render_as_string(hide_password=True)!r})"

    # --- sessions --------------------------------------------------------------------------------

    @contextmanager
    def _reading(self) -> Iterator[Session]:
        """A read transaction. RegistryUnavailableError when the database does not answer."""
        with (
            unavailable_as_registry_error(self._outage_seen),
            self._read_sessions() as session,
            session.begin(),
        ):
            yield session

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        """A write transaction (BEGIN IMMEDIATE on SQLite); committed on success, rolled back on error.
        RegistryBusyError when no write turn comes within the busy timeout; RegistryUnavailableError when
        the database does not answer (`maybe_written` when the commit was sent)."""
        with (
            unavailable_as_registry_error(self._outage_seen) as phase,
            busy_as_registry_error(),
            hold_write_turn(self._gate),
            self._write_sessions() as session,
            session.begin(),
        ):
            yield session
            phase.committing = True

    def ping(self) -> None:
        """One round trip to the database (`SELECT 1`): RegistryUnavailableError when it does not answer."""
        with self._reading() as session:
            session.execute(text("SELECT 1"))

    def _outage_seen(self) -> None:
        """The database did not answer: expired leases wait `reap_grace_seconds` after it answers again
        (`_reap_paused`), so that workers whose heartbeats failed meanwhile can renew them first."""
        self._reap_paused_until = time.monotonic() + self.reap_grace_seconds

    def _reap_paused(self) -> bool:
        return time.monotonic() < self._reap_paused_until

    def now(self) -> datetime:
        """The registry's clock: what its timestamps (a job's start, end, lease) are measured by."""
        return self._now()

    def _now(self) -> datetime:
        now = self._clock()
        if now.tzinfo is None:
            raise ValueError("the registry's clock must return timezone-aware datetimes")
        return now

    # --- job records and the name caches ---------------------------------------------------------

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
        """The task's primary metric (cached: a task's definition never changes)."""
        if task_id not in self._task_metrics:
            self._task_metrics[task_id] = session.scalar(select(Task.metric).where(Task.id == task_id))
        return self._task_metrics[task_id]


def _or_default(value: float | None, default: float) -> float:
    return default if value is None else value


__all__ = ["RegistryCore"]
