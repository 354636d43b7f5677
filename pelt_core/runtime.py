"""The runtime: how a shared frozen backbone routes each row of a batch through its own job's modules.

`Runtime` is attached once per backbone (`get_runtime`). It puts one forward hook on each linear map and
norm of every layer and wraps the attention function (sdpa or eager) in a prefix-aware one. While a
`pelt_core.model.PeltModel` forward runs inside `Runtime.routing`, the runtime knows which rows of the batch
belong to which job (the routes) and applies each job's modules to its own rows only: bottlenecks and
BitFit biases at linear maps, norm deltas at norms, prefix keys/values (with their gates) in attention.
That is what lets one backbone forward serve several jobs or tasks at once; it never writes a backbone
tensor. Outside a routed forward every hook is a no-op, so the backbone behaves as loaded.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from pelt_core.backbones import Backbone
from pelt_core.dropout import BackboneDropout, RowGenerators, attention_with_dropout, use_backbone_dropout

if TYPE_CHECKING:
    from pelt_core.model import JobDelta


@dataclass
class Route:
    """One job's rows of the batch: `rows` of the batch go through `delta`."""

    delta: JobDelta
    rows: slice

    @property
    def size(self) -> int:
        return self.rows.stop - self.rows.start


class Runtime:
    """Installed once per backbone: forward hooks on every linear map and norm, and a prefix-aware
    attention."""

    def __init__(self, backbone: Backbone):
        self.backbone = backbone
        self.routes: list[Route] | None = None
        self.sizes: list[int] = []  # rows of each route, in batch order
        self.padding_mask: torch.Tensor | None = None
        self.stash: dict[tuple[int, str], torch.Tensor] = {}
        arch = backbone.arch
        sub_inputs = {arch.sublayer_input("attn"): "attn", arch.sublayer_input("ffn"): "ffn"}
        self.handles = []
        for i in range(backbone.num_layers):
            for concrete in arch.linear_paths:
                hook = self._linear_hook(i, concrete, sub_inputs.get(concrete))
                self.handles.append(backbone.linear(i, concrete).register_forward_hook(hook))
            for sublayer in arch.layer_norm_paths:
                norm = backbone.layer_norm(i, sublayer)
                self.handles.append(norm.register_forward_hook(self._norm_hook(i, sublayer)))
            _ATTENTION_OWNERS[backbone.attention(i)] = (self, i)
        _install_attention(backbone.model)
        use_backbone_dropout(backbone.model)  # same p, cheaper random numbers (pelt_core.dropout)
        for module in backbone.model.modules():  # each job's rows draw their masks from its own generator
            if isinstance(module, BackboneDropout):
                module.row_generators = self.row_generators

    @contextlib.contextmanager
    def routing(self, routes: list[Route], padding_mask: torch.Tensor) -> Iterator[None]:
        """Route the backbone forward run inside this block: one forward at a time per backbone."""
        if self.routes is not None:
            raise RuntimeError(
                "this backbone is already running a PELT forward (one forward at a time per backbone)"
            )
        self.routes, self.padding_mask = routes, padding_mask
        self.sizes = [route.size for route in routes]
        try:
            for route in routes:
                route.delta.begin_forward()
            yield
        finally:
            self.routes, self.padding_mask = None, None
            self.stash.clear()
            for route in routes:
                route.delta.end_forward()

    def row_generators(self) -> RowGenerators | None:
        """(rows, generator) per route while a routed forward runs and some job has its own dropout
        generator (`JobDelta.use_generator`); None otherwise (torch's generator draws every mask)."""
        routes = self.routes
        if not routes or any(route.delta.generator is None for route in routes):
            return None
        return [(route.size, route.delta.generator) for route in routes]

    def split(self, tensor: torch.Tensor | None) -> tuple[torch.Tensor, ...] | list[None]:
        """Each route's rows of a batch-first tensor, as views. `split` (not one slice per route): its
        backward joins the pieces' gradients once, where N slices would each fill a batch-sized zero
        tensor (N² work in a pack of N)."""
        if tensor is None:
            return [None] * len(self.routes)
        if len(self.routes) == 1:
            return (tensor,)
        return tensor.split(self.sizes)

    def _map_routes(self, output: torch.Tensor, fn: Callable) -> torch.Tensor | None:
        """Apply fn(route, route's rows of output, route index) per route; None when no route changed
        anything."""
        routes = self.routes
        if len(routes) == 1:
            return fn(routes[0], output, 0)
        pieces, changed = [], False
        for index, (route, rows) in enumerate(zip(routes, self.split(output), strict=True)):
            piece = fn(route, rows, index)
            if piece is None:
                piece = rows
            else:
                changed = True
            pieces.append(piece)
        return torch.cat(pieces, dim=0) if changed else None

    def _linear_hook(self, layer: int, concrete: str, stash_as: str | None):
        key = (layer, concrete)
        sublayer = "attn" if concrete in ("attn.o",) else ("ffn" if concrete == "ffn.out" else None)

        def hook(module, args, output):
            if self.routes is None:
                return None
            x = args[0]
            if stash_as is not None:
                self.stash[(layer, stash_as)] = x
            if not any(key in route.delta.linear_ops for route in self.routes):
                return None
            xs = self.split(x)
            sub_xs = self.split(self.stash.get((layer, sublayer)) if sublayer else None)

            def apply(route: Route, h: torch.Tensor, index: int):
                ops = route.delta.linear_ops.get(key)
                if ops is None:
                    return None
                return route.delta.apply_linear(ops, xs[index], h, sub_xs[index])

            return self._map_routes(output, apply)

        return hook

    def _norm_hook(self, layer: int, sublayer: str):
        key = (layer, sublayer)

        def hook(module, args, output):
            if self.routes is None:
                return None
            if not any(key in route.delta.norm_ops for route in self.routes):
                return None
            xs = self.split(args[0])

            def apply(route: Route, y: torch.Tensor, index: int):
                delta = route.delta.norm_ops.get(key)
                return None if delta is None else delta(module, xs[index], y)

            return self._map_routes(output, apply)

        return hook

    def extend_with_prefix(self, module, query, key, value, attention_mask, is_eager: bool):
        """Prepend each row's job prefix to keys/values and extend the mask; rows without one see none."""
        layer = _ATTENTION_OWNERS[module][1]
        entries = [route.delta.prefix_kv(layer) for route in self.routes]
        if all(e is None for e in entries):
            return key, value, attention_mask
        kv_heads, head_dim = key.shape[1], key.shape[3]
        length = max(e[0].shape[0] for e in entries if e is not None)
        xs = self.split(self.stash.get((layer, "attn")))
        masks = self.split(self.padding_mask)
        keys, values, valid = [], [], []
        for entry, rows, x, mask in zip(entries, self.sizes, xs, masks, strict=True):
            if entry is None:  # rows without a prefix: zero slots they never see
                keys.append(key.new_zeros(rows, kv_heads, length, head_dim))
                values.append(value.new_zeros(rows, kv_heads, length, head_dim))
                valid.append(torch.zeros(rows, length, dtype=torch.bool, device=key.device))
                continue
            pk, pv, prefix = entry
            n = pk.shape[0]
            k = pk.view(n, kv_heads, head_dim).transpose(0, 1).unsqueeze(0)  # (1, kvh, n, hd)
            v = pv.view(n, kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
            if prefix.gate is not None:
                gate = prefix.gate(x).squeeze(-1)  # (rows, T)
                mask = mask.to(gate.dtype) if mask is not None else None
                g = (gate * mask).sum(1) / mask.sum(1).clamp(min=1) if mask is not None else gate.mean(1)
                prefix.gate.last_mean = g.detach().mean()
                g = g.view(-1, 1, 1, 1)
                k, v = k * g, v * g
            k, v = k.expand(rows, -1, -1, -1).to(key.dtype), v.expand(rows, -1, -1, -1).to(value.dtype)
            if n < length:  # shorter than another job's prefix: zero slots this row never sees
                k, v = F.pad(k, (0, 0, 0, length - n)), F.pad(v, (0, 0, 0, length - n))
            keys.append(k)
            values.append(v)
            row_valid = torch.zeros(rows, length, dtype=torch.bool, device=key.device)
            row_valid[:, :n] = True
            valid.append(row_valid)
        prefix_k, prefix_v = torch.cat(keys), torch.cat(values)
        valid = torch.cat(valid)
        key = torch.cat([prefix_k, key], dim=2)
        value = torch.cat([prefix_v, value], dim=2)
        return key, value, _mask_with_prefix(module, query, key, attention_mask, valid, is_eager)


def _mask_with_prefix(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    valid: torch.Tensor,
    is_eager: bool,
) -> torch.Tensor:
    """The attention mask over [prefix; sequence] keys: `valid` (batch, length) says which prefix slots a
    row sees; the sequence part is the given mask (bool or additive), or causal / full when there is none."""
    batch, q_len, length = query.shape[0], query.shape[2], valid.shape[1]
    prefix_mask = valid[:, None, None, :].expand(batch, 1, q_len, length)
    if attention_mask is None:
        seq_len = key.shape[2] - length
        if getattr(module, "is_causal", False) and q_len > 1:
            seq_mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=key.device).tril(seq_len - q_len)
        else:
            seq_mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=key.device)
        seq_mask = seq_mask[None, None].expand(batch, 1, q_len, seq_len)
        full = torch.cat([prefix_mask, seq_mask], dim=-1)
        if is_eager:
            full = torch.zeros(full.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~full, torch.finfo(query.dtype).min
            )
        return full
    attention_mask = attention_mask.expand(batch, -1, q_len, -1)
    if attention_mask.dtype == torch.bool:
        return torch.cat([prefix_mask, attention_mask], dim=-1)
    additive = torch.zeros(prefix_mask.shape, dtype=attention_mask.dtype, device=attention_mask.device)
    additive = additive.masked_fill(~prefix_mask, torch.finfo(attention_mask.dtype).min)
    return torch.cat([additive, attention_mask], dim=-1)


def get_runtime(backbone: Backbone) -> Runtime:
    """The backbone's runtime, installed on first use (hooks stay for the backbone's lifetime)."""
    if backbone.runtime is None:
        backbone.runtime = Runtime(backbone)
    return backbone.runtime


# --------------------------------------------------------------------------------------------------
# Per-architecture attention patching: transformers' attention registry
# --------------------------------------------------------------------------------------------------
_REGISTERED = False
_ATTENTION_OWNERS: weakref.WeakKeyDictionary = (
    weakref.WeakKeyDictionary()
)  # attention module -> (runtime, layer)


def _runtime_of(module: nn.Module) -> Runtime | None:
    owner = _ATTENTION_OWNERS.get(module)
    return owner[0] if owner is not None else None


def _install_attention(model: nn.Module) -> None:
    """Route the model's attention through a prefix-aware wrapper of its sdpa or eager implementation."""
    global _REGISTERED
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not _REGISTERED:
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

        def pelt_sdpa(module, query, key, value, attention_mask, **kwargs):
            runtime = _runtime_of(module)
            if runtime is not None and runtime.routes is not None:
                key, value, attention_mask = runtime.extend_with_prefix(
                    module, query, key, value, attention_mask, is_eager=False
                )
                generators = runtime.row_generators()
                if _cheap_dropout_applies(query, kwargs, generators):
                    return _sdpa_with_cheap_dropout(
                        module, query, key, value, attention_mask, generators=generators, **kwargs
                    )
            return sdpa(module, query, key, value, attention_mask, **kwargs)

        def pelt_eager(module, query, key, value, attention_mask, **kwargs):
            eager = sys.modules[type(module).__module__].eager_attention_forward
            runtime = _runtime_of(module)
            if runtime is not None and runtime.routes is not None:
                key, value, attention_mask = runtime.extend_with_prefix(
                    module, query, key, value, attention_mask, is_eager=True
                )
            return eager(module, query, key, value, attention_mask, **kwargs)

        ALL_ATTENTION_FUNCTIONS.register("pelt_sdpa", pelt_sdpa)
        ALL_ATTENTION_FUNCTIONS.register("pelt_eager", pelt_eager)
        ALL_MASK_ATTENTION_FUNCTIONS.register("pelt_sdpa", sdpa_mask)
        ALL_MASK_ATTENTION_FUNCTIONS.register("pelt_eager", eager_mask)
        _REGISTERED = True
    current = model.config._attn_implementation
    if current in ("pelt_sdpa", "pelt_eager"):
        return
    if current not in ("sdpa", "eager"):
        raise ValueError(f"attention implementation {current!r} is not supported; use sdpa or eager")
    model.config._attn_implementation = f"pelt_{current}"


def _cheap_dropout_applies(query: torch.Tensor, kwargs: dict, generators: RowGenerators | None) -> bool:
    """Attention dropout with nothing sdpa-specific asked for (paged cache, position bias), on the CPU, or on
    any device when the jobs have their own dropout generators (a pack: on a GPU, sdpa's fused kernel would
    draw every job's mask from the device's one generator, so a job's masks would depend on its pack-mates)."""
    return (
        (kwargs.get("dropout") or 0.0) > 0.0
        and (query.device.type == "cpu" or generators is not None)
        and not any(kwargs.get(name) is not None for name in ("cache", "position_bias", "softcap"))
    )


def _sdpa_with_cheap_dropout(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float,
    scaling=None,
    is_causal=None,
    generators: RowGenerators | None = None,
    **_,
):
    """transformers' sdpa attention while training on the CPU or in a pack: the same inputs and result, with
    pelt_core.dropout's keep mask (each job's from its own generator) instead of sdpa's math fallback (which draws one number per weight)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    output = attention_with_dropout(
        query, key, value, attention_mask, dropout, scaling, is_causal, generators
    )
    return output.transpose(1, 2).contiguous(), None
