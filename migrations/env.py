"""Alembic environment: runs the migrations on the registry database.

The URL comes from `config.attributes["url"]` (set by `services.registry.db.alembic_config`, which
`pelt db upgrade` uses), else `sqlalchemy.url` in alembic.ini, else PELT_DATABASE_URL / the default.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from services.registry.db import ensure_sqlite_folder, make_engine, normalize_url
from services.registry.models import Base

config = context.config
target_metadata = Base.metadata
if config.config_file_name is not None:  # the developers' alembic.ini; `pelt db` configures no logging
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _database_url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        from services.settings import get_settings

        url = get_settings().database_url
    return normalize_url(url).render_as_string(hide_password=False)


def _configure(**kwargs: object) -> None:
    context.configure(target_metadata=target_metadata, compare_type=True, **kwargs)


def run_migrations_offline() -> None:
    """Emit the SQL to stdout instead of running it (`alembic upgrade head --sql`)."""
    url = _database_url()
    _configure(url=url, literal_binds=True, render_as_batch=url.startswith("sqlite"))
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # Batch migrations rebuild a table and drop the old one; with foreign keys on, that DROP would
        # cascade-delete the rows that point at it. The pragma only works outside a transaction.
        connection.connection.dbapi_connection.execute("PRAGMA foreign_keys = OFF")
    # services.registry.db makes SQLAlchemy emit BEGIN on SQLite, so its DDL is transactional too:
    # a migration that fails half-way leaves the database as it was.
    _configure(connection=connection, render_as_batch=sqlite, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()
        if sqlite:
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if broken:
                raise RuntimeError(f"the migration broke foreign keys (rolled back): {broken[:10]}")


def run_migrations_online() -> None:
    """Run the migrations on a live connection (the caller's, or a fresh engine's)."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = _database_url()
    ensure_sqlite_folder(url)
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
