"""Each preset trains exactly the parameters its paper's formula counts, and nothing else."""

from __future__ import annotations

import pytest
import torch

from pelt_core import BUILTIN_METHODS, get_method
from pelt_core.model import JobDelta, PeltModel

from .conftest import encode


def expected_pelt_parameters(spec, backbone) -> int:
    """The papers' formulas, written out independently of the implementation."""
    d, layers = backbone.hidden_size, backbone.num_layers
    ffn = backbone.config.intermediate_size
    kv = backbone.num_kv_heads * backbone.head_dim
    llama = backbone.arch.family == "llama"
    shapes = {  # representation -> list of (d_in, d_out) of the matrices it names
        "attn.q": [(d, d)],
        "attn.k": [(d, kv)],
        "attn.v": [(d, kv)],
        "attn.o": [(d, d)],
        "ffn.in": [(d, ffn)] * (2 if llama else 1),
        "ffn.out": [(ffn, d)],
    }
    total = 0
    for module in spec.modules.values():
        count = len(module.layers) if module.layers is not None else layers
        gate = (d + 1) if module.gate else 0
        if module.form == "prefix":
            total += count * (2 * module.size * kv + gate)  # 2·l·d per layer once the MLP is dropped
        elif module.form == "dense":  # full fine-tuning: the weight's own shape
            total += count * sum(d_in * d_out + gate for d_in, d_out in shapes[module.representation])
        elif module.nonlinearity == "identity" and not module.proj_bias:  # LoRA: r·(d_in + d_out) per matrix
            for d_in, d_out in shapes[module.representation]:
                total += count * (module.size * (d_in + d_out) + (d_in + 1 if module.gate else 0))
        else:  # bottleneck adapter: 2md + d + m per insertion
            total += count * (2 * module.size * d + d + module.size + gate)
    per_layer_biases = 0
    if spec.bias:
        per_layer_biases += (
            sum(out for _, out in [(0, d), (0, kv), (0, kv), (0, d)])
            + sum(out for _, out in shapes["ffn.in"])
            + d
            + 2 * d
        )  # linear biases + two norm shifts
    if spec.layer_norm:
        per_layer_biases += 2 * d + (0 if spec.bias else 2 * d)  # two norms: scale (+ shift unless counted)
    return total + layers * per_layer_biases


def small(name: str):
    spec = BUILTIN_METHODS[name]
    return get_method(spec, {"size": 4}) if spec.modules else spec


@pytest.mark.parametrize("name", sorted(BUILTIN_METHODS))
def test_parameter_count_matches_the_papers_formula(name, family, make_backbone):
    backbone = make_backbone(family)
    spec = small(name)
    delta = JobDelta(spec, backbone, num_labels=2)
    assert delta.parameter_counts()["pelt"] == expected_pelt_parameters(spec, backbone)
    delta.drop_reparameterization()
    kept = sum(p.numel() for p in delta.layers.parameters())
    assert kept == expected_pelt_parameters(spec, backbone)


@pytest.mark.parametrize("name", sorted(BUILTIN_METHODS))
def test_only_the_jobs_tensors_get_gradients_and_the_backbone_stays_bit_identical(
    name, family, make_backbone, sentences
):
    backbone = make_backbone(family)
    before = {k: v.clone() for k, v in backbone.model.state_dict().items()}
    torch.manual_seed(0)
    delta = JobDelta(small(name), backbone, num_labels=2)
    model = PeltModel(backbone, delta).train()
    optimizer = torch.optim.AdamW(delta.parameters(), lr=1e-2)
    input_ids, mask = encode(backbone, sentences)
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(input_ids, mask), torch.tensor([1, 0, 0, 1]))
        loss.backward()
        assert all(p.grad is None for p in backbone.model.parameters())
        with_grad = {n for n, p in delta.named_parameters() if p.grad is not None}
        assert with_grad == {n for n, _ in delta.named_parameters()}, "every job tensor is trained"
        optimizer.step()
        optimizer.zero_grad()
    after = backbone.model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    "name", ["lora", "lora_ffn", "parallel_adapter", "scaled_parallel_adapter", "bitfit"]
)
def test_zero_initialised_methods_reproduce_the_backbone_exactly(name, family, make_backbone, sentences):
    backbone = make_backbone(family)
    input_ids, mask = encode(backbone, sentences)
    plain = backbone.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    model = PeltModel(backbone, JobDelta(BUILTIN_METHODS[name], backbone, num_labels=2)).eval()
    assert torch.equal(model(input_ids, mask, return_hidden=True), plain)


@pytest.mark.parametrize("name", ["houlsby", "pfeiffer"])
def test_near_identity_adapters_stay_close_to_the_backbone(name, family, make_backbone, sentences):
    backbone = make_backbone(family)
    input_ids, mask = encode(backbone, sentences)
    plain = backbone.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    model = PeltModel(backbone, JobDelta(BUILTIN_METHODS[name], backbone, num_labels=2)).eval()
    hidden = model(input_ids, mask, return_hidden=True)
    assert not torch.equal(hidden, plain)
    assert (hidden - plain).norm() / plain.norm() < 1e-2  # near-identity init: N(0, 1e-2) weights


def test_two_jobs_share_one_backbone_and_each_row_sees_only_its_own_modules(make_backbone, sentences):
    backbone = make_backbone("bert")
    torch.manual_seed(0)
    lora = JobDelta(get_method("lora", {"init": "near_identity", "init_std": 0.5}), backbone, num_labels=2)
    prefix = JobDelta(get_method("prefix"), backbone, num_labels=3)
    houlsby = JobDelta(get_method("houlsby"), backbone, num_labels=2)
    input_ids, mask = encode(backbone, sentences)
    alone = {
        name: PeltModel(backbone, d).eval()(input_ids, mask)
        for name, d in {"lora": lora, "prefix": prefix, "houlsby": houlsby}.items()
    }
    mixed = PeltModel(backbone, {"lora": lora, "prefix": prefix, "houlsby": houlsby}).eval()
    out = mixed(input_ids, mask, routes=[("lora", 1), ("prefix", 2), ("houlsby", 1)])
    torch.testing.assert_close(out[0], alone["lora"][:1])
    torch.testing.assert_close(out[1], alone["prefix"][1:3])
    torch.testing.assert_close(out[2], alone["houlsby"][3:])


def test_routes_must_cover_the_batch(make_backbone, sentences):
    backbone = make_backbone("bert")
    model = PeltModel(backbone, {"a": JobDelta(BUILTIN_METHODS["lora"], backbone, 2)})
    input_ids, mask = encode(backbone, sentences)
    with pytest.raises(ValueError, match="cover 2 rows"):
        model(input_ids, mask, routes=[("a", 2)])
    with pytest.raises(KeyError, match="no delta named 'b'"):
        model(input_ids, mask, routes=[("b", 4)])


def test_a_failed_forward_start_releases_the_backbone(make_backbone, sentences):
    """When a delta cannot start its forward (its prefix MLP fails), the backbone stays usable."""
    backbone = make_backbone("bert")
    delta = JobDelta(get_method("prefix", {"size": 2}), backbone, 2)
    model = PeltModel(backbone, delta).eval()
    input_ids, mask = encode(backbone, sentences)
    expected = model(input_ids, mask)

    def fail() -> None:
        raise RuntimeError("the prefix MLP failed")

    delta.begin_forward = fail
    with pytest.raises(RuntimeError, match="prefix MLP failed"):
        model(input_ids, mask)
    del delta.begin_forward
    torch.testing.assert_close(model(input_ids, mask), expected)


def test_unsupported_architecture_lists_the_supported_ones():
    from pelt_core.backbones import BackboneError, architecture_for

    with pytest.raises(BackboneError, match=r"bert.*llama"):
        architecture_for("t5")


@pytest.mark.parametrize("learned", [False, True])
def test_a_scaled_bottleneck_adds_s_times_the_unscaled_delta_and_a_learned_scale_trains(learned):
    from pelt_core.layers import Bottleneck
    from pelt_core.spec import ModuleSpec

    plain = ModuleSpec(
        form="bottleneck",
        representation="ffn",
        insertion="parallel",
        composition="add",
        size=4,
        nonlinearity="relu",
        init="near_identity",
        init_std=0.5,
    )
    scaled = ModuleSpec(
        form="bottleneck",
        representation="ffn",
        insertion="parallel",
        composition="scaled",
        scale=4.0,
        size=4,
        nonlinearity="relu",
        init="near_identity",
        init_std=0.5,
        learned_scale=learned,
    )
    torch.manual_seed(0)
    unscaled_module, scaled_module = Bottleneck(plain, 6, 6), Bottleneck(scaled, 6, 6)
    scaled_module.load_state_dict(unscaled_module.state_dict(), strict=False)
    with torch.no_grad():
        scaled_module.up.bias.fill_(0.3)
        unscaled_module.up.bias.fill_(0.3)
    x = torch.randn(2, 3, 6)
    out = scaled_module(x)
    torch.testing.assert_close(out, 4.0 * unscaled_module(x))
    out.sum().backward()
    assert (scaled_module.scale.grad is not None) == learned
