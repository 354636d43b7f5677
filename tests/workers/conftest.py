"""Fixtures of the worker and dispatcher tests: a tiny BERT saved as a model folder (so a worker in
another process can load it by path), a toy sentiment task in JSON Lines, a migrated SQLite registry
in tmp, and helpers to wait for the registry to show something.

Job lengths: a job either runs to its end quickly (`SHORT`) or never ends by itself (`UNENDING`: it ends
when cancelled, released or its lease is lost). A test that must act while a job runs holds the job in
its worker until it lets it go (`tests.workers.hold`) instead of sizing it to outrun its checks."""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from pelt_core.limits import MAX_TRAIN_STEPS
from pelt_core.testing import VOCAB
from services.registry import Registry, upgrade
from services.registry.testing import sqlite_url, write_jsonl
from tests.workers.hold import Hold

BACKBONE = "tiny-bert"
TASK = "toy"
SHORT = 40  # optimisation steps of a job that runs to its end
UNENDING = MAX_TRAIN_STEPS  # a job that ends only when stopped (cancel, release, a lost lease)
_T = TypeVar("_T")


def save_tiny_bert(folder: Path, seed: int = 0) -> None:
    """A 2-layer BERT (hidden 32) with its pooler, so loading it back initialises nothing at random
    (its content hash is the same in every process), and its tokenizer."""
    import torch
    from transformers import BertModel

    from pelt_core.testing import tiny_bert_config, tiny_tokenizer

    torch.manual_seed(seed)
    BertModel(tiny_bert_config()).eval().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)


def toy_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """Sentences of random words ending in a positive or a negative pair of words (the label)."""
    rng = random.Random(seed)
    words = VOCAB[5:100]
    rows = []
    for _ in range(count):
        label = rng.randint(0, 1)
        cue = rng.choice(["good great", "great fun"] if label else ["bad awful", "boring bad"])
        rows.append({"sentence": " ".join(rng.choice(words) for _ in range(5)) + " " + cue, "label": label})
    return rows


@pytest.fixture(scope="session")
def tiny_backbone(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(model folder, content hash) of the tiny BERT."""
    from pelt_core.backbones import Backbone

    folder = tmp_path_factory.mktemp("tiny-bert")
    save_tiny_bert(folder)
    return str(folder), Backbone.load(str(folder)).content_hash


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("toy-data")
    return {
        "train": write_jsonl(folder / "train.jsonl", toy_rows(800, seed=0)),
        "validation": write_jsonl(folder / "validation.jsonl", toy_rows(40, seed=1)),
    }


@pytest.fixture(scope="session")
def migrated_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("registry-template") / "registry.db"
    upgrade(sqlite_url(path))
    return path


@pytest.fixture
def registry_url(
    tmp_path: Path, migrated_template: Path, tiny_backbone: tuple[str, str], toy_data: dict[str, Path]
) -> str:
    """A fresh SQLite registry with the toy task and the tiny backbone registered."""
    path = tmp_path / "registry.db"
    shutil.copyfile(migrated_template, path)
    url = sqlite_url(path)
    with Registry(url) as registry:
        registry.register_task(TASK, dict(toy_data), text_fields=["sentence"])
        registry.register_backbone(BACKBONE, tiny_backbone[0], tiny_backbone[1])
    return url


@pytest.fixture
def registry(registry_url: str) -> Iterator[Registry]:
    """The registry as the dispatcher sees it: short leases and backoffs so retries happen in seconds."""
    with Registry(
        registry_url, lease_seconds=8, retry_backoff_seconds=0.2, retry_backoff_max_seconds=1
    ) as reg:
        yield reg


def submit(
    registry: Registry, count: int, *, steps: int = SHORT, seed0: int = 0, **hyperparameters: Any
) -> list[int]:
    """Queue `count` LoRA jobs of `steps` optimisation steps each (batch 2)."""
    values = {"max_steps": steps, "batch_size": 2, "eval_batch_size": 64, **hyperparameters}
    return [registry.submit_job(TASK, "lora", BACKBONE, values, seed=seed0 + i).id for i in range(count)]


# Waits are deadlines, not margins: each returns as soon as its condition holds. Their sizes in the tests are
# what a quiet machine needs, times LOAD_FACTOR for a 2-core machine running the suite on several processes
# (`make test`), where a Ray worker's start alone can take most of a minute.
LOAD_FACTOR = 3


def wait_for(predicate: Callable[[], _T], timeout: float, what: str, interval: float = 0.2) -> _T:
    """Poll until `predicate()` is truthy; its value, or a failure naming `what` after `timeout` x
    LOAD_FACTOR seconds."""
    timeout *= LOAD_FACTOR
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def step_of(registry: Registry, job_id: int) -> int:
    """The last step the job's worker reported (0 before the first report)."""
    detail = registry.get_job(job_id).progress_detail
    return 0 if detail is None else detail["step"]


def ended(registry: Registry, job_ids: list[int]) -> bool:
    return all(registry.get_job(job_id).status in ("succeeded", "failed", "cancelled") for job_id in job_ids)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A local Ray as the service starts it in embedded mode (4 logical CPUs on this small machine)."""
    import ray

    from services.dispatcher import connect_ray
    from services.settings import Settings

    started = connect_ray(Settings(ray_address=None), namespace="pelt-tests", num_cpus=4, log_to_driver=False)
    assert started
    yield
    ray.shutdown()


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> str:
    """A Ray namespace of the test's own (its workers and backbone hosts)."""
    return f"t-{request.node.name[:40]}"


@pytest.fixture
def hold(tmp_path: Path) -> Hold:
    """Holds each job at its store step until the test releases it (tests/workers/hold.py)."""
    return Hold(tmp_path / "hold")
