"""Packs: jobs of mixed methods train through shared backbone passes, and each ends as it would alone."""

from __future__ import annotations

import random

import datasets
import pytest
import torch

from pelt_core import TrainConfig, get_method
from pelt_core.data import TaskFields
from pelt_core.methods import list_methods
from pelt_core.pack import Pack, length_groups
from pelt_core.testing import VOCAB
from pelt_core.train import TrainingCancelled, TrainingError, train

WORDS = VOCAB[-14:]  # the tiny vocabulary's real words ("good", "bad", ... "boring")


def sentences(n: int, seed: int, classes: int = 2) -> datasets.Dataset:
    """n rows of 1 to 12 words (so batches differ in length), labelled by the first word's index."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 12))]
        records.append({"sentence": " ".join(words), "label": WORDS.index(words[0]) % classes})
    return datasets.Dataset.from_list(records)


def job(method: str, index: int) -> dict:
    """The index-th job of a mixed sweep: its own method, seed, batch size, data size, task and schedule."""
    classes = 2 + index % 2
    return {
        "method": get_method(method),
        "train_data": sentences(20 + 4 * index, seed=index, classes=classes),
        "eval_data": sentences(12, seed=100 + index, classes=classes),
        "config": TrainConfig(
            epochs=2,
            batch_size=4 + index % 3,
            eval_batch_size=5,
            seed=index,
            bf16="false",
            head_dropout=0.0,
            learning_rate=3e-3,
        ),
    }


def train_alone(backbone, spec: dict):
    return train(
        backbone,
        spec["method"],
        spec["train_data"],
        spec["eval_data"],
        spec["config"],
        sources=spec.get("sources"),
    )


def run_pack(backbone, specs: list[dict], join_at: dict[int, int] | None = None):
    """Train the specs in one pack; spec i joins before step join_at[i] (default 0). Returns the members."""
    join_at = join_at or {}
    pack, members, steps = Pack(backbone), {}, 0
    while len(members) < len(specs) or any(not m.done for m in members.values()):
        for i, spec in enumerate(specs):
            if i not in members and join_at.get(i, 0) <= steps:
                members[i] = pack.join(**spec)
        pack.step()
        steps += 1
    return [members[i] for i in range(len(specs))]


def assert_same_delta(packed, alone, learning_rate: float = 3e-3) -> None:
    """Same steps, same metrics, and every tensor within a tenth of one optimizer step of the method's
    fastest module (`lr_multiplier`: UniPELT's prefix steps at 5x the job's rate): fp32 rounding differs
    with the batch's shape and the thread count, and AdamW turns it into steps of up to the learning rate
    where gradients are near 0 (measured: at most 0.035 of a step on these tiny models, on 1 and 2 threads
    of an AVX2-only EPYC; rows sent through another job's modules move tensors by tens of steps)."""
    assert packed.steps == alone.steps
    packed_state, alone_state = packed.delta.state_dict(), alone.delta.state_dict()
    assert packed_state.keys() == alone_state.keys()
    fastest = max([1.0, *(module.lr_multiplier for module in alone.delta.method.modules.values())])
    step = learning_rate * fastest
    for name, tensor in alone_state.items():
        torch.testing.assert_close(packed_state[name], tensor, rtol=1e-3, atol=step / 10, msg=name)
    assert packed.metrics.keys() == alone.metrics.keys()
    for name, value in alone.metrics.items():
        assert packed.metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name


def test_every_preset_in_a_mixed_pack_ends_as_it_would_alone(family, make_backbone):
    backbone = make_backbone(family)
    specs = [job(method, i) for i, method in enumerate(list_methods())]
    assert len(specs) >= 8
    alone = [train_alone(backbone, spec) for spec in specs]
    packed = run_pack(backbone, specs)
    for member, expected in zip(packed, alone, strict=True):
        assert member.error is None, member.method.name
        assert_same_delta(member.result, expected)
        assert len(member.result.history) == 2


def test_jobs_join_a_running_pack_and_leave_it_without_changing_their_mates(make_backbone):
    backbone = make_backbone("bert")
    specs = [job(m, i) for i, m in enumerate(["lora", "prefix", "unipelt", "bitfit"])]
    alone = [train_alone(backbone, spec) for spec in specs]
    packed = run_pack(backbone, specs, join_at={1: 3, 2: 7, 3: 11})
    for member, expected in zip(packed, alone, strict=True):
        assert_same_delta(member.result, expected)


def test_a_failing_or_cancelled_job_leaves_and_its_mates_finish_as_alone(make_backbone, monkeypatch):
    import pelt_core.pack

    backbone = make_backbone("bert")
    healthy = job("lora", 0)
    diverging = job("pfeiffer", 1)  # the pack's one regression job: its loss turns NaN at its third step
    real_loss, regression_losses = pelt_core.pack.loss_fn, []

    def loss_fn(problem_type, logits, labels):
        loss = real_loss(problem_type, logits, labels)
        if problem_type == "regression" and torch.is_grad_enabled():
            regression_losses.append(loss)
            return loss * float("nan") if len(regression_losses) >= 3 else loss
        return loss

    monkeypatch.setattr(pelt_core.pack, "loss_fn", loss_fn)
    scores = [
        {"sentence": row["sentence"], "score": float(i)} for i, row in enumerate(diverging["train_data"])
    ]
    diverging["train_data"] = datasets.Dataset.from_list(scores)
    diverging["eval_data"] = None
    diverging["task"] = TaskFields(("sentence",), "score", "regression", [])
    cancelled_steps = []
    cancelled = job("prefix", 2) | {"should_stop": lambda: len(cancelled_steps) >= 3}
    cancelled["progress"] = cancelled_steps.append
    expected = train_alone(backbone, healthy)
    member, bad, stopped = run_pack(backbone, [healthy, diverging, cancelled])
    assert isinstance(bad.error, TrainingError) and "loss became" in str(bad.error)
    assert isinstance(stopped.error, TrainingCancelled) and "step 3 of" in str(stopped.error)
    assert member.error is None
    assert_same_delta(member.result, expected)


def test_an_error_in_one_jobs_forward_fails_that_job_only(make_backbone, monkeypatch):
    backbone = make_backbone("bert")
    specs = [job("lora", 0), job("bitfit", 1)]
    expected = train_alone(backbone, specs[0])
    pack = Pack(backbone)
    good, broken = pack.join(**specs[0]), pack.join(**specs[1])

    def broken_head(hidden, mask):
        raise RuntimeError("this head is broken")

    monkeypatch.setattr(broken.delta.head, "forward", broken_head)
    while not good.done:
        pack.step()
    assert isinstance(broken.error, RuntimeError) and "this head is broken" in str(broken.error)
    assert_same_delta(good.result, expected)
    assert len(pack) == 0


def test_evaluation_of_jobs_that_reach_it_together_shares_backbone_passes(make_backbone):
    backbone = make_backbone("bert")
    forwards = []
    backbone.model.register_forward_hook(lambda module, args, output: forwards.append(args))
    same = job("lora", 0)
    train_alone(backbone, same)
    alone_forwards = len(forwards)
    forwards.clear()
    run_pack(backbone, [same | {"method": get_method(m)} for m in ("lora", "pfeiffer", "prefix", "bitfit")])
    assert len(forwards) == alone_forwards  # four jobs, same rows: every training and dev pass shared


def test_with_dropout_on_a_jobs_masks_come_from_its_own_generator(make_backbone):
    """With the backbone's dropout on, job 0's result does not depend on how many rows its pack-mate has or
    how much dropout it draws (its mate's one-word rows never widen job 0's batches)."""
    backbone = make_backbone("bert", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    first = job("lora", 0)
    first["config"] = TrainConfig(**{**first["config"].to_dict(), "head_dropout": 0.1})
    one_word = datasets.Dataset.from_list([{"sentence": w, "label": i % 2} for i, w in enumerate(WORDS * 3)])
    small_mate = job("pfeiffer", 1) | {"train_data": one_word, "eval_data": one_word}
    big_mate = small_mate | {
        "method": get_method("pfeiffer", {"dropout": 0.3}),
        "config": TrainConfig(**{**small_mate["config"].to_dict(), "batch_size": 9, "head_dropout": 0.2}),
    }
    beside_small, _ = run_pack(backbone, [first, small_mate])
    beside_big, _ = run_pack(backbone, [first, big_mate])
    assert_same_delta(beside_big.result, beside_small.result)
    without_dropout = run_pack(make_backbone("bert"), [first, small_mate])[0]
    moved = (
        without_dropout.result.delta.head.classifier.weight - beside_small.result.delta.head.classifier.weight
    )
    assert float(moved.detach().abs().max()) > 1e-3  # the masks did act


def test_rows_share_a_forward_only_while_padding_stays_small_and_the_forward_within_its_tokens():
    def batch(rows: int, width: int) -> dict:
        return {"input_ids": torch.zeros(rows, width, dtype=torch.long)}

    assert length_groups([batch(8, 10), batch(8, 11), batch(8, 12)]) == [[2, 1, 0]]
    assert length_groups([batch(8, 10), batch(8, 40)]) == [[1], [0]]
    assert length_groups([batch(4, 30), batch(16, 10), batch(4, 28), batch(16, 9)]) == [[0, 2], [1, 3]]
    assert length_groups([batch(8, 10)] * 3, max_tokens=160) == [[0, 1], [2]]  # at most 160 padded tokens
    assert length_groups([batch(64, 10)], max_tokens=160) == [[0]]  # a larger batch still gets its forward


def test_a_pack_refuses_a_job_in_another_precision_and_stays_as_it_was(make_backbone):
    backbone = make_backbone("bert")
    pack = Pack(backbone)
    pack.join(**job("lora", 0))
    other = job("lora", 1)
    other["config"] = TrainConfig(**{**other["config"].to_dict(), "bf16": "true"})
    with pytest.raises(ValueError, match="one precision"):
        pack.join(**other)
    assert len(pack) == 1 and len(pack.model.deltas) == 1


def test_a_job_whose_own_callbacks_raise_fails_alone(make_backbone):
    backbone = make_backbone("bert")
    healthy = job("lora", 0)
    expected = train_alone(backbone, healthy)

    def broken_progress(progress):
        raise RuntimeError("progress sink is down")

    def broken_epoch_end(record):
        raise RuntimeError("epoch hook is down")

    by_progress = job("bitfit", 1) | {"progress": broken_progress}
    by_epoch_end = job("prefix", 2) | {"on_epoch_end": broken_epoch_end}
    member, first, second = run_pack(backbone, [healthy, by_progress, by_epoch_end])
    assert "progress sink is down" in str(first.error) and "epoch hook is down" in str(second.error)
    assert_same_delta(member.result, expected)


def test_the_shared_backbone_rests_in_eval_mode_after_training(make_backbone):
    backbone = make_backbone("bert")
    spec = job("lora", 0) | {"eval_data": None}
    train_alone(backbone, spec)
    assert not backbone.model.training


def test_a_jobs_training_seconds_span_its_optimizer_step_as_well_as_forward_and_backward(
    make_backbone, monkeypatch
):
    """The clock a benchmark compares with a peer's whole loop: a step's clipping and AdamW update count
    (a fake clock that only the optimizer step moves, by 100 s each time)."""
    import pelt_core.pack

    now = [0.0]
    monkeypatch.setattr(pelt_core.pack.time, "perf_counter", lambda: now[0])
    pack = Pack(make_backbone())
    member = pack.join(**(job("lora", 0) | {"eval_data": None}))
    real_step = member.optimizer.step

    def slow_step(*args, **kwargs):
        now[0] += 100.0
        return real_step(*args, **kwargs)

    monkeypatch.setattr(member.optimizer, "step", slow_step)
    while not member.done:
        pack.step()
    assert member.error is None and member.result.steps > 0
    assert member.result.train_seconds == pytest.approx(100.0 * member.result.steps)
