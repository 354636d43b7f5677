"""MLflow set-up for the delta store: quiet defaults, tracking-URI rules and the one-time schema upgrade.

Nothing here imports mlflow at module level: `quiet_mlflow()` must run before mlflow's first import,
because mlflow decides about telemetry when it is imported.

Embedded store (the default): an SQLite file `<PELT_DATA_DIR>/mlflow.db` plus the artifact folder
`<PELT_DATA_DIR>/mlartifacts`. Deployed: PELT_MLFLOW_TRACKING_URI is an `http(s)://` MLflow server
(PostgreSQL behind it); the server owns its database and where artifacts go. A database URI
(`postgresql://…`) is also accepted and used directly, like SQLite.

`ensure_store()` creates or upgrades MLflow's schema (what `mlflow db upgrade` does) once, at service
start, under a lock: a file lock next to an SQLite file, `pg_advisory_lock` on PostgreSQL. Workers
only check (`check_store`): MLflow would otherwise initialise an empty database from every process
that opens it, concurrently.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from services.delta_store.errors import DeltaStoreError, StoreNotReadyError

UPGRADE_COMMAND = "pelt mlflow upgrade"
QUIET_ENVIRONMENT = {
    "MLFLOW_DISABLE_TELEMETRY": "true",  # no usage telemetry (mlflow >= 3.2)
    "DO_NOT_TRACK": "true",  # the cross-tool opt-out mlflow also honours
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # no "View run at …" lines from a server's client
    "GIT_PYTHON_REFRESH": "quiet",
}
_ADVISORY_LOCK_KEY = int.from_bytes(
    hashlib.sha256(b"pelt: mlflow schema upgrade").digest()[:8], "big", signed=True
)


def quiet_mlflow() -> None:
    """Default mlflow to no telemetry and no progress bars (explicit environment settings win)."""
    for key, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def is_server_uri(tracking_uri: str) -> bool:
    """True for an MLflow tracking server (`http://`, `https://`), False for a database URI."""
    return tracking_uri.split(":", 1)[0].lower() in ("http", "https")


def normalize_tracking_uri(tracking_uri: str) -> str:
    """A bare `postgresql://` URI gets the installed psycopg (3) driver; other URIs are kept."""
    scheme, sep, rest = tracking_uri.partition("://")
    if sep and scheme.lower() in ("postgresql", "postgres"):
        return f"postgresql+psycopg://{rest}"
    return tracking_uri


def display_uri(tracking_uri: str) -> str:
    """The URI with any password hidden, for messages."""
    if is_server_uri(tracking_uri) or "://" not in tracking_uri:
        return tracking_uri
    from sqlalchemy import make_url

    return make_url(tracking_uri).render_as_string(hide_password=True)


def sqlite_file(tracking_uri: str) -> Path | None:
    """The file of an `sqlite:///…` tracking URI (None for anything else)."""
    if not tracking_uri.startswith("sqlite:"):
        return None
    from sqlalchemy import make_url

    database = make_url(tracking_uri).database or ""
    return None if database in ("", ":memory:") else Path(database).expanduser()


def ensure_store(
    tracking_uri: str | None = None, artifact_root: str | None = None, *, wait_seconds: float = 0.0
) -> str | None:
    """Make the MLflow store usable: create or upgrade its schema once (locked), make the artifact
    folder; for a tracking server, wait up to `wait_seconds` for its /health. Returns the schema
    revision (None for a server). Safe to call from several processes at once."""
    from services.settings import get_settings

    quiet_mlflow()
    settings = get_settings()
    uri = normalize_tracking_uri(tracking_uri or settings.mlflow_tracking_uri)
    if is_server_uri(uri):
        wait_for_server(uri, wait_seconds)
        return None
    if tracking_uri is None and artifact_root is None:
        artifact_root = settings.mlflow_artifact_root
    if artifact_root and "://" not in artifact_root:
        Path(artifact_root).expanduser().mkdir(parents=True, exist_ok=True)
    path = sqlite_file(uri)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    with _init_lock(uri):
        return _upgrade(uri)


_CHECKED: set[str] = set()  # URIs found at head by this process (a schema does not go back)


def check_store(tracking_uri: str) -> None:
    """Raise StoreNotReadyError unless the database behind `tracking_uri` is at MLflow's schema head
    (servers are not checked here: their own start-up does it). Checked once per process and URI."""
    uri = normalize_tracking_uri(tracking_uri)
    if is_server_uri(uri) or uri in _CHECKED:
        return
    path = sqlite_file(uri)
    if path is not None and not path.exists():
        raise StoreNotReadyError(
            f"the MLflow store {display_uri(uri)} does not exist yet; run "
            f"`{UPGRADE_COMMAND}` (or services.delta_store.ensure_store()) once at start-up"
        )
    current, head = schema_revisions(uri)
    if current != head:
        state = "is empty" if current is None else f"is at schema revision {current}, not {head}"
        raise StoreNotReadyError(
            f"the MLflow store {display_uri(uri)} {state}; run `{UPGRADE_COMMAND}` "
            "(or services.delta_store.ensure_store()) once at start-up"
        )
    _CHECKED.add(uri)


def schema_revisions(tracking_uri: str) -> tuple[str | None, str]:
    """(the database's MLflow schema revision or None when it has no MLflow tables, the installed head)."""
    quiet_mlflow()
    from mlflow.store.db import utils as db_utils

    engine = _engine(normalize_tracking_uri(tracking_uri))
    try:
        current = None if db_utils._is_empty_database(engine) else db_utils._get_schema_version(engine)
        return current, db_utils._get_latest_schema_revision()
    finally:
        engine.dispose()


def wait_for_server(tracking_uri: str, wait_seconds: float = 0.0) -> None:
    """Return once `<tracking_uri>/health` answers 200; DeltaStoreError after `wait_seconds`."""
    deadline = time.monotonic() + wait_seconds
    url = tracking_uri.rstrip("/") + "/health"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
                problem = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as exc:
            problem = str(exc)
        if time.monotonic() >= deadline:
            raise DeltaStoreError(f"the MLflow server {tracking_uri} does not answer ({problem})")
        time.sleep(0.5)


# --- internals ------------------------------------------------------------------------------------


def _engine(uri: str):
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    return create_engine(uri, poolclass=NullPool)


def _upgrade(uri: str) -> str:
    """What `mlflow db upgrade` does: create the tables of an empty database, else migrate to head."""
    from mlflow.store.db import utils as db_utils

    engine = _engine(uri)
    try:
        if db_utils._is_empty_database(engine):
            db_utils._initialize_tables(engine)
        elif db_utils._get_schema_version(engine) != db_utils._get_latest_schema_revision():
            db_utils._upgrade_db(engine)
        return db_utils._get_schema_version(engine)
    finally:
        engine.dispose()


def _init_lock(uri: str) -> contextlib.AbstractContextManager[None]:
    """One MLflow schema upgrade at a time (`services.upgrade_lock`: an advisory lock, or a file lock)."""
    from services.upgrade_lock import upgrade_lock

    return upgrade_lock(uri, _ADVISORY_LOCK_KEY, "mlflow")


__all__ = [
    "QUIET_ENVIRONMENT",
    "UPGRADE_COMMAND",
    "check_store",
    "display_uri",
    "ensure_store",
    "is_server_uri",
    "normalize_tracking_uri",
    "quiet_mlflow",
    "schema_revisions",
    "sqlite_file",
    "wait_for_server",
]
