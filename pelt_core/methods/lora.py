"""LoRA (Hu et al., ICLR 2022) and He et al.'s FFN variant.

Paper defaults (RoBERTa-base GLUE): W_q and W_v of every layer, rank r = 8, α = 8 (scale α/r),
A random (Kaiming-uniform), B zero so training starts at the backbone's function, learning rate 5e-4 over
30+ epochs of full GLUE data. pelt's default learning rate, 2e-3, suits short low-resource runs (K=500,
3 epochs on SST-2 with all-MiniLM-L6-v2: 0.81 dev accuracy vs 0.61 at 5e-4, seed 0).
Parameters per adapted d×d matrix: 2·d·r. Merging adds s·BA to a copy of W; unmerging drops the copy.

`lora_ffn` (He et al., ICLR 2022, sec. 4): LoRA on the FFN's two matrices with scale s = 4.
"""

from pelt_core.spec import MethodSpec, ModuleSpec

LOW_RANK = dict(  # the shape of a LoRA module; representation, size and alpha vary
    form="bottleneck",
    insertion="parallel",
    composition="scaled",
    nonlinearity="identity",
    proj_bias=False,
    init="lora",
)

LORA = MethodSpec(
    name="lora",
    modules={
        "q": ModuleSpec(representation="attn.q", size=8, alpha=8.0, **LOW_RANK),
        "v": ModuleSpec(representation="attn.v", size=8, alpha=8.0, **LOW_RANK),
    },
    description="low-rank updates of W_q and W_v",
    reference="Hu et al. LoRA. ICLR 2022",
    defaults={"learning_rate": 2e-3},
)

LORA_FFN = MethodSpec(
    name="lora_ffn",
    modules={
        "ffn_in": ModuleSpec(representation="ffn.in", size=16, alpha=64.0, **LOW_RANK),
        "ffn_out": ModuleSpec(representation="ffn.out", size=16, alpha=64.0, **LOW_RANK),
    },
    description="low-rank updates of the FFN matrices, scale 4",
    reference="He et al. Towards a Unified View of Parameter-Efficient Transfer Learning. ICLR 2022",
    defaults={"learning_rate": 5e-4},
)

PRESETS = [LORA, LORA_FFN]
