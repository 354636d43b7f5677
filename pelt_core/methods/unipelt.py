"""UniPELT (Mao et al., ACL 2022): several PELT modules, each switched by its own learned gate.

Paper defaults: a Pfeiffer adapter after the FFN (reduction 16), prefix tuning (l = 10) and LoRA on
W_q, W_v (r = 8, α = 16). Each sub-module's contribution is multiplied by a gate G = σ(W_g x + b_g)
computed from that sub-module's input: per token for the adapter (its input h_F) and LoRA (the layer
input), and per example for the prefix (averaged over the attention input's tokens), which scales
P_k and P_v. `unipelt` is the full APL mixture; `unipelt_ap` drops LoRA; any of them takes
`bias=true` to add BitFit's bias deltas.
"""

from dataclasses import replace

from pelt_core.methods.lora import LOW_RANK
from pelt_core.methods.pfeiffer import FFN_ADAPTER
from pelt_core.methods.prefix import KV_PREFIX
from pelt_core.spec import MethodSpec, ModuleSpec

# The Pfeiffer adapter and the prefix as their own presets have them, each with a gate; LoRA at α = 16.
_ADAPTER = replace(FFN_ADAPTER, gate=True)
_PREFIX = replace(KV_PREFIX, gate=True)
_LORA = dict(LOW_RANK, size=8, alpha=16.0, gate=True)

_REFERENCE = "Mao et al. UniPELT: A Unified Framework for Parameter-Efficient Language Model Tuning. ACL 2022"

UNIPELT_APL = MethodSpec(
    name="unipelt_apl",
    modules={
        "adapter": _ADAPTER,
        "prefix": _PREFIX,
        "lora_q": ModuleSpec(representation="attn.q", **_LORA),
        "lora_v": ModuleSpec(representation="attn.v", **_LORA),
    },
    description="gated adapter + prefix + LoRA",
    reference=_REFERENCE,
    defaults={"learning_rate": 1e-3},
)

UNIPELT = MethodSpec(
    name="unipelt",
    modules=UNIPELT_APL.modules,
    description="gated adapter + prefix + LoRA (same as unipelt_apl)",
    reference=_REFERENCE,
    defaults={"learning_rate": 1e-3},
)

UNIPELT_AP = MethodSpec(
    name="unipelt_ap",
    modules={"adapter": _ADAPTER, "prefix": _PREFIX},
    description="gated adapter + prefix",
    reference=_REFERENCE,
    defaults={"learning_rate": 1e-3},
)

PRESETS = [UNIPELT, UNIPELT_AP, UNIPELT_APL]
