"""Pfeiffer adapters (Pfeiffer et al., EACL 2021, "AdapterFusion").

Paper defaults: one sequential bottleneck adapter after the FFN sub-layer only, reduction factor 16
(m = d/16, 48 for a 768-wide model), ReLU, near-identity initialisation. Parameters per layer: 2md + d + m.
"""

from pelt_core.spec import MethodSpec, ModuleSpec

FFN_ADAPTER = ModuleSpec(
    form="bottleneck",
    representation="ffn",
    insertion="sequential",
    composition="add",
    size=48,
    nonlinearity="relu",
    init="near_identity",
    init_std=1e-2,
)

PFEIFFER = MethodSpec(
    name="pfeiffer",
    modules={"adapter": FFN_ADAPTER},
    description="sequential bottleneck adapter after the FFN only",
    reference="Pfeiffer et al. AdapterFusion. EACL 2021",
    defaults={"learning_rate": 1e-3},
)

PRESETS = [PFEIFFER]
