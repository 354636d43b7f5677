"""Devices: choosing one, refusing one that is not here, out-of-memory steps, and each job's own memory.

These run on any machine; tests/gpu/ runs the same paths on a GPU when one is visible."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from click.testing import CliRunner

from pelt_core.backbones import Backbone
from pelt_core.cli import train_command
from pelt_core.devices import DeviceError, DeviceOutOfMemory, is_out_of_memory, resolve_device
from pelt_core.pack import MIN_FORWARD_TOKENS, Pack
from pelt_core.runtime import _cheap_dropout_applies
from pelt_core.train import TrainingError
from tests.core.test_pack import WORDS, assert_same_delta, job, run_pack, train_alone
from tests.workers.conftest import save_tiny_bert

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


def test_auto_is_the_gpu_when_torch_sees_one_and_the_cpu_otherwise():
    expected = "cuda" if torch.cuda.is_available() else "cpu"

    assert resolve_device("auto").type == expected
    assert resolve_device(None).type == expected
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "mps", "cpu:0:1"])
def test_a_name_that_is_not_a_device_is_refused_naming_the_choices(name):
    with pytest.raises(DeviceError, match="device must be auto, cpu, cuda or cuda:N"):
        resolve_device(name)


@NO_GPU
@pytest.mark.parametrize("name", ["cuda", "gpu", "cuda:1"])
def test_a_gpu_asked_for_where_none_is_visible_is_refused_saying_so(name):
    with pytest.raises(DeviceError, match="no CUDA GPU is visible"):
        resolve_device(name)


@NO_GPU
def test_a_backbone_asked_onto_a_missing_gpu_is_refused_before_it_loads(tmp_path, monkeypatch):
    save_tiny_bert(tmp_path)
    monkeypatch.setattr("pelt_core.backbones.read_backbone_config", lambda *a: pytest.fail("it loaded"))

    with pytest.raises(DeviceError, match="no CUDA GPU is visible"):
        Backbone.load(str(tmp_path), device="cuda")


def test_a_backbone_loads_onto_the_device_it_is_given_and_keeps_its_checkpoints_hash(tmp_path):
    save_tiny_bert(tmp_path)
    default = Backbone.load(str(tmp_path))
    on_auto = Backbone.load(str(tmp_path), device="auto", dtype="bfloat16")

    assert default.device == torch.device("cpu")
    assert on_auto.device.type == resolve_device("auto").type
    assert on_auto.dtype == torch.bfloat16
    assert on_auto.content_hash == default.content_hash  # the checkpoint's, whatever the dtype or device


def write_rows(path, n: int) -> str:
    words = ["good", "bad", "great", "awful", "fun", "boring"]
    with open(path, "w") as handle:
        for i in range(n):
            handle.write(
                json.dumps({"sentence": f"{words[i % 6]} {words[(i * 7) % 6]}", "label": i % 2}) + "\n"
            )
    return str(path)


@NO_GPU
def test_pelt_train_on_a_missing_gpu_fails_with_the_reason_and_writes_nothing(tmp_path):
    save_tiny_bert(tmp_path / "model")
    out = tmp_path / "out"
    args = ["--backbone", str(tmp_path / "model"), "--train", write_rows(tmp_path / "t.jsonl", 8)]
    result = CliRunner().invoke(
        train_command, [*args, "--method", "lora", "--out", str(out), "--device", "cuda"]
    )

    assert result.exit_code == 1
    assert "no CUDA GPU is visible" in result.output
    assert not out.exists()


def test_pelt_train_reports_its_device_precision_and_memory(tmp_path):
    save_tiny_bert(tmp_path / "model")
    args = ["--backbone", str(tmp_path / "model"), "--train", write_rows(tmp_path / "t.jsonl", 8)]
    settings = ["--set", "max_steps=2", "--set", "batch_size=4", "--set", "bf16=false", "--quiet"]
    result = CliRunner().invoke(
        train_command,
        [*args, "--method", "lora", "--out", str(tmp_path / "out"), "--device", "cpu", *settings],
    )

    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert (summary["device"], summary["bf16"]) == ("cpu", False)
    assert summary["peak_memory_bytes"] > 0


def test_a_result_counts_the_jobs_own_weights_gradients_and_optimizer_state(make_backbone):
    backbone = make_backbone("bert")
    result = train_alone(backbone, job("lora", 0))
    trainable = sum(p.numel() for p in result.delta.parameters() if p.requires_grad)
    backbone_bytes = sum(p.numel() * p.element_size() for p in backbone.model.parameters())

    assert result.device == "cpu"
    assert result.job_memory_bytes >= 4 * 4 * trainable  # fp32 weight, its gradient, AdamW's two moments
    assert result.job_memory_bytes < backbone_bytes


def out_of_memory() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_shared_step_out_of_memory_is_redone_one_job_at_a_time_then_forwards_hold_half_the_tokens(
    make_backbone, monkeypatch
):
    backbone = make_backbone("bert")
    specs = [job("lora", 0), job("pfeiffer", 1), job("prefix", 2)]
    alone = [train_alone(backbone, spec) for spec in specs]
    forward_losses, failed = Pack._forward_losses, []

    def fails_once_together(pack, batches):
        if len(batches) > 1 and not failed:
            failed.append(len(batches))
            raise out_of_memory()
        return forward_losses(pack, batches)

    monkeypatch.setattr(Pack, "_forward_losses", fails_once_together)
    pack_of = {}
    monkeypatch.setattr(Pack, "__init__", _recording_init(Pack.__init__, pack_of))
    members = run_pack(backbone, specs)

    assert failed and all(member.error is None for member in members)
    for member, single in zip(members, alone, strict=True):
        assert_same_delta(member.result, single)  # the failed step was redone, nothing lost or doubled
    pack = pack_of["pack"]
    assert pack.out_of_memory == 1
    assert pack.forward_tokens == max(MIN_FORWARD_TOKENS, 1024 // 2)


def test_a_step_redone_after_running_out_of_memory_draws_the_same_dropout_masks(make_backbone, monkeypatch):
    backbone = make_backbone("bert", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    one_word = datasets.Dataset.from_list([{"sentence": w, "label": i % 2} for i, w in enumerate(WORDS * 3)])
    specs = [job("lora", 0), job("pfeiffer", 1) | {"train_data": one_word, "eval_data": one_word}]
    undisturbed = run_pack(backbone, specs)[0]
    forward_losses, failed = Pack._forward_losses, []

    def fails_once_together(pack, batches):
        if len(batches) > 1 and not failed:
            failed.append(True)
            forward_losses(pack, batches)  # the masks are drawn, then the step runs out of memory
            raise out_of_memory()
        return forward_losses(pack, batches)

    monkeypatch.setattr(Pack, "_forward_losses", fails_once_together)
    redone = run_pack(backbone, specs)[0]

    assert failed
    assert_same_delta(redone.result, undisturbed.result)


def _recording_init(init, record: dict):
    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        record["pack"] = self

    return recording


def test_a_job_whose_own_step_runs_out_of_memory_leaves_as_retryable_and_its_mates_finish(
    make_backbone, monkeypatch
):
    backbone = make_backbone("bert")
    specs = [job("lora", 0), job("pfeiffer", 1)]
    alone = train_alone(backbone, specs[0])
    forward_losses = Pack._forward_losses
    greedy: list = []

    def the_greedy_job_never_fits(pack, batches):
        if any(member is greedy[0] for member, _ in batches):
            raise out_of_memory()
        return forward_losses(pack, batches)

    pack = Pack(backbone)
    fine = pack.join(**specs[0])
    greedy.append(pack.join(**specs[1]))
    monkeypatch.setattr(Pack, "_forward_losses", the_greedy_job_never_fits)
    while not (fine.done and greedy[0].done):
        pack.step()

    assert isinstance(greedy[0].error, DeviceOutOfMemory)
    assert not isinstance(greedy[0].error, TrainingError)  # not permanent: the service retries it
    assert "out of memory on cpu in a training step of its own (pack of 2 job(s)" in str(greedy[0].error)
    assert "a smaller batch_size or max_length, bf16, or a smaller pack would fit" in str(greedy[0].error)
    assert_same_delta(fine.result, alone)


def test_out_of_memory_errors_are_told_apart_from_other_failures():
    with pytest.raises(RuntimeError) as cpu_allocator:  # what torch's CPU allocator really raises
        torch.empty(1 << 60, dtype=torch.uint8)

    assert is_out_of_memory(cpu_allocator.value)
    assert is_out_of_memory(out_of_memory())
    assert is_out_of_memory(DeviceOutOfMemory("x"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_attention_dropout_draws_from_each_jobs_generator_on_every_device_and_stays_fused_otherwise():
    on_gpu = torch.empty(1, device="meta")  # any device but the CPU
    on_cpu = torch.empty(1)
    generators = [(2, torch.Generator())]

    assert _cheap_dropout_applies(on_gpu, {"dropout": 0.1}, generators)  # a pack's jobs: their own masks
    assert not _cheap_dropout_applies(on_gpu, {"dropout": 0.1}, None)  # no job generators: sdpa's own kernel
    assert _cheap_dropout_applies(on_cpu, {"dropout": 0.1}, None)
    assert not _cheap_dropout_applies(on_gpu, {"dropout": 0.0}, generators)
