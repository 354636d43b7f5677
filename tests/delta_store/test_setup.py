"""Setting the store up: the schema upgrade runs once at start-up (locked), workers only check it;
embedded by default under the data directory; quiet (no telemetry); light to import; picklable; the HTTP
client does without it."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import services.client
from services.delta_store import (
    DeltaStoreError,
    MlflowDeltaStore,
    StoreNotReadyError,
    ensure_store,
    schema_revisions,
)
from services.delta_store.cli import mlflow_group
from services.delta_store.testing import free_port
from services.registry.testing import scratch_postgres, sqlite_url
from services.settings import Settings
from tests.postgres import postgres_url

from .conftest import run_job


def upgrade_from_threads(uri: str, count: int = 2) -> list[object]:
    """`ensure_store(uri)` from `count` threads at once (as processes starting together would)."""
    results: list[object] = [None] * count

    def start(index: int) -> None:
        try:
            results[index] = ensure_store(uri)
        except Exception as exc:  # reported below
            results[index] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def test_a_worker_never_initialises_the_store_and_start_up_does_it_once(tmp_path):
    uri = sqlite_url(tmp_path / "mlflow.db")
    with pytest.raises(StoreNotReadyError, match="pelt mlflow upgrade"):
        MlflowDeltaStore(uri, tmp_path / "artifacts")  # no database yet: refused, nothing created
    sqlite3.connect(tmp_path / "mlflow.db").close()  # an empty file, e.g. made by another tool
    with pytest.raises(StoreNotReadyError, match="is empty"):
        MlflowDeltaStore(uri, tmp_path / "artifacts")
    assert schema_revisions(uri)[0] is None  # the refused store did not create MLflow's tables

    first, second = upgrade_from_threads(uri)  # two services starting at once: one upgrades, one waits
    head = schema_revisions(uri)[1]
    assert first == second == head
    result = CliRunner().invoke(mlflow_group, ["upgrade", "--uri", uri])  # again: nothing to do
    assert result.exit_code == 0, result.output
    assert f"MLflow schema revision {head}" in result.output
    MlflowDeltaStore(uri, tmp_path / "artifacts")  # now it opens


@pytest.mark.postgres
def test_a_postgres_store_is_upgraded_once_under_an_advisory_lock():
    base = postgres_url("the upgrade of a PostgreSQL store")
    with scratch_postgres(base, prefix="pelt_test_mlflow_") as url:
        bare = url.replace("postgresql+psycopg://", "postgresql://")  # the driver is added for mlflow
        first, second = upgrade_from_threads(bare)
        assert first == second == schema_revisions(bare)[1]


def test_the_default_store_is_embedded_under_the_data_directory(tmp_path, sqlite_template, registry, trained):
    settings = Settings(data_dir=tmp_path / "data")
    assert settings.mlflow_tracking_uri == f"sqlite:///{tmp_path / 'data' / 'mlflow.db'}"
    assert settings.mlflow_artifact_root == str(tmp_path / "data" / "mlartifacts")
    (tmp_path / "data").mkdir()
    shutil.copyfile(sqlite_template, tmp_path / "data" / "mlflow.db")

    store = MlflowDeltaStore.from_settings(settings, registry=registry)
    job = run_job(store, registry, trained["lora-0"], accuracy=0.7)
    run = store.client.get_run(registry.get_result(job.job_id).mlflow_run_id)
    assert run.info.artifact_uri.startswith((tmp_path / "data" / "mlartifacts" / "pelt" / "sst2").as_uri())
    assert store.pull("sst2").version == "1"


def test_a_tracking_server_that_does_not_answer_is_a_clear_error():
    with pytest.raises(DeltaStoreError, match="does not answer"):
        ensure_store(f"http://127.0.0.1:{free_port()}")


def test_the_store_travels_to_workers_by_pickle(store, registry, trained):
    run_job(store, registry, trained["lora-0"], accuracy=0.7)
    copy = pickle.loads(pickle.dumps(store))  # what Ray does with the sink
    assert (copy.tracking_uri, copy.namespace, copy.artifact_root) == (
        store.tracking_uri,
        store.namespace,
        store.artifact_root,
    )
    assert str(copy.registry.engine.url) == str(registry.engine.url)
    assert [v.version for v in copy.list_versions("sst2")] == ["1"]


def test_importing_the_store_is_light_and_turns_telemetry_off():
    # light: no MLflow, torch or transformers (pelt_core's pure-Python tables, e.g. its limits, may load)
    code = (
        "import json, os, sys; import services.delta_store; "
        "print(json.dumps({'loaded': [m for m in ('mlflow', 'torch', 'transformers') "
        "if m in sys.modules], 'telemetry_off': os.environ.get('MLFLOW_DISABLE_TELEMETRY'), "
        "'do_not_track': os.environ.get('DO_NOT_TRACK')}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "loaded": [],
        "telemetry_off": "true",
        "do_not_track": "true",
    }


def test_the_http_client_never_imports_the_store():
    # the thin client reads deltas with pelt_core's format and pull code only: not at import ...
    code = (
        "import json, sys; import services.client; "
        "print(json.dumps([m for m in sys.modules if m.startswith('services.delta_store') or m == 'mlflow']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    # ... and not inside a function either (an import statement anywhere in the module)
    tree = ast.parse(Path(services.client.__file__).read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    ]
    assert [name for name in imported if name.startswith("services.delta_store")] == []
