"""`full`, the fine-tuning baseline as a preset: every weight matrix, bias and LayerNorm of every layer
trained as the job's own dense delta of the same shape (W + ΔW), the embeddings and the shared backbone
untouched. Its gradients are those of fine-tuning the weights themselves."""

from __future__ import annotations

import datasets
import torch

from pelt_core import TrainConfig, get_method
from pelt_core.layers import DenseDelta
from pelt_core.limits import estimate_job_memory
from pelt_core.model import JobDelta, PeltModel
from pelt_core.spec import MethodSpec, SpecError
from pelt_core.train import train
from tests.core.conftest import encode
from tests.core.test_train import rows


def layer_tensors(backbone) -> dict[str, torch.Tensor]:
    """The backbone's parameters inside its transformer layers (embeddings and pooler left out)."""
    return {
        name: p for name, p in backbone.model.named_parameters() if ".layer." in name or "layers." in name
    }


def full_delta(backbone) -> JobDelta:
    return JobDelta(
        get_method("full"), backbone, 2, "single_label_classification", "mean", 0.0, ["neg", "pos"]
    )


def test_full_trains_as_many_values_as_the_layers_hold(make_backbone, family):
    backbone = make_backbone(family)
    delta = full_delta(backbone)
    in_layers = sum(p.numel() for p in layer_tensors(backbone).values())
    extra = 0  # Llama has no biases and RMSNorms without a shift: the deltas give it both
    if family == "llama":
        linears = [m for m in backbone.model.modules() if isinstance(m, torch.nn.Linear)]
        norms = [p for name, p in layer_tensors(backbone).items() if "norm" in name]
        extra = sum(m.out_features for m in linears) + sum(p.numel() for p in norms)
    assert delta.parameter_counts()["pelt"] == in_layers + extra
    dense = [m for m in delta.modules() if isinstance(m, DenseDelta)]
    assert dense and all(not m.weight.any() for m in dense)  # zero at the start: the backbone's function


def test_the_gradient_of_each_dense_delta_is_the_gradient_of_its_weight(make_backbone, sentences):
    backbone = make_backbone("bert")
    delta = full_delta(backbone)
    model = PeltModel(backbone, {"job": delta}).eval()
    weights = {
        name: p
        for name, p in layer_tensors(backbone).items()
        if name.endswith(".weight") and p.dim() == 2  # the linear maps (LayerNorm weights are 1-d)
    }
    for p in weights.values():
        p.requires_grad_(True)
    try:
        input_ids, mask = encode(backbone, sentences)
        model(input_ids, mask).logsumexp(-1).sum().backward()
        by_shape_and_grad = sorted((tuple(p.shape), round(float(p.grad.norm()), 6)) for p in weights.values())
        deltas = sorted(
            (tuple(m.weight.shape), round(float(m.weight.grad.norm()), 6))
            for m in delta.modules()
            if isinstance(m, DenseDelta)
        )
        assert deltas == by_shape_and_grad  # one dense delta per weight, fed the same input
        for name, p in weights.items():
            owner = next(
                m for m in delta.modules() if isinstance(m, DenseDelta) and torch.equal(m.weight.grad, p.grad)
            )
            assert owner.weight.shape == p.shape, name
    finally:
        for p in weights.values():
            p.requires_grad_(False)
            p.grad = None


def test_full_fine_tuning_learns_and_never_writes_the_shared_backbone(make_backbone):
    backbone = make_backbone("bert")
    before = {name: p.detach().clone() for name, p in backbone.model.named_parameters()}
    data = datasets.Dataset.from_list(rows())
    result = train(
        backbone,
        get_method("full"),
        data,
        data,
        TrainConfig(epochs=6, batch_size=8, bf16="false", learning_rate=1e-3),
    )
    assert result.metrics["accuracy"] >= 0.75
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert all(torch.equal(p, before[name]) for name, p in backbone.model.named_parameters())


def test_a_dense_delta_only_modifies_a_weight_beside_it():
    for bad, field in (
        ({"representation": "ffn", "insertion": "parallel"}, "representation"),
        ({"representation": "attn.q", "insertion": "sequential"}, "insertion"),
    ):
        spec = {"name": "x", "modules": {"m": {"form": "dense", **bad}}}
        try:
            MethodSpec.from_dict(spec).validate()
        except SpecError as exc:
            assert f"x.modules.m.{field}" in str(exc) or field in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_the_memory_estimate_counts_four_copies_of_the_dense_deltas():
    facts = {
        "hidden_size": 384,
        "num_layers": 6,
        "num_heads": 12,
        "intermediate_size": 1536,
        "num_parameters": 22_700_000,
    }
    config = {"max_length": 64, "batch_size": 16}
    full = estimate_job_memory(config, get_method("full").to_dict(), facts)
    lora = estimate_job_memory(config, get_method("lora").to_dict(), facts)
    layer_weights = 6 * (4 * 384 * 384 + 2 * 384 * 1536)
    assert full.parameters >= 16 * layer_weights  # delta, gradient, two AdamW moments
    assert full.parameters > 40 * lora.parameters
