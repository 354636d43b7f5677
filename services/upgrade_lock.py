"""One schema upgrade at a time, across processes and hosts: the lock the registry's (`pelt db upgrade`) and
MLflow's (`pelt mlflow upgrade`) upgrades take, so that two pods starting at once leave one schema.

PostgreSQL: `pg_advisory_lock(key)` on a connection of its own, held while the upgrade runs (each database its
own key). SQLite: an exclusive file lock beside the database file (`<file>.upgrade.lock`); none for an
in-memory database, which no other process sees. Any other database: a file lock in the temporary folder,
which serialises upgrades on one host only.
"""

from __future__ import annotations

import fcntl
import hashlib
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def upgrade_lock(url: str, key: int, name: str) -> Iterator[None]:
    """Hold the upgrade lock of the database at `url` (`key`: its advisory lock on PostgreSQL; `name` names
    the temporary lock file of other databases)."""
    from sqlalchemy import create_engine, make_url
    from sqlalchemy.pool import NullPool

    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        engine = create_engine(parsed, poolclass=NullPool)
        try:
            with engine.connect() as connection:
                connection.exec_driver_sql(f"SELECT pg_advisory_lock({int(key)})")
                try:
                    yield
                finally:
                    connection.exec_driver_sql(f"SELECT pg_advisory_unlock({int(key)})")
        finally:
            engine.dispose()
        return
    if backend == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or database.startswith("file:"):
            yield
            return
        path = Path(database).expanduser()
        lock_path = path.with_name(path.name + ".upgrade.lock")
    else:
        digest = hashlib.sha256(url.encode()).hexdigest()[:16]
        lock_path = Path(tempfile.gettempdir()) / f"pelt-{name}-upgrade-{digest}.lock"
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
