"""`pelt db …`: create, upgrade, inspect or downgrade the registry database (PELT_DATABASE_URL)."""

from __future__ import annotations

import click

from services.registry import db as registry_db

_URL_HELP = "database URL (default: PELT_DATABASE_URL, else SQLite under PELT_DATA_DIR)"


def _url(url: str | None) -> str:
    if url:
        return url
    from services.settings import get_settings

    return get_settings().database_url


@click.group("db")
def db() -> None:
    """The registry database: `pelt db upgrade` creates it or brings it up to date."""


@db.command("upgrade")
@click.argument("revision", default="head")
@click.option("--url", default=None, help=_URL_HELP)
def upgrade_command(revision: str, url: str | None) -> None:
    """Create or upgrade the database to REVISION (default: head, the code's revision)."""
    target = _url(url)
    before = _current_or_none(target)
    after = registry_db.upgrade(target, revision)
    where = registry_db.display_url(target)
    if before == after:
        click.echo(f"{where} is already at revision {after} (head {registry_db.head_revision()})")
    else:
        click.echo(f"upgraded {where} from {before or 'an empty database'} to revision {after}")


@db.command("downgrade")
@click.argument("revision")
@click.option("--url", default=None, help=_URL_HELP)
@click.confirmation_option(prompt="Downgrading can drop tables and data. Continue?")
def downgrade_command(revision: str, url: str | None) -> None:
    """Downgrade the database to REVISION: -1 for one step back, base to drop every table."""
    target = _url(url)
    after = registry_db.downgrade(target, revision)
    click.echo(f"downgraded {registry_db.display_url(target)} to revision {after or 'base (empty)'}")


@db.command("current")
@click.option("--url", default=None, help=_URL_HELP)
def current_command(url: str | None) -> None:
    """Show the database's revision and whether it is the one the code needs."""
    target = _url(url)
    current = _current_or_none(target)
    head = registry_db.head_revision()
    state = "up to date" if current == head else f"behind: run `{registry_db.UPGRADE_COMMAND}`"
    click.echo(
        f"{registry_db.display_url(target)}: revision {current or 'none'} (code needs {head}; {state})"
    )


def _current_or_none(url: str) -> str | None:
    path = registry_db.sqlite_path(url)
    if path is not None and not path.exists():
        return None  # no database yet; do not create an empty file
    with registry_db.connect(url) as engine:
        return registry_db.current_revision(engine)


__all__ = ["db"]
