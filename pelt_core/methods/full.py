"""Full fine-tuning, the baseline every PELT paper measures against (UniPELT's "FT" row).

Every weight matrix of every transformer layer (attention q, k, v, o and the FFN's), every bias and every
LayerNorm is trained, each as a dense delta of its own shape, zero at the start: the layer computes
x (W + ΔW)ᵀ + (b + Δb), which is full fine-tuning of those tensors while the shared backbone is never
written. The token embeddings stay frozen (on all-MiniLM-L6-v2 they are half of the parameters). Cost: the
delta is as large as the layers (about 47% of MiniLM, 10.6M values), and a job holds four copies of it
(delta, gradient, two AdamW moments: ~170 MB on MiniLM, ~1.7 GB on SmolLM2-135M); the service counts
them in a job's memory estimate. Learning rate 5e-5, as BERT fine-tuning commonly uses.
"""

from pelt_core.spec import WEIGHT_REPRESENTATIONS, MethodSpec, ModuleSpec

FULL = MethodSpec(
    name="full",
    modules={
        representation.replace(".", "_"): ModuleSpec(
            form="dense", representation=representation, insertion="parallel"
        )
        for representation in WEIGHT_REPRESENTATIONS
    },
    bias=True,
    layer_norm=True,
    description="full fine-tuning of every layer's weights, biases and LayerNorms (embeddings frozen)",
    reference="Devlin et al. BERT. NAACL 2019 (the fine-tuning baseline of every PELT paper)",
    defaults={"learning_rate": 5e-5},
)

PRESETS = [FULL]
