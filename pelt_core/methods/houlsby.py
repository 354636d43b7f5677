"""Houlsby adapters (Houlsby et al., ICML 2019).

Paper defaults: a bottleneck adapter (down-projection, nonlinearity, up-projection, residual) inserted
sequentially after the attention sub-layer and after the FFN sub-layer of every layer, bottleneck m = 64
(searched over 8/64/256), near-identity initialisation (weights ~ N(0, 1e-2)), LayerNorms trained too,
learning rate swept over 3e-5 to 3e-3.
Parameters per insertion: 2md + d + m.
"""

from pelt_core.spec import MethodSpec, ModuleSpec

_ADAPTER = dict(
    form="bottleneck",
    insertion="sequential",
    composition="add",
    size=64,
    nonlinearity="relu",
    init="near_identity",
    init_std=1e-2,
)

HOULSBY = MethodSpec(
    name="houlsby",
    modules={
        "attn_adapter": ModuleSpec(representation="attn", **_ADAPTER),
        "ffn_adapter": ModuleSpec(representation="ffn", **_ADAPTER),
    },
    layer_norm=True,
    description="sequential bottleneck adapters after attention and FFN, trainable LayerNorms",
    reference="Houlsby et al. Parameter-Efficient Transfer Learning for NLP. ICML 2019",
    defaults={"learning_rate": 1e-3},
)

PRESETS = [HOULSBY]
