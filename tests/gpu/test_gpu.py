"""pelt on a GPU: packs, deltas across devices, bf16 storage, a GPU worker. Skipped where torch sees no GPU.

Run them on a machine with a GPU with `pytest -m gpu tests/gpu` (benchmarks/README.md, "GPU benchmark", says
how they were run on a lent GPU). Every path here also has a CPU test that always runs (tests/core/test_devices.py,
tests/core/test_pack.py, tests/workers/test_worker.py)."""

from __future__ import annotations

import math

import datasets
import pytest
import torch

from pelt_core import TrainConfig
from pelt_core.delta import load_delta, save_delta
from pelt_core.methods import get_method, list_methods
from pelt_core.model import PeltModel, predict
from tests.core.test_pack import WORDS, assert_same_delta, job, run_pack, train_alone
from tests.workers.test_worker import RecordingLease, job_spec
from workers.backbone_store import LocalBackbones
from workers.job import LocalDeltaSink
from workers.worker import PeltWorker, WorkerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU is visible to torch here"),
]


@pytest.fixture
def on_gpu(make_backbone):
    """make_backbone, then the backbone moved onto the GPU."""

    def make(family: str = "bert", **config):
        return make_backbone(family, **config).to("cuda")

    return make


def test_every_preset_in_a_mixed_pack_on_the_gpu_ends_as_it_would_alone_there(family, on_gpu):
    backbone = on_gpu(family)
    specs = [job(method, i) for i, method in enumerate(list_methods())]
    alone = [train_alone(backbone, spec) for spec in specs]
    packed = run_pack(backbone, specs)
    for member, expected in zip(packed, alone, strict=True):
        assert member.error is None, member.method.name
        assert_same_delta(member.result, expected)
        assert member.result.device.startswith("cuda:")
        assert member.result.peak_memory_bytes > member.result.job_memory_bytes > 0


def test_with_dropout_on_a_gpu_jobs_masks_come_from_its_own_generator(on_gpu):
    """Attention dropout too: on a GPU, sdpa's kernel would draw from the device's one generator. The mates'
    one-word rows never widen job 0's batches, so only their masks could move job 0."""
    backbone = on_gpu(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    first = job("lora", 0)
    one_word = datasets.Dataset.from_list([{"sentence": w, "label": i % 2} for i, w in enumerate(WORDS * 3)])
    mate = job("pfeiffer", 1) | {"train_data": one_word, "eval_data": one_word}
    bigger_mate = mate | {
        "config": TrainConfig(**{**mate["config"].to_dict(), "batch_size": 9, "head_dropout": 0.2})
    }
    beside_mate, _ = run_pack(backbone, [first, mate])
    beside_bigger, _ = run_pack(backbone, [first, bigger_mate])
    assert_same_delta(beside_bigger.result, beside_mate.result)


@pytest.mark.parametrize(("trained_on", "loaded_on"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_delta_trained_on_one_device_loads_and_predicts_the_same_on_the_other(
    make_backbone, tmp_path, trained_on, loaded_on
):
    spec = job("unipelt", 0)
    trained_backbone = make_backbone("bert").to(trained_on)
    result = train_alone(trained_backbone, spec)
    saved = save_delta(result.delta, trained_backbone, tmp_path / "delta")
    texts = [" ".join(WORDS[i : i + 4]) for i in range(8)]
    expected = predict(PeltModel(trained_backbone, {"delta": result.delta}).eval(), texts)

    other = make_backbone("bert").to(loaded_on)
    loaded = load_delta(saved.path, other, expected_sha256=saved.sha256).to(other.device)
    got = predict(PeltModel(other, {"delta": loaded}).eval(), texts)

    assert [row["label"] for row in got] == [row["label"] for row in expected]
    assert [row["score"] for row in got] == pytest.approx([row["score"] for row in expected], abs=1e-4)


def test_a_backbone_held_in_bf16_on_the_gpu_trains_fp32_deltas_under_autocast(on_gpu):
    backbone = on_gpu()
    backbone.model.to(torch.bfloat16)
    spec = job("lora", 0)
    spec["config"] = TrainConfig(**{**spec["config"].to_dict(), "bf16": "true", "backbone_dtype": "bfloat16"})
    result = train_alone(backbone, spec)

    assert result.bf16 and math.isfinite(result.metrics["loss"])
    assert all(p.dtype == torch.float32 for p in result.delta.parameters())


def test_a_gpu_worker_holds_its_backbone_on_its_gpu_and_records_where_the_job_trained(
    tiny_backbone, toy_data, tmp_path
):
    lease = RecordingLease(1)
    worker = PeltWorker(
        "w1",
        WorkerConfig(threads=None, heartbeat_seconds=0.05, lease_seconds=5, pack_size=4, device="cuda"),
        backbones=LocalBackbones(),
    )
    outcome = worker.run(job_spec(tiny_backbone, toy_data, steps=20), lease, LocalDeltaSink(tmp_path))

    assert outcome.status == "succeeded", outcome.error
    result = lease.calls[-1][1]
    assert result["device"].startswith("cuda:") and result["job_memory_bytes"] > 0
    assert worker.info()["device"] == "cuda"
    (warm,) = worker._backbones.values()
    assert warm.backbone.device.type == "cuda"


def test_a_prediction_replica_on_the_gpu_answers_mixed_methods_as_one_on_the_cpu_does(
    tiny_backbone, tmp_path
):
    """PELT_PREDICT_GPUS_PER_REPLICA: the replica (as Ray Serve builds it, without Serve) holds the backbone
    and every delta it loads on the GPU, and answers a batch of mixed methods' rows as a CPU replica does."""
    from pelt_core.backbones import Backbone
    from pelt_core.model import JobDelta
    from pelt_core.serving import DeltaKey
    from tests.core.conftest import trained_like
    from workers.serving import PredictReplica, ReplicaConfig

    source, content_hash = tiny_backbone
    backbone = Backbone.load(source)
    folders, requests = {}, []
    for seed, method in enumerate(["lora", "pfeiffer", "prefix", "bitfit", "unipelt"]):
        delta = trained_like(JobDelta(get_method(method), backbone, num_labels=2), seed)
        delta.text_fields = ("sentence",)
        saved = save_delta(delta, backbone, tmp_path / method)
        key = DeltaKey(method, 1, saved.sha256)
        folders[key] = saved.path
        requests.append((key, [" ".join(WORDS[seed : seed + 3 + seed]), "good film"]))

    def replica(device: str) -> PredictReplica:
        config = ReplicaConfig("tiny", source, content_hash, batch_rows=4, device=device)
        return PredictReplica(config, lambda key, scratch: folders[key])

    on_gpu, on_cpu = replica("cuda"), replica("cpu")
    got, expected = on_gpu._answer(requests), on_cpu._answer(requests)

    assert on_gpu.backbone.device.type == "cuda"
    assert all(next(on_gpu.cache.get(key).parameters()).is_cuda for key, _ in requests)
    for answer, reference in zip(got, expected, strict=True):
        assert [row["label"] for row in answer["rows"]] == [row["label"] for row in reference["rows"]]
        assert [row["score"] for row in answer["rows"]] == pytest.approx(
            [row["score"] for row in reference["rows"]], abs=1e-4
        )


def test_a_fusion_on_the_gpu_trains_in_a_mixed_pack_as_alone_and_under_bf16_autocast(on_gpu):
    """CPU counterpart: tests/core/test_fusion.py (the pack and the frozen sources)."""
    from tests.core.test_fusion import CONFIG, rows, sha, source_delta, two_source_fusion

    backbone = on_gpu()
    sources = {sha(1): source_delta(backbone, 1), sha(2): source_delta(backbone, 2)}
    fusion = {
        "method": two_source_fusion(own_adapter=True),
        "train_data": rows(24, 0),
        "eval_data": rows(8, 1),
        "config": TrainConfig(**CONFIG),
        "sources": sources,
    }
    alone = train_alone(backbone, fusion)
    packed, _ = run_pack(backbone, [fusion, job("lora", 1)])
    assert packed.error is None
    assert_same_delta(packed.result, alone, learning_rate=CONFIG["learning_rate"])
    assert packed.result.device.startswith("cuda:")

    autocast = fusion | {"config": TrainConfig(**{**CONFIG, "bf16": "true"})}
    result = train_alone(backbone, autocast)
    assert result.bf16 and math.isfinite(result.metrics["loss"])
    assert sum(result.fusion_weights.values()) == pytest.approx(1.0, abs=1e-3)
