"""Files the service writes are its own: folders 0700, files 0600.

The service's processes (`pelt serve`, `pelt dispatcher`, `pelt demo`, and the local Ray they start,
whose workers inherit it) run with umask 0o077 (`private_files`), so the registry and MLflow
databases (with SQLite's -wal/-shm files, which take the database's mode), uploaded datasets, MLflow
artifacts and deltas are created for the service's user only. `secure_data_dir` makes PELT_DATA_DIR
0700 at start-up and tightens the files an older version may have left readable to others.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_UMASK = 0o077
EMBEDDED_FILES = ("registry.db", "mlflow.db", "api_token")  # and their -wal/-shm/-journal companions


def private_files() -> None:
    """From now on, this process (and every process it starts) creates files 0600 and folders 0700."""
    os.umask(PRIVATE_UMASK)


def secure_data_dir(data_dir: Path) -> None:
    """Create PELT_DATA_DIR if missing and make it 0700; the embedded stores' files in it become 0600."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    data_dir.chmod(0o700)
    for name in EMBEDDED_FILES:
        for path in data_dir.glob(f"{name}*"):
            if path.is_file() and not path.is_symlink():
                path.chmod(0o600)


__all__ = ["PRIVATE_UMASK", "private_files", "secure_data_dir"]
