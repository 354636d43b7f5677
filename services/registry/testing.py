"""Helpers for tests and benchmarks of the registry: scratch databases, a settable clock and
worker loops that run in separate processes (module-level, so `spawn` children can import them).

Nothing in the service imports this module.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, make_url
from sqlalchemy.pool import NullPool

from services.registry.db import normalize_url

MAINTENANCE_DATABASE = "postgres"

# --- scratch databases ---------------------------------------------------------------------------


def sqlite_url(path: str | Path) -> str:
    """The SQLAlchemy URL of an SQLite file."""
    return f"sqlite:///{Path(path).resolve()}"


def create_postgres_database(
    base_url: str, *, prefix: str = "pelt_test_", template: str | None = None
) -> str:
    """Create a database with a random name (from `template` if given) on the server of `base_url`,
    through the `postgres` maintenance database; returns its URL."""
    base = normalize_url(base_url)
    name = f"{prefix}{secrets.token_hex(6)}"
    statement = f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")
    _maintenance(base_url, statement)
    return base.set(database=name).render_as_string(hide_password=False)


def drop_postgres_database(url: str) -> None:
    """Drop the database of `url`, disconnecting whoever is still connected (PostgreSQL 13+)."""
    name = make_url(url).database
    if not name or name == MAINTENANCE_DATABASE:
        raise ValueError(f"refusing to drop {name!r}")
    _maintenance(url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def scratch_postgres(
    base_url: str, *, prefix: str = "pelt_test_", template: str | None = None
) -> Iterator[str]:
    """A fresh PostgreSQL database for the duration of the block, dropped afterwards."""
    url = create_postgres_database(base_url, prefix=prefix, template=template)
    try:
        yield url
    finally:
        drop_postgres_database(url)


def _maintenance(url: str, statement: str) -> None:
    engine = create_engine(
        normalize_url(url).set(database=MAINTENANCE_DATABASE),
        isolation_level="AUTOCOMMIT",
        poolclass=NullPool,
    )
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql(statement)
    finally:
        engine.dispose()


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write rows as JSON Lines (a task's data file); returns the path."""
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --- time ----------------------------------------------------------------------------------------


class FakeClock:
    """A clock that stands still until told to move: `Registry(..., clock=FakeClock(start))`."""

    def __init__(self, start: datetime) -> None:
        if start.tzinfo is None:
            raise ValueError("FakeClock needs a timezone-aware start")
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


# --- worker loops for other processes ------------------------------------------------------------

EXAMPLE_RESULT: dict[str, Any] = {
    "metrics": {"accuracy": 0.5, "loss": 0.7},
    "trainable_params": 1000,
    "total_params": 1_000_000,
    "train_seconds": 0.01,
}


def claim_until_empty(
    url: str,
    worker_id: str,
    start: Any,
    out: Any,
    complete: bool = False,
    lease_seconds: float = 300.0,
) -> None:
    """Process target: wait at `start` (a Barrier), claim (and complete) jobs until none is left, then
    put (worker_id, claimed job ids, start time, end time) on `out`."""
    from services.registry.registry import Registry

    registry = Registry(url, lease_seconds=lease_seconds)
    try:
        registry.job_counts()  # connect before the start line
        start.wait(timeout=120)
        began = time.time()
        claimed: list[int] = []
        while True:
            job = registry.claim_job(worker_id)
            if job is None:
                break
            claimed.append(job.id)
            if complete:
                registry.complete_job(job.id, worker_id, EXAMPLE_RESULT)
        out.put((worker_id, claimed, began, time.time()))
    finally:
        registry.close()


def claim_and_hold(
    url: str, worker_id: str, lease_seconds: float, heartbeat_seconds: float, out: Any
) -> None:
    """Process target: claim one job, report (worker_id, job id, pid) on `out`, then keep the lease
    alive by heartbeat until killed (it never returns on its own)."""
    from services.registry.registry import Registry

    registry = Registry(url, lease_seconds=lease_seconds)
    job = registry.claim_job(worker_id)
    out.put((worker_id, None if job is None else job.id, os.getpid()))
    if job is None:
        return
    while True:
        time.sleep(heartbeat_seconds)
        registry.heartbeat(job.id, worker_id)


__all__ = [
    "EXAMPLE_RESULT",
    "FakeClock",
    "claim_and_hold",
    "claim_until_empty",
    "create_postgres_database",
    "drop_postgres_database",
    "scratch_postgres",
    "sqlite_url",
    "write_jsonl",
]
