"""Composition of trained deltas: merging, averaging, multi-task serving and LoRA folding.

Every function here returns something new and never writes its inputs. A composed `JobDelta` is an
ordinary delta: serve it with `PeltModel`, save it with `save_composed` (= `save_delta` with its
provenance in the manifest's `extra["composition"]`) and load it back with `load_delta`.

Task vectors
    Task arithmetic, TIES and DARE combine task vectors τ = θ_task − θ_base. A PELT delta's tensors
    live outside the backbone and (LoRA's B, parallel adapters' up-projection, bias and norm deltas)
    start at zero effect, so pelt takes a delta's own tensors as its task vector, for every tensor:
    heads, gates, prefixes and near-identity adapters included (their τ is taken relative to 0).

Low-rank (LoRA) modules
    A bottleneck with identity nonlinearity, no biases and no gate adds ΔW = s·B·A to its matrix
    (`Bottleneck.delta_weight()`), and a weighted sum of factors is not a weighted sum of ΔW's, so these
    modules combine by ΔW:
    - linear merge / average: exactly, by concatenating factors. Rank Σ r_i, A = [A_1; …; A_n],
      B = [c_1 B_1 … c_n B_n] with c_i = λ·w_i·s_i/s', so s'·B·A = λ Σ w_i ΔW_i. With `lora_rank=k`
      the result is compressed instead (truncated SVD, below).
    - TIES / DARE: trim or drop, elect and combine the dense ΔW_i, then factor the result back to a LoRA
      of rank `lora_rank` (default: the inputs' rank) by truncated SVD: ΔW ≈ U_k S_k V_kᵀ,
      A = S_k^½ V_kᵀ, B = U_k S_k^½ / s'. This is the best rank-k approximation (Eckart–Young);
      lora_rank = min(d_in, d_out) keeps it exact. A rank above the matrix's rank pads with zeros.
    - `merge_lora_svd`: LoRA deltas of different ranks, Σ w_i ΔW_i truncated to one rank.
    The composed spec keeps the inputs' scale s' = s (α' = s·r' where the input used α = s·r); a
    learned scale is reset to that value and absorbed into B. Gated LoRA (UniPELT) is not linear in
    ΔW and combines parameter-wise like everything else: adapters, BitFit biases, norm deltas,
    prefixes, gates and heads.

Merges (λ = `scale`, weights w_i)
    linear  θ = λ Σ w_i θ_i; w defaults to 1/n (the plain average). Any real weights (task negation).
    ties    Yadav et al. 2023. Per tensor: keep each τ_i's ⌈density·n⌉ largest magnitudes (at least one;
            trimmed per tensor as PEFT and mergekit do, where the paper trims the whole vector), elect
            γ = sgn(Σ w_i τ̂_i), then the disjoint mean of the entries that agree with γ:
            θ = λ Σ_{i: sgn τ̂_i = γ} w_i τ̂_i / Σ_{i: sgn τ̂_i = γ} w_i (0 where γ = 0). w defaults to 1
            (the paper's plain disjoint mean) and must be > 0.
    dare    Yu et al. 2024. Drop rate p = 1 − density: τ̂_i = m_i ⊙ τ_i / (1 − p) with m_i = [u ≥ p],
            u = torch.rand(shape, generator=g), g = torch.Generator().manual_seed(seed) drawn for delta
            0's tensors in sorted key order (`task_vector`), then delta 1's, … Then combine="linear"
            (w default 1/n, so E[result] = the linear merge) or combine="ties" (TIES on τ̂ without
            further trimming; w default 1).

`average` is the uniform "model soup": the parameter mean of every tensor, except LoRA modules, whose
mean is taken over ΔW (by concatenation, exact): the factors of independently initialised runs span
different subspaces, so the mean of the A's times the mean of the B's means nothing.

Backbones: a delta loaded with `load_delta` (or composed here) knows its backbone's content hash, and
deltas from different backbones are refused; a freshly trained delta does not, so pass `backbone=` to
check it (shapes are always checked) and to record the backbone's hash in the provenance.

Provenance (`delta.provenance`, written to the manifest by `save_composed`): the operation (e.g.
"merge(ties)"), weights, λ, density / drop rate / seed, how LoRA was combined and to which rank, the
backbone hash, and per input its name (mapping key, else "delta<i>"), method, LoRA ranks and
`tensors_sha256(delta)` of its tensors. That hash is reproducible (a delta loaded
back from disk has the same one); the sha256 of a delta *file* is not a function of its tensors alone.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pelt_core.backbones import Backbone
from pelt_core.delta import SavedDelta, save_delta
from pelt_core.layers import Bottleneck
from pelt_core.limits import COMPOSE_RANGES, LimitError
from pelt_core.model import JobDelta, PeltModel
from pelt_core.spec import MethodSpec, ModuleSpec
from pelt_core.vocabulary import COMPOSE_OPTIONS

MERGE_METHODS = ("linear", "ties", "dare")
DARE_COMBINES = ("linear", "ties")
DEFAULT_DENSITY = {"ties": 0.2, "dare": 0.1}  # TIES paper: top 20 %; DARE paper: p = 0.9
DELTA_WEIGHT = ".delta_weight"  # task-vector key suffix of a LoRA module's dense ΔW

Deltas = Sequence[JobDelta] | Mapping[str, JobDelta]


class CompositionError(ValueError):
    """Deltas that cannot be composed together, or a composition argument out of range (`field`: its name)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


OPTIONS = COMPOSE_OPTIONS  # the keyword options each operation takes (pelt_core.vocabulary)


def check_options(op: str, options: Mapping[str, Any], sources: int) -> None:
    """An operation's options before any delta is loaded: known to `op`, of the right type, within the
    ranges of `limits.COMPOSE_RANGES`, one weight per source. A CompositionError names the option (`field`).
    The bounds that depend on the deltas (a rank at most what their matrices hold) are checked by the
    operations themselves, still before anything is allocated."""
    if op not in OPTIONS:
        raise CompositionError(f"op must be one of {', '.join(OPTIONS)}, got {op!r}", field="op")
    for name, value in options.items():
        if name not in OPTIONS[op]:
            raise CompositionError(
                f"{name}: not an option of {op}; its options: {', '.join(OPTIONS[op]) or '(none)'}",
                field=name,
            )
        if name == "how" and value not in MERGE_METHODS:
            raise CompositionError(
                f"how must be one of {', '.join(MERGE_METHODS)}, got {value!r}", field=name
            )
        if name == "combine" and value not in DARE_COMBINES:
            raise CompositionError(
                f"combine must be one of {', '.join(DARE_COMBINES)}, got {value!r}", field=name
            )
        if name == "weights" and value is not None:
            if isinstance(value, str | bytes) or not isinstance(value, Sequence):
                raise CompositionError(
                    f"weights must be a list of {sources} numbers, got {value!r}", field=name
                )
            if len(value) != sources:
                raise CompositionError(
                    f"{len(value)} weights for {sources} deltas; give one weight per delta", field=name
                )
            for index, weight in enumerate(value):
                _in_range("weights", weight, f"weights[{index}]")
        elif name in COMPOSE_RANGES and not (value is None and name in ("lora_rank", "density")):
            _in_range(name, value, name)
    if op == "merge_lora_svd" and options.get("rank") is None:
        raise CompositionError("rank: merge_lora_svd needs the rank of its result", field="rank")


def _in_range(name: str, value: Any, field: str) -> None:
    try:
        COMPOSE_RANGES[name].check(value, field)
    except LimitError as exc:
        raise CompositionError(str(exc), field=field) from None


# --------------------------------------------------------------------------------------------------
# Tensor-level operations (public: the building blocks, checked by hand in the tests)
# --------------------------------------------------------------------------------------------------
def trim_to_density(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """TIES trim: keep the ⌈density·n⌉ (at least 1) largest-magnitude entries, zero the rest."""
    _check_density(density)
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
    """TIES on one tensor of n task vectors: trim each, elect the sign of Σ w_i τ̂_i, weighted disjoint mean."""
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
    """DARE: drop each entry with probability p (u < p, u = torch.rand(shape, generator)), rescale survivors by 1/(1-p)."""
    if not 0.0 <= drop_rate < 1.0:
        raise CompositionError(f"drop rate must be in [0, 1), got {drop_rate!r}")
    keep = (torch.rand(tensor.shape, generator=generator) >= drop_rate).to(tensor.device)
    return torch.where(keep, tensor / (1.0 - drop_rate), torch.zeros_like(tensor))


def is_low_rank(spec: ModuleSpec) -> bool:
    """A LoRA-like module: a linear bottleneck without biases or gate, so its effect is ΔW = s·B·A."""
    return (
        spec.form == "bottleneck" and spec.nonlinearity == "identity" and not spec.proj_bias and not spec.gate
    )


def tensors_sha256(delta: JobDelta) -> str:
    """sha256 over a delta's state-dict tensors (sorted name, dtype, shape, bytes): its reproducible identity,
    the same as `backbones.state_dict_hash` (which cannot hash 0-dim tensors such as a learned scale)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(delta.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def task_vector(delta: JobDelta) -> dict[str, torch.Tensor]:
    """A delta as TIES/DARE see it (float64, CPU, sorted keys): every state-dict tensor, except that each
    LoRA module is one dense ΔW = s·B·A under `<module path>.delta_weight`."""
    return _task_vector(_view("delta", delta))


# --------------------------------------------------------------------------------------------------
# Merging
# --------------------------------------------------------------------------------------------------
def merge(
    deltas: Deltas,
    weights: Sequence[float] | None = None,
    how: str = "linear",
    *,
    density: float | None = None,
    seed: int = 0,
    scale: float = 1.0,
    combine: str = "linear",
    lora_rank: int | None = None,
    backbone: Backbone | None = None,
) -> JobDelta:
    """Merge deltas of one method and shape into a new delta, in eval mode (rules: the module docstring).

    weights: one per delta (default 1/n, or 1 for TIES); how: linear | ties | dare; density: the kept
    fraction (TIES trim; DARE keep probability 1 − p); seed: DARE's drop masks; scale: λ; combine: DARE's
    linear | ties; lora_rank: refactor LoRA modules to this rank by SVD; backbone: check hashes against it.
    """
    if how not in MERGE_METHODS:
        raise CompositionError(f"how must be one of {', '.join(MERGE_METHODS)}, got {how!r}")
    if how == "linear" and density is not None:
        raise CompositionError("density applies to how='ties' and how='dare', not to a linear merge")
    if how != "dare" and combine != "linear":
        raise CompositionError("combine applies to how='dare' only")
    if how == "dare" and combine not in DARE_COMBINES:
        raise CompositionError(f"combine must be one of {', '.join(DARE_COMBINES)}, got {combine!r}")
    views = _views(deltas, "merge")
    _check_compatible(views, backbone, "merge", same_ranks=True)
    uses_ties = how == "ties" or (how == "dare" and combine == "ties")
    w = _weights(weights, len(views), default=1.0 if uses_ties else 1.0 / len(views), positive=uses_ties)
    scale = _finite(scale, "scale")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise CompositionError(f"seed must be a whole number >= 0, got {seed!r}", field="seed")
    if lora_rank is not None:
        _check_rank(lora_rank, "lora_rank")
        _check_rank_fits(lora_rank, "lora_rank", views)
    if how != "linear":
        density = DEFAULT_DENSITY[how] if density is None else density
        _check_density(density)
    spec = views[0].delta.method
    low_roles = _low_rank_roles(spec)
    provenance: dict[str, Any] = {
        "op": f"merge({how})" if how != "dare" or combine == "linear" else "merge(dare+ties)",
        "how": how,
        "weights": w,
        "scale": scale,
    }

    if how == "linear":
        dense = {
            key: scale * sum(wi * v.dense[key] for wi, v in zip(w, views, strict=True))
            for key in views[0].dense
        }
        low_rank = {
            path: _Factors(
                torch.cat([v.low_rank[path].down for v in views], 0),
                torch.cat(
                    [scale * wi * v.low_rank[path].up_scaled for wi, v in zip(w, views, strict=True)], 1
                ),
            )
            for path in views[0].low_rank
        }
        if lora_rank is None:
            ranks = {role: sum(v.delta.method.modules[role].size for v in views) for role in low_roles}
        else:
            ranks = dict.fromkeys(low_roles, lora_rank)
            low_rank = {path: _svd_factors(f.delta_weight(), lora_rank) for path, f in low_rank.items()}
        provenance["lora"] = ("concat" if lora_rank is None else "svd") if low_rank else None
    else:
        vectors = [_task_vector(v) for v in views]
        if how == "dare":
            drop_rate = 1.0 - density
            generator = torch.Generator().manual_seed(seed)
            vectors = [
                {key: dare_sparsify(t, drop_rate, generator) for key, t in vector.items()}
                for vector in vectors
            ]
            provenance.update(density=density, drop_rate=drop_rate, seed=seed, combine=combine)
        else:
            provenance.update(density=density)
        merged = {}
        for key in vectors[0]:
            tensors = [vector[key] for vector in vectors]
            if uses_ties:
                merged[key] = scale * ties_combine(tensors, density if how == "ties" else 1.0, w)
            else:
                merged[key] = scale * sum(wi * t for wi, t in zip(w, tensors, strict=True))
        ranks = {role: (lora_rank or spec.modules[role].size) for role in low_roles}
        dense, low_rank = _split(merged, ranks)
        provenance["lora"] = "svd" if low_rank else None
    provenance["lora_rank"] = lora_rank
    return _compose(views, _spec_with_ranks(spec, ranks), dense, low_rank, provenance, backbone)


def average(deltas: Deltas, *, lora_rank: int | None = None, backbone: Backbone | None = None) -> JobDelta:
    """The uniform mean of deltas with one config (e.g. seeds of one method): a parameter "model soup",
    with LoRA modules averaged over ΔW by concatenation (rank n·r; `lora_rank` compresses by SVD)."""
    result = merge(deltas, None, "linear", lora_rank=lora_rank, backbone=backbone)
    result.provenance["op"] = "average"
    return result


def merge_lora_svd(
    deltas: Deltas, weights: Sequence[float] | None, rank: int, *, backbone: Backbone | None = None
) -> JobDelta:
    """LoRA deltas of possibly different ranks → Σ w_i ΔW_i per matrix → truncated SVD to `rank`
    (A = S^½Vᵀ, B = U S^½ / s): exact when rank ≥ the sum's rank, else the best rank-`rank` approximation.
    Any other tensors (head, BitFit biases) are summed with the same weights; w defaults to 1/n."""
    _check_rank(rank, "rank")
    views = _views(deltas, "merge_lora_svd")
    _check_compatible(views, backbone, "merge_lora_svd", same_ranks=False)
    _check_rank_fits(rank, "rank", views)
    spec = views[0].delta.method
    low_roles = _low_rank_roles(spec)
    if not low_roles:
        raise CompositionError(
            f"merge_lora_svd: method {spec.name!r} has no LoRA module (a linear bottleneck "
            "without biases or gate); use merge()"
        )
    w = _weights(weights, len(views), default=1.0 / len(views), positive=False)
    dense = {key: sum(wi * v.dense[key] for wi, v in zip(w, views, strict=True)) for key in views[0].dense}
    low_rank = {
        path: _svd_factors(
            sum(wi * v.low_rank[path].delta_weight() for wi, v in zip(w, views, strict=True)), rank
        )
        for path in views[0].low_rank
    }
    provenance = {
        "op": "merge_lora_svd",
        "weights": w,
        "lora_rank": rank,
        "lora": "svd",
        "input_ranks": [{role: v.delta.method.modules[role].size for role in low_roles} for v in views],
    }
    return _compose(
        views, _spec_with_ranks(spec, dict.fromkeys(low_roles, rank)), dense, low_rank, provenance, backbone
    )


def save_composed(
    delta: JobDelta, backbone: Backbone, out_dir: str | Path, extra: dict[str, Any] | None = None
) -> SavedDelta:
    """`save_delta` with the delta's provenance in the manifest, under `extra["composition"]`."""
    provenance = getattr(delta, "provenance", None)
    if provenance is None:
        raise CompositionError(
            "this delta was not composed by pelt_core.compose (no provenance); use save_delta"
        )
    known = provenance.get("backbone_hash")
    if known is not None and known != backbone.content_hash:
        raise CompositionError(
            f"this delta was composed from deltas of backbone {known[:12]}…, "
            f"not of {backbone.name!r} ({backbone.content_hash[:12]}…)"
        )
    return save_delta(delta, backbone, out_dir, extra={**(extra or {}), "composition": provenance})


# --------------------------------------------------------------------------------------------------
# Multi-task serving and LoRA folding
# --------------------------------------------------------------------------------------------------
class MultiTaskModel(PeltModel):
    """Several task deltas on one shared backbone; a batch of mixed tasks runs in one backbone forward."""

    @property
    def tasks(self) -> list[str]:
        return list(self.deltas)

    def forward_tasks(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        tasks: Sequence[str],
        token_type_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Per-row logits (one 1-D tensor per row, in input order); row i goes through task tasks[i]."""
        if len(tasks) != input_ids.shape[0]:
            raise ValueError(f"{len(tasks)} task names for a batch of {input_ids.shape[0]} rows")
        groups: dict[str, list[int]] = {}
        for row, task in enumerate(tasks):
            if task not in self.deltas:
                raise KeyError(f"no task named {task!r}; this model serves {', '.join(self.deltas)}")
            groups.setdefault(task, []).append(row)
        order = [row for rows in groups.values() for row in rows]
        index = torch.tensor(order, device=input_ids.device)
        outputs = self(
            input_ids[index],
            attention_mask[index],
            None if token_type_ids is None else token_type_ids[index],
            routes=[(task, len(rows)) for task, rows in groups.items()],
        )
        if isinstance(outputs, torch.Tensor):
            outputs = [outputs]
        per_row: list[torch.Tensor] = [None] * len(order)  # type: ignore[list-item]
        for row, logits in zip(order, (r for block in outputs for r in block), strict=True):
            per_row[row] = logits
        return per_row

    @torch.no_grad()
    def predict(
        self, items: Sequence[tuple[str, str | tuple[str, str]]], batch_size: int = 32, max_length: int = 128
    ) -> list[dict]:
        """Predictions for (task, text) or (task, (text, text_pair)) items, in input order; each chunk of
        `batch_size` items is one backbone forward. Same result format as `pelt_core.model.predict`, plus "task"."""
        for position, item in enumerate(items):
            if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError(
                    f"item {position}: expected (task, text) or (task, (text, text_pair)), got {item!r}"
                )
        was_training = self.training
        self.eval()
        device = next(self.deltas.parameters()).device
        results: list[dict] = []
        try:
            for start in range(0, len(items), batch_size):
                chunk = items[start : start + batch_size]
                tasks = [task for task, _ in chunk]
                batch = _tokenize(self.backbone.tokenizer, [text for _, text in chunk], max_length, device)
                rows = self.forward_tasks(
                    batch["input_ids"], batch["attention_mask"], tasks, batch.get("token_type_ids")
                )
                for task, logits in zip(tasks, rows, strict=True):
                    delta = self.deltas[task]
                    result = _predictions(delta.problem_type, delta.label_names, logits.float().unsqueeze(0))[
                        0
                    ]
                    results.append({"task": task, **result})
        finally:
            self.train(was_training)
        return results


def multi_task(backbone: Backbone, deltas: Mapping[str, JobDelta]) -> MultiTaskModel:
    """A model serving several task deltas on one backbone, in eval mode (the deltas are shared, not copied)."""
    if not isinstance(deltas, Mapping) or not deltas:
        raise CompositionError("multi_task: give a non-empty {task name: JobDelta} mapping")
    for task, delta in deltas.items():
        if not isinstance(task, str) or not task or "." in task:
            raise CompositionError(f"multi_task: task name {task!r} must be a non-empty string without '.'")
        _check_on_backbone(task, delta, backbone, "multi_task")
    return MultiTaskModel(backbone, dict(deltas)).eval()


class FoldedModel(nn.Module):
    """A standalone transformers model with LoRA folded into its dense weights, plus the task head."""

    def __init__(
        self, model: nn.Module, head: nn.Module, tokenizer, problem_type: str, label_names: list[str] | None
    ):
        super().__init__()
        self.model = model
        self.head = head
        self.tokenizer = tokenizer
        self.problem_type = problem_type
        self.label_names = label_names

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = self.model(**kwargs).last_hidden_state
        return hidden if return_hidden else self.head(hidden, attention_mask)

    @torch.no_grad()
    def predict(
        self, texts: Sequence[str | tuple[str, str]], batch_size: int = 32, max_length: int = 128
    ) -> list[dict]:
        """Same result format as `pelt_core.model.predict`."""
        was_training = self.training
        self.eval()
        device = next(self.head.parameters()).device
        results: list[dict] = []
        try:
            for start in range(0, len(texts), batch_size):
                batch = _tokenize(self.tokenizer, list(texts[start : start + batch_size]), max_length, device)
                logits = self(
                    batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")
                ).float()
                results.extend(_predictions(self.problem_type, self.label_names, logits))
        finally:
            self.train(was_training)
        return results


def fold_lora(backbone: Backbone, delta: JobDelta) -> FoldedModel:
    """Fold a LoRA delta's ΔW (and BitFit linear biases) into a copy of the backbone: zero-overhead inference,
    same logits. Adapters, prefixes, gated LoRA and norm deltas do not fold and are refused."""
    _check_on_backbone("delta", delta, backbone, "fold_lora")
    try:
        merged = PeltModel(backbone, {"job": delta}).merged_backbone("job")
    except ValueError as exc:
        raise CompositionError(f"fold_lora: {exc}") from exc
    head = copy.deepcopy(delta.head)
    return FoldedModel(merged, head, backbone.tokenizer, delta.problem_type, delta.label_names).eval()


# --------------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------------
@dataclass
class _Factors:
    """A LoRA module as factors: ΔW = up_scaled @ down (up_scaled = s·B)."""

    down: torch.Tensor  # A, (r, d_in)
    up_scaled: torch.Tensor  # s·B, (d_out, r)

    def delta_weight(self) -> torch.Tensor:
        return self.up_scaled @ self.down


@dataclass
class _View:
    """One input delta as float64 CPU tensors; `delta` is the input or a copy without prefix reparameterisation."""

    name: str
    original: JobDelta
    delta: JobDelta
    dense: dict[str, torch.Tensor]  # every state-dict tensor not in a LoRA module, sorted by key
    low_rank: dict[str, _Factors]  # LoRA module path -> factors


def _view(name: str, delta: JobDelta) -> _View:
    if not isinstance(delta, JobDelta):
        raise CompositionError(f"{name}: expected a JobDelta, got {type(delta).__name__}")
    source = delta
    if delta.prefix_encoders:  # what a saved delta keeps: the prefixes the MLP produces (on a copy)
        delta = copy.deepcopy(delta)
        delta.drop_reparameterization()
    low_rank: dict[str, _Factors] = {}
    with torch.no_grad():
        for path, module in delta.named_modules():
            if isinstance(module, Bottleneck) and is_low_rank(module.spec):
                low_rank[path] = _Factors(
                    module.down.weight.detach().to("cpu", torch.float64),
                    module.up.weight.detach().to("cpu", torch.float64) * float(module.scale.detach()),
                )
        dense = {
            key: tensor.detach().to("cpu", torch.float64)
            for key, tensor in sorted(delta.state_dict().items())
            if not any(key.startswith(path + ".") for path in low_rank)
        }
    return _View(name, source, delta, dense, low_rank)


def _views(deltas: Deltas, op: str) -> list[_View]:
    if isinstance(deltas, JobDelta):
        raise CompositionError(f"{op}: give a list (or a name -> delta mapping) of deltas, not one delta")
    items = (
        list(deltas.items())
        if isinstance(deltas, Mapping)
        else [(f"delta{i}", d) for i, d in enumerate(deltas)]
    )
    if not items:
        raise CompositionError(f"{op}: no deltas given")
    return [_view(str(name), delta) for name, delta in items]


def _task_vector(view: _View) -> dict[str, torch.Tensor]:
    vector = dict(view.dense)
    vector.update({path + DELTA_WEIGHT: factors.delta_weight() for path, factors in view.low_rank.items()})
    return dict(sorted(vector.items()))


def _split(merged: dict[str, torch.Tensor], ranks: dict[str, int]) -> tuple[dict, dict]:
    dense, low_rank = {}, {}
    for key, tensor in merged.items():
        if key.endswith(DELTA_WEIGHT):
            path = key[: -len(DELTA_WEIGHT)]
            low_rank[path] = _svd_factors(tensor, ranks[path.rsplit(".", 1)[1]])
        else:
            dense[key] = tensor
    return dense, low_rank


def _svd_factors(delta_weight: torch.Tensor, rank: int) -> _Factors:
    """Truncated SVD: ΔW ≈ (U_k S_k^½)(S_k^½ V_kᵀ), the best rank-k approximation."""
    u, s, vh = torch.linalg.svd(delta_weight.to(torch.float64), full_matrices=False)
    k = min(rank, s.numel())
    root = s[:k].sqrt()
    return _Factors(root[:, None] * vh[:k], u[:, :k] * root[None, :])


def _low_rank_roles(spec: MethodSpec) -> list[str]:
    return [role for role, module in spec.modules.items() if is_low_rank(module)]


def _spec_with_ranks(spec: MethodSpec, ranks: dict[str, int]) -> MethodSpec:
    """The method spec with new LoRA ranks, keeping each module's scale s (α' = s·r' where α was given)."""
    data = spec.to_dict()
    for role, rank in ranks.items():
        module = data["modules"][role]
        if module["alpha"] is not None:
            module["alpha"] = spec.modules[role].effective_scale * rank
        module["size"] = rank
    return MethodSpec.from_dict(data)


def _compose(
    views: list[_View],
    spec: MethodSpec,
    dense: dict[str, torch.Tensor],
    low_rank: dict[str, _Factors],
    provenance: dict[str, Any],
    backbone: Backbone | None,
) -> JobDelta:
    """A new delta shaped like the first input, with `spec` and the given tensors."""
    result = copy.deepcopy(views[0].delta)
    with torch.random.fork_rng(devices=[]):  # a module's init draws must not move the caller's random stream
        for path, module in list(result.named_modules()):
            if isinstance(module, Bottleneck) and is_low_rank(module.spec):  # fresh: new rank, initial scale
                parent_path, role = path.rsplit(".", 1)
                weight = module.down.weight
                result.get_submodule(parent_path)[role] = Bottleneck(
                    spec.modules[role], module.down.in_features, module.up.out_features
                ).to(weight.device, weight.dtype)
    result.method = spec
    result.reindex()  # rebuild the per-site plan over the new modules
    state = dict(dense)
    for path, factors in low_rank.items():
        module = result.get_submodule(path)
        down, up_scaled = factors.down, factors.up_scaled
        missing = module.spec.size - down.shape[0]
        if missing > 0:  # the matrix's rank is below the asked rank: pad with zero directions
            down = torch.cat([down, down.new_zeros(missing, down.shape[1])], 0)
            up_scaled = torch.cat([up_scaled, up_scaled.new_zeros(up_scaled.shape[0], missing)], 1)
        s = float(module.scale.detach())
        state[f"{path}.down.weight"] = down
        state[f"{path}.up.weight"] = up_scaled / s
        if isinstance(module.scale, nn.Parameter):
            state[f"{path}.scale"] = torch.tensor(s)
    try:
        result.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # a bug here, not a user error: say so plainly
        raise CompositionError(f"composed tensors do not fit the composed spec: {exc}") from exc
    for parameter in result.parameters():
        parameter.grad = None
    if hasattr(result, "manifest"):
        del result.manifest  # the first input's manifest does not describe the result
    backbone_hash = _common_backbone_hash(views, backbone)
    result.provenance = _provenance(views, spec, provenance, backbone_hash)
    return result.eval()


def _provenance(
    views: list[_View], spec: MethodSpec, record: dict[str, Any], backbone_hash: str | None
) -> dict[str, Any]:
    from pelt_core import __version__

    inputs = []
    for view in views:
        entry = {
            "name": view.name,
            "method": view.delta.method.name,
            "tensors_sha256": tensors_sha256(view.delta),
        }
        ranks = {role: m.size for role, m in view.delta.method.modules.items() if is_low_rank(m)}
        if ranks:
            entry["lora_ranks"] = ranks
        inputs.append(entry)
    return {
        **record,
        "inputs": inputs,
        "method": spec.name,
        "backbone_hash": backbone_hash,
        "pelt_version": __version__,
    }


def _known_hash(delta: JobDelta) -> str | None:
    manifest = getattr(delta, "manifest", None)
    if isinstance(manifest, dict):
        return manifest.get("backbone", {}).get("content_hash")
    provenance = getattr(delta, "provenance", None)
    return provenance.get("backbone_hash") if isinstance(provenance, dict) else None


def _common_backbone_hash(views: list[_View], backbone: Backbone | None) -> str | None:
    if backbone is not None:
        return backbone.content_hash
    return next((h for h in (_known_hash(v.original) for v in views) if h is not None), None)


def _check_on_backbone(name: str, delta: JobDelta, backbone: Backbone, op: str) -> None:
    if not isinstance(delta, JobDelta):
        raise CompositionError(f"{op}: {name} is a {type(delta).__name__}, not a JobDelta")
    known = _known_hash(delta)
    if known is not None and known != backbone.content_hash:
        raise CompositionError(
            f"{op}: {name} belongs to backbone {known[:12]}…, not to {backbone.name!r} "
            f"({backbone.content_hash[:12]}…)"
        )
    if delta.num_layers != backbone.num_layers or delta.head.classifier.in_features != backbone.hidden_size:
        raise CompositionError(
            f"{op}: {name} has the shape of another backbone ({delta.num_layers} layers, "
            f"hidden {delta.head.classifier.in_features}) than {backbone.name!r}"
        )


def _check_compatible(views: list[_View], backbone: Backbone | None, op: str, same_ranks: bool) -> None:
    """One method (one spec; LoRA ranks may differ unless same_ranks), one backbone, one head shape."""
    first = views[0]
    for view in views:
        hash_ = _known_hash(view.original)
        if backbone is not None:
            _check_on_backbone(view.name, view.original, backbone, op)
        elif hash_ is not None:
            for other in views:
                other_hash = _known_hash(other.original)
                if other_hash is not None and other_hash != hash_:
                    raise CompositionError(
                        f"{op}: {view.name} and {other.name} come from different backbones "
                        f"(content hash {hash_[:12]}… vs {other_hash[:12]}…)"
                    )
    for view in views[1:]:
        a, b = first.delta.method, view.delta.method
        if a.name != b.name:
            raise CompositionError(
                f"{op}: {view.name} uses method {b.name!r} but {first.name} uses {a.name!r}; "
                "only deltas of one method compose"
            )
        diffs = _differences(_spec_key(a, same_ranks), _spec_key(b, same_ranks))
        if diffs:
            hint = (
                " (merge_lora_svd merges LoRA deltas of different ranks)"
                if same_ranks and _spec_key(a, False) == _spec_key(b, False)
                else ""
            )
            raise CompositionError(
                f"{op}: the method spec of {view.name} differs from that of {first.name}: "
                f"{'; '.join(diffs[:5])}{hint}"
            )
        for label, x, y in (
            ("problem type", first.delta.problem_type, view.delta.problem_type),
            (
                "number of labels",
                first.delta.head.classifier.out_features,
                view.delta.head.classifier.out_features,
            ),
            ("pooling", first.delta.head.pooling, view.delta.head.pooling),
        ):
            if x != y:
                raise CompositionError(
                    f"{op}: the heads differ: {label} {x!r} ({first.name}) vs {y!r} ({view.name})"
                )
        if (
            first.delta.label_names
            and view.delta.label_names
            and first.delta.label_names != view.delta.label_names
        ):
            raise CompositionError(
                f"{op}: the heads differ: label names {first.delta.label_names} ({first.name}) "
                f"vs {view.delta.label_names} ({view.name})"
            )
        shapes_a = {k: tuple(t.shape) for k, t in first.dense.items()}
        shapes_a.update(
            {p + DELTA_WEIGHT: (f.up_scaled.shape[0], f.down.shape[1]) for p, f in first.low_rank.items()}
        )
        shapes_b = {k: tuple(t.shape) for k, t in view.dense.items()}
        shapes_b.update(
            {p + DELTA_WEIGHT: (f.up_scaled.shape[0], f.down.shape[1]) for p, f in view.low_rank.items()}
        )
        if shapes_a != shapes_b:
            diff = _differences(shapes_a, shapes_b)
            raise CompositionError(
                f"{op}: {view.name} does not have the shape of {first.name} (different backbones?): "
                f"{'; '.join(diff[:3])}"
            )


def _spec_key(spec: MethodSpec, same_ranks: bool) -> dict[str, Any]:
    data = spec.to_dict()
    for key in ("description", "reference", "defaults"):
        data.pop(key)
    if not same_ranks:
        for role, module in spec.modules.items():
            if is_low_rank(module):
                data["modules"][role].update(size=None, alpha=None)
    return data


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        found: list[str] = []
        for key in sorted(set(a) | set(b), key=str):
            where = f"{prefix}.{key}" if prefix else str(key)
            found += _differences(a.get(key, "<missing>"), b.get(key, "<missing>"), where)
        return found
    return [] if a == b else [f"{prefix}: {a!r} vs {b!r}"]


def _weights(weights: Sequence[float] | None, n: int, default: float, positive: bool) -> list[float]:
    if weights is None:
        return [default] * n
    if isinstance(weights, str | bytes) or not isinstance(weights, Sequence):
        raise CompositionError(f"weights must be a list of {n} numbers, got {weights!r}")
    if len(weights) != n:
        raise CompositionError(f"{len(weights)} weights for {n} deltas; give one weight per delta")
    values = [_finite(w, f"weights[{i}]") for i, w in enumerate(weights)]
    if positive and any(v <= 0 for v in values):
        raise CompositionError(f"TIES weights must be > 0 (sign election), got {values}")
    return values


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CompositionError(f"{name} must be a finite number, got {value!r}", field=name)
    return float(value)


def _check_density(density: Any) -> None:
    if isinstance(density, bool) or not isinstance(density, int | float) or not 0.0 < density <= 1.0:
        raise CompositionError(f"density must be in (0, 1], got {density!r}", field="density")


def _check_rank(rank: Any, name: str) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise CompositionError(f"{name} must be a whole number >= 1, got {rank!r}", field=name)
    _in_range(name, rank, name)


def _check_rank_fits(rank: int, name: str, views: list[_View]) -> None:
    """Before anything of that rank is allocated: at most the larger of min(d_in, d_out) of the LoRA
    matrices (the rank at which the result is exact) and the sources' summed rank (a linear merge's own)."""
    matrices = [factors for view in views for factors in view.low_rank.values()]
    if not matrices:
        return  # no LoRA module: the rank is not used
    exact = max(min(f.down.shape[1], f.up_scaled.shape[0]) for f in matrices)
    summed = max(sum(v.low_rank[path].down.shape[0] for v in views) for path in views[0].low_rank)
    bound = max(exact, summed)
    if rank > bound:
        raise CompositionError(
            f"{name}: must be at most {bound}, the larger of min(d_in, d_out) of the LoRA "
            f"matrices ({exact}) and the sources' summed rank ({summed}), got {rank}",
            field=name,
        )


def _tokenize(tokenizer, texts: list, max_length: int, device) -> dict[str, torch.Tensor]:
    """Tokenize single texts, (text, text_pair) pairs, or a mix of both (rows encoded one by one, then padded)."""

    def is_pair(text):
        return isinstance(text, tuple | list) and len(text) == 2 and all(isinstance(t, str) for t in text)

    for position, text in enumerate(texts):
        if not (isinstance(text, str) or is_pair(text)):
            raise ValueError(f"text {position}: expected a string or a (text, text_pair) pair, got {text!r}")
    options = {"truncation": True, "max_length": max_length}
    if all(isinstance(t, str) for t in texts):
        batch = tokenizer(list(texts), padding=True, return_tensors="pt", **options)
    elif all(is_pair(t) for t in texts):
        batch = tokenizer(
            [a for a, _ in texts], [b for _, b in texts], padding=True, return_tensors="pt", **options
        )
    else:
        rows = [
            dict(tokenizer(t, **options) if isinstance(t, str) else tokenizer(t[0], t[1], **options))
            for t in texts
        ]
        batch = tokenizer.pad(rows, padding=True, return_tensors="pt")
    return {
        k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")
    }


def _predictions(problem_type: str, label_names: list[str] | None, logits: torch.Tensor) -> list[dict]:
    """The result format of `pelt_core.model.predict`, from a (rows, labels) logits tensor."""
    if problem_type == "regression":
        return [{"value": float(v)} for v in logits.squeeze(-1)]
    names = label_names or [str(i) for i in range(logits.shape[-1])]
    if problem_type == "multi_label_classification":
        return [
            {
                "labels": [names[i] for i, p in enumerate(row) if p > 0.5],
                "scores": {names[i]: float(p) for i, p in enumerate(row)},
            }
            for row in torch.sigmoid(logits)
        ]
    results = []
    for row in torch.softmax(logits, -1):
        best = int(row.argmax())
        results.append({"label": names[best], "score": float(row[best])})
    return results


__all__ = [
    "DEFAULT_DENSITY",
    "MERGE_METHODS",
    "OPTIONS",
    "CompositionError",
    "FoldedModel",
    "MultiTaskModel",
    "average",
    "check_options",
    "dare_sparsify",
    "fold_lora",
    "is_low_rank",
    "merge",
    "merge_lora_svd",
    "multi_task",
    "save_composed",
    "task_vector",
    "tensors_sha256",
    "ties_combine",
    "trim_to_density",
]
