"""UniPELT (Mao et al., ACL 2022): several PELT modules, each switched by its own learned gate.

Paper defaults: a Pfeiffer adapter after the FFN (reduction 16), prefix tuning (l = 10) and LoRA on
W_q, W_v (r = 8, α = 16). Each sub-module's contribution is multiplied by a gate G = σ(W_g x + b_g)
computed from that sub-module's input: per token for the adapter (its input h_F) and LoRA (the layer
input), and per example for the prefix (averaged over the attention input's tokens), which scales
P_k and P_v. `unipelt` is the full APL mixture; `unipelt_ap` drops LoRA; any of them takes
`bias=true` to add BitFit's bias deltas.

Learning rates: each module learns at its own preset's rate, as a multiple of the mixture's (the job's)
learning rate, 1e-3 (`lr_multiplier`): the adapter at 1e-3 (the `pfeiffer` preset's), the prefix at 5e-3
(the `prefix` preset's) and LoRA at 2e-3 (the `lora` preset's), each gate with its module; the head and
BitFit's biases at 1e-3. A job's `learning_rate` scales them all together. The paper's reference code (its run_glue.py on the
Hugging Face Trainer) trains the whole mixture at the one `--learning_rate` of its training arguments; on
all-MiniLM-L6-v2 at K=100 one rate of 1e-3 held UniPELT (AP)'s prefix back (docs/unipelt-low-resource.md).
"""

from dataclasses import replace

from pelt_core.methods.lora import LORA, LOW_RANK
from pelt_core.methods.pfeiffer import FFN_ADAPTER, PFEIFFER
from pelt_core.methods.prefix import KV_PREFIX, PREFIX
from pelt_core.spec import MethodSpec, ModuleSpec

# The Pfeiffer adapter and the prefix as their own presets have them, each with a gate; LoRA at α = 16;
# each at its own preset's learning rate (1e-3, 5e-3, 2e-3) relative to the mixture's 1e-3.
LEARNING_RATE = 1e-3
_ADAPTER = replace(FFN_ADAPTER, gate=True, lr_multiplier=PFEIFFER.defaults["learning_rate"] / LEARNING_RATE)
_PREFIX = replace(KV_PREFIX, gate=True, lr_multiplier=PREFIX.defaults["learning_rate"] / LEARNING_RATE)
_LORA = dict(
    LOW_RANK, size=8, alpha=16.0, gate=True, lr_multiplier=LORA.defaults["learning_rate"] / LEARNING_RATE
)

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
    defaults={"learning_rate": LEARNING_RATE},
)

UNIPELT = MethodSpec(
    name="unipelt",
    modules=UNIPELT_APL.modules,
    description="gated adapter + prefix + LoRA (same as unipelt_apl)",
    reference=_REFERENCE,
    defaults={"learning_rate": LEARNING_RATE},
)

UNIPELT_AP = MethodSpec(
    name="unipelt_ap",
    modules={"adapter": _ADAPTER, "prefix": _PREFIX},
    description="gated adapter + prefix",
    reference=_REFERENCE,
    defaults={"learning_rate": LEARNING_RATE},
)

PRESETS = [UNIPELT, UNIPELT_AP, UNIPELT_APL]
