"""Results of the study protocol (`dev_rows`): the registry keeps the dev evaluation beside the test
metrics, a leaderboard ranks by either split and says which, and a job that could never draw its dev
split is refused at submit, writing nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.dispatcher import RegistryLease
from services.dispatcher.job_specs import JobSpecs
from services.registry import Registry, RegistryValidationError
from tests.registry.test_metric_names import BACKBONE, live_registry, tiny_bert_dir, write_task_files
from workers.backbone_store import LocalBackbones
from workers.job import LocalDeltaSink
from workers.worker import PeltWorker, WorkerConfig

__all__ = ["live_registry", "tiny_bert_dir"]  # fixtures shared with the metric-names specification


def plain(accuracy: float) -> dict:
    return {
        "metrics": {"accuracy": accuracy},
        "trainable_params": 10,
        "total_params": 1000,
        "train_seconds": 1.0,
    }


def studied(test: float, dev: float) -> dict:
    return plain(test) | {"dev_metrics": {"accuracy": dev, "loss": 0.5, "epoch": 3, "step": 30}}


def finish(registry: Registry, method: str, result: dict, seed: int) -> int:
    job = registry.submit_job("sst2", method, "tiny-bert", seed=seed)
    claimed = registry.claim_job("w1")
    assert claimed is not None and claimed.id == job.id
    registry.complete_job(job.id, "w1", result)
    return job.id


def test_a_leaderboard_ranks_by_the_test_split_or_the_dev_split_and_says_which(ready: Registry):
    finish(ready, "lora", studied(test=0.70, dev=0.90), seed=0)
    finish(ready, "pfeiffer", studied(test=0.80, dev=0.60), seed=0)
    plain_job = finish(ready, "bitfit", plain(0.95), seed=0)
    by_test = ready.leaderboard("sst2")
    assert [(row.method, row.best) for row in by_test] == [
        ("bitfit", 0.95),
        ("pfeiffer", 0.80),
        ("lora", 0.70),
    ]
    by_dev = ready.leaderboard("sst2", split="dev")
    assert [(row.method, row.best) for row in by_dev] == [("lora", 0.90), ("pfeiffer", 0.60)]  # no plain job
    assert plain_job not in [row.best_job_id for row in by_dev]
    assert list(ready.leaderboard_by_k("sst2", split="dev")) == [None]
    stored = ready.get_result(by_dev[0].best_job_id)
    assert stored is not None and (stored.dev_primary_metric, stored.dev_metrics["step"]) == (0.90, 30)
    assert ready.get_result(plain_job).dev_metrics is None
    with pytest.raises(RegistryValidationError, match="split: must be one of test, dev"):
        ready.leaderboard("sst2", split="validation")  # type: ignore[arg-type]


def test_a_result_whose_dev_metrics_lack_the_tasks_metric_is_refused(ready: Registry):
    job = ready.submit_job("sst2", "lora", "tiny-bert")
    ready.claim_job("w1")
    bad = plain(0.5) | {"dev_metrics": {"loss": 0.3}}
    with pytest.raises(
        RegistryValidationError, match=r"result.dev_metrics.accuracy: .*missing \(have: loss\)"
    ):
        ready.complete_job(job.id, "w1", bad)
    assert ready.get_result(job.id) is None and ready.get_job(job.id).status == "running"


@pytest.mark.parametrize(
    ("hyperparameters", "k_shot", "field", "message"),
    [
        ({"dev_rows": 35}, 10, "dev_rows", "35 dev rows and K=10 training row"),  # 40 rows in all
        ({"dev_rows": 40}, None, "dev_rows", "40 dev rows and at least one training row"),
        ({"patience": 3}, None, "patience", "early stopping needs a dev split"),
        ({"dev_rows": 0}, None, "dev_rows", "dev_rows"),
    ],
)
def test_a_protocol_job_that_cannot_draw_its_splits_is_refused_and_nothing_is_written(
    ready: Registry, hyperparameters, k_shot, field, message
):
    with pytest.raises(RegistryValidationError, match=message) as refused:
        ready.submit_job("sst2", "lora", "tiny-bert", hyperparameters, k_shot=k_shot)
    assert refused.value.field == field
    assert ready.list_jobs() == []


def test_a_protocol_job_trains_through_a_worker_and_stores_its_dev_and_test_evaluations(
    live_registry: Registry, tmp_path: Path
):
    files = write_task_files(tmp_path / "task", "single_label_classification", classes=2)
    live_registry.register_task("two", files, text_fields="text")
    config = {"epochs": 3, "batch_size": 4, "bf16": "false", "dev_rows": 8, "patience": 5}
    job = live_registry.submit_job("two", "lora", BACKBONE, config, k_shot=12)
    claimed = live_registry.claim_job("w-study")
    assert claimed is not None and claimed.id == job.id
    lease = RegistryLease(
        live_registry.engine.url.render_as_string(hide_password=False),
        job.id,
        "w-study",
        live_registry.lease_seconds,
        live_registry.retry_backoff_seconds,
        live_registry.retry_backoff_max_seconds,
    )
    worker = PeltWorker("w-study", WorkerConfig(threads=None), backbones=LocalBackbones())
    outcome = worker.run(JobSpecs(live_registry).build(claimed), lease, LocalDeltaSink(tmp_path / "deltas"))
    assert outcome.status == "succeeded", outcome.error
    result = live_registry.get_result(job.id)
    assert result is not None and result.dev_metrics is not None
    assert result.dev_primary_metric == result.dev_metrics["accuracy"]
    assert result.dev_metrics["epoch"] in (1, 2, 3)  # the kept checkpoint: one of the 3 epochs' ends
    # 12 rows at batch 4: 3 steps an epoch
    assert result.dev_metrics["step"] == 3 * result.dev_metrics["epoch"]
    assert set(result.metrics) >= {"accuracy", "loss"} and "epoch" not in result.metrics  # the test set's
