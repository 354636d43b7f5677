"""Every job a run, every delta a model version; aliases follow the registry's results; one version per job."""

from __future__ import annotations

import hashlib

import pytest

from services.delta_store import DeltaStoreError, MlflowDeltaStore
from services.delta_store.values import TAG_SHA256

from .conftest import BACKBONE, WORKER, claim, job_spec, run_job, with_metric


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def aliases(store: MlflowDeltaStore, task: str = "sst2") -> dict[str, str]:
    return {a: str(v) for a, v in store.client.get_registered_model(store.model_name(task)).aliases.items()}


def test_a_jobs_run_holds_its_params_metric_history_tags_and_delta(store, registry, trained, tmp_path):
    delta = trained["lora-0"]
    job = claim(registry, delta, sweep=True)
    store.complete_job(job, WORKER, delta.folder, with_metric(delta, 0.75), delta.history)

    result = registry.get_result(job.job_id)
    run = store.client.get_run(result.mlflow_run_id)
    experiment = store.client.get_experiment_by_name(store.experiment_name("sst2"))
    assert run.info.experiment_id == experiment.experiment_id and run.info.status == "FINISHED"

    params = run.data.params  # the job's parameters: task, method, backbone, training config, method spec
    assert (params["task"], params["method"], params["backbone"]) == ("sst2", "lora", BACKBONE)
    assert float(params["epochs"]) == 2 and float(params["learning_rate"]) == 5e-3 and params["seed"] == "0"
    assert params["spec.modules.q.size"] == "2" and params["spec.modules.v.representation"] == "attn.v"

    tags = run.data.tags
    assert tags["pelt.job_id"] == str(job.job_id) and tags["pelt.task"] == "sst2"
    assert (tags["pelt.method"], tags["pelt.backbone"], tags["pelt.attempt"]) == ("lora", BACKBONE, "1")
    assert tags["pelt.sweep_id"] == str(job.sweep_id) and tags["pelt.kind"] == "job"

    history = store.client.get_metric_history(run.info.run_id, "accuracy")  # one point per epoch
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (r["epoch"], pytest.approx(r["accuracy"])) for r in delta.history
    ]
    assert len(store.client.get_metric_history(run.info.run_id, "loss")) == 2
    assert run.data.metrics["final/accuracy"] == 0.75  # the final metrics, as the registry recorded them
    assert run.data.metrics["trainable_params"] == delta.result["trainable_params"]

    artifacts = {a.path for a in store.client.list_artifacts(run.info.run_id, "delta")}
    assert artifacts == {"delta/delta.safetensors", "delta/manifest.json"}
    assert {"job.json", "history.json"} <= {a.path for a in store.client.list_artifacts(run.info.run_id)}
    expected_sha = sha256(delta.folder / "delta.safetensors")
    assert tags[TAG_SHA256] == expected_sha == result.delta_sha256

    # the registry's row points at the model version, whose source is the run's delta artifact
    version = store.client.get_model_version(store.model_name("sst2"), result.mlflow_model_version)
    assert result.delta_uri == f"models:/{store.model_name('sst2')}/{version.version}"
    assert version.source == f"runs:/{run.info.run_id}/delta" and version.run_id == run.info.run_id
    folder = store.download("sst2", version.version, tmp_path / "download")
    assert (folder / "delta.safetensors").read_bytes() == (delta.folder / "delta.safetensors").read_bytes()


def test_three_jobs_of_two_methods_give_three_versions_and_best_aliases(store, registry, trained):
    first_lora = run_job(store, registry, trained["lora-0"], accuracy=0.60)
    bitfit = run_job(store, registry, trained["bitfit-0"], accuracy=0.70)
    second_lora = run_job(store, registry, trained["lora-1"], accuracy=0.80)

    versions = store.list_versions("sst2")
    assert [(v.version, v.job_id, v.method, v.kind) for v in versions] == [
        ("1", first_lora.job_id, "lora", "job"),
        ("2", bitfit.job_id, "bitfit", "job"),
        ("3", second_lora.job_id, "lora", "job"),
    ]
    for info in versions:  # each version is the one the registry recorded, with the same sha256
        result = registry.get_result(info.job_id)
        assert (result.mlflow_model_version, result.delta_sha256, result.mlflow_run_id) == (
            info.version,
            info.sha256,
            info.run_id,
        )
        assert info.source == f"runs:/{info.run_id}/delta"
    assert aliases(store) == {"best": "3", "best-lora": "3", "best-bitfit": "2"}
    assert store.list_tasks() == ["sst2"]


@pytest.mark.parametrize("store_backend", ["sqlite"], indirect=True)  # the CLI's default namespace
def test_pelt_mlflow_versions_prints_a_header_then_one_line_per_version(store, registry, trained, tracking):
    from click.testing import CliRunner

    from services.cli import main

    def versions(task: str) -> list[str]:
        result = CliRunner().invoke(main, ["mlflow", "versions", task, "--uri", tracking["tracking_uri"]])
        assert result.exit_code == 0, result.output
        return result.output.splitlines()

    lora = run_job(store, registry, trained["lora-0"], accuracy=0.60)
    header, line = versions("sst2")
    assert header.split() == ["version", "kind", "job", "method", "metric", "sha256", "aliases"]
    assert line.split()[:4] == ["1", "job", f"job={lora.job_id}", "lora"]
    assert line.split()[-2:] == ["best", "best-lora"]


def test_an_alias_moves_only_when_a_new_result_beats_the_current_one(store, registry, trained):
    run_job(store, registry, trained["lora-0"], accuracy=0.80)
    run_job(store, registry, trained["bitfit-0"], accuracy=0.70)
    assert aliases(store) == {"best": "1", "best-lora": "1", "best-bitfit": "2"}

    run_job(store, registry, trained["lora-1"], accuracy=0.80)  # a tie (same size): the older job keeps it
    assert aliases(store) == {"best": "1", "best-lora": "1", "best-bitfit": "2"}

    run_job(store, registry, trained["lora-r4"], accuracy=0.90)  # better: best and best-lora move
    assert aliases(store) == {"best": "4", "best-lora": "4", "best-bitfit": "2"}


def test_a_retried_job_leaves_one_version(store, registry, trained):
    first, second = trained["lora-0"], trained["lora-1"]
    job = claim(registry, first)
    stored = store.store(job, first.folder, with_metric(first, 0.7), first.history)
    assert store.store(job, first.folder, with_metric(first, 0.7), first.history) == stored  # repeated: no-op

    # the worker dies before recording the result; the job is retried and its new attempt trains again
    registry.fail_job(job.job_id, WORKER, "worker lost", retryable=True)
    assert registry.claim_job("worker-2").id == job.job_id
    retry = job_spec(registry, job.job_id)
    assert retry.attempt == 2
    record = store.complete_job(retry, "worker-2", second.folder, with_metric(second, 0.8), second.history)

    versions = store.list_versions("sst2")
    assert [v.version for v in versions] == [record.mlflow_model_version] != [stored.model_version]
    assert versions[0].sha256 == sha256(second.folder / "delta.safetensors") == record.delta_sha256
    assert store.client.get_run(stored.run_id).info.lifecycle_stage == "deleted"  # attempt 1's run
    assert aliases(store) == {"best": record.mlflow_model_version, "best-lora": record.mlflow_model_version}

    # a duplicate completion (the same message delivered twice) changes nothing
    again = store.complete_job(retry, "worker-2", first.folder, with_metric(first, 0.9), first.history)
    assert again == record
    assert [v.version for v in store.list_versions("sst2")] == [record.mlflow_model_version]


def test_a_retry_of_the_same_delta_reuses_its_version(store, registry, trained):
    delta = trained["bitfit-0"]
    job = claim(registry, delta)
    stored = store.store(job, delta.folder, with_metric(delta, 0.7), delta.history)
    registry.fail_job(job.job_id, WORKER, "worker lost", retryable=True)
    registry.claim_job("worker-2")
    record = store.complete_job(
        job_spec(registry, job.job_id), "worker-2", delta.folder, with_metric(delta, 0.7), delta.history
    )
    assert record.mlflow_model_version == stored.model_version
    assert [v.version for v in store.list_versions("sst2")] == [stored.model_version]


def test_two_workers_completing_one_job_keep_the_recorded_version(store, registry, trained):
    slow, fast = trained["lora-0"], trained["lora-1"]
    job = claim(registry, slow)
    slow_stored = store.store(job, slow.folder, with_metric(slow, 0.7), slow.history)  # then its lease lapses
    registry.fail_job(job.job_id, WORKER, "lease expired", retryable=True)
    registry.claim_job("worker-2")
    fast_stored = store.store(
        job_spec(registry, job.job_id), fast.folder, with_metric(fast, 0.8), fast.history
    )
    assert len(store.list_versions("sst2")) == 2  # until the registry decides

    record = store.complete_job(
        job_spec(registry, job.job_id), "worker-2", fast.folder, with_metric(fast, 0.8), fast.history
    )
    late = store.complete_job(job, WORKER, slow.folder, with_metric(slow, 0.7), slow.history)  # lapsed worker
    assert late == record and record.mlflow_model_version == fast_stored.model_version
    assert [v.version for v in store.list_versions("sst2")] == [fast_stored.model_version]
    assert store.client.get_run(slow_stored.run_id).info.lifecycle_stage == "deleted"


def record_without_aliases(store, registry, delta, accuracy: float):
    """A job's delta stored and its result row committed, as a worker that died before the alias step
    (or one that has not reached it yet) leaves it."""
    job = claim(registry, delta)
    stored = store.store(job, delta.folder, with_metric(delta, accuracy), delta.history)
    registry.complete_job(
        job.job_id,
        WORKER,
        {
            **with_metric(delta, accuracy),
            "delta_uri": stored.uri,
            "delta_sha256": stored.sha256,
            "mlflow_run_id": stored.run_id,
            "mlflow_model_version": stored.model_version,
        },
    )
    return stored


def test_a_crash_between_result_and_aliases_is_repaired_by_sync(store, registry, trained):
    stored = record_without_aliases(store, registry, trained["lora-0"], 0.7)
    assert aliases(store) == {}  # the process died here, before the alias step

    expected = {"best": stored.model_version, "best-lora": stored.model_version}
    assert store.sync_aliases("sst2") == expected
    assert store.reconcile("sst2") == expected  # idempotent
    assert aliases(store) == expected


def test_a_job_that_succeeded_pulls_by_name_before_its_aliases_move(store, registry, trained):
    """The registry says succeeded a moment before the completion moves MLflow's aliases; a caller who
    saw the job succeed resolves `task`, `task@best` and `task@best-<method>` to its delta all the same."""
    first = run_job(store, registry, trained["lora-0"], accuracy=0.60)
    bitfit = record_without_aliases(store, registry, trained["bitfit-0"], 0.70)
    assert aliases(store) == {"best": "1", "best-lora": "1"}  # not moved yet

    for ref in ("sst2", "sst2@best", "sst2@best-bitfit"):
        assert store.get_version(ref).version == bitfit.model_version, ref
    assert store.get_version("sst2", method="bitfit").version == bitfit.model_version
    assert store.get_version("sst2@best-lora").job_id == first.job_id


def test_a_failed_jobs_version_is_dropped(store, registry, trained):
    delta = trained["lora-0"]
    job = claim(registry, delta)
    store.store(job, delta.folder, with_metric(delta, 0.7), delta.history)
    registry.fail_job(job.job_id, WORKER, "bad data", retryable=False)
    assert store.reconcile("sst2") == {}
    assert store.list_versions("sst2") == []


def test_without_a_registry_the_last_attempt_replaces_the_earlier_ones(tracking, registry, trained):
    store = MlflowDeltaStore(
        tracking["tracking_uri"], tracking["artifact_root"], namespace=tracking["namespace"]
    )
    first, second = trained["lora-0"], trained["lora-1"]
    job = claim(registry, first)
    store.store(job, first.folder, with_metric(first, 0.7), first.history)
    last = store.store(job, second.folder, with_metric(second, 0.8), second.history)
    assert [(v.version, v.sha256) for v in store.list_versions("sst2")] == [(last.model_version, last.sha256)]
    with pytest.raises(DeltaStoreError, match="needs the registry"):
        store.sync_aliases("sst2")
