"""The data folder a first `pelt serve` makes (the registry's and MLflow's schemas migrated to head), built once
per test process and copied into each test's own data folder.

A test of a running service that is not about its first start copies it instead of migrating both schemas
again: a few CPU seconds a test, mostly MLflow's migrations. What it skips is tested on its own: the
migrations in tests/registry/test_registry_migrations.py and tests/delta_store/test_setup.py, a first
`pelt serve` on an empty folder in tests/api/test_serve.py and test_server_limits.py (its file modes).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

DATABASE_FILES = ("registry.db", "mlflow.db")  # Settings' defaults under PELT_DATA_DIR


@functools.cache
def migrated_data_template() -> Path:
    """A folder holding registry.db and mlflow.db at their schemas' heads (this process's own, removed at exit)."""
    from services.delta_store import ensure_store
    from services.registry import upgrade
    from services.registry.testing import sqlite_url

    folder = Path(tempfile.mkdtemp(prefix="pelt-data-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    upgrade(sqlite_url(folder / "registry.db"))
    ensure_store(sqlite_url(folder / "mlflow.db"), str(folder / "unused-artifacts"))
    return folder


def copy_migrated_data(data_dir: Path) -> Path:
    """`data_dir` (made if missing) with a copy of the migrated databases; returns it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name in DATABASE_FILES:
        shutil.copyfile(migrated_data_template() / name, data_dir / name)
    return data_dir
