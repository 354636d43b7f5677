"""Migrations: every revision round-trips on both databases, the models match the migrated schema,
and a database behind the code is refused at start-up with the command that fixes it."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from sqlalchemy import Column, Connection, Integer, MetaData, Table, inspect, select, text
from sqlalchemy.exc import IntegrityError

import pelt_core
from services.registry import Registry, SchemaOutOfDateError, db, presets
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


def _method_rows(url: str) -> list[tuple]:
    """The `methods` table's rows (name, builtin, spec, description), or [] before it exists."""
    if "methods" not in _tables(url):
        return []
    with db.connect(url) as engine, engine.connect() as connection:
        table = Table("methods", MetaData(), autoload_with=connection)
        query = select(table.c.name, table.c.builtin, table.c.spec, table.c.description).order_by(table.c.id)
        return [tuple(row) for row in connection.execute(query)]


def test_every_migration_upgrades_downgrades_and_upgrades_again(db_url: str) -> None:
    revisions = _revisions_oldest_first()
    assert revisions[-1] == db.head_revision()
    previous_tables: set[str] = set()
    previous_methods: list[tuple] = []
    previous = "base"
    for revision in revisions:
        assert db.upgrade(db_url, revision) == revision
        tables, methods = _tables(db_url), _method_rows(db_url)
        assert db.downgrade(db_url, previous) == (None if previous == "base" else previous)
        assert _tables(db_url) == previous_tables, (
            f"downgrade of {revision} left {_tables(db_url) - previous_tables}"
        )
        assert _method_rows(db_url) == previous_methods, f"downgrade of {revision} changed the method rows"
        assert db.upgrade(db_url, revision) == revision
        assert (_tables(db_url), _method_rows(db_url)) == (tables, methods)
        previous_tables, previous_methods, previous = tables, methods, revision
    assert _schema_differences(db_url, Base.metadata) == []


def test_upgrades_started_together_run_one_at_a_time_and_leave_one_schema_at_head(
    db_url, monkeypatch
) -> None:
    """API pods starting at once each run `pelt db upgrade`: the upgrades run one after another (an advisory
    lock on PostgreSQL, a file lock beside SQLite's file), the first migrating, the others finding it done."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from alembic import command

    inside, overlapped, barrier = [0], [False], threading.Barrier(3)
    real_upgrade = command.upgrade

    def slow_upgrade(*args, **kwargs):
        inside[0] += 1
        overlapped[0] |= inside[0] > 1
        try:
            threading.Event().wait(0.3)  # long enough for another upgrade to come in, were it not locked out
            return real_upgrade(*args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(db.command, "upgrade", slow_upgrade)

    def upgrade(_: int) -> str | None:
        barrier.wait(timeout=60)  # all three ask at the same moment
        return db.upgrade(db_url)

    with ThreadPoolExecutor(3) as pool:
        revisions = list(pool.map(upgrade, range(3)))
    assert revisions == [db.head_revision()] * 3 and not overlapped[0]
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


def test_the_built_in_presets_are_pelt_cores_presets(registry: Registry) -> None:
    builtins = registry.list_methods(builtin=True)
    assert {m.name: m.spec for m in builtins} == pelt_core.builtin_specs()
    assert [m.name for m in builtins] == list(pelt_core.builtin_specs())  # in pelt_core's order
    assert all(m.builtin and m.fingerprint == presets.fingerprint(m.spec) for m in builtins)
    assert registry.list_methods(builtin=False) == []


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


# --- 0008: built-in presets come from pelt_core --------------------------------------------------

OLD = datetime(2026, 1, 1, tzinfo=UTC)


def _insert(connection: Connection, table_name: str, **values: object) -> int:
    table = Table(table_name, MetaData(), autoload_with=connection)
    return connection.execute(table.insert().values(**values)).inserted_primary_key[0]


def _succeeded_jobs_written_at_0007(url: str) -> dict[str, int]:
    """A database at 0007 holding task `sst2`, a user preset `tiny_lora`, and one succeeded job (with its
    result) of `lora` and one of `tiny_lora`; returns the job ids by method."""
    db.upgrade(url, "0007")
    with db.connect(url) as engine, engine.begin() as connection:
        at = OLD.replace(tzinfo=None) if engine.dialect.name == "sqlite" else OLD
        methods = Table("methods", MetaData(), autoload_with=connection)
        lora = connection.execute(select(methods.c.id).where(methods.c.name == "lora")).scalar_one()
        spec = {**pelt_core.get_method("lora", {"r": 2}).to_dict(), "name": "tiny_lora"}
        user = _insert(
            connection, "methods", name="tiny_lora", spec=spec, builtin=False, description="", created_at=at
        )
        task = _insert(
            connection,
            "tasks",
            **dict(
                name="sst2", source_kind="files", source={"train": "train.jsonl"}, split_sizes={"train": 40}
            ),
            **dict(train_size=40, text_fields=["sentence"], label_field="label", label_names=["neg", "pos"]),
            **dict(problem_type="single_label_classification", metric="accuracy", metric_direction="max"),
            **dict(max_length=128, description="", created_at=at),
        )
        backbone = _insert(
            connection, "backbones", name="tiny-bert", source="x", content_hash="h", created_at=at
        )
        job_ids = {}
        for name, method_id, value in (("lora", lora, 0.8), ("tiny_lora", user, 0.7)):
            job_ids[name] = _insert(
                connection,
                "jobs",
                **dict(task_id=task, method_id=method_id, backbone_id=backbone, seed=0, priority=0),
                **dict(hyperparameters={}, train_config={}, method_spec={}, status="succeeded", attempts=1),
                **dict(max_attempts=3, cancel_requested=False, created_at=at, updated_at=at, finished_at=at),
            )
            _insert(
                connection,
                "results",
                **dict(job_id=job_ids[name], metrics={"accuracy": value}, primary_metric=value, attempt=1),
                **dict(trainable_params=10, trainable_percent=1.0, train_seconds=1.0, created_at=at),
            )
    return job_ids


def test_0008_keeps_old_jobs_on_the_leaderboard_with_the_fingerprint_of_the_preset_they_ran(
    db_url: str,
) -> None:
    job_ids = _succeeded_jobs_written_at_0007(db_url)
    before = _method_rows(db_url)
    specs = {name: spec for name, _, spec, _ in before}

    db.upgrade(db_url, "head")
    assert all(
        spec is None and description == ""
        for _, builtin, spec, description in _method_rows(db_url)
        if builtin
    )
    with Registry(db_url) as registry:
        jobs = {name: registry.get_job(job_id) for name, job_id in job_ids.items()}
        assert {name: job.method_fingerprint for name, job in jobs.items()} == {
            name: presets.fingerprint(specs[name]) for name in job_ids
        }
        rows = {row.method: row for row in registry.leaderboard("sst2")}
        for name, job in jobs.items():
            assert (rows[name].best_job_id, rows[name].best_method_fingerprint) == (
                job.id,
                job.method_fingerprint,
            )
            assert rows[name].method_fingerprints == [job.method_fingerprint]
        assert registry.get_method("tiny_lora").spec == specs["tiny_lora"]

    db.downgrade(db_url, "0007")
    assert _method_rows(db_url) == before


def test_0008_downgrade_gives_a_later_built_in_the_spec_its_jobs_ran_or_drops_an_unused_one(
    db_url: str, sst2_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db.upgrade(db_url, "0007")
    before = _method_rows(db_url)
    db.upgrade(db_url, "head")
    for name, rank in (("lora_r2", 2), ("lora_r4", 4)):  # presets a later pelt_core adds
        added = dataclasses.replace(pelt_core.get_method("lora", {"r": rank}), name=name)
        monkeypatch.setitem(pelt_core.methods.BUILTIN_METHODS, name, added)
    with Registry(db_url) as registry:
        registry.register_task("sst2", sst2_file, text_fields=["sentence"])
        registry.register_backbone("tiny-bert", "hf:prajjwal1/bert-tiny", "sha256:" + "ab" * 32)
        job = registry.submit_job("sst2", "lora_r2", "tiny-bert")
        assert [m.name for m in registry.list_methods()][-2:] == ["lora_r2", "lora_r4"]

    db.downgrade(db_url, "0007")
    assert _method_rows(db_url) == [
        *before,
        ("lora_r2", True, job.method_spec, job.method_spec["description"]),
    ]


# --- 0009: jobs name their device, results where they trained ----------------------------------


def _columns(url: str, table: str) -> set[str]:
    with db.connect(url) as engine:
        return {column["name"] for column in inspect(engine).get_columns(table)}


def _queue_index(url: str) -> list[str]:
    with db.connect(url) as engine:
        (index,) = [i for i in inspect(engine).get_indexes("jobs") if i["name"] == "ix_jobs_queue"]
        return list(index["column_names"])


def test_0009_puts_existing_jobs_on_any_device_refuses_unknown_ones_and_downgrades(db_url: str) -> None:
    job_ids = _succeeded_jobs_written_at_0007(db_url)
    db.upgrade(db_url, "0009")
    assert _queue_index(db_url) == ["status", "priority", "created_at", "device"]
    with db.connect(db_url) as engine:
        with engine.connect() as connection:
            jobs = Table("jobs", MetaData(), autoload_with=connection)
            results = Table("results", MetaData(), autoload_with=connection)
            assert set(connection.execute(select(jobs.c.id, jobs.c.device))) == {
                (job_id, "any") for job_id in job_ids.values()
            }
            assert set(connection.execute(select(results.c.device, results.c.job_memory_bytes))) == {
                (None, None)
            }
        with engine.begin() as connection:
            connection.execute(jobs.update().where(jobs.c.id == job_ids["lora"]).values(device="gpu"))
        with pytest.raises(IntegrityError), engine.begin() as connection:
            connection.execute(jobs.update().values(device="tpu"))  # the CHECK, not only the code

    db.downgrade(db_url, "0008")
    assert "device" not in _columns(db_url, "jobs")
    assert {"device", "job_memory_bytes"} & _columns(db_url, "results") == set()
    assert _queue_index(db_url) == ["status", "priority", "created_at"]


# --- 0013: idempotency keys are each token's own; sweeps record who submitted them ----------------


def _rows(url: str, table_name: str, *columns: str) -> set[tuple]:
    with db.connect(url) as engine, engine.connect() as connection:
        table = Table(table_name, MetaData(), autoload_with=connection)
        return {tuple(row) for row in connection.execute(select(*(table.c[c] for c in columns)))}


def _keyed_job(
    connection: Connection, job_id: int, key: str, submitted_by: str | None, **extra: object
) -> int:
    """A copy of job `job_id` (a succeeded one), queued under `key` by `submitted_by`."""
    jobs = Table("jobs", MetaData(), autoload_with=connection)
    row = connection.execute(select(jobs).where(jobs.c.id == job_id)).mappings().one()
    values = {name: value for name, value in row.items() if name not in ("id", "finished_at")}
    values.update(status="queued", attempts=0, idempotency_key=key, submitted_by=submitted_by, **extra)
    return connection.execute(jobs.insert().values(**values)).inserted_primary_key[0]


def _keyed_sweep(connection: Connection, job_id: int, key: str | None) -> int:
    """A sweep of the task and backbone of job `job_id`, under `key`."""
    jobs = Table("jobs", MetaData(), autoload_with=connection)
    job = connection.execute(select(jobs).where(jobs.c.id == job_id)).mappings().one()
    return _insert(
        connection,
        "sweeps",
        **dict(task_id=job["task_id"], backbone_id=job["backbone_id"], methods=["lora"], seeds=[0]),
        **dict(k_values=[None], hyperparameters={}, method_hyperparameters={}, priority=0),
        idempotency_key=key,
        created_at=job["created_at"],
    )


def test_0013_keeps_every_key_on_its_row_for_the_token_that_made_it_and_names_each_sweeps_submitter(
    db_url: str,
) -> None:
    lora = _succeeded_jobs_written_at_0007(db_url)["lora"]
    db.upgrade(db_url, "0012")
    with db.connect(db_url) as engine, engine.begin() as connection:
        alices_sweep = _keyed_sweep(connection, lora, "study-sst2")
        local_sweep = _keyed_sweep(connection, lora, None)
        for sweep_id, owner in ((alices_sweep, "alice"), (local_sweep, None)):
            _keyed_job(connection, lora, f"in-sweep-{sweep_id}", owner, sweep_id=sweep_id)
        bobs = _keyed_job(connection, lora, "retry-1", "bob")
        local = _keyed_job(connection, lora, "retry-2", None)
    jobs_before = _rows(db_url, "jobs", "id", "idempotency_key", "submitted_by", "status")
    results_before = _rows(db_url, "results", "id", "job_id", "primary_metric")

    db.upgrade(db_url, "head")
    assert _rows(db_url, "jobs", "id", "idempotency_key", "submitted_by", "status") == jobs_before
    assert _rows(db_url, "results", "id", "job_id", "primary_metric") == results_before
    assert _rows(db_url, "sweeps", "id", "idempotency_key", "submitted_by") == {
        (alices_sweep, "study-sst2", "alice"),
        (local_sweep, None, None),
    }
    with db.connect(db_url) as engine:
        with engine.begin() as connection:  # the same key, another token: a key of its own
            _keyed_job(connection, bobs, "retry-1", "carol")
            _keyed_job(connection, local, "retry-1", None)
        for key, owner in (("retry-1", "bob"), ("retry-2", None)):  # the same key, the same submitter
            with pytest.raises(IntegrityError), engine.begin() as connection:
                _keyed_job(connection, bobs, key, owner)


def test_0013_downgrade_leaves_a_key_several_tokens_used_on_its_oldest_row(db_url: str) -> None:
    lora = _succeeded_jobs_written_at_0007(db_url)["lora"]
    db.upgrade(db_url, "head")
    with db.connect(db_url) as engine, engine.begin() as connection:
        first, second, third = (
            _keyed_job(connection, lora, "retry-1", owner) for owner in ("bob", "alice", None)
        )
        own = _keyed_job(connection, lora, "retry-2", "alice")
        older, newer = _keyed_sweep(connection, lora, "study-sst2"), _keyed_sweep(connection, lora, None)
        sweeps = Table("sweeps", MetaData(), autoload_with=connection)
        connection.execute(sweeps.update().where(sweeps.c.id == older).values(submitted_by="alice"))
        connection.execute(
            sweeps.update()
            .where(sweeps.c.id == newer)
            .values(idempotency_key="study-sst2", submitted_by="bob")
        )

    db.downgrade(db_url, "0012")
    assert _rows(db_url, "jobs", "id", "idempotency_key") >= {
        (first, "retry-1"),
        (second, None),
        (third, None),
        (own, "retry-2"),
    }
    assert _rows(db_url, "sweeps", "id", "idempotency_key") == {(older, "study-sst2"), (newer, None)}
    assert "submitted_by" not in _columns(db_url, "sweeps")
    with pytest.raises(IntegrityError), db.connect(db_url) as engine, engine.begin() as connection:
        _keyed_job(connection, own, "retry-1", "carol")  # unique across tokens again
    db.upgrade(db_url, "head")
    assert ("retry-1", "bob") in _rows(db_url, "jobs", "idempotency_key", "submitted_by")


def test_0015_adds_the_predict_scope_and_its_downgrade_makes_predict_tokens_read_tokens(db_url: str) -> None:
    db.upgrade(db_url, "0014")
    with db.connect(db_url) as engine, engine.begin() as connection:
        with pytest.raises(IntegrityError), connection.begin_nested():
            _token(connection, "app", "predict")  # not a scope before 0015
        _token(connection, "reader", "read")
    db.upgrade(db_url, "head")
    with db.connect(db_url) as engine, engine.begin() as connection:
        _token(connection, "app", "predict")
    assert _rows(db_url, "api_tokens", "name", "scope") == {("reader", "read"), ("app", "predict")}

    db.downgrade(db_url, "0014")
    assert _rows(db_url, "api_tokens", "name", "scope") == {("reader", "read"), ("app", "read")}  # narrower
    db.upgrade(db_url, "head")


def _token(connection: Connection, name: str, scope: str) -> None:
    tokens = Table("api_tokens", MetaData(), autoload_with=connection)
    connection.execute(
        tokens.insert().values(
            name=name, scope=scope, token_hash=name * 8, prefix=name[:8], created_at=datetime.now(UTC)
        )
    )


def test_0017_lets_a_result_leave_its_test_metric_out_and_its_downgrade_refuses_while_one_does(
    ready: Registry, migrated_url: str
) -> None:
    settings = {"dev_rows": 8}
    untested = ready.submit_job("sst2", "lora", "tiny-bert", settings | {"evaluate_test": False}, k_shot=16)
    tested = ready.submit_job("sst2", "lora", "tiny-bert", settings, seed=1, k_shot=16)
    result = {
        "dev_metrics": {"accuracy": 0.7},
        "trainable_params": 1,
        "total_params": 10,
        "train_seconds": 1.0,
    }
    ready.claim_job("worker")
    ready.complete_job(untested.id, "worker", result | {"metrics": {}})
    ready.claim_job("worker")
    ready.complete_job(tested.id, "worker", result | {"metrics": {"accuracy": 0.8}})
    ready.close()
    with pytest.raises(
        RuntimeError, match=rf"1 result\(s\) have no test metric: jobs {untested.id} ran with"
    ):
        db.downgrade(migrated_url, "0016")
    with db.connect(migrated_url) as engine:
        assert db.current_revision(engine) == db.head_revision()  # refused before anything changed
    with db.connect(migrated_url) as engine, engine.begin() as connection:
        connection.execute(text("DELETE FROM results WHERE primary_metric IS NULL"))
    db.downgrade(migrated_url, "0016")
    with db.connect(migrated_url) as engine:
        (column,) = [c for c in inspect(engine).get_columns("results") if c["name"] == "primary_metric"]
    assert column["nullable"] is False
    assert _rows(migrated_url, "results", "job_id", "primary_metric") == {(tested.id, 0.8)}  # kept
    # revision 0016's code knows no `evaluate_test` setting: it is gone from every job
    with db.connect(migrated_url) as engine, engine.begin() as connection:
        settings_rows = connection.execute(text("SELECT train_config, hyperparameters FROM jobs")).all()
    assert all("evaluate_test" not in str(row) for row in settings_rows) and len(settings_rows) == 2
    db.upgrade(migrated_url, "head")
