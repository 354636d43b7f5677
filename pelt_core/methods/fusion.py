"""AdapterFusion (Pfeiffer et al., "AdapterFusion: Non-Destructive Task Composition for Transfer Learning",
EACL 2021): learn, per layer, how to combine frozen adapters that other tasks trained.

Stage one trained an adapter per source task (stored deltas). Stage two, the fusion job, keeps them frozen and
learns, at every sub-layer where they sit, an attention over their outputs, plus the target task's head:

    s_n = softmax_n( (h Q) · (a_n K) )         h: the sub-layer's output, a_n = adapter n's Δh there
    h'  = h + Σ_n s_n · (a_n V)                 Q, K: d×d with bias, random; V: d×d, identity at the start

so at the start h' is h plus the mean of the adapters' outputs. The loss adds the paper's λ‖I − V‖² per layer
(λ = 0.01, the paper's code's value), which keeps V near identity. Query, keys and values as in the paper's
dynamic variant (AdapterHub's default): no scaling of the scores, values projected before the softmax's
weighting, the residual added after. The paper trains fusion at 5e-5 for 10 epochs (BERT-base); the preset
keeps that rate.

Which sources join: bottleneck adapters on a sub-layer's output (Pfeiffer's, Houlsby's, the parallel and
scaled adapters), sequential or parallel, ungated. LoRA and prefix deltas are refused with the reason
(`pelt_core.spec.fusion_refusal`): they act inside the attention (on a weight matrix, or on every head's keys
and values), so no per-source output exists at a sub-layer for the fusion to attend over; compose them with a
merge instead. A source's LayerNorm and bias deltas (Houlsby's trainable LayerNorms, BitFit) are left out:
they change the shared norms for every adapter at once, and AdapterHub's adapters that the paper fused have
none. The target's own adapter may train alongside (`own_adapter`), one more member of the attention, at its
own preset's rate (`lr_multiplier` 20: 1e-3 beside the fusion's 5e-5); or, as in the paper, the target's
stored adapter joins as one more frozen source.

A fused delta holds its sources' adapters too, so it loads, predicts and serves as any other delta; its spec
names each source's task, version and sha256 (`FusionSpec.sources`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pelt_core.methods.pfeiffer import FFN_ADAPTER, PFEIFFER
from pelt_core.spec import FusionSource, FusionSpec, MethodSpec, ModuleSpec, SpecError, fusion_refusal

LEARNING_RATE = 5e-5  # the paper's AdapterFusion rate
REGULARIZATION = 0.01  # λ of λ‖I − V‖²
# the target's own adapter, trained alongside, learns at its own preset's rate (1e-3 at the job's 5e-5)
OWN_ADAPTER = dataclasses.replace(
    FFN_ADAPTER, lr_multiplier=PFEIFFER.defaults["learning_rate"] / LEARNING_RATE
)


class FusionError(SpecError):
    """A fusion's sources cannot be fused (a method fusion cannot use, another backbone, a fusion itself)."""


@dataclass(frozen=True)
class Source:
    """A stored delta to fuse: where it came from and its method spec."""

    task: str
    sha256: str
    method: MethodSpec
    version: int | None = None


class FusionLayer(nn.Module):
    """One sub-layer's attention over its adapters' outputs (the module docstring's formula)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size, bias=False)
        for projection in (self.query, self.key):
            nn.init.normal_(projection.weight, std=0.02)
            nn.init.zeros_(projection.bias)
        with torch.no_grad():
            self.value.weight.copy_(torch.eye(hidden_size))
        self.last_weights: torch.Tensor | None = None  # mean attention per member in the last forward

    def forward(self, hidden: torch.Tensor, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Σ_n s_n (a_n V) for the adapters' outputs a_n (each shaped like `hidden`), in `hidden`'s dtype."""
        dtype = hidden.dtype
        weight_dtype = self.query.weight.dtype
        members = torch.stack([output.to(weight_dtype) for output in outputs], dim=-2)  # (..., N, d)
        query = self.query(hidden.to(weight_dtype)).unsqueeze(-1)  # (..., d, 1)
        scores = torch.matmul(self.key(members), query).squeeze(-1)  # (..., N)
        weights = torch.softmax(scores, dim=-1)
        self.last_weights = weights.detach().reshape(-1, weights.shape[-1]).mean(0)
        fused = torch.matmul(weights.unsqueeze(-2), self.value(members)).squeeze(-2)  # (..., d)
        return fused.to(dtype)

    def value_penalty(self) -> torch.Tensor:
        """‖I − V‖² of this layer."""
        identity = torch.eye(self.value.weight.shape[0], device=self.value.weight.device)
        return (identity - self.value.weight).pow(2).sum()


def fusable_roles(method: MethodSpec, label: str) -> list[str]:
    """The roles of `method`'s modules a fusion takes; a FusionError naming `label` (e.g. "source sst2 v3")
    when the method has one fusion cannot use, or is a fusion itself."""
    if method.fusion is not None:
        raise FusionError(
            f"{label}: method {method.name!r} is itself a fusion; fuse its sources directly instead"
        )
    if not method.modules:
        raise FusionError(f"{label}: method {method.name!r} has no adapter modules to fuse")
    for role, module in method.modules.items():
        reason = fusion_refusal(module)
        if reason is not None:
            raise FusionError(
                f"{label}: method {method.name!r} cannot join an AdapterFusion: its module {role!r} is "
                f"{module.form} on {module.representation}, and {reason}. AdapterFusion fuses bottleneck "
                "adapters (pfeiffer, houlsby, parallel_adapter, scaled_pa); compose LoRA or prefix deltas "
                "with a merge instead"
            )
    return list(method.modules)


def fusion_method(
    sources: Sequence[Source],
    own_adapter: ModuleSpec | bool = False,
    regularization: float = REGULARIZATION,
    name: str = "fusion",
) -> MethodSpec:
    """The method spec of a fusion of `sources` (their adapters frozen, as roles `s<i>_<role>`), plus the
    target's own adapter trained alongside when `own_adapter` is true (Pfeiffer's at its preset's rate, 20×
    the fusion's, or the ModuleSpec given)."""
    if not sources:
        raise FusionError("a fusion needs at least one source delta")
    modules: dict[str, ModuleSpec] = {}
    recorded: list[FusionSource] = []
    for index, source in enumerate(sources, start=1):
        label = f"source {source.task}" + (f" version {source.version}" if source.version is not None else "")
        roles = {}
        for role in fusable_roles(source.method, label):
            modules[f"s{index}_{role}"] = source.method.modules[role]
            roles[f"s{index}_{role}"] = role
        recorded.append(FusionSource(source.task, source.sha256, source.method.name, roles, source.version))
    if own_adapter:
        modules["adapter"] = own_adapter if isinstance(own_adapter, ModuleSpec) else OWN_ADAPTER
    if len(modules) < 2:
        raise FusionError(
            "AdapterFusion attends over two or more adapters: give a second source, or train the target's own "
            "adapter alongside"
        )
    described = ", ".join(s.task for s in sources) + (" + the target's own adapter" if own_adapter else "")
    spec = MethodSpec(
        name=name,
        modules=modules,
        description=f"AdapterFusion of {described}",
        reference="Pfeiffer et al. AdapterFusion: Non-Destructive Task Composition for Transfer Learning. EACL 2021",
        defaults={"learning_rate": LEARNING_RATE},
        fusion=FusionSpec(tuple(recorded), regularization),
    )
    spec.validate()
    return spec


def load_sources(delta: nn.Module, sources: Mapping[str, nn.Module]) -> None:
    """Copy each source delta's adapter weights into the fusion `delta`'s frozen modules and freeze them.

    `sources` maps each source's sha256 (as the spec records it) to its loaded JobDelta."""
    fusion = delta.method.fusion
    if fusion is None:
        raise FusionError(f"method {delta.method.name!r} is not a fusion")
    for recorded in fusion.sources:
        source = sources.get(recorded.sha256)
        if source is None:
            raise FusionError(
                f"source {recorded.task} (sha256 {recorded.sha256[:12]}…) was not given to the fusion"
            )
        for fused_role, own_role in recorded.roles.items():
            copied = 0
            for layer_key, sites in delta.layers.items():
                for site_key, modules in sites.items():
                    if fused_role not in modules:
                        continue
                    try:
                        source_module = source.layers[layer_key][site_key][own_role]
                    except KeyError:
                        raise FusionError(
                            f"source {recorded.task}: it has no module {own_role!r} at layer {layer_key} "
                            f"{site_key}, where its method spec puts one"
                        ) from None
                    try:
                        modules[fused_role].load_state_dict(source_module.state_dict())
                    except RuntimeError as exc:
                        raise FusionError(
                            f"source {recorded.task}: module {own_role!r} does not fit the fusion's {fused_role!r}: {exc}"
                        ) from None
                    copied += 1
            if copied == 0:
                raise FusionError(f"source {recorded.task}: module {own_role!r} placed nowhere in the fusion")
    freeze_sources(delta)


def freeze_sources(delta: nn.Module) -> None:
    """The source adapters of a fusion `delta` take no gradient (the fusion layers, own adapter and head do)."""
    frozen = delta.method.fusion.frozen_roles if delta.method.fusion is not None else frozenset()
    for sites in delta.layers.values():
        for modules in sites.values():
            for role, module in modules.items():
                if role in frozen:
                    module.requires_grad_(False)


def value_penalty(delta: nn.Module) -> torch.Tensor | None:
    """λ Σ_layers ‖I − V‖² of a fusion delta (None for any other method): added to its training loss."""
    fusion = delta.method.fusion
    if fusion is None or fusion.regularization == 0:
        return None
    penalties = [module.value_penalty() for module in delta.modules() if isinstance(module, FusionLayer)]
    return fusion.regularization * torch.stack(penalties).sum() if penalties else None


def fusion_weights(delta: nn.Module) -> dict[str, float]:
    """The mean attention each member got in the last forward, over layers (empty for other methods)."""
    totals: dict[str, list[float]] = {}
    for sites in delta.layers.values():
        for modules in sites.values():
            layer = modules["fusion"] if "fusion" in modules else None  # noqa: SIM401 (a ModuleDict)
            if not isinstance(layer, FusionLayer) or layer.last_weights is None:
                continue
            members = [role for role in modules if role != "fusion"]
            for role, weight in zip(members, layer.last_weights.tolist(), strict=False):
                totals.setdefault(role, []).append(weight)
    return {role: sum(values) / len(values) for role, values in totals.items()}


PRESETS: list[MethodSpec] = []  # a fusion is built from its sources (`fusion_method`), not a fixed preset
