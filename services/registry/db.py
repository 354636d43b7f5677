"""Engines, sessions and schema revisions of the registry database.

SQLite (the default) runs in WAL mode with a busy timeout and foreign keys on; SQLAlchemy, not the
sqlite3 module, emits BEGIN, so a write transaction can start with `BEGIN IMMEDIATE` (it takes the
write lock up front and never fails half-way with "database is locked" on a read-to-write upgrade).
PostgreSQL connections are pre-pinged; claims use `FOR UPDATE SKIP LOCKED` (see queue.py). A server that
restarts or cannot be reached surfaces as `RegistryUnavailableError` (`unavailable_as_registry_error`), which
callers whose call is safe to repeat ride out with `call_through_outage`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import URL, Engine, create_engine, event, make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from services.registry.errors import RegistryBusyError, RegistryUnavailableError, SchemaOutOfDateError

log = logging.getLogger("pelt.registry")
T = TypeVar("T")
# SQLSTATEs of a server going away or not back yet: connection exceptions (class 08), and an operator's,
# a crash's or a start's refusal (57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now)
UNAVAILABLE_SQLSTATES = ("57P01", "57P02", "57P03")
OUTAGE_RETRY_FIRST_WAIT, OUTAGE_RETRY_MAX_WAIT = 0.2, 5.0
CONNECT_TIMEOUT_SECONDS = 10  # PostgreSQL's connect_timeout for the registry's connections
# A connection whose packets stop being acknowledged (the database's host cut off, not restarted: no reset
# reaches the client) is closed after this long instead of the kernel's ~15 minutes of retransmissions, so
# that a heartbeat or a round stuck on it fails as an outage (ridden out, retried) rather than hanging; idle
# pooled connections are probed by TCP keepalives. libpq's own options; a URL that sets one keeps its value.
STALLED_CONNECTION_OPTIONS = {
    "tcp_user_timeout": 30_000,  # ms of unacknowledged data (not a query's duration)
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}

SQLITE_BEGIN_OPTION = "pelt_sqlite_begin"
"""Execution option naming the BEGIN mode on SQLite: "DEFERRED" (reads) or "IMMEDIATE" (writes)."""

UPGRADE_COMMAND = "pelt db upgrade"


def normalize_url(url: str | URL) -> URL:
    """Parse a database URL; a bare `postgresql://` URL gets the installed psycopg (3) driver."""
    parsed = make_url(url) if isinstance(url, str) else url
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def display_url(url: str | URL) -> str:
    """The URL with its password hidden, for messages."""
    return normalize_url(url).render_as_string(hide_password=True)


def make_engine(
    url: str | URL | None = None, *, busy_timeout_seconds: float | None = None, **kwargs: Any
) -> Engine:
    """Create an engine for the registry (default URL: settings.database_url).

    SQLite: turns on WAL, foreign keys and a busy timeout, and lets
    `engine.execution_options(pelt_sqlite_begin="IMMEDIATE")` start write transactions with
    BEGIN IMMEDIATE. PostgreSQL: `pool_pre_ping`, and a connect timeout (CONNECT_TIMEOUT_SECONDS) unless the
    URL sets one: a database host that drops packets fails a call within seconds instead of minutes.
    """
    if url is None or busy_timeout_seconds is None:
        from services.settings import get_settings

        settings = get_settings()
        url = settings.database_url if url is None else url
        busy_timeout_seconds = (
            settings.db_busy_timeout_seconds if busy_timeout_seconds is None else busy_timeout_seconds
        )
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, busy_timeout_seconds, **kwargs)
    kwargs.setdefault("pool_pre_ping", True)
    connect_args = kwargs.setdefault("connect_args", {})
    for option, value in {"connect_timeout": CONNECT_TIMEOUT_SECONDS, **STALLED_CONNECTION_OPTIONS}.items():
        if option not in parsed.query:
            connect_args.setdefault(option, value)
    kwargs.setdefault("insertmanyvalues_page_size", 50)  # psycopg parses one huge INSERT slowly (big sweeps)
    return create_engine(parsed, **kwargs)


def sqlite_path(url: str | URL) -> Path | None:
    """The file of an SQLite URL (None for other databases and in-memory ones)."""
    parsed = normalize_url(url)
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database).expanduser()


def ensure_sqlite_folder(url: str | URL) -> None:
    """Create the folder of an SQLite file (before `pelt db upgrade` creates the file itself)."""
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)


def _sqlite_engine(url: URL, busy_timeout_seconds: float, **kwargs: Any) -> Engine:
    database = url.database or ""
    in_memory = database in ("", ":memory:") or "mode=memory" in str(url)
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("timeout", busy_timeout_seconds)
    engine = create_engine(url, connect_args=connect_args, **kwargs)
    busy_ms = int(busy_timeout_seconds * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy emits BEGIN itself (see _on_begin)
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            if not in_memory:
                cursor.execute("PRAGMA journal_mode = WAL")
                cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        mode = connection.get_execution_options().get(SQLITE_BEGIN_OPTION, "DEFERRED")
        if mode not in ("DEFERRED", "IMMEDIATE", "EXCLUSIVE"):
            raise ValueError(f"{SQLITE_BEGIN_OPTION}: unknown BEGIN mode {mode!r}")
        connection.exec_driver_sql(f"BEGIN {mode}")

    return engine


class SQLiteWriteGate:
    """Lets one registry write transaction at a time into an SQLite file, across processes.

    SQLite's own busy handler makes a blocked writer sleep for up to 100 ms between tries, so with
    several writer processes most time goes to sleeping (and an unlucky one can starve). Writers
    first take an OS file lock (`<database>.writelock`), polling every 0.2-2 ms, then BEGIN IMMEDIATE
    as before; the lock dies with its process. Gives up after `timeout` seconds with RegistryBusyError
    (a TimeoutError; the API answers 503 with Retry-After).
    """

    def __init__(self, database: Path, timeout: float) -> None:
        self.path = database.with_name(database.name + ".writelock")
        self.timeout = timeout
        self._thread_lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0

    @contextmanager
    def hold(self) -> Iterator[None]:
        import fcntl

        deadline = time.monotonic() + self.timeout
        if not self._thread_lock.acquire(timeout=self.timeout):
            raise RegistryBusyError(f"no write turn within {self.timeout:g} s (another thread held it)")
        try:
            fd = self._descriptor()
            delay = 0.0002
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RegistryBusyError(  # no path in the message: it may reach an API caller
                            f"no write turn within {self.timeout:g} s (another process held it)"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.002)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # a forked child needs its own open file
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._pid = os.getpid()
        return self._fd

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None


def write_gate(engine: Engine, timeout: float = 30.0) -> SQLiteWriteGate | None:
    """The writer gate for an SQLite file database (None elsewhere, and where fcntl is missing)."""
    path = sqlite_path(engine.url)
    if path is None:
        return None
    try:
        import fcntl  # noqa: F401 - POSIX only
    except ImportError:  # pragma: no cover - Windows: SQLite's busy handler alone
        return None
    return SQLiteWriteGate(path.resolve(), timeout)


def hold_write_turn(gate: SQLiteWriteGate | None) -> AbstractContextManager[None]:
    """The gate's turn, or nothing to wait for."""
    return gate.hold() if gate is not None else nullcontext()


@contextmanager
def busy_as_registry_error() -> Iterator[None]:
    """SQLite's "database is locked" / "database is busy" (its busy timeout ran out: a writer outside the
    gate, such as another tool, held the file) as a RegistryBusyError; the transaction was rolled back."""
    try:
        yield
    except OperationalError as exc:
        text = str(exc.orig if exc.orig is not None else exc).lower()
        if "database is locked" in text or "database is busy" in text:
            raise RegistryBusyError("SQLite's write lock was held past the busy timeout") from exc
        raise


def unavailable(exc: BaseException) -> bool:
    """Whether a database error means that the server is away (restarting, unreachable, the connection
    dropped), not that the statement was wrong."""
    if not isinstance(exc, DBAPIError) or exc.orig is None:
        return False
    if exc.connection_invalidated:
        return True
    state = getattr(exc.orig, "sqlstate", None)
    if state:
        return state.startswith("08") or state in UNAVAILABLE_SQLSTATES
    # psycopg's failures to connect, and to read an answer, carry no SQLSTATE (SQLite's errors are local)
    return isinstance(exc, OperationalError) and type(exc.orig).__module__.startswith("psycopg")


@dataclass
class TransactionPhase:
    """Where a transaction got to: `committing` once its body ran and the commit was sent."""

    committing: bool = False


@contextmanager
def unavailable_as_registry_error(on_outage: Callable[[], None]) -> Iterator[TransactionPhase]:
    """A database that is away, as RegistryUnavailableError (maybe_written once the commit was sent);
    `on_outage` is called first. The server's own words (addresses, ports) go to the log, not the error."""
    phase = TransactionPhase()
    try:
        yield phase
    except DBAPIError as exc:
        if not unavailable(exc):
            raise
        on_outage()
        log.warning("the registry's database did not answer: %s", str(exc.orig).splitlines()[0])
        what = "the connection broke during the commit" if phase.committing else "no connection"
        raise RegistryUnavailableError(what, maybe_written=phase.committing) from exc


def call_through_outage(call: Callable[[], T], seconds: float, what: str) -> T:
    """`call()`, tried again while the registry is unavailable, for up to `seconds` (waits doubling from
    0.2 s to 5 s). Only for calls that do nothing twice: a RegistryUnavailableError may mean it was written."""
    deadline = time.monotonic() + seconds
    wait = OUTAGE_RETRY_FIRST_WAIT
    while True:
        try:
            return call()
        except RegistryUnavailableError as exc:
            if time.monotonic() + wait > deadline:
                raise
            log.warning("%s: %s; trying again in %.1f s", what, exc, wait)
            time.sleep(wait)
            wait = min(wait * 2, OUTAGE_RETRY_MAX_WAIT)


def write_engine(engine: Engine) -> Engine:
    """The engine to use for write transactions: on SQLite they begin with BEGIN IMMEDIATE."""
    if engine.dialect.name == "sqlite":
        return engine.execution_options(**{SQLITE_BEGIN_OPTION: "IMMEDIATE"})
    return engine


def session_factory(engine: Engine, *, write: bool = False) -> sessionmaker[Session]:
    """A sessionmaker bound to the engine (`write=True`: SQLite write transactions begin IMMEDIATE)."""
    bind = write_engine(engine) if write else engine
    return sessionmaker(bind=bind, expire_on_commit=False)


# --- schema revisions (Alembic) ------------------------------------------------------------------


def migrations_dir() -> Path:
    """The `migrations/` package directory (shipped in the wheel)."""
    import migrations

    return Path(migrations.__file__).resolve().parent


def alembic_config(url: str | URL | None = None) -> Config:
    """An Alembic config built in code (no alembic.ini needed) for the given database URL."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if url is not None:
        # passed as an attribute, not a main option: configparser would mangle '%' in passwords
        config.attributes["url"] = normalize_url(url).render_as_string(hide_password=False)
    return config


@lru_cache(maxsize=1)
def _known_revisions() -> tuple[str | None, frozenset[str]]:
    scripts = ScriptDirectory.from_config(alembic_config())
    return scripts.get_current_head(), frozenset(script.revision for script in scripts.walk_revisions())


def head_revision() -> str:
    """The schema revision this code needs."""
    head = _known_revisions()[0]
    if head is None:  # pragma: no cover - the package always ships its migrations
        raise RuntimeError(f"no migrations found in {migrations_dir()}")
    return head


def current_revision(engine: Engine) -> str | None:
    """The database's schema revision (None: an empty database)."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


UPGRADE_LOCK_KEY = (
    7_470_761_001  # pg_advisory_lock key of the registry's schema upgrades (MLflow's is another)
)


def upgrade(url: str | URL | None = None, revision: str = "head") -> str | None:
    """Create or upgrade the database to `revision`; returns the revision it is at afterwards. On PostgreSQL
    one upgrade runs at a time (an advisory lock): two processes upgrading at once (two API pods starting)
    leave one schema, the second finding the work done; on SQLite, a file lock beside the database."""
    url = _url_or_default(url)
    ensure_sqlite_folder(url)
    with _upgrade_lock(make_url(url) if isinstance(url, str) else url):
        command.upgrade(alembic_config(url), revision)
    return _revision_at(url)


def _upgrade_lock(url: URL) -> AbstractContextManager[None]:
    """One registry upgrade at a time (`services.upgrade_lock`: an advisory lock, or a file lock)."""
    from services.upgrade_lock import upgrade_lock

    return upgrade_lock(url.render_as_string(hide_password=False), UPGRADE_LOCK_KEY, "registry")


def downgrade(url: str | URL | None, revision: str) -> str | None:
    """Downgrade the database to `revision` ("base": drop everything); returns the revision after."""
    url = _url_or_default(url)
    command.downgrade(alembic_config(url), revision)
    return _revision_at(url)


def check_schema_current(engine: Engine) -> None:
    """Refuse a database whose schema is not the code's head revision, naming the command to run."""
    needed = head_revision()
    where = display_url(engine.url)
    path = sqlite_path(engine.url)
    if path is not None and not path.exists():  # do not leave an empty file behind
        raise SchemaOutOfDateError(
            f"there is no database at {where} yet (the code needs revision {needed}); run `{UPGRADE_COMMAND}` to create it"
        )
    found = current_revision(engine)
    if found == needed:
        return
    if found is None:
        raise SchemaOutOfDateError(
            f"database at {where} has no pelt schema yet (no revision) but the code needs {needed}; "
            f"run `{UPGRADE_COMMAND}` to create it"
        )
    if found not in _known_revisions()[1]:
        raise SchemaOutOfDateError(
            f"database at {where} is at revision {found}, which this version of pelt does not know "
            f"(it needs {needed}); the database was upgraded by a newer pelt: upgrade pelt"
        )
    raise SchemaOutOfDateError(
        f"database at {where} is at revision {found} but the code needs {needed}; run `{UPGRADE_COMMAND}`"
    )


@contextmanager
def connect(url: str | URL | None = None) -> Iterator[Engine]:
    """A short-lived engine, disposed on exit."""
    engine = make_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()


def _url_or_default(url: str | URL | None) -> str | URL:
    if url is not None:
        return url
    from services.settings import get_settings

    return get_settings().database_url


def _revision_at(url: str | URL) -> str | None:
    with connect(url) as engine:
        return current_revision(engine)


__all__ = [
    "SQLITE_BEGIN_OPTION",
    "SQLiteWriteGate",
    "alembic_config",
    "busy_as_registry_error",
    "check_schema_current",
    "connect",
    "current_revision",
    "display_url",
    "downgrade",
    "ensure_sqlite_folder",
    "head_revision",
    "hold_write_turn",
    "make_engine",
    "migrations_dir",
    "normalize_url",
    "session_factory",
    "sqlite_path",
    "upgrade",
    "write_engine",
    "write_gate",
]
