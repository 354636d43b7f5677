"""Dropout for the frozen backbone with cheaper random numbers on the CPU.

The backbone keeps its dropout while a job trains (BERT: 0.1 on hidden states and on attention
probabilities), as the PELT papers and their reference implementations do. On a CPU, torch draws one
Mersenne-Twister number per element for `bernoulli_`, and `scaled_dot_product_attention` with dropout
leaves its fused kernel for a math path that does so too: on RTE-length sequences that was ~30% of a
LoRA training step. Here one 64-bit draw from torch's generator gives four 16-bit numbers, so the keep
mask costs about a sixth, and attention with dropout runs as plain matmul → softmax → masked matmul.

Semantics stay those of `torch.nn.Dropout`: each element is kept with probability 1 - p and scaled by
1 / (1 - p), p rounded to a multiple of 1/65536 (0.1 → 0.100006); attention applies the 1 / (1 - p) to
its output instead of to the weights (the same product, on a smaller tensor). `torch.manual_seed` makes it
reproducible. Other devices use torch's own dropout (already fast there), except for jobs with their own
generators (a pack's members, on any device): their masks come from `keep_mask` with their generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

RESOLUTION = 1 << 16  # p is a multiple of 1/RESOLUTION


def keep_mask(
    shape: torch.Size | tuple[int, ...],
    p: float,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """A boolean mask of `shape`, each element True (kept) with probability 1 - p (p rounded to 1/65536)."""
    threshold = round(p * RESOLUTION) if 0.0 <= p < 1.0 else RESOLUTION
    if threshold >= RESOLUTION:
        raise ValueError(f"dropout probability must be in [0, 1 - 2**-17), got {p}")
    count = math.prod(shape)
    bits = torch.empty((count + 3) // 4, dtype=torch.int64, device=device)
    bits.random_(
        -(1 << 63), (1 << 63) - 1, generator=generator
    )  # the full 64 bits (plain random_() leaves the top one 0)
    return keep_from_int16(bits.view(torch.int16)[:count].view(shape), threshold)


def keep_from_int16(values: torch.Tensor, threshold: int) -> torch.Tensor:
    """Uniform 16-bit numbers -> keep flags: exactly 65536 - threshold of the 65536 possible values keep."""
    return values >= threshold - RESOLUTION // 2


def keep_scale(p: float) -> float:
    """1 / (1 - p) for the p that keep_mask really uses."""
    return RESOLUTION / (RESOLUTION - round(p * RESOLUTION))


def _cheap(x: torch.Tensor, p: float) -> bool:
    """Whether the 16-bit masks serve: on the CPU, for p that does not round to 1 (torch's dropout does the rest)."""
    return x.device.type == "cpu" and round(p * RESOLUTION) < RESOLUTION


# (rows, generator) per consecutive slice of a batch
RowGenerators = list[tuple[int, "torch.Generator | None"]]


def dropout(
    x: torch.Tensor, p: float, training: bool = True, generators: RowGenerators | None = None
) -> torch.Tensor:
    """`F.dropout` with the cheap keep mask on the CPU; with `generators`, each consecutive slice of rows
    (dim 0) draws its mask from its own generator (a job's rows in a pack: pelt_core.pack)."""
    if not training or p == 0.0:
        return x
    if generators is not None:
        return x * row_keep_mask(x.shape, p, x.device, generators).to(x.dtype).mul_(keep_scale(p))
    if not _cheap(x, p):
        return F.dropout(x, p, training=True)
    # a float mask and a multiply: on the CPU cheaper forward and backward than torch.where or masked_fill
    return x * keep_mask(x.shape, p, x.device).to(x.dtype).mul_(keep_scale(p))


def row_keep_mask(
    shape: torch.Size | tuple[int, ...], p: float, device: torch.device | str, generators: RowGenerators
) -> torch.Tensor:
    """A keep mask whose rows (dim 0) come in slices, each drawn from its own generator (None: torch's)."""
    if sum(rows for rows, _ in generators) != shape[0]:
        raise ValueError(
            f"row generators cover {sum(r for r, _ in generators)} rows, the tensor has {shape[0]}"
        )
    pieces = [keep_mask((rows, *shape[1:]), p, device, generator) for rows, generator in generators]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


class BackboneDropout(nn.Dropout):
    """nn.Dropout that draws its mask with `keep_mask` (installed in place of the backbone's own).

    `row_generators`, when set (by pelt_core.runtime), says which generator draws each slice of rows."""

    row_generators: Callable[[], RowGenerators | None] | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        generators = self.row_generators() if self.row_generators is not None and self.training else None
        if generators is not None and sum(rows for rows, _ in generators) != input.shape[0]:
            generators = None  # not a batch-first tensor: torch's generator draws its mask
        return dropout(input, self.p, self.training, generators)


class JobDropout(nn.Dropout):
    """Dropout inside one job's own modules (head, bottlenecks): its masks come from the job's generator
    when one is set (`JobDelta.use_generator`), else from torch's."""

    generator: torch.Generator | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.generator is None or not self.training or self.p == 0.0:
            return super().forward(input)
        return dropout(input, self.p, True, [(input.shape[0], self.generator)])


def use_backbone_dropout(model: nn.Module) -> int:
    """Replace every plain nn.Dropout of `model` by a BackboneDropout with the same p; returns how many.

    The module tree changes, no tensor does (dropout has no state)."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                swapped = BackboneDropout(child.p, child.inplace)
                swapped.train(child.training)
                setattr(parent, name, swapped)
                replaced += 1
    return replaced


def attention_with_dropout(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    p: float,
    scale: float | None = None,
    is_causal: bool = False,
    generators: RowGenerators | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale + mask) with dropout, times v: what `scaled_dot_product_attention` computes.

    query (B, H, Q, D), key/value (B, H, K, D) (GQA heads already repeated); attention_mask broadcastable
    to (B, H, Q, K), boolean (True = attend) or additive; returns (B, H, Q, D); `generators`: as `dropout`. A row with nothing
    to attend to gets uniform weights instead of NaN (padding rows only; their outputs are never read)."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    # scores and softmax in fp32 whatever the inputs (bf16 autocast, a bf16 backbone), as sdpa's math path does
    scores = torch.matmul(query, key.transpose(-1, -2)).float().mul_(scale)
    lowest = torch.finfo(scores.dtype).min
    if is_causal:
        q_len, k_len = scores.shape[-2], scores.shape[-1]
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
        scores = scores.masked_fill(~causal, lowest)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, lowest)
        else:  # additive; -inf (some models' masks) clamped so a fully masked row gets uniform weights, not NaN
            scores = scores + attention_mask.to(scores.dtype).clamp(min=lowest)
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    if p == 0.0:
        return torch.matmul(weights, value)
    if generators is not None:
        kept = weights * row_keep_mask(weights.shape, p, weights.device, generators).to(weights.dtype)
        return torch.matmul(kept, value).mul_(keep_scale(p))
    if not _cheap(weights, p):
        return torch.matmul(F.dropout(weights, p, training=True), value)
    kept = weights * keep_mask(weights.shape, p, weights.device).to(weights.dtype)
    return torch.matmul(kept, value).mul_(keep_scale(p))  # 1/(1-p) on the (smaller) output, not the weights
