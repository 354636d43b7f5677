"""Files the service writes are its own: folders 0700, files 0600.

The service's processes (`pelt serve`, `pelt dispatcher`, `pelt demo`, and the local Ray they start,
whose workers inherit it) run with umask 0o077 (`private_files`), so the registry and MLflow
databases (with SQLite's -wal/-shm files, which take the database's mode), uploaded datasets, MLflow
artifacts and deltas are created for the service's user only. `secure_data_dir` makes PELT_DATA_DIR
0700 at start-up and tightens the files an older version may have left readable to others, where the
process owns them. A data directory it does not own (a mounted volume: NFS, EFS or Filestore with a group
set by the pod's `fsGroup`) is left as it is, with a warning, as long as the process can read, write and
enter it; one it cannot use is refused at once, naming the directory, its owner and mode, and the process's
user.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
EMBEDDED_FILES = ("registry.db", "mlflow.db", "api_token")  # and their -wal/-shm/-journal companions

log = logging.getLogger("pelt.serve")


class DataDirError(PermissionError):
    """PELT_DATA_DIR exists but this process cannot read, write or enter it."""


def private_files() -> None:
    """From now on, this process (and every process it starts) creates files 0600 and folders 0700."""
    os.umask(PRIVATE_UMASK)


def secure_data_dir(data_dir: Path) -> None:
    """Create PELT_DATA_DIR if missing and make it 0700 where this process owns it (its embedded stores'
    files 0600, those it owns); a directory owned by another user is used as it is, with a warning, if this
    process can read, write and enter it, else DataDirError (module docstring)."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = data_dir.stat()
    uid = os.geteuid()
    if info.st_uid != uid:
        mode = stat.S_IMODE(info.st_mode)
        where = (
            f"PELT_DATA_DIR {data_dir} (owner uid {info.st_uid}, group gid {info.st_gid}, mode {mode:04o})"
        )
        if not os.access(
            data_dir, os.R_OK | os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids
        ):
            raise DataDirError(
                f"{where} is not readable, writable and enterable by this process (uid {uid}, gid "
                f"{os.getegid()}, groups {sorted(os.getgroups())}): give it to this user, or its group "
                "write access (a Kubernetes pod's fsGroup), or point PELT_DATA_DIR elsewhere"
            )
        log.warning(
            "%s is not this process's (uid %s): its mode is left as it is; pelt's own files in it are "
            "still created 0600%s",
            where,
            uid,
            "; others can enter it" if mode & 0o007 else "",
        )
    else:
        data_dir.chmod(0o700)
    for name in EMBEDDED_FILES:
        for path in data_dir.glob(f"{name}*"):
            if path.is_file() and not path.is_symlink() and path.stat().st_uid == uid:
                path.chmod(0o600)


__all__ = ["PRIVATE_UMASK", "DataDirError", "private_files", "secure_data_dir"]
