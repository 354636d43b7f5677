"""The backbone's dropout while a job trains: torch.nn.Dropout's semantics, cheaper random numbers."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pelt_core import dropout as cheap
from pelt_core import get_method
from pelt_core.dropout import BackboneDropout, attention_with_dropout, keep_from_int16, keep_mask, keep_scale
from pelt_core.model import JobDelta, PeltModel
from pelt_core.testing import tiny_bert, tiny_llama
from tests.core.conftest import encode


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_drops_p_of_the_elements_and_scales_the_rest(p):
    torch.manual_seed(0)
    out = cheap.dropout(torch.ones(1000, 1000), p)
    assert float((out == 0).float().mean()) == pytest.approx(p, abs=0.002)
    p_used = round(p * cheap.RESOLUTION) / cheap.RESOLUTION
    assert abs(p_used - p) <= 0.5 / cheap.RESOLUTION
    assert keep_scale(p) == pytest.approx(1.0 / (1.0 - p_used), rel=1e-12)
    assert torch.all(out[out != 0] == torch.tensor(keep_scale(p), dtype=torch.float32))
    assert float(out.mean()) == pytest.approx(1.0, abs=0.005)
    assert cheap.dropout(torch.ones(3), p, training=False).tolist() == [1.0, 1.0, 1.0]


def test_keep_mask_is_reproducible_from_torch_seed_and_differs_between_seeds():
    torch.manual_seed(3)
    first = keep_mask((64, 33), 0.3)
    torch.manual_seed(3)
    again = keep_mask((64, 33), 0.3)
    torch.manual_seed(4)
    other = keep_mask((64, 33), 0.3)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


@pytest.mark.parametrize("threshold", [0, 1, 6554, 32768, 65535])
def test_exactly_65536_minus_threshold_of_all_16_bit_values_keep(threshold):
    every_value = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    assert int(keep_from_int16(every_value, threshold).sum()) == 65536 - threshold


def test_keep_mask_refuses_a_probability_outside_0_1_and_dropout_hands_those_to_torch():
    for p in (1.0, 1.0 - 1e-6, -0.1):
        with pytest.raises(ValueError, match="dropout probability"):
            keep_mask((3,), p)
    assert torch.all(keep_mask((100,), 0.0))
    assert torch.equal(
        cheap.dropout(torch.ones(10), 1.0), torch.zeros(10)
    )  # nn.Dropout(p=1) zeroes everything


def test_attention_in_bf16_computes_its_softmax_in_fp32():
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, 5, 7)
    mask[..., 4:] = float("-inf")  # an additive mask with -inf, as some models build it
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ours = attention_with_dropout(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask.bfloat16(), 0.0)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), reference, atol=3e-2, rtol=3e-2)
    everything_masked = torch.full((2, 1, 5, 7), float("-inf"))
    assert torch.isfinite(attention_with_dropout(q, k, v, everything_masked, 0.0)).all()


def _qkv(q_len=5, k_len=7):
    torch.manual_seed(0)
    return torch.randn(2, 3, q_len, 8), torch.randn(2, 3, k_len, 8), torch.randn(2, 3, k_len, 8)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "causal"])
def test_attention_without_dropout_equals_scaled_dot_product_attention(mask_kind):
    q, k, v = _qkv(5, 5 if mask_kind == "causal" else 7)
    mask = None
    if mask_kind in ("bool", "additive"):
        mask = torch.rand(2, 1, 5, 7) > 0.3
        mask[..., 0] = True
        if mask_kind == "additive":
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    causal = mask_kind == "causal"
    ours = attention_with_dropout(q, k, v, mask, 0.0, is_causal=causal)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(ours, reference)


def test_attention_dropout_multiplies_the_softmax_weights_by_the_keep_mask():
    q, k, v = _qkv()
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    mask[1, ..., 5:] = False
    torch.manual_seed(11)
    ours = attention_with_dropout(q, k, v, mask, 0.25, scale=0.5)
    torch.manual_seed(11)
    keep = keep_mask((2, 3, 5, 7), 0.25)
    scores = (q @ k.transpose(-1, -2)) * 0.5
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(ours, (weights * keep / 0.75) @ v)


def _model(family: str, tmp_path, method: str = "unipelt"):
    dropouts = {
        "bert": {"hidden_dropout_prob": 0.2, "attention_probs_dropout_prob": 0.2},
        "llama": {"attention_dropout": 0.2},
    }[family]
    backbone = (tiny_bert if family == "bert" else tiny_llama)(str(tmp_path), **dropouts)
    torch.manual_seed(0)
    model = PeltModel(backbone, JobDelta(get_method(method), backbone, 2))
    return backbone, model


def test_a_pelt_model_swaps_the_backbones_dropout_modules_keeping_their_rate(tmp_path):
    backbone, _ = _model("bert", tmp_path)
    dropouts = [m for m in backbone.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(type(m) is BackboneDropout for m in dropouts)
    assert {m.p for m in dropouts} == {0.2}


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_training_forward_with_every_mask_kept_equals_the_backbone_without_dropout(
    family, tmp_path, monkeypatch, sentences
):
    """With the keep mask forced to ones, the cheap attention path (prefix, padding, GQA, causal) computes
    exactly what transformers' sdpa computes in eval mode."""
    backbone, model = _model(family, tmp_path)
    ids, mask = encode(backbone, sentences)
    model.eval()
    with torch.no_grad():
        expected = model(ids, mask)
    monkeypatch.setattr(
        cheap,
        "keep_mask",
        lambda shape, p, device="cpu", generator=None: torch.ones(shape, dtype=torch.bool, device=device),
    )
    monkeypatch.setattr(cheap, "keep_scale", lambda p: 1.0)
    model.train()
    for (
        delta
    ) in model.deltas.values():  # the head's and modules' own dropout off; only the backbone's is tested
        for module in delta.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    with torch.no_grad():
        got = model(ids, mask)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_training_forward_drops_and_is_reproducible_from_the_seed(family, tmp_path, sentences):
    backbone, model = _model(family, tmp_path)
    ids, mask = encode(backbone, sentences)
    model.eval()
    with torch.no_grad():
        without = model(ids, mask)
    model.train()
    outputs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        logits = model(ids, mask)
        logits.sum().backward()  # gradients flow through the cheap path
        outputs.append(logits.detach())
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.allclose(outputs[0], outputs[2])
    assert not torch.allclose(outputs[0], without)
