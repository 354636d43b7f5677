"""Prefix-Tuning (Li & Liang, ACL 2021).

Paper defaults: l trainable key and value vectors prepended in every attention layer (l = 10 for
table-to-text, also UniPELT's choice), reparameterised during training by an MLP over a smaller embedding
(hidden 512) for stability; the MLP is dropped after training and only P_k, P_v are kept.
Parameters kept per layer: 2·l·d (d = key/value width; with grouped-query attention, kv_heads·head_dim).
In the unified view the prefix acts as Δh = softmax(x W_q P_kᵀ) P_v composed by gating:
h ← (1 - λ(x)) h + λ(x) Δh.
"""

from pelt_core.spec import MethodSpec, ModuleSpec

KV_PREFIX = ModuleSpec(
    form="prefix",
    representation="attn.heads",
    insertion="parallel",
    composition="gated",
    size=10,
    reparam_hidden=512,
    init_std=1.0,
)

PREFIX = MethodSpec(
    name="prefix",
    modules={"prefix": KV_PREFIX},
    description="trainable key/value prefixes in every attention layer",
    reference="Li & Liang. Prefix-Tuning. ACL 2021",
    defaults={"learning_rate": 5e-3},
)

PRESETS = [PREFIX]
