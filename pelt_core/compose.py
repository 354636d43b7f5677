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
`tensors_sha256` = `backbones.state_dict_hash(delta)` of its tensors. That hash is reproducible (a delta
loaded back from disk has the same one); the sha256 of a delta *file* is not a function of its tensors alone.

Where each part lives: this module holds the merge operations and the composed result; argument checks in
`compose_options`, tensor arithmetic (TIES, DARE, LoRA factors and SVD) in `compose_tensors`, the inputs
(views, task vectors, compatibility) in `compose_inputs`, multi-task serving and LoRA folding in
`compose_serving`. Import the public names from here.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pelt_core.backbones import Backbone, state_dict_hash
from pelt_core.compose_inputs import (
    Deltas,
    DeltaView,
    check_compatible,
    check_rank_fits,
    common_backbone_hash,
    split_task_vector,
    task_vector,
    task_vector_of,
    views_of,
)
from pelt_core.compose_options import (
    DARE_COMBINES,
    DEFAULT_DENSITY,
    MERGE_METHODS,
    OPTIONS,
    CompositionError,
    check_density,
    check_options,
    check_rank,
    check_seed,
    check_weights,
    finite_number,
)
from pelt_core.compose_serving import FoldedModel, MultiTaskModel, check_multi_task, fold_lora, multi_task
from pelt_core.compose_tensors import (
    LoraFactors,
    dare_sparsify,
    is_low_rank,
    low_rank_roles,
    spec_with_ranks,
    svd_factors,
    ties_combine,
    trim_to_density,
)
from pelt_core.delta import SavedDelta, save_delta
from pelt_core.layers import Bottleneck
from pelt_core.model import JobDelta
from pelt_core.spec import MethodSpec


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
    views = views_of(deltas, "merge")
    check_compatible(views, backbone, "merge", same_ranks=True)
    uses_ties = how == "ties" or (how == "dare" and combine == "ties")
    w = check_weights(weights, len(views), default=1.0 if uses_ties else 1.0 / len(views), positive=uses_ties)
    scale = finite_number(scale, "scale")
    check_seed(seed)
    if lora_rank is not None:
        check_rank(lora_rank, "lora_rank")
        check_rank_fits(lora_rank, "lora_rank", views)
    if how != "linear":
        density = DEFAULT_DENSITY[how] if density is None else density
        check_density(density)
    provenance: dict[str, Any] = {
        "op": f"merge({how})" if how != "dare" or combine == "linear" else "merge(dare+ties)",
        "how": how,
        "weights": w,
        "scale": scale,
    }
    if how == "linear":
        dense, low_rank, ranks = _linear_merge(views, w, scale, lora_rank)
        provenance["lora"] = ("concat" if lora_rank is None else "svd") if low_rank else None
    else:
        if how == "dare":
            provenance.update(density=density, drop_rate=1.0 - density, seed=seed, combine=combine)
        else:
            provenance.update(density=density)
        dense, low_rank, ranks = _sparse_merge(views, w, scale, how, density, seed, uses_ties, lora_rank)
        provenance["lora"] = "svd" if low_rank else None
    provenance["lora_rank"] = lora_rank
    spec = spec_with_ranks(views[0].delta.method, ranks)
    return _composed(views, spec, dense, low_rank, provenance, backbone)


def _linear_merge(
    views: list[DeltaView], w: list[float], scale: float, lora_rank: int | None
) -> tuple[dict[str, torch.Tensor], dict[str, LoraFactors], dict[str, int]]:
    """θ = λ Σ w_i θ_i for dense tensors; LoRA factors concatenated (exact), or truncated to `lora_rank`."""
    dense = {
        key: scale * sum(wi * v.dense[key] for wi, v in zip(w, views, strict=True)) for key in views[0].dense
    }
    low_rank = {
        path: LoraFactors(
            torch.cat([v.low_rank[path].down for v in views], 0),
            torch.cat([scale * wi * v.low_rank[path].up_scaled for wi, v in zip(w, views, strict=True)], 1),
        )
        for path in views[0].low_rank
    }
    low_roles = low_rank_roles(views[0].delta.method)
    if lora_rank is None:
        ranks = {role: sum(v.delta.method.modules[role].size for v in views) for role in low_roles}
    else:
        ranks = dict.fromkeys(low_roles, lora_rank)
        low_rank = {path: svd_factors(f.delta_weight(), lora_rank) for path, f in low_rank.items()}
    return dense, low_rank, ranks


def _sparse_merge(
    views: list[DeltaView],
    w: list[float],
    scale: float,
    how: str,
    density: float,
    seed: int,
    uses_ties: bool,
    lora_rank: int | None,
) -> tuple[dict[str, torch.Tensor], dict[str, LoraFactors], dict[str, int]]:
    """TIES or DARE over task vectors (LoRA as dense ΔW), then LoRA re-factored by SVD."""
    vectors = [task_vector_of(v) for v in views]
    if how == "dare":
        drop_rate = 1.0 - density
        generator = torch.Generator().manual_seed(seed)
        vectors = [
            {key: dare_sparsify(t, drop_rate, generator) for key, t in vector.items()} for vector in vectors
        ]
    merged = {}
    for key in vectors[0]:
        tensors = [vector[key] for vector in vectors]
        if uses_ties:
            merged[key] = scale * ties_combine(tensors, density if how == "ties" else 1.0, w)
        else:
            merged[key] = scale * sum(wi * t for wi, t in zip(w, tensors, strict=True))
    spec = views[0].delta.method
    ranks = {role: (lora_rank or spec.modules[role].size) for role in low_rank_roles(spec)}
    dense, low_rank = split_task_vector(merged, ranks)
    return dense, low_rank, ranks


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
    check_rank(rank, "rank")
    views = views_of(deltas, "merge_lora_svd")
    check_compatible(views, backbone, "merge_lora_svd", same_ranks=False)
    check_rank_fits(rank, "rank", views)
    spec = views[0].delta.method
    low_roles = low_rank_roles(spec)
    if not low_roles:
        raise CompositionError(
            f"merge_lora_svd: method {spec.name!r} has no LoRA module (a linear bottleneck "
            "without biases or gate); use merge()"
        )
    w = check_weights(weights, len(views), default=1.0 / len(views), positive=False)
    dense = {key: sum(wi * v.dense[key] for wi, v in zip(w, views, strict=True)) for key in views[0].dense}
    low_rank = {
        path: svd_factors(
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
    return _composed(
        views, spec_with_ranks(spec, dict.fromkeys(low_roles, rank)), dense, low_rank, provenance, backbone
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
# The composed delta
# --------------------------------------------------------------------------------------------------
def _composed(
    views: list[DeltaView],
    spec: MethodSpec,
    dense: dict[str, torch.Tensor],
    low_rank: dict[str, LoraFactors],
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
    backbone_hash = common_backbone_hash(views, backbone)
    result.provenance = _provenance(views, spec, provenance, backbone_hash)
    return result.eval()


def _provenance(
    views: list[DeltaView], spec: MethodSpec, record: dict[str, Any], backbone_hash: str | None
) -> dict[str, Any]:
    from pelt_core import __version__

    inputs = []
    for view in views:
        entry = {
            "name": view.name,
            "method": view.delta.method.name,
            "tensors_sha256": state_dict_hash(view.delta),
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


__all__ = [
    "DEFAULT_DENSITY",
    "MERGE_METHODS",
    "OPTIONS",
    "CompositionError",
    "FoldedModel",
    "MultiTaskModel",
    "average",
    "check_multi_task",
    "check_options",
    "dare_sparsify",
    "fold_lora",
    "is_low_rank",
    "merge",
    "merge_lora_svd",
    "multi_task",
    "save_composed",
    "task_vector",
    "ties_combine",
    "trim_to_density",
]
