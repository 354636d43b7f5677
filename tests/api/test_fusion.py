"""POST /v1/fusions as a specification: an AdapterFusion job names stored adapters by task (best, alias or
version), records each source's version and sha256, and runs on their backbone; a source fusion cannot use,
a multi-task bundle, a fusion, an unknown version or sources of two backbones are refused before anything is
written. The worker's side fetches exactly the recorded versions (`MlflowDeltaStore.fetch`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pelt_core.backbones import Backbone
from pelt_core.delta import save_delta
from pelt_core.delta_format import DeltaError
from pelt_core.methods import get_method
from pelt_core.methods.fusion import Source, fusion_method
from pelt_core.model import JobDelta
from services.registry import RegistryValidationError
from tests.api.conftest import BACKBONE, Api
from tests.api.helpers import refused
from tests.workers.conftest import save_tiny_bert


def store_delta(api: Api, task: str, method: str, folder: Path, backbone_name: str = BACKBONE, seed: int = 0):
    """A random (untrained) delta of `method` stored as the next version of `task`; its StoredDelta."""
    backbone = Backbone.load(api.registry.get_backbone(backbone_name).source)
    torch.manual_seed(seed)
    delta = JobDelta(get_method(method), backbone, num_labels=2, label_names=["negative", "positive"])
    return api.store.register(task, save_delta(delta, backbone, folder).path)


@pytest.fixture
def adapters(api: Api, toy_task: str, toy_files, tmp_path: Path) -> dict[str, object]:
    """Tasks src-a (a Pfeiffer adapter, version 1) and src-b (a Houlsby adapter v1, a LoRA v2) stored."""
    client = api.client()
    for task in ("src-a", "src-b"):
        client.register_task(task, toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    return {
        "a": store_delta(api, "src-a", "pfeiffer", tmp_path / "a"),
        "b": store_delta(api, "src-b", "houlsby", tmp_path / "b"),
        "lora": store_delta(api, "src-b", "lora", tmp_path / "lora"),
    }


def test_a_fusion_job_records_each_source_version_and_sha256_and_runs_on_their_backbone(api: Api, adapters):
    job = api.client().fuse("toy", ["src-a/1", "src-b/1"], own_adapter=True, hyperparameters={"epochs": 2})
    assert (job.task, job.method, job.backbone, job.status) == ("toy", "fusion", BACKBONE, "queued")
    assert job.sources == [
        {"task": "src-a", "version": 1, "sha256": adapters["a"].sha256, "method": "pfeiffer"},
        {"task": "src-b", "version": 1, "sha256": adapters["b"].sha256, "method": "houlsby"},
    ]
    spec = api.registry.get_job(job.id).method_spec
    # Pfeiffer's FFN adapter, Houlsby's two (its LayerNorm deltas left out), the task's own adapter
    assert list(spec["modules"]) == ["s1_adapter", "s2_attn_adapter", "s2_ffn_adapter", "adapter"]
    assert not spec["layer_norm"] and job.train_config["learning_rate"] is None  # the preset's 5e-5


def test_sources_fusion_cannot_use_are_refused_before_anything_is_written(api: Api, adapters, tmp_path: Path):
    client = api.client()
    before = len(api.registry.list_jobs())
    refused(lambda: client.fuse("toy", ["src-a/1", "src-b/2"]), 422, "sources", "lora")
    refused(lambda: client.fuse("toy", ["src-a/1", "src-a/1"]), 422, "sources", "same delta")
    refused(lambda: client.fuse("toy", ["src-a/1"]), 422, "sources", "two or more adapters")
    refused(lambda: client.fuse("toy", ["src-a/1", "src-b/9"]), 404, words="version")
    refused(lambda: client.fuse("nowhere", ["src-a/1", "src-b/1"]), 404, words="nowhere")
    refused(lambda: client.fuse("toy", ["src-a/1", "src-b/1"], backbone="all-minilm-l6-v2"), 404)

    backbone = Backbone.load(api.registry.get_backbone(BACKBONE).source)
    a, b = (JobDelta(get_method(m), backbone, num_labels=2) for m in ("pfeiffer", "houlsby"))
    fused = JobDelta(
        fusion_method([Source("src-a", "1" * 64, a.method), Source("src-b", "2" * 64, b.method)]),
        backbone,
        num_labels=2,
    )
    api.store.register("src-c", save_delta(fused, backbone, tmp_path / "fused").path)
    refused(lambda: client.fuse("toy", ["src-a/1", "src-c/1"]), 422, "sources", "itself a fusion")

    other = tmp_path / "other-bert"
    other.mkdir()
    save_tiny_bert(other, seed=1)
    api.registry.register_backbone("other-bert", str(other), Backbone.load(str(other)).content_hash)
    store_delta(api, "src-c", "pfeiffer", tmp_path / "other", backbone_name="other-bert")
    refused(lambda: client.fuse("toy", ["src-a/1", "src-c/2"]), 422, "sources", "share one backbone")
    refused(
        lambda: client.fuse("toy", ["src-a/1", "src-b/1"], backbone="other-bert"), 422, "backbone", "not on"
    )
    assert len(api.registry.list_jobs()) == before


def test_method_fusion_is_only_submitted_through_its_sources(api: Api, toy_task: str):
    client = api.client()
    refused(lambda: client.submit("toy", "fusion", backbone=BACKBONE), 422, "method", "pelt fuse")
    refused(lambda: client.sweep("toy", ["lora", "fusion"], backbone=BACKBONE), 422, "method", "pelt fuse")
    with pytest.raises(RegistryValidationError, match="cannot be a fusion"):
        api.registry.register_method({**get_method("pfeiffer").to_dict(), "name": "fusion"})
    assert api.registry.list_jobs() == []


def test_the_worker_fetches_exactly_the_recorded_version_and_nothing_changed(
    api: Api, adapters, tmp_path: Path
):
    folder = api.store.fetch("src-a", 1, adapters["a"].sha256, tmp_path / "fetched")
    assert (folder / "delta.safetensors").is_file()
    with pytest.raises(DeltaError, match="not the"):
        api.store.fetch("src-b", 1, adapters["a"].sha256, tmp_path / "wrong")
    with pytest.raises(DeltaError, match="src-b version 7"):
        api.store.fetch("src-b", 7, adapters["b"].sha256, tmp_path / "gone")


def test_overrides_change_the_fusions_own_adapter_never_its_frozen_sources(api: Api, adapters):
    client = api.client()
    refused(
        lambda: client.fuse(
            "toy", ["src-a/1", "src-b/1"], own_adapter=True, hyperparameters={"bottleneck": 8}
        ),
        422,
        "hyperparameters",
        "frozen",
    )
    refused(
        lambda: client.fuse("toy", ["src-a/1", "src-b/1"], hyperparameters={"s1_adapter.dropout": 0.1}), 422
    )
    job = client.fuse("toy", ["src-a/1", "src-b/1"], own_adapter=True, hyperparameters={"adapter.size": 8})
    assert api.registry.get_job(job.id).method_spec["modules"]["adapter"]["size"] == 8


def test_the_same_key_with_other_sources_is_a_conflict_not_the_old_job(api: Api, adapters, tmp_path: Path):
    client = api.client()
    first = client.fuse("toy", ["src-a/1", "src-b/1"], idempotency_key="fuse-1")
    assert client.fuse("toy", ["src-a/1", "src-b/1"], idempotency_key="fuse-1").id == first.id
    store_delta(api, "src-a", "pfeiffer", tmp_path / "a2", seed=2)
    refused(lambda: client.fuse("toy", ["src-a/2", "src-b/1"], idempotency_key="fuse-1"), 409)
    refused(
        lambda: client.fuse("toy", ["src-a/1", "src-b/1"], own_adapter=True, idempotency_key="fuse-1"), 409
    )


def test_an_archived_source_is_refused_at_submit_and_by_the_worker(api: Api, adapters, tmp_path: Path):
    client = api.client()
    job = client.fuse("toy", ["src-a/1", "src-b/1"])
    client.archive_version("src-b", 1)
    refused(lambda: client.fuse("toy", ["src-a/1", "src-b/1"]), 422, "sources", "archived")
    (_, source) = api.registry.get_job(job.id).method_spec["fusion"]["sources"]
    with pytest.raises(DeltaError, match="archived"):
        api.store.fetch(source["task"], source["version"], source["sha256"], tmp_path / "archived")
