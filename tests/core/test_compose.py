"""Composition of deltas: task arithmetic, TIES and DARE by hand, SVD truncation, soups, multi-task, folding."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pelt_core import get_method
from pelt_core.backbones import state_dict_hash
from pelt_core.compose import (
    CompositionError,
    average,
    dare_sparsify,
    fold_lora,
    merge,
    merge_lora_svd,
    multi_task,
    save_composed,
    task_vector,
    ties_combine,
    trim_to_density,
)
from pelt_core.delta import load_delta, save_delta
from pelt_core.model import JobDelta, PeltModel, predict

from .conftest import TINY, encode, trained_like

# Three task vectors of six numbers (the TIES worked example below).
T1 = [0.5, -1.0, 0.2, 0.0, 2.0, -0.3]
T2 = [-0.4, 0.8, 0.1, 1.0, -1.5, -0.6]
T3 = [0.3, -0.9, -0.7, 0.2, 1.0, 0.5]


def make(backbone, method, seed, num_labels=2, **kwargs) -> JobDelta:
    spec = get_method(*method) if isinstance(method, tuple) else get_method(method)
    return trained_like(JobDelta(spec, backbone, num_labels=num_labels, **kwargs), seed)


def lora_sites(delta: JobDelta) -> dict:
    return {key: ops.parallel_x[0].delta_weight().detach() for key, ops in delta.linear_ops.items()}


def snapshot(deltas) -> list[dict]:
    return [{k: v.clone() for k, v in d.state_dict().items()} for d in deltas]


def unchanged(deltas, before) -> bool:
    return all(
        d.state_dict().keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in d.state_dict().items())
        for d, b in zip(deltas, before, strict=True)
    )


# --------------------------------------------------------------------------------------------------
# Linear merge (task arithmetic) of LoRA: exact in ΔW
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_linear_merge_of_loras_is_the_weighted_sum_of_their_delta_w(
    family, make_backbone, tmp_path, sentences
):
    backbone = make_backbone(family)
    deltas = [make(backbone, ("lora", {"r": 2}), seed) for seed in (1, 2)]
    before = snapshot(deltas)
    weights = [0.7, -0.4]  # task arithmetic allows negation
    merged = merge(deltas, weights)

    assert unchanged(deltas, before)
    assert merged.method.modules["q"].size == 4  # ranks concatenate: 2 + 2
    assert merged.method.modules["q"].effective_scale == deltas[0].method.modules["q"].effective_scale
    first, second = lora_sites(deltas[0]), lora_sites(deltas[1])
    for key, delta_w in lora_sites(merged).items():
        torch.testing.assert_close(delta_w, 0.7 * first[key] - 0.4 * second[key], atol=1e-6, rtol=1e-5)
    for name, tensor in merged.head.state_dict().items():
        expected = 0.7 * deltas[0].head.state_dict()[name] - 0.4 * deltas[1].head.state_dict()[name]
        torch.testing.assert_close(tensor, expected)

    # the merged model's hidden states = the backbone with W + Σ w_i ΔW_i written into its weights
    input_ids, mask = encode(backbone, sentences)
    by_hand = TINY[family](str(tmp_path), seed=0).model  # the same frozen weights, as a plain model
    with torch.no_grad():
        for (layer, concrete), delta_w in first.items():
            by_hand.get_submodule(backbone.linear_path(layer, concrete)).weight += (
                0.7 * delta_w - 0.4 * second[(layer, concrete)]
            )
    expected = by_hand(input_ids=input_ids, attention_mask=mask).last_hidden_state
    ours = PeltModel(backbone, merged).eval()(input_ids, mask, return_hidden=True)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_linear_merge_of_adapters_is_the_weighted_parameter_sum(make_backbone):
    backbone = make_backbone("bert")
    deltas = [make(backbone, ("houlsby", {"size": 4}), seed) for seed in (1, 2, 3)]
    merged = merge(deltas, [0.5, 0.25, 0.25], scale=2.0)
    for name, tensor in merged.state_dict().items():
        expected = 2.0 * sum(w * d.state_dict()[name] for w, d in zip([0.5, 0.25, 0.25], deltas, strict=True))
        torch.testing.assert_close(tensor, expected)


# --------------------------------------------------------------------------------------------------
# TIES, by hand
# --------------------------------------------------------------------------------------------------
def test_ties_on_three_task_vectors_worked_by_hand():
    # density 0.5 keeps the 3 largest magnitudes of each vector:
    #   T1 -> [0.5, -1.0, 0,    0,   2.0, 0]
    #   T2 -> [0,    0.8, 0,    1.0, -1.5, 0]
    #   T3 -> [0,   -0.9, -0.7, 0,   1.0, 0]
    # elected sign of the sums [0.5, -1.1, -0.7, 1.0, 1.5, 0] -> [+, -, -, +, +, 0]
    # disjoint means: [0.5, (-1.0 - 0.9)/2, -0.7, 1.0, (2.0 + 1.0)/2, 0]
    tensors = [torch.tensor(t, dtype=torch.float64) for t in (T1, T2, T3)]
    assert trim_to_density(tensors[1], 0.5).tolist() == [0.0, 0.8, 0.0, 1.0, -1.5, 0.0]
    expected = [0.5, -0.95, -0.7, 1.0, 1.5, 0.0]
    torch.testing.assert_close(ties_combine(tensors, 0.5), torch.tensor(expected, dtype=torch.float64))

    # weights (1, 3, 1): weighted sums [0.5, 0.5, -0.7, 3.0, -1.5, 0] -> signs [+, +, -, +, -, 0];
    # agreeing entries: [T1: 0.5], [T2: 0.8], [T3: -0.7], [T2: 1.0], [T2: -1.5]; weighted means keep them
    weighted = ties_combine(tensors, 0.5, [1.0, 3.0, 1.0])
    torch.testing.assert_close(weighted, torch.tensor([0.5, 0.8, -0.7, 1.0, -1.5, 0.0], dtype=torch.float64))


def test_ties_merge_of_deltas_follows_the_hand_example_and_scales_by_lambda(make_backbone):
    backbone = make_backbone("bert")
    deltas = [make(backbone, "bitfit", seed, num_labels=6) for seed in (1, 2, 3)]
    with torch.no_grad():
        for delta, values in zip(deltas, (T1, T2, T3), strict=True):
            delta.head.classifier.bias.copy_(torch.tensor(values))  # the 6-number task vectors
    merged = merge(deltas, how="ties", density=0.5)
    torch.testing.assert_close(merged.head.classifier.bias, torch.tensor([0.5, -0.95, -0.7, 1.0, 1.5, 0.0]))
    assert merged.provenance["op"] == "merge(ties)" and merged.provenance["density"] == 0.5
    doubled = merge(deltas, how="ties", density=0.5, scale=2.0)
    torch.testing.assert_close(doubled.head.classifier.bias, torch.tensor([1.0, -1.9, -1.4, 2.0, 3.0, 0.0]))
    # every tensor is trimmed on its own (per tensor, as PEFT and mergekit do)
    weight = merged.head.classifier.weight
    expected = ties_combine([d.head.classifier.weight.detach().double() for d in deltas], 0.5)
    torch.testing.assert_close(weight, expected.float())


# --------------------------------------------------------------------------------------------------
# DARE
# --------------------------------------------------------------------------------------------------
def test_dare_drops_the_seeded_mask_and_rescales_the_survivors():
    tensor = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -8.0])
    p = 0.5
    dropped_by_seed = torch.rand(8, generator=torch.Generator().manual_seed(7)) < p  # the documented draw
    result = dare_sparsify(tensor, p, torch.Generator().manual_seed(7))
    assert 0 < int(dropped_by_seed.sum()) < 8
    assert torch.equal(result, torch.where(dropped_by_seed, torch.zeros(8), tensor * 2.0))  # 1/(1-p) = 2
    other = dare_sparsify(tensor, p, torch.Generator().manual_seed(8))
    assert not torch.equal(other == 0, result == 0)
    assert torch.equal(dare_sparsify(tensor, 0.0, torch.Generator().manual_seed(7)), tensor)

    # unbiased: E[result] = input (per entry, std of one draw = |x|·sqrt(p/(1-p)) = |x|)
    draws = 4000
    mean = sum(dare_sparsify(tensor, p, torch.Generator().manual_seed(s)) for s in range(draws)) / draws
    assert ((mean - tensor).abs() <= 5 * tensor.abs() / math.sqrt(draws)).all()


def test_dare_merge_of_deltas_uses_the_documented_draw_order_and_is_unbiased(make_backbone):
    backbone = make_backbone("bert")
    deltas = [make(backbone, "bitfit", seed) for seed in (1, 2)]
    merged = merge(deltas[:1], [1.0], how="dare", density=0.5, seed=3)
    generator = torch.Generator().manual_seed(3)
    merged_vector = task_vector(merged)
    for key, tensor in task_vector(deltas[0]).items():  # sorted keys, one draw per tensor
        dropped = torch.rand(tensor.shape, generator=generator) < 0.5
        torch.testing.assert_close(
            merged_vector[key], torch.where(dropped, 0.0, 2.0 * tensor).to(torch.float32), check_dtype=False
        )
    assert merged.provenance["seed"] == 3 and merged.provenance["drop_rate"] == 0.5

    # over many seeds, DARE + linear combination averages to the plain linear merge
    linear = torch.cat([t.flatten() for t in task_vector(merge(deltas, [0.6, 0.4])).values()])
    seeds = 150
    total = sum(
        torch.cat(
            [
                t.flatten()
                for t in task_vector(merge(deltas, [0.6, 0.4], how="dare", density=0.5, seed=s)).values()
            ]
        )
        for s in range(seeds)
    )
    relative = (total / seeds - linear).norm() / linear.norm()
    assert relative < 3 / math.sqrt(seeds)  # the Monte-Carlo error is about sqrt(p/(1-p)/seeds)·(spread)
    # DARE + TIES runs too and is recorded as such
    assert merge(deltas, how="dare", density=0.5, combine="ties").provenance["op"] == "merge(dare+ties)"


def test_ties_and_dare_on_lora_work_on_delta_w_and_refactor_to_the_asked_rank(make_backbone):
    backbone = make_backbone("bert")
    deltas = [make(backbone, ("lora", {"r": 2}), seed) for seed in (1, 2)]
    kept = merge(deltas, how="ties", density=0.5)
    assert kept.method.modules["q"].size == 2  # default: the inputs' rank
    full = merge(deltas, how="ties", density=0.5, lora_rank=32)  # 32 = min(d_in, d_out): exact
    vectors = [task_vector(d) for d in deltas]
    for key, delta_w in task_vector(full).items():
        if key.endswith(".delta_weight"):
            expected = ties_combine([v[key] for v in vectors], 0.5)
            torch.testing.assert_close(delta_w, expected, atol=1e-6, rtol=1e-5)
    assert merge(deltas, how="dare", density=0.9, lora_rank=3).method.modules["v"].size == 3


# --------------------------------------------------------------------------------------------------
# SVD merge to a target rank
# --------------------------------------------------------------------------------------------------
def test_svd_merge_is_exact_at_full_rank_and_the_best_approximation_below(make_backbone):
    backbone = make_backbone("llama")
    deltas = [make(backbone, ("lora", {"r": 2}), 1), make(backbone, ("lora", {"r": 3, "alpha": 6.0}), 2)]
    weights = [0.6, 0.4]
    target = {
        key: weights[0] * a + weights[1] * lora_sites(deltas[1])[key]
        for key, a in lora_sites(deltas[0]).items()
    }
    with pytest.raises(CompositionError, match="merge_lora_svd"):
        merge(deltas, weights)  # different ranks: merge() refuses and points to merge_lora_svd

    for rank in (5, 8):  # the sum has rank <= 2 + 3; 8 pads with zero directions
        merged = merge_lora_svd(deltas, weights, rank)
        assert merged.method.modules["q"].size == rank
        assert merged.method.modules["q"].effective_scale == deltas[0].method.modules["q"].effective_scale
        for key, delta_w in lora_sites(merged).items():
            torch.testing.assert_close(delta_w, target[key], atol=1e-6, rtol=1e-5)

    merged = merge_lora_svd(deltas, weights, 2)
    for key, delta_w in lora_sites(merged).items():
        u, s, vh = torch.linalg.svd(target[key].double())
        tail = s[2:].pow(2).sum().sqrt()
        error = torch.linalg.matrix_norm(delta_w.double() - target[key].double())
        assert torch.isclose(error, tail, rtol=1e-4, atol=1e-7)  # Eckart–Young: the tail singular values
        best = (u[:, :2] * s[:2]) @ vh[:2]
        torch.testing.assert_close(delta_w.double(), best, atol=1e-6, rtol=1e-4)
    assert merged.provenance["input_ranks"] == [{"q": 2, "v": 2}, {"q": 3, "v": 3}]


# --------------------------------------------------------------------------------------------------
# Average of seeds ("model soup")
# --------------------------------------------------------------------------------------------------
def test_average_of_seeds_is_the_parameter_mean_and_the_delta_w_mean_for_lora(make_backbone):
    backbone = make_backbone("bert")
    seeds = [make(backbone, ("houlsby", {"size": 4}), seed) for seed in (1, 2, 3)]
    soup = average(seeds)
    for name, tensor in soup.state_dict().items():
        torch.testing.assert_close(tensor, sum(d.state_dict()[name] for d in seeds) / 3)
    assert soup.provenance["op"] == "average" and soup.provenance["weights"] == pytest.approx([1 / 3] * 3)

    loras = [make(backbone, ("lora", {"r": 2}), seed) for seed in (1, 2, 3)]
    soup = average(loras)
    assert soup.method.modules["q"].size == 6
    sites = [lora_sites(d) for d in loras]
    for key, delta_w in lora_sites(soup).items():
        torch.testing.assert_close(delta_w, sum(s[key] for s in sites) / 3, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(soup.head.classifier.weight, sum(d.head.classifier.weight for d in loras) / 3)
    assert average(loras, lora_rank=2).method.modules["q"].size == 2


def test_average_of_prefix_deltas_leaves_the_inputs_reparameterisation_alone(make_backbone, sentences):
    backbone = make_backbone("bert")
    deltas = [make(backbone, ("prefix", {"size": 3, "reparam_hidden": 8}), seed) for seed in (1, 2)]
    before = snapshot(deltas)
    soup = average(deltas)
    assert unchanged(deltas, before) and all(d.prefix_encoders for d in deltas)
    assert not soup.prefix_encoders  # the result holds the prefixes themselves, as a saved delta does
    input_ids, mask = encode(backbone, sentences)
    assert torch.isfinite(PeltModel(backbone, soup).eval()(input_ids, mask)).all()


# --------------------------------------------------------------------------------------------------
# Multi-task serving
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_mixed_batch_gives_each_row_what_its_task_model_gives_alone(family, make_backbone):
    backbone = make_backbone(family)
    tasks = {
        "sentiment": make(backbone, ("lora", {"r": 2}), 1, label_names=["neg", "pos"]),
        "topic": make(backbone, ("houlsby", {"size": 4}), 2, num_labels=3),
        "nli": make(backbone, ("prefix", {"size": 3, "reparam_hidden": "none"}), 3, num_labels=3),
        "score": make(backbone, "bitfit", 4, num_labels=1, problem_type="regression"),
    }
    model = multi_task(backbone, tasks)
    items = [
        ("sentiment", "the movie was good"),
        ("topic", "a film"),
        ("nli", ("the film", "a movie")),
        ("score", "great fun"),
        ("sentiment", "bad film , not fun"),
        ("topic", "the very boring movie"),
        ("nli", ("good", "bad")),
        ("score", "awful"),
        ("sentiment", "great"),
    ]
    random.Random(0).shuffle(items)

    results = model.predict(items, batch_size=5)  # two forwards, each over mixed tasks
    for (task, text), result in zip(items, results, strict=True):
        alone = predict(PeltModel(backbone, tasks[task]).eval(), [text])[0]  # eval: predict restores the mode
        assert result.pop("task") == task
        assert result.keys() == alone.keys()
        for key, value in result.items():
            assert (
                value == pytest.approx(alone[key], abs=1e-5)
                if not isinstance(value, str)
                else value == alone[key]
            )

    texts = [text for _, text in items if isinstance(text, str)]
    names = [task for task, text in items if isinstance(text, str)]
    input_ids, mask = encode(backbone, texts)
    rows = model.forward_tasks(input_ids, mask, names)
    for row, task, ids, m in zip(rows, names, input_ids, mask, strict=True):
        alone = PeltModel(backbone, tasks[task]).eval()(ids[None], m[None])[0]
        torch.testing.assert_close(row, alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(KeyError, match="no task named"):
        model.forward_tasks(input_ids, mask, ["nope"] * len(texts))


# --------------------------------------------------------------------------------------------------
# Folding LoRA into dense weights
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_folded_lora_gives_the_logits_of_the_unfolded_one(family, make_backbone, sentences):
    backbone = make_backbone(family)
    before = {k: v.clone() for k, v in backbone.model.state_dict().items()}
    delta = make(backbone, ("lora", {"r": 2}), 1, num_labels=3)
    folded = fold_lora(backbone, delta)
    input_ids, mask = encode(backbone, sentences)
    expected = PeltModel(backbone, delta).eval()(input_ids, mask)
    torch.testing.assert_close(folded(input_ids, mask), expected, atol=1e-5, rtol=1e-5)
    assert not any(hook for m in folded.model.modules() for hook in m._forward_hooks.values())
    assert [r["label"] for r in folded.predict(sentences)] == [
        r["label"] for r in predict(PeltModel(backbone, delta).eval(), sentences)
    ]
    assert all(torch.equal(before[k], v) for k, v in backbone.model.state_dict().items())
    # a merged LoRA folds too
    merged = merge([delta, make(backbone, ("lora", {"r": 2}), 2, num_labels=3)])
    torch.testing.assert_close(
        fold_lora(backbone, merged)(input_ids, mask),
        PeltModel(backbone, merged).eval()(input_ids, mask),
        atol=1e-5,
        rtol=1e-5,
    )


def test_only_lora_folds(make_backbone):
    backbone = make_backbone("bert")
    with pytest.raises(CompositionError, match="fold_lora: adapters do not fold"):
        fold_lora(backbone, make(backbone, ("parallel_adapter", {"size": 4}), 1))
    with pytest.raises(CompositionError, match=r"fold_lora: .*norm deltas"):
        fold_lora(backbone, make(backbone, ("houlsby", {"size": 4}), 1))


# --------------------------------------------------------------------------------------------------
# Saving and provenance
# --------------------------------------------------------------------------------------------------
def test_a_composed_delta_saves_loads_to_identical_logits_and_records_its_provenance(
    make_backbone, tmp_path, sentences
):
    backbone = make_backbone("bert")
    inputs = []
    for seed in (1, 2):
        trained = make(backbone, ("lora", {"r": 2}), seed)
        saved = save_delta(trained, backbone, tmp_path / f"in{seed}")
        inputs.append(
            (state_dict_hash(trained), load_delta(saved.path, backbone, expected_sha256=saved.sha256))
        )
    composed = merge(
        {"sst2": inputs[0][1], "imdb": inputs[1][1]}, [0.5, 0.5], how="ties", density=0.3, lora_rank=4
    )
    input_ids, mask = encode(backbone, sentences)
    expected = PeltModel(backbone, composed).eval()(input_ids, mask)

    saved = save_composed(composed, backbone, tmp_path / "composed", extra={"task": "sentiment"})
    fresh = TINY["bert"](str(tmp_path), seed=0)
    loaded = load_delta(saved.path, fresh, expected_sha256=saved.sha256)
    assert torch.equal(PeltModel(fresh, loaded).eval()(input_ids, mask), expected)

    manifest = saved.manifest
    assert manifest["method"]["modules"]["q"]["size"] == 4 and manifest["extra"]["task"] == "sentiment"
    provenance = manifest["extra"]["composition"]
    assert provenance["op"] == "merge(ties)"
    assert (provenance["density"], provenance["weights"], provenance["lora_rank"]) == (0.3, [0.5, 0.5], 4)
    assert provenance["backbone_hash"] == backbone.content_hash
    assert inputs[0][0] != inputs[1][0]
    assert [(i["name"], i["tensors_sha256"]) for i in provenance["inputs"]] == [
        ("sst2", inputs[0][0]),
        ("imdb", inputs[1][0]),
    ]  # the hashes of the trained deltas, before saving
    assert loaded.manifest["extra"]["composition"] == provenance

    # a composed delta composes again; the next provenance names it by the hash it had before saving
    again = merge([loaded, loaded], how="linear")
    assert again.provenance["inputs"][0]["tensors_sha256"] == state_dict_hash(composed)
    assert again.provenance["backbone_hash"] == backbone.content_hash
    with pytest.raises(CompositionError, match="no provenance"):
        save_composed(inputs[0][1], backbone, tmp_path / "plain")


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------
def test_deltas_that_do_not_compose_are_refused_with_the_reason(make_backbone, tmp_path):
    backbone = make_backbone("bert")
    lora = [make(backbone, ("lora", {"r": 2}), seed) for seed in (1, 2)]
    cases = [
        (lambda: merge([]), "no deltas given"),
        (lambda: merge(lora[0]), "not one delta"),
        (lambda: merge([lora[0], "x"]), "expected a JobDelta, got str"),
        (lambda: merge([lora[0], make(backbone, ("houlsby", {"size": 4}), 3)]), "uses method 'houlsby'"),
        (
            lambda: merge([lora[0], make(backbone, ("lora", {"r": 2, "q.layers": "0"}), 3)]),
            "modules.q.layers",
        ),
        (lambda: merge([lora[0], make(backbone, ("lora", {"r": 2}), 3, num_labels=3)]), "number of labels 2"),
        (lambda: merge([lora[0], make(backbone, ("lora", {"r": 2}), 3, pooling="cls")]), "pooling"),
        (lambda: merge(lora, [1.0]), "1 weights for 2 deltas"),
        (lambda: merge(lora, [1.0, float("nan")]), r"weights\[1\] must be a finite number"),
        (lambda: merge(lora, how="ties", density=0.0), r"density must be in \(0, 1\]"),
        (lambda: merge(lora, how="dare", density=1.5), r"density must be in \(0, 1\]"),
        (lambda: merge(lora, density=0.5), "density applies to how='ties'"),
        (lambda: merge(lora, how="ties", weights=[1.0, -1.0]), "TIES weights must be > 0"),
        (lambda: merge(lora, how="average"), "how must be one of linear, ties, dare"),
        (lambda: merge(lora, how="dare", combine="mean"), "combine must be one of"),
        (lambda: merge(lora, lora_rank=0), "lora_rank must be a whole number >= 1"),
        (lambda: merge(lora, how="dare", seed=-1), "seed must be a whole number"),
        (lambda: merge_lora_svd([make(backbone, "bitfit", 1)], None, 2), "has no LoRA module"),
        (lambda: multi_task(backbone, {}), "non-empty"),
        (lambda: multi_task(backbone, {"a.b": lora[0]}), "without '.'"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()

    other = make_backbone("bert", seed=1)  # same shapes, other weights: only the content hash tells
    saved = [save_delta(lora[0], backbone, tmp_path / "a"), save_delta(lora[1], other, tmp_path / "b")]
    mine, theirs = load_delta(saved[0].path, backbone), load_delta(saved[1].path, other)
    with pytest.raises(CompositionError, match="different backbones"):
        merge([mine, theirs])
    with pytest.raises(CompositionError, match="belongs to backbone"):
        merge([mine, lora[1]], backbone=other)
    with pytest.raises(CompositionError, match="belongs to backbone"):
        fold_lora(backbone, theirs)
    llama = make_backbone("llama")
    with pytest.raises(CompositionError, match="does not have the shape"):
        merge([lora[0], make(llama, ("lora", {"r": 2}), 1)])
