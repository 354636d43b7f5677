"""A job's PELT modules on a shared frozen backbone: what a job trains, what a user holds and serves.

- `JobDelta` holds everything one job trains: the modules its method spec asks for, gates, BitFit bias
  deltas, LayerNorm deltas and the task head. Nothing else is trainable. It plans, per linear map, norm
  and attention layer, what its modules do there; `pelt_core.runtime` applies that plan to its rows.
- `PeltModel` = backbone + one or more named `JobDelta`s: `model(input_ids, attention_mask)` for one job,
  `routes=[("sst2", 8), ("rte", 8)]` for a mixed batch (one backbone forward, each row through its own
  job's modules: the hooks and attention glue live in `pelt_core.runtime`).
- `predict` classifies or scores texts with one job (decoded by `pelt_core.predictions`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pelt_core.backbones import Backbone
from pelt_core.dropout import JobDropout
from pelt_core.layers import Bottleneck, DenseDelta, Gate, NormDelta, PrefixEncoder, PrefixParams
from pelt_core.limits import LimitError, check_against_backbone
from pelt_core.methods.fusion import FusionLayer, freeze_sources
from pelt_core.predictions import Text, check_text_form, decode_predictions, evaluating, tokenize_texts
from pelt_core.runtime import Route, get_runtime
from pelt_core.spec import WEIGHT_REPRESENTATIONS, MethodSpec, SpecError
from pelt_core.vocabulary import PROBLEM_TYPES


# --------------------------------------------------------------------------------------------------
# The task head
# --------------------------------------------------------------------------------------------------
class Head(nn.Module):
    """Pool the sequence (cls / mean / last token), then dropout and a linear classifier or regressor.

    A regressor trains on standardized targets: while it trains, the trainer sets the training labels'
    mean and standard deviation (`set_target_scaling`), the head's training output is in standardized units
    (compared with `standardized(labels)`) and its evaluation output is mapped back to the labels' units by
    `target_shift + target_scale * output`; at the end the trainer folds the two into the regressor's weights
    (`fold_target_scaling`), so a finished delta predicts in the labels' units with no scaling of its own
    (merges and PEFT exports see plain weights). Its output starts at the label mean and the loss and its
    steps are sized to the labels' spread, whatever their scale. The linear layer runs in fp32 even under
    bf16 autocast: it is tiny, and a regression value near 1,000 would otherwise round to steps of 4."""

    def __init__(self, hidden_size: int, num_labels: int, pooling: str, dropout: float = 0.1):
        super().__init__()
        if pooling not in ("cls", "mean", "last"):
            raise ValueError(f"pooling must be cls, mean or last, got {pooling!r}")
        self.pooling = pooling
        self.dropout = JobDropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_labels)
        nn.init.normal_(self.classifier.weight, std=0.02)
        nn.init.zeros_(self.classifier.bias)
        self.target_shift = 0.0
        self.target_scale = 1.0

    def set_target_scaling(self, shift: float, scale: float) -> None:
        """Regression labels' mean (`shift`) and standard deviation (`scale`, finite and > 0)."""
        if not (math.isfinite(shift) and math.isfinite(scale) and scale > 0):
            raise ValueError(
                f"target scaling needs a finite shift and a positive scale, got {shift}, {scale}"
            )
        self.target_shift, self.target_scale = float(shift), float(scale)

    def standardized(self, labels: torch.Tensor) -> torch.Tensor:
        """Training targets in the units of the head's training output (labels as they are for a classifier
        or a regressor without scaling)."""
        if self.target_scale == 1.0 and self.target_shift == 0.0:
            return labels
        return (labels.float() - self.target_shift) / self.target_scale

    @torch.no_grad()
    def fold_target_scaling(self) -> None:
        """Fold the target scaling into the regressor's weight and bias (output' = scale * output + shift):
        the same predictions, in training and evaluation mode alike, with no scaling left on the side."""
        if self.target_scale == 1.0 and self.target_shift == 0.0:
            return
        self.classifier.weight.mul_(self.target_scale)
        self.classifier.bias.mul_(self.target_scale).add_(self.target_shift)
        self.target_shift, self.target_scale = 0.0, 1.0

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.classifier.weight.dtype)
        if self.pooling == "cls":
            return hidden[:, 0]
        mask = attention_mask.to(hidden.dtype)
        if self.pooling == "mean":
            return (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)
        last = attention_mask.long().sum(1).clamp(min=1) - 1  # right padding: last real token
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pooled = self.dropout(self.pool(hidden, attention_mask))
        with torch.autocast(pooled.device.type, enabled=False):
            output = self.classifier(pooled.to(self.classifier.weight.dtype))
            if not self.training and (self.target_scale != 1.0 or self.target_shift != 0.0):
                output = output * self.target_scale + self.target_shift
        return output


class BiasDelta(nn.Module):
    """BitFit: the job's own bias vector, added to a frozen linear map's output."""

    def __init__(self, dim: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(dim))


class PrefixLayer(nn.Module):
    """One attention layer's prefix: stored key/values (None while a reparameterisation produces them) and
    its gate."""

    def __init__(self, length: int, kv_dim: int, hidden_size: int, gate: bool, params: bool, init_std: float):
        super().__init__()
        self.length = length
        self.params = PrefixParams(length, kv_dim, init_std) if params else None
        self.gate = Gate(hidden_size) if gate else None


@dataclass
class LinearOps:
    """What one job does at one linear map's output."""

    bias: BiasDelta | None
    parallel_x: list[Bottleneck]  # Δh from the linear map's own input (LoRA)
    parallel_sub: list[Bottleneck]  # Δh from the sub-layer's input (parallel adapters)
    sequential: list[Bottleneck]  # Δh from h itself (Houlsby/Pfeiffer adapters)
    fusion: FusionLayer | None = None  # AdapterFusion: an attention over `fused`'s outputs replaces their sum
    fused: list[Bottleneck] = field(default_factory=list)  # the adapters it attends over, in the spec's order


# --------------------------------------------------------------------------------------------------
# Everything one job trains
# --------------------------------------------------------------------------------------------------
class JobDelta(nn.Module):
    """The trainable part of one job: PELT modules per layer and site, plus the head.

    State-dict keys read like `layers.3.attn_q.lora.down.weight`: layer, site, role, tensor.
    """

    def __init__(
        self,
        method: MethodSpec,
        backbone: Backbone,
        num_labels: int,
        problem_type: str = "single_label_classification",
        pooling: str = "mean",
        head_dropout: float = 0.1,
        label_names: list[str] | None = None,
        reparameterize_prefix: bool = True,
    ):
        super().__init__()
        if problem_type not in PROBLEM_TYPES:
            raise ValueError(f"problem_type must be one of {', '.join(PROBLEM_TYPES)}, got {problem_type!r}")
        method.validate()
        # before anything is allocated: ranks, prefix lengths and layers within the backbone (as the service)
        try:
            check_against_backbone({}, method.to_dict(), backbone.facts)
        except LimitError as exc:
            raise SpecError(str(exc)) from None
        self.method = method
        self.problem_type = problem_type
        self.label_names = list(label_names) if label_names else None
        # the task's text columns: two means predictions take (text, text_pair) pairs (None: not recorded)
        self.text_fields: tuple[str, ...] | None = None
        self.num_layers = backbone.num_layers
        self.kv_dim = backbone.num_kv_heads * backbone.head_dim
        self.layers = nn.ModuleDict()
        self.prefix_encoders = nn.ModuleDict()
        self.head = Head(backbone.hidden_size, num_labels, pooling, head_dropout)
        self._build(method, backbone, reparameterize_prefix)
        self._index()
        self._prefix_cache: torch.Tensor | None = None
        self.generator: torch.Generator | None = None

    def use_generator(self, generator: torch.Generator | None) -> None:
        """Draw every dropout mask of this job's rows (its modules, its head, the backbone's dropout on its
        rows) from `generator`, so that its masks never depend on the jobs that share its forward."""
        self.generator = generator
        for module in self.modules():
            if isinstance(module, JobDropout):
                module.generator = generator

    # -- construction --------------------------------------------------------------------------------
    def _site(self, layer: int, key: str) -> nn.ModuleDict:
        if str(layer) not in self.layers:
            self.layers[str(layer)] = nn.ModuleDict()
        layer_dict = self.layers[str(layer)]
        if key not in layer_dict:
            layer_dict[key] = nn.ModuleDict()
        return layer_dict[key]

    def _build(self, method: MethodSpec, backbone: Backbone, reparameterize_prefix: bool) -> None:
        arch, d = backbone.arch, backbone.hidden_size
        all_layers = range(backbone.num_layers)
        for role, spec in method.modules.items():
            layers = [i for i in (spec.layers if spec.layers is not None else all_layers)]
            for i in layers:
                if i >= backbone.num_layers:
                    raise ValueError(
                        f"{method.name}.modules.{role}.layers: layer {i} does not exist "
                        f"(backbone has {backbone.num_layers})"
                    )
            if spec.form == "prefix":
                use_encoder = reparameterize_prefix and spec.reparam_hidden is not None
                for i in layers:
                    self._site(i, "attn_heads")[role] = PrefixLayer(
                        spec.size, self.kv_dim, d, spec.gate, params=not use_encoder, init_std=spec.init_std
                    )
                if use_encoder:
                    self.prefix_encoders[role] = PrefixEncoder(
                        spec.size, d, spec.reparam_hidden, len(layers), self.kv_dim
                    )
                continue
            if spec.representation in WEIGHT_REPRESENTATIONS:
                concretes = arch.weight_sites[spec.representation]
            else:
                concretes = (arch.sublayer_output(spec.representation),)
            for i in layers:
                for concrete in concretes:
                    linear = backbone.linear(i, concrete)
                    if spec.representation in WEIGHT_REPRESENTATIONS and spec.insertion == "parallel":
                        d_in = linear.in_features
                    elif spec.insertion == "parallel":  # sub-layer input -> sub-layer output
                        d_in = backbone.linear(i, arch.sublayer_input(spec.representation)).in_features
                    else:
                        d_in = linear.out_features
                    key = (
                        concrete.replace(".", "_")
                        if spec.representation in WEIGHT_REPRESENTATIONS
                        else spec.representation
                    )
                    kind = DenseDelta if spec.form == "dense" else Bottleneck
                    self._site(i, key)[role] = kind(spec, d_in, linear.out_features)
        if method.fusion is not None:  # one attention per sub-layer that holds the fused adapters
            for sites in self.layers.values():
                for site_key in list(sites):
                    sites[site_key]["fusion"] = FusionLayer(d)
            freeze_sources(self)
        if method.bias:
            for i in all_layers:
                for concrete in arch.linear_paths:
                    self._site(i, concrete.replace(".", "_"))["bitfit"] = BiasDelta(
                        backbone.linear(i, concrete).out_features
                    )
        if method.bias or method.layer_norm:
            for i in all_layers:
                for sublayer in arch.layer_norm_paths:
                    self._site(i, f"norm_{sublayer}")["norm"] = NormDelta(
                        d, scale=method.layer_norm, shift=method.bias or method.layer_norm
                    )
        self._arch = arch

    def reindex(self) -> None:
        """Rebuild the per-site plan after modules were replaced (e.g. by composition)."""
        self._index()

    def _index(self) -> None:
        """Plan, per (layer, concrete linear), which modules act there and how (used by the hooks)."""
        arch = self._arch
        self.linear_ops: dict[tuple[int, str], LinearOps] = {}
        self.norm_ops: dict[tuple[int, str], NormDelta] = {}
        self.prefix_layers: dict[int, tuple[str, PrefixLayer]] = {}
        for layer_key, sites in self.layers.items():
            i = int(layer_key)
            for site_key, modules in sites.items():
                if site_key == "attn_heads":
                    for role, module in modules.items():
                        self.prefix_layers[i] = (role, module)
                    continue
                if site_key.startswith("norm_"):
                    self.norm_ops[(i, site_key[5:])] = modules["norm"]
                    continue
                if "fusion" in modules:
                    ops = self._ops(i, arch.sublayer_output(site_key))
                    ops.fusion = modules["fusion"]
                    ops.fused = [module for role, module in modules.items() if role != "fusion"]
                    continue
                for module in modules.values():
                    if isinstance(module, BiasDelta):
                        self._ops(i, site_key.replace("_", ".")).bias = module
                        continue
                    spec = module.spec
                    if spec.representation in WEIGHT_REPRESENTATIONS:
                        concrete = site_key.replace("_", ".")
                        ops = self._ops(i, concrete)
                        (ops.parallel_x if spec.insertion == "parallel" else ops.sequential).append(module)
                    else:
                        ops = self._ops(i, arch.sublayer_output(spec.representation))
                        (ops.parallel_sub if spec.insertion == "parallel" else ops.sequential).append(module)
        self._prefix_layer_order = {
            role: sorted(i for i, (r, _) in self.prefix_layers.items() if r == role)
            for role in self.prefix_encoders
        }

    def _ops(self, layer: int, concrete: str) -> LinearOps:
        if (layer, concrete) not in self.linear_ops:
            self.linear_ops[(layer, concrete)] = LinearOps(None, [], [], [])
        return self.linear_ops[(layer, concrete)]

    # -- used by the runtime hooks ------------------------------------------------------------------------
    def apply_linear(
        self, ops: LinearOps, x: torch.Tensor, h: torch.Tensor, sub_x: torch.Tensor | None
    ) -> torch.Tensor:
        out = h
        if ops.bias is not None:
            out = out + ops.bias.bias.to(out.dtype)
        for module in ops.parallel_x:
            out = out + module(x)
        for module in ops.parallel_sub:
            out = out + module(sub_x)
        for module in ops.sequential:
            out = out + module(out)
        if ops.fusion is not None:
            outputs = [module(sub_x if module.spec.insertion == "parallel" else out) for module in ops.fused]
            out = out + ops.fusion(out, outputs)
        return out

    def begin_forward(self) -> None:
        """Run the prefix reparameterisation once per forward (not once per layer)."""
        self._prefix_cache = {role: encoder() for role, encoder in self.prefix_encoders.items()} or None

    def end_forward(self) -> None:
        self._prefix_cache = None

    def prefix_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, PrefixLayer] | None:
        """This layer's prefix keys and values, each (length, kv_dim), or None if it has none."""
        entry = self.prefix_layers.get(layer)
        if entry is None:
            return None
        role, prefix = entry
        if prefix.params is not None:
            return prefix.params.key, prefix.params.value, prefix
        if self._prefix_cache is None:
            self.begin_forward()
        kv = self._prefix_cache[role][self._prefix_layer_order[role].index(layer)]
        return kv[0], kv[1], prefix

    # -- after training ---------------------------------------------------------------------------------
    @torch.no_grad()
    def drop_reparameterization(self) -> None:
        """Replace the prefix MLP by the prefixes it produces (what the paper keeps after training)."""
        for role, encoder in list(self.prefix_encoders.items()):
            values = encoder()
            for index, layer in enumerate(self._prefix_layer_order[role]):
                prefix = self.prefix_layers[layer][1]
                params = PrefixParams(prefix.length, self.kv_dim)
                params.key.copy_(values[index, 0])
                params.value.copy_(values[index, 1])
                prefix.params = params.to(encoder.embedding.device)
            del self.prefix_encoders[role]
        self._prefix_layer_order = {}

    def parameter_groups(self, learning_rate: float) -> list[dict[str, Any]]:
        """The trainable parameters as optimizer parameter groups, one per learning-rate multiplier of the
        method's modules (`ModuleSpec.lr_multiplier`): each group's `lr` is `learning_rate` times its
        `lr_multiplier`, and `roles` names what it holds (module roles; `bitfit`, `norm` and `head`, which
        learn at the job's rate)."""
        multipliers = {role: spec.lr_multiplier for role, spec in self.method.modules.items()}
        members: dict[float, tuple[list[nn.Parameter], list[str]]] = {}
        placed: set[int] = set()

        def add(module: nn.Module, role: str, multiplier: float) -> None:
            for parameter in module.parameters():
                if parameter.requires_grad and id(parameter) not in placed:
                    placed.add(id(parameter))
                    parameters, roles = members.setdefault(multiplier, ([], []))
                    parameters.append(parameter)
                    if role not in roles:
                        roles.append(role)

        for sites in self.layers.values():
            for modules in sites.values():
                for role, module in modules.items():
                    own = not isinstance(module, BiasDelta | NormDelta)  # BitFit's and the norms' deltas
                    add(module, role, multipliers.get(role, 1.0) if own else 1.0)
        for role, encoder in self.prefix_encoders.items():
            add(encoder, role, multipliers.get(role, 1.0))
        add(self, "head", 1.0)  # the head, and anything else the job trains
        return [
            {
                "params": parameters,
                "lr": learning_rate * multiplier,
                "lr_multiplier": multiplier,
                "roles": roles,
            }
            for multiplier, (parameters, roles) in members.items()
        ]

    def parameter_counts(self) -> dict[str, int]:
        """Parameter counts: `pelt` = what a saved delta keeps (modules, gates, prefixes, bias and norm
        deltas), `frozen` = the part of it a fusion holds from its sources and does not train, `trained` =
        `pelt` less `frozen`, `head`, `reparam` = training-only prefix MLP, `trainable` = what the optimizer
        sees now."""
        reparam = sum(p.numel() for p in self.prefix_encoders.parameters())
        head = sum(p.numel() for p in self.head.parameters())
        pelt = sum(p.numel() for p in self.layers.parameters())
        # prefixes still produced by the reparameterisation count as what they will become: 2·l·kv_dim
        pelt += sum(
            2 * prefix.length * self.kv_dim
            for _, prefix in self.prefix_layers.values()
            if prefix.params is None
        )
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in self.layers.parameters() if not p.requires_grad)
        return {
            "pelt": pelt,
            "frozen": frozen,
            "trained": pelt - frozen,
            "head": head,
            "reparam": reparam,
            "trainable": trainable,
        }

    def gate_values(self) -> dict[str, float]:
        """Mean UniPELT gate value per module role in the last forward, over layers (empty without gates)."""
        values: dict[str, list[float]] = {}
        for sites in self.layers.values():
            for modules in sites.values():
                for role, module in modules.items():
                    gate = getattr(module, "gate", None)
                    if isinstance(gate, Gate) and gate.last_mean is not None:
                        values.setdefault(role, []).append(float(gate.last_mean))
        return {role: sum(v) / len(v) for role, v in values.items()}


# --------------------------------------------------------------------------------------------------
# The model a job trains and serves
# --------------------------------------------------------------------------------------------------
class PeltModel(nn.Module):
    """A shared frozen backbone plus named job deltas; only the deltas are parameters of this module."""

    def __init__(self, backbone: Backbone, deltas: dict[str, JobDelta] | JobDelta):
        super().__init__()
        if isinstance(deltas, JobDelta):
            deltas = {"job": deltas}
        self.deltas = nn.ModuleDict(deltas)
        self.backbone = backbone  # a plain attribute: not part of parameters() or state_dict()
        self.runtime = get_runtime(backbone)
        self.train(backbone.model.training)  # start in the backbone's mode (eval after Backbone.load)

    def __setattr__(self, name, value):
        if name == "backbone":  # keep the shared backbone out of this module's tree
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def train(self, mode: bool = True) -> PeltModel:
        super().train(mode)
        self.backbone.model.train(mode)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        routes: list[tuple[str, int]] | None = None,
        return_hidden: bool = False,
    ):
        """Logits for one job (a tensor), or a list of per-route logits when `routes` splits the batch.

        routes: (job name, number of rows) in batch order; omitted with a single delta = all rows.
        """
        resolved = self._resolve_routes(routes, input_ids.shape[0])
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        with self.runtime.routing(resolved, attention_mask):
            hidden = self.backbone.model(**kwargs).last_hidden_state
        if return_hidden:
            return hidden
        pieces = zip(
            resolved,
            self._split_rows(resolved, hidden),
            self._split_rows(resolved, attention_mask),
            strict=True,
        )
        outputs = [route.delta.head(rows, mask) for route, rows, mask in pieces]
        return outputs[0] if len(outputs) == 1 else outputs

    @staticmethod
    def _split_rows(routes: list[Route], tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each route's rows as views (`split`: one gradient join in backward, not one per route)."""
        return tensor.split([route.size for route in routes])

    def _resolve_routes(self, routes: list[tuple[str, int]] | None, batch: int) -> list[Route]:
        """(name, rows) pairs as consecutive row slices of the batch, checked against the deltas held."""
        if routes is None:
            if len(self.deltas) != 1:
                raise ValueError(
                    f"this model holds {len(self.deltas)} deltas; pass routes=[(name, rows), ...]"
                )
            routes = [(next(iter(self.deltas)), batch)]
        resolved, start = [], 0
        for name, count in routes:
            if name not in self.deltas:
                raise KeyError(f"no delta named {name!r}; this model holds {', '.join(self.deltas)}")
            resolved.append(Route(self.deltas[name], slice(start, start + count)))
            start += count
        if start != batch:
            raise ValueError(f"routes cover {start} rows but the batch has {batch}")
        return resolved

    def merged_backbone(self, name: str | None = None) -> nn.Module:
        """A standalone copy of the backbone with this job's LoRA ΔW folded into its weights.

        The shared backbone is untouched ("unmerge" is exact: drop the copy). Only linear, ungated,
        bias-free bottlenecks on weight matrices (LoRA) fold; any other module is refused.
        """
        if name is None:
            if len(self.deltas) != 1:
                raise ValueError("name the delta to fold")
            name = next(iter(self.deltas))
        delta = self.deltas[name]
        if delta.prefix_layers or delta.norm_ops:
            raise ValueError(
                "only LoRA-style deltas fold into dense weights (this one has prefixes or norm deltas)"
            )
        merged = copy.deepcopy(self.backbone.model)
        merged.config._attn_implementation = self.backbone.model.config._attn_implementation.replace(
            "pelt_", ""
        )
        for (layer, concrete), ops in delta.linear_ops.items():
            if ops.parallel_sub or ops.sequential or ops.fusion is not None:
                raise ValueError("adapters do not fold into dense weights; only LoRA-style deltas do")
            linear = merged.get_submodule(self.backbone.linear_path(layer, concrete))
            for module in ops.parallel_x:
                linear.weight.data = linear.weight.data + module.delta_weight().to(linear.weight.dtype)
            if ops.bias is not None:
                if linear.bias is None:
                    linear.bias = nn.Parameter(torch.zeros(linear.out_features, dtype=linear.weight.dtype))
                linear.bias.data = linear.bias.data + ops.bias.bias.to(linear.weight.dtype)
        for module in merged.modules():
            module._forward_hooks.clear()
        return merged


@torch.no_grad()
def predict(
    model: PeltModel,
    texts: Sequence[Text],
    name: str | None = None,
    batch_size: int = 32,
    max_length: int = 128,
) -> list[dict]:
    """Classify (or score) texts or (text, text_pair) pairs with one job of `model`, in input order
    (the result format of `pelt_core.predictions`: {"label", "score"}, {"labels", "scores"} or {"value"})."""
    routes_name = name or next(iter(model.deltas))
    delta = model.deltas[routes_name]
    check_text_form(texts, delta.text_fields)
    device = next(delta.parameters()).device
    results: list[dict] = []
    with evaluating(model):
        for start in range(0, len(texts), batch_size):
            chunk = texts[start : start + batch_size]
            batch = tokenize_texts(model.backbone.tokenizer, chunk, max_length, device)
            logits = model(**batch, routes=[(routes_name, len(chunk))]).float()
            results.extend(decode_predictions(delta.problem_type, delta.label_names, logits))
    return results
