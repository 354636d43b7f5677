"""The trainable building blocks that every method spec is made of.

- `Bottleneck`: Δh = s · G(x) · f(x W_down + b_down) W_up + b_up (adapters; LoRA is f = identity, no biases)
- `Gate`: UniPELT's G(x) = σ(x W_g + b_g)
- `PrefixParams` / `PrefixEncoder`: per-layer key/value prefixes, optionally produced by a training-time MLP
- `NormDelta`: the job's own additive LayerNorm scale/shift deltas (Houlsby's trainable LNs, BitFit's β)

All of them compute in the dtype of their own parameters (fp32) and return in the caller's dtype,
so a bf16 backbone works with fp32 PELT parameters.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from pelt_core.dropout import JobDropout
from pelt_core.spec import ModuleSpec

ACTIVATIONS = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "silu": nn.SiLU,
    "identity": nn.Identity,
}


class Gate(nn.Module):
    """UniPELT's gate: a scalar in (0, 1) per token from the module's input."""

    def __init__(self, d_in: int):
        super().__init__()
        self.proj = nn.Linear(d_in, 1)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)
        self.last_mean: torch.Tensor | None = None  # mean gate value of the last forward, for reporting

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.proj(x.to(self.proj.weight.dtype)))
        self.last_mean = gate.detach().mean()
        return gate


def set_composition_scale(module: nn.Module, spec: ModuleSpec) -> None:
    """`module.scale`: s of a "scaled" composition (1 otherwise), a parameter when it is learned."""
    scale = spec.effective_scale if spec.composition == "scaled" else 1.0
    if spec.learned_scale:
        module.scale = nn.Parameter(torch.tensor(float(scale)))
    else:
        module.register_buffer("scale", torch.tensor(float(scale)), persistent=False)


class DenseDelta(nn.Module):
    """Δh = s · G(x) · x ΔWᵀ with ΔW of the modified weight's own shape, zero at the start: full fine-tuning
    of that weight (W + ΔW) as the job's own tensor, the shared W never written."""

    def __init__(self, spec: ModuleSpec, d_in: int, d_out: int):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.zeros(d_out, d_in))
        self.gate = Gate(d_in) if spec.gate else None
        set_composition_scale(self, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(self.weight.dtype)
        delta = F.linear(x, self.weight)  # no scaled copy of the (large) weight for a plain "add"
        if self.spec.composition == "scaled" or self.spec.learned_scale:
            delta = delta * self.scale
        if self.gate is not None:
            delta = delta * self.gate(x)
        return delta.to(dtype)

    def delta_weight(self) -> torch.Tensor:
        """ΔW = s · ΔW: the matrix added to W when merged (ungated only)."""
        if self.gate is not None:
            raise ValueError("a gated dense delta does not fold into a weight matrix")
        return self.weight * self.scale


class Bottleneck(nn.Module):
    """down-projection -> nonlinearity -> up-projection, composed by add or (fixed/learned) scale, optionally gated."""

    def __init__(self, spec: ModuleSpec, d_in: int, d_out: int):
        super().__init__()
        self.spec = spec
        self.down = nn.Linear(d_in, spec.size, bias=spec.proj_bias)
        self.up = nn.Linear(spec.size, d_out, bias=spec.proj_bias)
        self.act = ACTIVATIONS[spec.nonlinearity]()
        self.dropout = JobDropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.gate = Gate(d_in) if spec.gate else None
        set_composition_scale(self, spec)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        spec = self.spec
        if spec.init == "near_identity":
            nn.init.normal_(self.down.weight, std=spec.init_std)
            nn.init.normal_(self.up.weight, std=spec.init_std)
        else:  # "lora" / "zero_up": random down-projection, zero up-projection -> Δh = 0 at init
            nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5))
            nn.init.zeros_(self.up.weight)
        for bias in (self.down.bias, self.up.bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(self.down.weight.dtype)
        hidden = self.act(self.down(self.dropout(x)))
        if self.spec.composition == "scaled" or self.spec.learned_scale:
            # s·(h W_upᵀ + b) = h (s·W_up)ᵀ + s·b: scale the small weight, not the (batch, tokens, d) output
            bias = None if self.up.bias is None else self.up.bias * self.scale
            delta = F.linear(hidden, self.up.weight * self.scale, bias)
        else:
            delta = self.up(hidden)
        if self.gate is not None:
            delta = delta * self.gate(x)
        return delta.to(dtype)

    def delta_weight(self) -> torch.Tensor:
        """ΔW = s · W_up W_down for a linear bottleneck (LoRA): the matrix added to W when merged."""
        if self.spec.nonlinearity != "identity" or self.spec.proj_bias or self.gate is not None:
            raise ValueError(
                "only an ungated linear bottleneck without biases (LoRA) folds into a weight matrix"
            )
        return (self.up.weight @ self.down.weight) * self.scale


class PrefixParams(nn.Module):
    """The l key and value vectors of one attention layer (what a saved delta keeps)."""

    def __init__(self, length: int, kv_dim: int, init_std: float = 1.0):
        super().__init__()
        self.key = nn.Parameter(torch.randn(length, kv_dim) * init_std)
        self.value = nn.Parameter(torch.randn(length, kv_dim) * init_std)


class PrefixEncoder(nn.Module):
    """Li & Liang's training-time reparameterisation: P = MLP(E), shared across layers, dropped after training."""

    def __init__(self, length: int, hidden_size: int, reparam_hidden: int, num_layers: int, kv_dim: int):
        super().__init__()
        self.num_layers, self.kv_dim = num_layers, kv_dim
        self.embedding = nn.Parameter(torch.randn(length, hidden_size) * 0.02)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, reparam_hidden),
            nn.Tanh(),
            nn.Linear(reparam_hidden, num_layers * 2 * kv_dim),
        )

    def forward(self) -> torch.Tensor:
        """All layers' prefixes, shape (num_layers, 2, length, kv_dim)."""
        out = self.mlp(self.embedding)  # (length, num_layers * 2 * kv_dim)
        return out.view(out.shape[0], self.num_layers, 2, self.kv_dim).permute(1, 2, 0, 3)


class NormDelta(nn.Module):
    """Additive deltas on a LayerNorm/RMSNorm: y' = y + x̂ Δγ + Δβ, x̂ the normalised input."""

    def __init__(self, dim: int, scale: bool, shift: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim)) if scale else None
        self.bias = nn.Parameter(torch.zeros(dim)) if shift else None

    def forward(self, norm: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = y
        if self.weight is not None:
            out = out + (normalize_like(norm, x) * self.weight.to(torch.float32)).to(y.dtype)
        if self.bias is not None:
            out = out + self.bias.to(y.dtype)
        return out


def normalize_like(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x̂: what the norm module computes before its affine scale/shift (LayerNorm or RMSNorm), in fp32."""
    x = x.to(torch.float32)
    if isinstance(norm, nn.LayerNorm):
        return F.layer_norm(x, norm.normalized_shape, eps=norm.eps)
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
