"""Fixtures of the delta-store tests: every store test runs on two MLflow set-ups.

- "sqlite": the embedded store (an SQLite file + a local artifact folder), a fresh copy per test;
- "server": one `mlflow server` per test session on 127.0.0.1 (a free port) over a scratch PostgreSQL
  database (PELT_TEST_DATABASE_URL), artifacts proxied by the server; each test gets its own namespace
  (experiments `<ns>/<task>`, models `<ns>.<task>`). Stopped by pid, database dropped, at the end.

The registry is a fresh SQLite copy per test (its PostgreSQL half is tested in tests/registry).
Deltas are trained once per session on a tiny random BERT saved to disk, so that the manifest's
backbone name is a folder `Backbone.load` can open again.
"""

from __future__ import annotations

import os

# a test fails fast when the server is gone (mlflow's client retries for minutes by default);
# importing services.delta_store sets the quiet defaults (no telemetry) before mlflow is imported
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")

import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pelt_core.backbones import Backbone
from services.delta_store import MlflowDeltaStore, ensure_store
from services.delta_store.testing import MlflowServer
from services.dispatcher import task_spec
from services.registry import Registry, upgrade
from services.registry.testing import (
    create_postgres_database,
    drop_postgres_database,
    sqlite_url,
    write_jsonl,
)
from tests.postgres import postgres_url
from workers.job import JobSpec

BACKENDS = ["sqlite", pytest.param("server", marks=[pytest.mark.postgres, pytest.mark.slow])]
BACKBONE = "tiny-bert"  # the registry's name for the tiny backbone
WORKER = "worker-1"

POSITIVE = [
    "good",
    "great",
    "fun",
    "very good",
    "a great film",
    "the movie was fun",
    "great fun",
    "very great",
]
NEGATIVE = [
    "bad",
    "awful",
    "boring",
    "very bad",
    "an awful film",
    "the movie was boring",
    "not fun",
    "very awful",
]
TOPICS = {"w1": "sports", "w2": "music", "w3": "news"}
SST2_TEXTS = ["the movie was good", "an awful film", "very boring , not fun", "great"]


def logits_of(backbone: Backbone, delta: Any, texts: list[str] = SST2_TEXTS) -> Any:
    """The logits a delta gives on its backbone, computed here from the in-memory delta (no store)."""
    import torch

    from pelt_core.model import PeltModel

    batch = backbone.tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return PeltModel(backbone, delta).eval()(
            batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")
        )


# --------------------------------------------------------------------------------------------------
# Data, backbone and trained deltas (once per session)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tiny tasks: sst2 (sentiment, 2 labels) and topic (3 labels)."""
    folder = tmp_path_factory.mktemp("data")
    sst2 = [{"sentence": s, "label": "positive"} for s in POSITIVE] + [
        {"sentence": s, "label": "negative"} for s in NEGATIVE
    ]
    write_jsonl(folder / "sst2-train.jsonl", sst2 + sst2[::-1])
    write_jsonl(folder / "sst2-validation.jsonl", sst2)
    topic = [
        {"text": f"{word} {filler} w{10 + i}", "label": label}
        for i, (word, label) in enumerate(TOPICS.items())
        for filler in ("the", "a", "was", "is")
    ]
    write_jsonl(folder / "topic-train.jsonl", topic)
    write_jsonl(folder / "topic-validation.jsonl", topic)
    return folder


@pytest.fixture(scope="session")
def backbone_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT saved with save_pretrained: its folder is the backbone's name in manifests."""
    import torch
    from transformers import BertModel

    from pelt_core.testing import tiny_bert

    folder = tmp_path_factory.mktemp("tiny-bert")
    tiny = tiny_bert(str(folder), seed=0)
    # saved with its pooler: AutoModel would otherwise initialise a missing pooler at random on every
    # load, and the backbone's content hash (its identity for deltas) would change from load to load
    torch.manual_seed(0)
    full = BertModel(tiny.model.config, add_pooling_layer=True)
    full.load_state_dict(tiny.model.state_dict(), strict=False)
    full.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def backbone(backbone_dir: Path) -> Backbone:
    return Backbone.load(str(backbone_dir))


@dataclass
class Trained:
    """A delta trained once per session: its folder, the in-memory delta and what a worker reports."""

    task: str
    method: str
    hyperparameters: dict[str, Any]
    seed: int
    folder: Path
    delta: Any  # pelt_core.model.JobDelta
    result: dict[str, Any]
    history: list[dict[str, Any]]


TRAINING = {"epochs": 2, "batch_size": 8, "learning_rate": 5e-3}
CATALOG = {  # key -> (task, method, method hyperparameters, seed)
    "lora-0": ("sst2", "lora", {"r": 2}, 0),
    "lora-1": ("sst2", "lora", {"r": 2}, 1),
    "lora-r4": ("sst2", "lora", {"r": 4}, 2),
    "bitfit-0": ("sst2", "bitfit", {}, 0),
    "topic-lora": ("topic", "lora", {"r": 2}, 0),
}


@pytest.fixture(scope="session")
def trained(
    backbone: Backbone, data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Trained]:
    """The catalog's deltas, each trained for 2 epochs with pelt_core (a second or so each)."""
    from pelt_core import TrainConfig, get_method
    from pelt_core.data import infer_task_fields, load_table
    from pelt_core.delta import save_delta
    from pelt_core.train import train

    root = tmp_path_factory.mktemp("trained")
    out: dict[str, Trained] = {}
    for key, (task, method, overrides, seed) in CATALOG.items():
        train_data = load_table(data_dir / f"{task}-train.jsonl")
        eval_data = load_table(data_dir / f"{task}-validation.jsonl")
        fields = infer_task_fields(train_data)
        config = TrainConfig.from_dict({**TRAINING, "seed": seed})
        run = train(backbone, get_method(method, overrides), train_data, eval_data, config, task=fields)
        saved = save_delta(run.delta, backbone, root / key)
        counts = run.parameter_counts
        result = {
            "metrics": dict(run.metrics),
            "trainable_params": counts["pelt"] + counts["head"],
            "trainable_percent": run.trainable_percent,
            "train_seconds": run.train_seconds,
        }
        out[key] = Trained(task, method, dict(overrides), seed, saved.path, run.delta, result, run.history)
    return out


# --------------------------------------------------------------------------------------------------
# Registry (SQLite, fresh per test)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def registry_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("registry-template") / "registry.db"
    upgrade(sqlite_url(path))
    return path


@pytest.fixture
def registry(
    registry_template: Path, tmp_path: Path, data_dir: Path, backbone: Backbone
) -> Iterator[Registry]:
    """A registry with tasks sst2 and topic and the tiny backbone registered."""
    path = tmp_path / "registry.db"
    shutil.copyfile(registry_template, path)
    with Registry(sqlite_url(path), lease_seconds=60, retry_backoff_seconds=0) as opened:
        for task, text in (("sst2", "sentence"), ("topic", "text")):
            opened.register_task(
                task,
                {
                    "train": data_dir / f"{task}-train.jsonl",
                    "validation": data_dir / f"{task}-validation.jsonl",
                },
                text_fields=[text],
            )
        opened.register_backbone(BACKBONE, backbone.source, backbone.content_hash)
        yield opened


# --------------------------------------------------------------------------------------------------
# MLflow: embedded SQLite, or a server over PostgreSQL
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow SQLite database at schema head (initialised once, copied per test)."""
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    ensure_store(sqlite_url(path), str(path.parent / "unused-artifacts"))
    return path


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One MLflow tracking server for the session, on a scratch PostgreSQL database."""
    base = postgres_url("the MLflow server + PostgreSQL half of the delta-store tests")
    url = create_postgres_database(base, prefix="pelt_test_mlflow_")
    folder = tmp_path_factory.mktemp("mlflow-server")
    server = MlflowServer(url, folder / "artifacts", folder / "server.log")
    try:
        yield server.start(timeout=150)
    finally:
        server.stop()
        drop_postgres_database(url)


@pytest.fixture(params=BACKENDS)
def store_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def tracking(store_backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Where this test's MLflow store lives: tracking URI, artifact root and namespace."""
    if store_backend == "sqlite":
        path = tmp_path / "mlflow.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        return {
            "tracking_uri": sqlite_url(path),
            "artifact_root": str(tmp_path / "mlartifacts"),
            "namespace": "pelt",
        }
    return {
        "tracking_uri": request.getfixturevalue("mlflow_server"),
        "artifact_root": None,
        "namespace": f"t{secrets.token_hex(5)}",
    }


@pytest.fixture
def store(tracking: dict[str, Any], registry: Registry, backbone: Backbone) -> MlflowDeltaStore:
    """The store under test, wired to the test's registry, reusing the session's backbone."""
    return MlflowDeltaStore(
        tracking["tracking_uri"],
        tracking["artifact_root"],
        registry=registry,
        namespace=tracking["namespace"],
        backbones=[backbone],
    )


# --------------------------------------------------------------------------------------------------
# Running jobs the way the service does: submit, claim, train (cached), store + complete
# --------------------------------------------------------------------------------------------------
def job_spec(registry: Registry, job_id: int) -> JobSpec:
    """The JobSpec a dispatcher would hand a worker for a claimed job."""
    record = registry.get_job(job_id)
    task = registry.get_task(record.task)
    return JobSpec(
        job_id=record.id,
        task=task_spec(task),
        method=record.method,
        method_spec=record.method_spec,
        train_config=record.train_config,
        backbone=record.backbone,
        attempt=record.attempts,
        sweep_id=record.sweep_id,
    )


def claim(registry: Registry, delta: Trained, *, sweep: bool = False) -> JobSpec:
    """Submit the job that trains `delta` (alone, or as a one-job sweep) and claim it."""
    hyperparameters = {**TRAINING, **delta.hyperparameters}
    if sweep:
        job_id = registry.submit_sweep(
            delta.task, [delta.method], [delta.seed], [None], BACKBONE, hyperparameters
        ).job_ids[0]
    else:
        job_id = registry.submit_job(delta.task, delta.method, BACKBONE, hyperparameters, seed=delta.seed).id
    claimed = registry.claim_job(WORKER)
    assert claimed is not None and claimed.id == job_id
    return job_spec(registry, job_id)


def with_metric(delta: Trained, accuracy: float | None) -> dict[str, Any]:
    """The worker's result, its accuracy set by the test (so the ranking is known in advance)."""
    result = {**delta.result, "metrics": dict(delta.result["metrics"])}
    if accuracy is not None:
        result["metrics"]["accuracy"] = accuracy
    return result


def run_job(
    store: MlflowDeltaStore, registry: Registry, delta: Trained, accuracy: float | None = None
) -> JobSpec:
    """A whole successful job: claim, then store + complete + finalize (`complete_job`)."""
    job = claim(registry, delta)
    store.complete_job(job, WORKER, delta.folder, with_metric(delta, accuracy), delta.history)
    return job
