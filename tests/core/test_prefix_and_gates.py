"""Prefix tuning equals explicit key/value concatenation and He et al.'s gated form; UniPELT gates by hand."""

from __future__ import annotations

import pytest
import torch

from pelt_core import get_method
from pelt_core.model import JobDelta, PeltModel

from .conftest import encode


def capture_first_attention(backbone, model, input_ids, mask):
    """Run the model; return (attention input x, attention context output) of layer 0."""
    seen = {}
    attention = backbone.attention(0)
    q_linear = backbone.linear(0, "attn.q")
    h1 = q_linear.register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    h2 = attention.register_forward_hook(lambda m, args, out: seen.update(out=out[0]))
    try:
        model(input_ids, mask)
    finally:
        h1.remove()
        h2.remove()
    return seen["x"], seen["out"]


def heads(t, n_heads):
    batch, length, width = t.shape
    return t.view(batch, length, n_heads, width // n_heads).transpose(1, 2)


def attend(q, k, v, key_mask, scale):
    scores = q @ k.transpose(-1, -2) * scale + (~key_mask)[:, None, None, :] * torch.finfo(q.dtype).min
    return torch.softmax(scores, -1) @ v, scores


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_prefix_equals_explicit_key_value_concatenation_and_the_gated_form(
    attn_implementation, make_backbone, sentences
):
    backbone = make_backbone("bert", attn_implementation=attn_implementation)
    torch.manual_seed(0)
    delta = JobDelta(get_method("prefix", {"reparam_hidden": "none", "size": 3}), backbone, num_labels=2)
    model = PeltModel(backbone, delta).eval()
    input_ids, mask = encode(backbone, sentences)
    x, out = capture_first_attention(backbone, model, input_ids, mask)

    n_heads, scale = backbone.num_heads, backbone.head_dim**-0.5
    q = heads(backbone.linear(0, "attn.q")(x), n_heads)
    k = heads(backbone.linear(0, "attn.k")(x), n_heads)
    v = heads(backbone.linear(0, "attn.v")(x), n_heads)
    params = delta.prefix_layers[0][1].params
    pk = params.key.view(1, 3, n_heads, -1).transpose(1, 2).expand(len(sentences), -1, -1, -1)
    pv = params.value.view(1, 3, n_heads, -1).transpose(1, 2).expand(len(sentences), -1, -1, -1)
    tokens = mask.bool()
    prefix_valid = torch.ones(len(sentences), 3, dtype=torch.bool)

    # 1. concatenation: softmax(q [P_k; K]ᵀ) [P_v; V]
    concat, _ = attend(
        q, torch.cat([pk, k], 2), torch.cat([pv, v], 2), torch.cat([prefix_valid, tokens], 1), scale
    )
    torch.testing.assert_close(out, concat.transpose(1, 2).reshape_as(out), atol=1e-5, rtol=1e-5)

    # 2. He et al.'s gated form: (1 - λ) Attn(q, K, V) + λ Attn(q, P_k, P_v)
    h, seq_scores = attend(q, k, v, tokens, scale)
    delta_h, prefix_scores = attend(q, pk, pv, prefix_valid, scale)
    prefix_mass = torch.exp(prefix_scores).sum(-1, keepdim=True)
    seq_mass = (torch.exp(seq_scores) * tokens[:, None, None, :]).sum(-1, keepdim=True)
    lam = prefix_mass / (prefix_mass + seq_mass)
    gated = (1 - lam) * h + lam * delta_h
    torch.testing.assert_close(out, gated.transpose(1, 2).reshape_as(out), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_prefix_gives_the_same_logits_with_sdpa_and_eager_attention(family, make_backbone, sentences):
    outputs = []
    for impl in ("sdpa", "eager"):
        backbone = make_backbone(family, attn_implementation=impl)
        torch.manual_seed(0)
        model = PeltModel(backbone, JobDelta(get_method("mam", {"size": 4}), backbone, num_labels=2)).eval()
        outputs.append(model(*encode(backbone, sentences)))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)


def test_prefix_keeps_a_decoder_causal(make_backbone):
    backbone = make_backbone("llama")
    torch.manual_seed(0)
    model = PeltModel(backbone, JobDelta(get_method("prefix", {"size": 4}), backbone, num_labels=2)).eval()
    a = torch.tensor([[5, 6, 7, 8, 9]])
    b = torch.tensor([[5, 6, 7, 8, 50]])
    mask = torch.ones_like(a)
    ha, hb = model(a, mask, return_hidden=True), model(b, mask, return_hidden=True)
    torch.testing.assert_close(ha[:, :4], hb[:, :4])
    assert not torch.allclose(ha[:, 4], hb[:, 4])


def test_unipelt_gates_match_a_hand_computation(make_backbone, sentences):
    backbone = make_backbone("bert")
    torch.manual_seed(0)
    spec = get_method(
        "unipelt", {"size": 4, "prefix.reparam_hidden": "none", "init": "near_identity", "init_std": 0.3}
    )
    delta = JobDelta(spec, backbone, num_labels=2)
    for gate in [m for m in delta.modules() if m.__class__.__name__ == "Gate"]:
        torch.nn.init.normal_(gate.proj.weight, std=0.5)
        torch.nn.init.normal_(gate.proj.bias, std=0.5)
    model = PeltModel(backbone, delta).eval()
    input_ids, mask = encode(backbone, sentences)

    seen = {}
    q_linear, ffn_out = backbone.linear(0, "attn.q"), backbone.linear(0, "ffn.out")
    hooks = [
        q_linear.register_forward_hook(lambda m, a, o: seen.update(q_in=a[0], q_out=o)),
        ffn_out.register_forward_hook(lambda m, a, o: seen.update(f_in=a[0], f_out=o)),
    ]
    model(input_ids, mask)
    for hook in hooks:
        hook.remove()
    sites = delta.layers["0"]

    # LoRA on W_q: h = W x + b + σ(w_g·x + b_g) · s · B A x
    lora = sites["attn_q"]["lora_q"]
    x = seen["q_in"]
    g_lora = torch.sigmoid(x @ lora.gate.proj.weight.T + lora.gate.proj.bias)
    expected_q = q_linear(x) + g_lora * (lora.scale * (x @ lora.down.weight.T @ lora.up.weight.T))
    torch.testing.assert_close(seen["q_out"], expected_q)

    # adapter after the FFN: h_F + σ(w_g·h_F + b_g) · W_up relu(W_down h_F)
    adapter = sites["ffn"]["adapter"]
    h_f = ffn_out(seen["f_in"])
    g_adapter = torch.sigmoid(h_f @ adapter.gate.proj.weight.T + adapter.gate.proj.bias)
    expected_f = h_f + g_adapter * adapter.up(torch.relu(adapter.down(h_f)))
    torch.testing.assert_close(seen["f_out"], expected_f)

    # prefix: one gate per example, the mean of σ(w_g·x + b_g) over its real tokens, scaling P_k and P_v
    prefix = sites["attn_heads"]["prefix"]
    token_gates = torch.sigmoid(x @ prefix.gate.proj.weight.T + prefix.gate.proj.bias).squeeze(-1)
    g_prefix = (token_gates * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(prefix.gate.last_mean, g_prefix.mean())

    # the gate values a job reports are these gates' means (here over layers 0 and 1)
    reported = delta.gate_values()
    assert set(reported) == {"adapter", "prefix", "lora_q", "lora_v"}
    assert all(0.0 < value < 1.0 for value in reported.values())
