"""Tensor-level operations of composition: TIES trimming and sign election, DARE dropping, and LoRA modules
as factors of ΔW with their truncated-SVD re-factorisation (the rules: `pelt_core.compose`'s docstring).

Public building blocks (checked by hand in the tests): `trim_to_density`, `ties_combine`, `dare_sparsify`,
`is_low_rank`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pelt_core.compose_options import CompositionError, check_density
from pelt_core.spec import MethodSpec, ModuleSpec


# --------------------------------------------------------------------------------------------------
# TIES and DARE on one tensor
# --------------------------------------------------------------------------------------------------
def trim_to_density(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """TIES trim: keep the ⌈density·n⌉ (at least 1) largest-magnitude entries, zero the rest."""
    check_density(density)
    n = tensor.numel()
    if n == 0:
        return tensor.clone()
    k = min(n, max(1, math.ceil(density * n * (1 - 1e-12))))  # the guard absorbs float error in density·n
    if k == n:
        return tensor.clone()
    flat = tensor.reshape(-1)
    keep = torch.zeros(n, dtype=torch.bool, device=tensor.device)
    keep[flat.abs().topk(k).indices] = True
    return torch.where(keep, flat, torch.zeros_like(flat)).view_as(tensor)


def ties_combine(
    tensors: Sequence[torch.Tensor], density: float = 1.0, weights: Sequence[float] | None = None
) -> torch.Tensor:
    """TIES on one tensor of n task vectors: trim each, elect the sign of Σ w_i τ̂_i, then the weighted
    disjoint mean."""
    if not tensors:
        raise CompositionError("ties_combine: no tensors")
    weights = [1.0] * len(tensors) if weights is None else list(weights)
    if len(weights) != len(tensors):
        raise CompositionError(f"ties_combine: {len(weights)} weights for {len(tensors)} tensors")
    trimmed = torch.stack([trim_to_density(t, density) for t in tensors])
    w = torch.tensor(weights, dtype=trimmed.dtype, device=trimmed.device).view(-1, *[1] * (trimmed.dim() - 1))
    weighted = trimmed * w
    elected = torch.sign(weighted.sum(0))
    agree = (torch.sign(trimmed) == elected) & (elected != 0)
    total = (weighted * agree).sum(0)
    mass = (w * agree).sum(0)
    return torch.where(
        agree.any(0), total / mass.where(mass != 0, torch.ones_like(mass)), torch.zeros_like(total)
    )


def dare_sparsify(tensor: torch.Tensor, drop_rate: float, generator: torch.Generator) -> torch.Tensor:
    """DARE: drop each entry with probability p (u < p, u = torch.rand(shape, generator)), rescale the
    survivors by 1/(1-p)."""
    if not 0.0 <= drop_rate < 1.0:
        raise CompositionError(f"drop rate must be in [0, 1), got {drop_rate!r}")
    keep = (torch.rand(tensor.shape, generator=generator) >= drop_rate).to(tensor.device)
    return torch.where(keep, tensor / (1.0 - drop_rate), torch.zeros_like(tensor))


# --------------------------------------------------------------------------------------------------
# LoRA modules as factors of ΔW
# --------------------------------------------------------------------------------------------------
def is_low_rank(spec: ModuleSpec) -> bool:
    """A LoRA-like module: a linear bottleneck without biases or gate, so its effect is ΔW = s·B·A."""
    return (
        spec.form == "bottleneck" and spec.nonlinearity == "identity" and not spec.proj_bias and not spec.gate
    )


def low_rank_roles(spec: MethodSpec) -> list[str]:
    """The method's module roles that are LoRA-like (`is_low_rank`)."""
    return [role for role, module in spec.modules.items() if is_low_rank(module)]


@dataclass
class LoraFactors:
    """A LoRA module as factors: ΔW = up_scaled @ down (up_scaled = s·B)."""

    down: torch.Tensor  # A, (r, d_in)
    up_scaled: torch.Tensor  # s·B, (d_out, r)

    def delta_weight(self) -> torch.Tensor:
        return self.up_scaled @ self.down


def svd_factors(delta_weight: torch.Tensor, rank: int) -> LoraFactors:
    """Truncated SVD: ΔW ≈ (U_k S_k^½)(S_k^½ V_kᵀ), the best rank-k approximation."""
    u, s, vh = torch.linalg.svd(delta_weight.to(torch.float64), full_matrices=False)
    k = min(rank, s.numel())
    root = s[:k].sqrt()
    return LoraFactors(root[:, None] * vh[:k], u[:, :k] * root[None, :])


def spec_with_ranks(spec: MethodSpec, ranks: dict[str, int]) -> MethodSpec:
    """The method spec with new LoRA ranks, keeping each module's scale s (α' = s·r' where α was given)."""
    data = spec.to_dict()
    for role, rank in ranks.items():
        module = data["modules"][role]
        if module["alpha"] is not None:
            module["alpha"] = spec.modules[role].effective_scale * rank
        module["size"] = rank
    return MethodSpec.from_dict(data)
