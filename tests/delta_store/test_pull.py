"""Pull by task name: the best delta (or a method's, an alias's, a version's), checked, on its backbone."""

from __future__ import annotations

import pytest
import torch

from pelt_core.delta_format import DeltaError
from pelt_core.model import PeltModel, predict
from pelt_core.testing import tiny_bert
from services.delta_store import DeltaIntegrityError, DeltaNotFoundError, MlflowDeltaStore
from services.delta_store.values import TAG_SHA256

from .conftest import BACKBONE, SST2_TEXTS, TRAINING, WORKER, job_spec, logits_of, run_job


def test_pull_by_task_name_returns_the_trained_models_logits(store, registry, trained, backbone):
    run_job(store, registry, trained["lora-0"], accuracy=0.60)
    run_job(store, registry, trained["bitfit-0"], accuracy=0.90)
    run_job(store, registry, trained["lora-1"], accuracy=0.70)

    best = store.pull("sst2")  # the `best` alias: the bitfit job
    assert (best.info.method, best.version, "best" in best.info.aliases) == ("bitfit", "2", True)
    torch.testing.assert_close(best.logits(SST2_TEXTS), logits_of(backbone, trained["bitfit-0"].delta))
    expected = predict(PeltModel(backbone, trained["bitfit-0"].delta).eval(), SST2_TEXTS)
    assert [p["label"] for p in best.predict(SST2_TEXTS)] == [p["label"] for p in expected]

    by_method = store.pull("sst2", method="lora")  # best-lora: the second lora job (0.70 > 0.60)
    assert by_method.version == "3"
    torch.testing.assert_close(by_method.logits(SST2_TEXTS), logits_of(backbone, trained["lora-1"].delta))
    by_version = store.pull("sst2", version=1)
    torch.testing.assert_close(by_version.logits(SST2_TEXTS), logits_of(backbone, trained["lora-0"].delta))

    # the same picks as strings: "task@alias", "task/version"
    assert store.pull("sst2@best-lora").version == "3" and store.pull("sst2/1").version == "1"


def test_pull_loads_the_backbone_its_manifest_names(tracking, store, registry, trained, backbone_dir):
    run_job(store, registry, trained["lora-0"], accuracy=0.7)
    fresh = MlflowDeltaStore(
        tracking["tracking_uri"],
        tracking["artifact_root"],
        registry=registry,
        namespace=tracking["namespace"],
    )  # no backbone given: Backbone.load(manifest name)
    pulled = fresh.pull("sst2")
    assert pulled.manifest["backbone"]["name"] == str(backbone_dir)
    assert (
        pulled.backbone is not store._backbones[pulled.backbone.content_hash]
    )  # loaded anew, from the folder
    torch.testing.assert_close(pulled.logits(SST2_TEXTS), store.pull("sst2").logits(SST2_TEXTS))
    assert fresh.pull("sst2").backbone is pulled.backbone  # loaded once per store


def test_a_tampered_artifact_is_refused(store, registry, trained, tmp_path):
    job = run_job(store, registry, trained["lora-0"], accuracy=0.7)
    result = registry.get_result(job.job_id)
    tampered = tmp_path / "delta.safetensors"
    data = bytearray((trained["lora-0"].folder / "delta.safetensors").read_bytes())
    data[-1] ^= 0x01  # one bit of one weight
    tampered.write_bytes(bytes(data))
    store.client.log_artifact(result.mlflow_run_id, str(tampered), "delta")  # overwrite it in the store

    with pytest.raises(DeltaIntegrityError, match="sha256"):
        store.pull("sst2")
    with pytest.raises(DeltaIntegrityError, match="refusing"):
        store.download("sst2", result.mlflow_model_version)


def test_a_changed_sha256_tag_is_caught_by_the_registrys_record(store, registry, trained):
    job = run_job(store, registry, trained["lora-0"], accuracy=0.7)
    version = registry.get_result(job.job_id).mlflow_model_version
    store.client.set_model_version_tag(store.model_name("sst2"), version, TAG_SHA256, "0" * 64)
    with pytest.raises(DeltaIntegrityError, match="differs from the registry"):
        store.pull("sst2")


def test_pulling_an_unknown_task_method_alias_or_version_lists_what_exists(store, registry, trained):
    run_job(store, registry, trained["lora-0"], accuracy=0.6)
    run_job(store, registry, trained["bitfit-0"], accuracy=0.7)

    with pytest.raises(DeltaNotFoundError, match=r"no task 'mnli'.*known tasks: sst2") as unknown_task:
        store.pull("mnli")
    assert isinstance(unknown_task.value, LookupError) and unknown_task.value.known == ["sst2"]
    with pytest.raises(DeltaNotFoundError, match=r"no method 'houlsby'.*known methods: bitfit, lora"):
        store.pull("sst2", method="houlsby")
    with pytest.raises(DeltaNotFoundError, match=r"no version '9'.*known versions: 1, 2"):
        store.pull("sst2", version=9)
    with pytest.raises(
        DeltaNotFoundError, match=r"no alias 'soup'.*known aliases: best, best-bitfit, best-lora"
    ):
        store.pull("sst2", alias="soup")


def test_an_archived_version_is_never_the_best_and_its_aliases_go_to_the_best_other_run(
    store, registry, trained
):
    run_job(store, registry, trained["lora-0"], accuracy=0.60)  # version 1
    run_job(store, registry, trained["lora-1"], accuracy=0.80)  # version 2: best, best-lora
    run_job(store, registry, trained["bitfit-0"], accuracy=0.70)  # version 3: best-bitfit
    assert store.get_version("sst2").version == "2"

    archived = store.archive_version("sst2", 2)
    assert archived.archived and archived.aliases == ()
    assert store.get_version("sst2").version == "3"  # bitfit's 0.70 beats lora's 0.60 now
    assert store.get_version("sst2", method="lora").version == "1"
    assert store.pull("sst2", version=2).info.archived  # its number still pulls it

    run_job(store, registry, trained["lora-r4"], accuracy=0.75)  # version 4: a later sync leaves 2 out too
    assert store.get_version("sst2").version == "4" and store.get_version("sst2@best-lora").version == "4"
    assert [v.version for v in store.list_versions("sst2") if v.archived] == ["2"]


def test_a_compositions_own_name_pulls_its_latest_version(store, registry, trained):
    run_job(store, registry, trained["lora-0"], accuracy=0.6)
    run_job(store, registry, trained["lora-1"], accuracy=0.7)
    store.compose("merge", ["sst2/1", "sst2/2"], into="soup", weights=[0.5, 0.5])
    latest = store.compose("merge", ["sst2/1", "sst2/2"], into="soup", weights=[0.9, 0.1])
    assert store.pull("soup").version == latest.version == "2"
    with pytest.raises(DeltaNotFoundError, match="no alias 'best'"):
        store.get_version("soup@best")  # only the plain name falls back to the latest
    store.archive_version("soup", 2)
    assert store.get_version("soup").version == "1"


def test_a_delta_is_refused_by_another_backbone(store, registry, trained, tmp_path):
    run_job(store, registry, trained["lora-0"], accuracy=0.7)
    other = tiny_bert(str(tmp_path), seed=1)  # same shapes, other weights: another content hash
    with pytest.raises(DeltaError, match="trained on backbone"):
        store.pull("sst2", backbone=other)


def test_versions_without_a_test_metric_are_never_the_best_and_pulling_best_says_why(
    store, registry, trained
):
    delta = trained["lora-0"]
    settings = {**TRAINING, "dev_rows": 4, "evaluate_test": False}  # as a search's early rung
    job_id = registry.submit_job(delta.task, delta.method, BACKBONE, settings, seed=delta.seed).id
    assert registry.claim_job(WORKER).id == job_id
    dev_only = {**delta.result, "metrics": {}, "dev_metrics": {"accuracy": 0.9}}
    store.complete_job(job_spec(registry, job_id), WORKER, delta.folder, dev_only, delta.history)
    assert registry.get_job(job_id).status == "succeeded"
    with pytest.raises(
        DeltaNotFoundError, match="its versions: 1; none has a test metric to be ranked by yet"
    ):
        store.pull("sst2")
    assert store.get_version("sst2/1").version == "1"  # still pulled by its number
    run_job(store, registry, trained["lora-1"], accuracy=0.6)  # a worse dev score, but a test metric
    assert store.get_version("sst2").version == "2"
