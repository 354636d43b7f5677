"""Migrations: every revision round-trips on both databases, the models match the migrated schema,
and a database behind the code is refused at start-up with the command that fixes it."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from sqlalchemy import Column, Integer, MetaData, inspect, text

import pelt_core
from services.registry import Registry, SchemaOutOfDateError, db
from services.registry.cli import db as db_command
from services.registry.models import Base
from services.settings import get_settings


def _tables(url: str) -> set[str]:
    with db.connect(url) as engine:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}


def _schema_differences(url: str, metadata: MetaData) -> list:
    with db.connect(url) as engine, engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return compare_metadata(context, metadata)


def _revisions_oldest_first() -> list[str]:
    scripts = ScriptDirectory.from_config(db.alembic_config())
    return [script.revision for script in reversed(list(scripts.walk_revisions()))]


def test_every_migration_upgrades_downgrades_and_upgrades_again(db_url: str) -> None:
    revisions = _revisions_oldest_first()
    assert revisions[-1] == db.head_revision()
    previous_tables: set[str] = set()
    previous = "base"
    for revision in revisions:
        assert db.upgrade(db_url, revision) == revision
        tables = _tables(db_url)
        assert db.downgrade(db_url, previous) == (None if previous == "base" else previous)
        assert _tables(db_url) == previous_tables, (
            f"downgrade of {revision} left {_tables(db_url) - previous_tables}"
        )
        assert db.upgrade(db_url, revision) == revision
        assert _tables(db_url) == tables
        previous_tables, previous = tables, revision
    assert _schema_differences(db_url, Base.metadata) == []


def test_the_model_metadata_matches_the_migrated_schema(migrated_url: str) -> None:
    assert _schema_differences(migrated_url, Base.metadata) == []


def test_the_schema_comparison_does_see_a_column_the_migrations_lack(migrated_url: str) -> None:
    changed = MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.tables.values():
        table.to_metadata(changed)
    changed.tables["jobs"].append_column(Column("not_migrated", Integer))
    differences = _schema_differences(migrated_url, changed)
    assert [(d[0], d[3].name) for d in differences] == [("add_column", "not_migrated")]


def test_the_built_in_presets_are_seeded_as_builtin_rows(registry: Registry) -> None:
    builtins = registry.list_methods(builtin=True)
    assert [m.name for m in builtins] == list(pelt_core.builtin_specs())
    assert all(m.builtin for m in builtins)
    assert registry.list_methods(builtin=False) == []


def test_the_seeded_presets_still_equal_pelt_core_presets(registry: Registry) -> None:
    """Fails when a preset in pelt_core changes: ship the change as a new migration updating its row."""
    seeded = {m.name: pelt_core.get_method(m.spec).to_dict() for m in registry.list_methods(builtin=True)}
    current = pelt_core.builtin_specs()
    changed = sorted(name for name in seeded.keys() | current.keys() if seeded.get(name) != current.get(name))
    assert not changed, (
        f"pelt_core presets {changed} differ from the migrated rows: add a migration that updates them"
    )


def test_an_empty_database_is_refused_with_the_upgrade_command(db_url: str) -> None:
    with pytest.raises(
        SchemaOutOfDateError, match=r"needs revision \w+|needs \w+; run `pelt db upgrade` to create it"
    ):
        Registry(db_url)
    assert _tables(db_url) == set()


def test_a_database_behind_the_code_is_refused_naming_both_revisions_and_the_command(db_url: str) -> None:
    first = _revisions_oldest_first()[0]
    db.upgrade(db_url, first)
    with pytest.raises(SchemaOutOfDateError) as refused:
        Registry(db_url)
    message = str(refused.value)
    assert f"at revision {first} but the code needs {db.head_revision()}" in message
    assert "run `pelt db upgrade`" in message


def test_a_database_from_a_newer_pelt_is_refused(migrated_url: str) -> None:
    with db.connect(migrated_url) as engine, engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = 'ffff_future'"))
    with pytest.raises(SchemaOutOfDateError, match="ffff_future, which this version of pelt does not know"):
        Registry(migrated_url)


def test_pelt_db_upgrade_creates_the_database_named_by_PELT_DATABASE_URL(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PELT_DATABASE_URL", db_url)
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        before = runner.invoke(db_command, ["current"])
        assert before.exit_code == 0, before.output
        assert "revision none" in before.output and "run `pelt db upgrade`" in before.output

        upgraded = runner.invoke(db_command, ["upgrade"])
        assert upgraded.exit_code == 0, upgraded.output
        assert f"to revision {db.head_revision()}" in upgraded.output
        with Registry(db_url) as registry:
            assert registry.get_method("lora").builtin

        again = runner.invoke(db_command, ["upgrade"])
        assert "already at revision" in again.output
        assert "up to date" in runner.invoke(db_command, ["current"]).output

        down = runner.invoke(db_command, ["downgrade", "base", "--yes"])
        assert down.exit_code == 0, down.output
        assert _tables(db_url) == set()
    finally:
        get_settings.cache_clear()


def test_pelt_db_upgrade_defaults_to_an_sqlite_file_in_the_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PELT_DATABASE_URL", raising=False)
    monkeypatch.setenv("PELT_DATA_DIR", str(tmp_path / "pelt-home"))
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(db_command, ["upgrade"])
        assert result.exit_code == 0, result.output
        assert (tmp_path / "pelt-home" / "registry.db").is_file()
        with Registry() as registry:
            assert len(registry.list_methods()) == len(pelt_core.builtin_specs())
    finally:
        get_settings.cache_clear()
