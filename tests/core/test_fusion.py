"""AdapterFusion: frozen source adapters of other tasks, an attention over their outputs per sub-layer, a
fusion delta that saves, loads and predicts like any other."""

from __future__ import annotations

import random

import datasets
import pytest
import torch

from pelt_core import TrainConfig, get_method
from pelt_core.delta import load_delta, save_delta
from pelt_core.methods.fusion import (
    FusionError,
    FusionLayer,
    Source,
    fusion_method,
    fusion_weights,
    value_penalty,
)
from pelt_core.model import JobDelta, PeltModel, predict
from pelt_core.pack import Pack
from pelt_core.spec import MethodSpec, SpecError
from pelt_core.testing import VOCAB
from pelt_core.train import train
from tests.core.conftest import encode, trained_like

WORDS = VOCAB[-14:]


def rows(n: int, seed: int) -> datasets.Dataset:
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 8))]
        records.append({"sentence": " ".join(words), "label": int(words[0] in ("good", "great", "fun"))})
    return datasets.Dataset.from_list(records)


def source_delta(backbone, seed: int, method: str = "pfeiffer") -> JobDelta:
    """A source task's delta as if trained: random non-zero adapter weights."""
    torch.manual_seed(seed)
    return trained_like(JobDelta(get_method(method), backbone, num_labels=2), seed).eval()


def sha(index: int) -> str:
    return f"{index:x}" * 64


def two_source_fusion(own_adapter: bool = False) -> MethodSpec:
    sources = [
        Source("sst2", sha(1), get_method("pfeiffer"), 3),
        Source("mrpc", sha(2), get_method("pfeiffer"), 1),
    ]
    return fusion_method(sources, own_adapter=own_adapter)


CONFIG = dict(epochs=1, batch_size=4, eval_batch_size=8, bf16="false", head_dropout=0.0, learning_rate=1e-2)


# -- the spec -------------------------------------------------------------------------------------------
def test_a_fusion_spec_names_its_frozen_sources_and_round_trips_through_json():
    spec = two_source_fusion(own_adapter=True)
    assert list(spec.modules) == ["s1_adapter", "s2_adapter", "adapter"]
    assert spec.fusion.frozen_roles == {"s1_adapter", "s2_adapter"}
    assert [(s.task, s.version, s.method, s.roles) for s in spec.fusion.sources] == [
        ("sst2", 3, "pfeiffer", {"s1_adapter": "adapter"}),
        ("mrpc", 1, "pfeiffer", {"s2_adapter": "adapter"}),
    ]
    assert spec.defaults["learning_rate"] == 5e-5  # the paper's fusion rate
    assert spec.modules["adapter"].lr_multiplier == 20  # the own adapter at its preset's 1e-3
    assert MethodSpec.from_dict(spec.to_dict()) == spec
    assert "fusion" not in get_method("pfeiffer").to_dict()  # specs without fusion read and write as before


@pytest.mark.parametrize(
    ("method", "named"),
    [("lora", "attn.q"), ("prefix", "prefix"), ("unipelt", "gate"), ("bitfit", "no adapter modules")],
)
def test_methods_without_a_per_source_output_are_refused_with_the_reason(method, named):
    with pytest.raises(FusionError) as refused:
        fusion_method(
            [Source("sst2", sha(1), get_method(method), 2), Source("rte", sha(2), get_method("pfeiffer"))]
        )
    message = str(refused.value)
    assert "source sst2 version 2" in message and named in message
    if method in ("lora", "prefix"):
        assert "merge" in message


def test_a_fusion_is_not_a_source_and_one_adapter_is_not_a_fusion():
    fused = two_source_fusion()
    with pytest.raises(FusionError, match="itself a fusion"):
        fusion_method([Source("rte", sha(3), fused), Source("sst2", sha(1), get_method("pfeiffer"))])
    with pytest.raises(FusionError, match="two or more adapters"):
        fusion_method([Source("sst2", sha(1), get_method("pfeiffer"))])
    alone_with_own = fusion_method([Source("sst2", sha(1), get_method("pfeiffer"))], own_adapter=True)
    assert list(alone_with_own.modules) == ["s1_adapter", "adapter"]


def test_a_hand_written_fusion_spec_is_checked():
    data = two_source_fusion().to_dict()
    data["fusion"]["sources"][0]["roles"] = {"nowhere": "adapter"}
    with pytest.raises(SpecError, match="'nowhere' is not a module"):
        MethodSpec.from_dict(data)
    data = two_source_fusion().to_dict()
    data["layer_norm"] = True
    with pytest.raises(SpecError, match="no bias or LayerNorm"):
        MethodSpec.from_dict(data)


# -- the attention -------------------------------------------------------------------------------------
def test_the_fusion_layer_computes_the_papers_attention():
    torch.manual_seed(0)
    layer = FusionLayer(8)
    with torch.no_grad():
        layer.value.weight.add_(torch.randn(8, 8) * 0.1)
    hidden, outputs = torch.randn(2, 3, 8), [torch.randn(2, 3, 8) for _ in range(3)]
    q = hidden.double() @ layer.query.weight.double().T + layer.query.bias.double()
    keys = [a.double() @ layer.key.weight.double().T + layer.key.bias.double() for a in outputs]
    values = [a.double() @ layer.value.weight.double().T for a in outputs]
    weights = torch.softmax(torch.stack([(q * k).sum(-1) for k in keys], -1), -1)
    expected = sum(weights[..., n : n + 1] * values[n] for n in range(3))
    assert torch.allclose(layer(hidden, outputs).double(), expected, atol=1e-5)
    assert torch.allclose(layer.value_penalty(), (torch.eye(8) - layer.value.weight).pow(2).sum())


@pytest.mark.parametrize(
    "method", ["pfeiffer", "houlsby_adapters", "parallel_adapter", "scaled_parallel_adapter"]
)
def test_a_fusion_of_one_adapter_twice_with_a_blind_query_is_that_adapter(
    make_backbone, sentences, family, method
):
    """Q = 0 gives every member the same weight and V starts at identity: fusing a source with itself is the
    source alone, so the fused model must place and compose the adapters exactly where the source had them:
    after the FFN and the attention (Houlsby's), from the sub-layer's input (the parallel adapters)."""
    backbone = make_backbone(family)
    if (
        method == "houlsby_adapters"
    ):  # Houlsby's two adapters, without its LayerNorm deltas (fusion drops them)
        spec = get_method("houlsby")
        spec = MethodSpec.from_dict({**spec.to_dict(), "layer_norm": False})
    else:
        spec = get_method(method)
    torch.manual_seed(1)
    source = trained_like(JobDelta(spec, backbone, num_labels=2), 1).eval()
    spec = fusion_method([Source("a", sha(1), source.method), Source("b", sha(2), source.method)])
    torch.manual_seed(5)
    fused = JobDelta(spec, backbone, num_labels=2)
    from pelt_core.methods.fusion import load_sources

    load_sources(fused, {sha(1): source, sha(2): source})
    fused.head.load_state_dict(source.head.state_dict())
    with torch.no_grad():
        for module in fused.modules():
            if isinstance(module, FusionLayer):
                module.query.weight.zero_()
                module.query.bias.zero_()
    ids, mask = encode(backbone, sentences)
    with torch.no_grad():
        alone = PeltModel(backbone, source).eval()(ids, mask)
        together = PeltModel(backbone, fused.eval())(ids, mask)
    assert torch.allclose(together, alone, atol=1e-5)
    weights = fusion_weights(fused)
    assert weights == pytest.approx({role: 0.5 for role in weights}) and len(weights) == 2 * len(
        source.method.modules
    )


# -- training -------------------------------------------------------------------------------------------
def test_training_moves_the_fusion_the_own_adapter_and_the_head_never_the_sources(make_backbone):
    backbone = make_backbone("bert")
    sources = {sha(1): source_delta(backbone, 1), sha(2): source_delta(backbone, 2)}
    spec = two_source_fusion(own_adapter=True)
    result = train(backbone, spec, rows(24, 0), rows(8, 1), TrainConfig(**CONFIG), sources=sources)
    fused = result.delta
    for layer_key, sites in fused.layers.items():
        for source_sha, role in ((sha(1), "s1_adapter"), (sha(2), "s2_adapter")):
            before = sources[source_sha].layers[layer_key]["ffn"]["adapter"].state_dict()
            after = sites["ffn"][role].state_dict()
            assert all(torch.equal(before[name], after[name].cpu()) for name in before)
    first = JobDelta(spec, backbone, num_labels=2)  # its fresh initialisation, same seed
    fresh = dict(first.named_parameters())
    moved = {
        name
        for name, parameter in fused.named_parameters()
        if name in fresh and not torch.equal(parameter.detach().cpu(), fresh[name].detach())
    }
    assert any(".fusion.query." in name for name in moved) and any(".fusion.value." in name for name in moved)
    assert any(".ffn.adapter." in name for name in moved) and "head.classifier.weight" in moved
    trained = {id(p) for group in fused.parameter_groups(1e-3) for p in group["params"]}
    assert not any(id(p) in trained for name, p in fused.named_parameters() if ".s1_adapter." in name)
    assert set(result.fusion_weights) == {"s1_adapter", "s2_adapter", "adapter"}
    assert sum(result.fusion_weights.values()) == pytest.approx(1.0, abs=1e-4)


def test_the_loss_holds_the_value_penalty(make_backbone):
    backbone = make_backbone("bert")
    fused = JobDelta(two_source_fusion(), backbone, num_labels=2)
    assert value_penalty(fused).item() == 0.0  # V starts at identity
    with torch.no_grad():
        for module in fused.modules():
            if isinstance(module, FusionLayer):
                module.value.weight.add_(0.5)
    layers = sum(isinstance(m, FusionLayer) for m in fused.modules())
    assert layers == backbone.num_layers  # Pfeiffer sources: one fusion per layer, at the FFN
    width = backbone.hidden_size
    assert value_penalty(fused).item() == pytest.approx(0.01 * layers * width * width * 0.25, rel=1e-5)
    assert value_penalty(JobDelta(get_method("pfeiffer"), backbone, num_labels=2)) is None


def test_a_fusion_trains_in_a_pack_as_it_does_alone(make_backbone):
    backbone = make_backbone("bert")
    sources = {sha(1): source_delta(backbone, 1), sha(2): source_delta(backbone, 2)}
    spec = two_source_fusion(own_adapter=True)
    config = TrainConfig(**CONFIG)
    alone = train(backbone, spec, rows(16, 0), rows(8, 1), config, sources=sources)
    pack = Pack(backbone)
    fused = pack.join(spec, rows(16, 0), rows(8, 1), TrainConfig(**CONFIG), sources=sources)
    pack.join(get_method("lora"), rows(12, 2), rows(8, 3), TrainConfig(**{**CONFIG, "seed": 4}))
    while any(not m.done for m in pack.members):
        pack.step()
    assert fused.error is None
    assert fused.result.metrics["accuracy"] == alone.metrics["accuracy"]
    packed = dict(fused.result.delta.state_dict())
    for name, tensor in alone.delta.state_dict().items():
        assert torch.allclose(packed[name], tensor, atol=1e-5), name


def test_a_source_that_is_missing_or_of_another_shape_is_a_clear_error(make_backbone):
    backbone = make_backbone("bert")
    spec = two_source_fusion()
    config = TrainConfig(**CONFIG)
    with pytest.raises(FusionError, match=r"source mrpc .* was not given"):
        train(backbone, spec, rows(8, 0), None, config, sources={sha(1): source_delta(backbone, 1)})
    wide = JobDelta(get_method("pfeiffer", {"bottleneck": 8}), backbone, num_labels=2)
    with pytest.raises(FusionError, match="does not fit"):
        train(
            backbone,
            spec,
            rows(8, 0),
            None,
            config,
            sources={sha(1): source_delta(backbone, 1), sha(2): wide},
        )
    with pytest.raises(ValueError, match="not a fusion"):
        train(backbone, get_method("pfeiffer"), rows(8, 0), None, config, sources={sha(1): wide})


def test_a_saved_fusion_loads_and_predicts_the_same_with_its_sources_recorded(make_backbone, tmp_path):
    backbone = make_backbone("bert")
    sources = {sha(1): source_delta(backbone, 1), sha(2): source_delta(backbone, 2)}
    result = train(backbone, two_source_fusion(), rows(16, 0), None, TrainConfig(**CONFIG), sources=sources)
    texts = ["good film", "a boring movie", "not fun"]
    before = predict(PeltModel(backbone, result.delta), texts)
    saved = save_delta(result.delta, backbone, tmp_path / "fused")
    assert saved.manifest["method"]["fusion"]["sources"][0]["sha256"] == sha(1)
    loaded = load_delta(tmp_path / "fused", backbone, expected_sha256=saved.sha256)
    after = predict(PeltModel(backbone, loaded), texts)
    assert [r["label"] for r in after] == [r["label"] for r in before]
    assert [r["score"] for r in after] == pytest.approx([r["score"] for r in before], abs=1e-6)


def test_the_memory_estimate_counts_the_attention_at_every_fused_site():
    from pelt_core.limits import estimate_job_memory

    facts = {
        "hidden_size": 384,
        "num_layers": 6,
        "num_heads": 12,
        "intermediate_size": 1536,
        "num_parameters": 22_700_000,
    }
    train = {"max_length": 128, "batch_size": 16}
    houlsby = MethodSpec.from_dict({**get_method("houlsby").to_dict(), "layer_norm": False})
    fused = fusion_method([Source("a", sha(1), houlsby), Source("b", sha(2), houlsby)]).to_dict()
    plain = {**fused, "fusion": None}
    extra = (
        estimate_job_memory(train, fused, facts).parameters
        - estimate_job_memory(train, plain, facts).parameters
    )
    assert extra == 16 * 12 * (3 * 384 * 384 + 2 * 384)  # 12 sites (Houlsby: 2 a layer), 16 bytes a value
