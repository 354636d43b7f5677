"""The inputs of a composition: each delta as a view of float64 tensors (LoRA modules as factors), its task
vector, and the checks that the deltas belong together (one method, one backbone, one head).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pelt_core.backbones import Backbone
from pelt_core.compose_options import CompositionError
from pelt_core.compose_tensors import LoraFactors, is_low_rank, svd_factors
from pelt_core.layers import Bottleneck
from pelt_core.model import JobDelta
from pelt_core.spec import MethodSpec

DELTA_WEIGHT = ".delta_weight"  # task-vector key suffix of a LoRA module's dense ΔW

Deltas = Sequence[JobDelta] | Mapping[str, JobDelta]


@dataclass
class DeltaView:
    """One input delta as float64 CPU tensors; `delta` is the input, or a copy of it without the prefix
    reparameterisation."""

    name: str
    original: JobDelta
    delta: JobDelta
    dense: dict[str, torch.Tensor]  # every state-dict tensor not in a LoRA module, sorted by key
    low_rank: dict[str, LoraFactors]  # LoRA module path -> factors


def view_of(name: str, delta: JobDelta) -> DeltaView:
    """The delta as composition reads it (the input is never written)."""
    if not isinstance(delta, JobDelta):
        raise CompositionError(f"{name}: expected a JobDelta, got {type(delta).__name__}")
    source = delta
    if delta.prefix_encoders:  # what a saved delta keeps: the prefixes the MLP produces (on a copy)
        delta = copy.deepcopy(delta)
        delta.drop_reparameterization()
    low_rank: dict[str, LoraFactors] = {}
    with torch.no_grad():
        for path, module in delta.named_modules():
            if isinstance(module, Bottleneck) and is_low_rank(module.spec):
                low_rank[path] = LoraFactors(
                    module.down.weight.detach().to("cpu", torch.float64),
                    module.up.weight.detach().to("cpu", torch.float64) * float(module.scale.detach()),
                )
        dense = {
            key: tensor.detach().to("cpu", torch.float64)
            for key, tensor in sorted(delta.state_dict().items())
            if not any(key.startswith(path + ".") for path in low_rank)
        }
    return DeltaView(name, source, delta, dense, low_rank)


def views_of(deltas: Deltas, op: str) -> list[DeltaView]:
    """Views of a list (named delta0, delta1, …) or a name -> delta mapping of at least one delta."""
    if isinstance(deltas, JobDelta):
        raise CompositionError(f"{op}: give a list (or a name -> delta mapping) of deltas, not one delta")
    items = (
        list(deltas.items())
        if isinstance(deltas, Mapping)
        else [(f"delta{i}", d) for i, d in enumerate(deltas)]
    )
    if not items:
        raise CompositionError(f"{op}: no deltas given")
    return [view_of(str(name), delta) for name, delta in items]


def task_vector(delta: JobDelta) -> dict[str, torch.Tensor]:
    """A delta as TIES/DARE see it (float64, CPU, sorted keys): every state-dict tensor, except that each
    LoRA module is one dense ΔW = s·B·A under `<module path>.delta_weight`."""
    return task_vector_of(view_of("delta", delta))


def task_vector_of(view: DeltaView) -> dict[str, torch.Tensor]:
    """`task_vector` of a view already taken."""
    vector = dict(view.dense)
    vector.update({path + DELTA_WEIGHT: factors.delta_weight() for path, factors in view.low_rank.items()})
    return dict(sorted(vector.items()))


def split_task_vector(
    merged: dict[str, torch.Tensor], ranks: dict[str, int]
) -> tuple[dict[str, torch.Tensor], dict[str, LoraFactors]]:
    """A merged task vector back as dense tensors and LoRA factors (each ΔW truncated to its role's rank)."""
    dense, low_rank = {}, {}
    for key, tensor in merged.items():
        if key.endswith(DELTA_WEIGHT):
            path = key[: -len(DELTA_WEIGHT)]
            low_rank[path] = svd_factors(tensor, ranks[path.rsplit(".", 1)[1]])
        else:
            dense[key] = tensor
    return dense, low_rank


# --------------------------------------------------------------------------------------------------
# Do the deltas belong together?
# --------------------------------------------------------------------------------------------------
def known_hash(delta: JobDelta) -> str | None:
    """The backbone content hash a loaded or composed delta records (None for a freshly trained one)."""
    manifest = getattr(delta, "manifest", None)
    if isinstance(manifest, dict):
        return manifest.get("backbone", {}).get("content_hash")
    provenance = getattr(delta, "provenance", None)
    return provenance.get("backbone_hash") if isinstance(provenance, dict) else None


def common_backbone_hash(views: list[DeltaView], backbone: Backbone | None) -> str | None:
    """The given backbone's hash, else the first one an input records."""
    if backbone is not None:
        return backbone.content_hash
    return next((h for h in (known_hash(v.original) for v in views) if h is not None), None)


def check_on_backbone(name: str, delta: JobDelta, backbone: Backbone, op: str) -> None:
    """A JobDelta of this backbone: its recorded hash (if any) and its shape."""
    if not isinstance(delta, JobDelta):
        raise CompositionError(f"{op}: {name} is a {type(delta).__name__}, not a JobDelta")
    known = known_hash(delta)
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


def check_compatible(views: list[DeltaView], backbone: Backbone | None, op: str, same_ranks: bool) -> None:
    """One method (one spec; LoRA ranks may differ unless same_ranks), one backbone, one head shape."""
    first = views[0]
    for view in views:
        hash_ = known_hash(view.original)
        if backbone is not None:
            check_on_backbone(view.name, view.original, backbone, op)
        elif hash_ is not None:
            for other in views:
                other_hash = known_hash(other.original)
                if other_hash is not None and other_hash != hash_:
                    raise CompositionError(
                        f"{op}: {view.name} and {other.name} come from different backbones "
                        f"(content hash {hash_[:12]}… vs {other_hash[:12]}…)"
                    )
    for view in views[1:]:
        _check_same_spec(first, view, op, same_ranks)
        _check_same_head(first, view, op)
        _check_same_shapes(first, view, op)


def _check_same_spec(first: DeltaView, view: DeltaView, op: str, same_ranks: bool) -> None:
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


def _check_same_head(first: DeltaView, view: DeltaView, op: str) -> None:
    a, b = first.delta, view.delta
    for label, x, y in (
        ("problem type", a.problem_type, b.problem_type),
        ("number of labels", a.head.classifier.out_features, b.head.classifier.out_features),
        ("pooling", a.head.pooling, b.head.pooling),
    ):
        if x != y:
            raise CompositionError(
                f"{op}: the heads differ: {label} {x!r} ({first.name}) vs {y!r} ({view.name})"
            )
    if a.label_names and b.label_names and a.label_names != b.label_names:
        raise CompositionError(
            f"{op}: the heads differ: label names {a.label_names} ({first.name}) "
            f"vs {b.label_names} ({view.name})"
        )


def _shapes(view: DeltaView) -> dict[str, tuple[int, ...]]:
    shapes = {key: tuple(t.shape) for key, t in view.dense.items()}
    shapes.update(
        {path + DELTA_WEIGHT: (f.up_scaled.shape[0], f.down.shape[1]) for path, f in view.low_rank.items()}
    )
    return shapes


def _check_same_shapes(first: DeltaView, view: DeltaView, op: str) -> None:
    shapes_a, shapes_b = _shapes(first), _shapes(view)
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
    for module in data["modules"].values():  # how fast a module learned, not what it computes
        module.pop("lr_multiplier", None)
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


def check_rank_fits(rank: int, name: str, views: list[DeltaView]) -> None:
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
