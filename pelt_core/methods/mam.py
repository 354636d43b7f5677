"""MAM adapter, "mix-and-match" (He et al., ICLR 2022).

Paper defaults: prefix tuning with a small prefix (l = 30) at the attention heads plus a scaled parallel
adapter (r = 512, s = 4) at the FFN. The paper's finding: modify the FFN with the larger budget, the
attention with the smaller one.
"""

from dataclasses import replace

from pelt_core.methods.prefix import KV_PREFIX
from pelt_core.spec import MethodSpec, ModuleSpec

MAM = MethodSpec(
    name="mam",
    modules={
        "prefix": replace(KV_PREFIX, size=30),
        "adapter": ModuleSpec(
            form="bottleneck",
            representation="ffn",
            insertion="parallel",
            composition="scaled",
            scale=4.0,
            size=512,
            nonlinearity="relu",
            init="lora",
        ),
    },
    description="prefix (l=30) at attention + scaled parallel adapter (r=512, s=4) at the FFN",
    reference="He et al. Towards a Unified View of Parameter-Efficient Transfer Learning. ICLR 2022",
    # its s = 4 FFN adapter needs a small step: at 1e-3 or 3e-4 SST-2 and RTE (MiniLM, K=500, 2 epochs) stayed at
    # chance; at 1e-4 SST-2 reached 78-79% over three seeds and RTE 55.6%
    defaults={"learning_rate": 1e-4},
)

PRESETS = [MAM]
