"""Frozen backbones: loading, content hashing, and where each architecture keeps its modules.

An `Architecture` names, per transformer layer, the linear maps that PELT modules can modify
(q, k, v, o, FFN in/out), the LayerNorms, and the attention module. Supported families: BERT
(bert, roberta, xlm-roberta) and Llama (llama, mistral, qwen2). Everything else is refused with
the list of supported model types.

Before anything is built, `Backbone.load` checks the model's config against `pelt_core.limits`
(`BACKBONE_CONFIG` ranges, an estimated parameter count at most `MAX_BACKBONE_PARAMETERS` or a lower
bound given) and the size of its weight files against that estimate, so a config that describes a
huge model is refused instead of allocated.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pelt_core.backbone_names import BACKBONE_ALIASES, resolve_backbone
from pelt_core.backbone_names import PACKAGED_BACKBONES as PACKAGED_BACKBONES  # re-exported
from pelt_core.errors import BackboneError
from pelt_core.limits import (
    BACKBONE_CONFIG,
    BACKBONE_WEIGHT_BYTES_ALLOWANCE,
    MAX_BACKBONE_CONFIG_BYTES,
    MAX_BACKBONE_PARAMETERS,
    MAX_BACKBONE_WEIGHT_BYTES_PER_PARAMETER,
    REQUIRED_BACKBONE_CONFIG,
    LimitError,
)


@dataclass(frozen=True)
class Architecture:
    """Where one model family keeps the parts that PELT modules modify."""

    family: str
    model_types: tuple[str, ...]
    is_decoder: bool
    layers_path: str
    linear_paths: dict[str, str]  # concrete linear name -> path inside a layer
    weight_sites: dict[str, tuple[str, ...]]  # spec representation -> concrete linear names
    layer_norm_paths: dict[str, str]
    attention_path: str

    def sublayer_input(self, sublayer: str) -> str:
        """The concrete linear whose input is the sub-layer's input x (for parallel insertion)."""
        return self.weight_sites["attn.q" if sublayer == "attn" else "ffn.in"][0]

    def sublayer_output(self, sublayer: str) -> str:
        """The concrete linear whose output is the sub-layer's output h, before the residual."""
        return "attn.o" if sublayer == "attn" else "ffn.out"


BERT = Architecture(
    family="bert",
    model_types=("bert", "roberta", "xlm-roberta"),
    is_decoder=False,
    layers_path="encoder.layer",
    linear_paths={
        "attn.q": "attention.self.query",
        "attn.k": "attention.self.key",
        "attn.v": "attention.self.value",
        "attn.o": "attention.output.dense",
        "ffn.in": "intermediate.dense",
        "ffn.out": "output.dense",
    },
    weight_sites={
        "attn.q": ("attn.q",),
        "attn.k": ("attn.k",),
        "attn.v": ("attn.v",),
        "attn.o": ("attn.o",),
        "ffn.in": ("ffn.in",),
        "ffn.out": ("ffn.out",),
    },
    layer_norm_paths={"attn": "attention.output.LayerNorm", "ffn": "output.LayerNorm"},
    attention_path="attention.self",
)

LLAMA = Architecture(
    family="llama",
    model_types=("llama", "mistral", "qwen2"),
    is_decoder=True,
    layers_path="layers",
    linear_paths={
        "attn.q": "self_attn.q_proj",
        "attn.k": "self_attn.k_proj",
        "attn.v": "self_attn.v_proj",
        "attn.o": "self_attn.o_proj",
        "ffn.gate": "mlp.gate_proj",
        "ffn.up": "mlp.up_proj",
        "ffn.out": "mlp.down_proj",
    },
    weight_sites={
        "attn.q": ("attn.q",),
        "attn.k": ("attn.k",),
        "attn.v": ("attn.v",),
        "attn.o": ("attn.o",),
        "ffn.in": ("ffn.up", "ffn.gate"),
        "ffn.out": ("ffn.out",),
    },
    layer_norm_paths={"attn": "input_layernorm", "ffn": "post_attention_layernorm"},
    attention_path="self_attn",
)

ARCHITECTURES = (BERT, LLAMA)
SUPPORTED_MODEL_TYPES = tuple(t for arch in ARCHITECTURES for t in arch.model_types)


def architecture_for(model_type: str) -> Architecture:
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            return arch
    raise BackboneError(
        f"unsupported architecture {model_type!r}; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


# --- the config checked before anything is built --------------------------------------------------------

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def read_backbone_config(path: str, gguf: str | None, name: str) -> Any:
    """The model's transformers config, read without weights and checked: a config.json is at most
    MAX_BACKBONE_CONFIG_BYTES and its sizes are checked as written (before transformers reads it); then
    the parsed config's sizes, architecture and estimated parameter count (`check_backbone_config`)."""
    from transformers import AutoConfig

    if gguf is None:
        file = Path(path) / "config.json"
        try:
            size = file.stat().st_size
            if size > MAX_BACKBONE_CONFIG_BYTES:
                raise BackboneError(
                    f"backbone {name!r}: config.json holds {size:,} bytes, more than the "
                    f"{MAX_BACKBONE_CONFIG_BYTES:,} a model config may"
                )
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise BackboneError(f"backbone {name!r}: config.json cannot be read: {exc}") from None
        if not isinstance(raw, dict):
            raise BackboneError(f"backbone {name!r}: config.json must hold a JSON object")
        check_config_values(raw, name, required=())
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise BackboneError(f"backbone {name!r}: its config cannot be read: {exc}") from None
    architecture_for(config.model_type)  # refuse unsupported models before anything else
    return config


def check_config_values(
    values: Mapping[str, Any], name: str, required: tuple[str, ...] = REQUIRED_BACKBONE_CONFIG
) -> None:
    """Every size in `values` (a config.json object or a config's attributes) within BACKBONE_CONFIG;
    the `required` ones present. A BackboneError names the field and its range."""
    for field in required:
        if values.get(field) is None:
            raise BackboneError(f"backbone {name!r}: its config lacks {field}")
    for field, allowed in BACKBONE_CONFIG.items():
        if values.get(field) is not None:
            try:
                allowed.check(values[field], f"config.{field}")
            except LimitError as exc:
                raise BackboneError(f"backbone {name!r}: {exc}") from None


def estimate_parameters(config: Any) -> int:
    """The base model's parameter count as its config describes it (embeddings, attention and FFN
    matrices, per-layer vectors), within a few percent of the built model's."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or max(hidden // heads, 1)
    arch = architecture_for(config.model_type)
    embeddings = config.vocab_size * hidden
    if arch.family == "bert":
        positions = getattr(config, "max_position_embeddings", None) or 0
        embeddings += (positions + (getattr(config, "type_vocab_size", None) or 0)) * hidden
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    ffn = (3 if arch.family == "llama" else 2) * hidden * config.intermediate_size
    return embeddings + config.num_hidden_layers * (attention + ffn + 10 * hidden)


def check_backbone_config(config: Any, name: str, max_parameters: int | None = None) -> int:
    """Refuse a config whose sizes are out of range or whose estimated parameter count is above
    MAX_BACKBONE_PARAMETERS (or `max_parameters`, when lower); return the estimate."""
    architecture_for(config.model_type)
    check_config_values({field: getattr(config, field, None) for field in BACKBONE_CONFIG}, name)
    estimate = estimate_parameters(config)
    bound = (
        MAX_BACKBONE_PARAMETERS if max_parameters is None else min(max_parameters, MAX_BACKBONE_PARAMETERS)
    )
    if estimate > bound:
        raise BackboneError(
            f"backbone {name!r}: its config describes about {estimate:,} parameters, more than "
            f"the limit {bound:,}"
        )
    return estimate


def check_weight_files(path: str, gguf: str | None, estimate: int, name: str) -> int:
    """The bytes of the backbone's weight files: some, and at most what `estimate` parameters need
    (MAX_BACKBONE_WEIGHT_BYTES_PER_PARAMETER each, plus BACKBONE_WEIGHT_BYTES_ALLOWANCE)."""
    folder = Path(path)
    files = (
        [folder / gguf]
        if gguf
        else [f for f in folder.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file()]
    )
    size = sum(f.stat().st_size for f in files)
    if not size:
        raise BackboneError(
            f"backbone {name!r} holds no weights (model.safetensors, pytorch_model.bin or a .gguf file)"
        )
    bound = estimate * MAX_BACKBONE_WEIGHT_BYTES_PER_PARAMETER + BACKBONE_WEIGHT_BYTES_ALLOWANCE
    if size > bound:
        raise BackboneError(
            f"backbone {name!r}: its weight files hold {size:,} bytes, more than its config's "
            f"about {estimate:,} parameters take ({bound:,} bytes at most)"
        )
    return size


def backbone_facts(config: Any, num_parameters: int | None = None) -> dict[str, Any]:
    """The shape facts a registry keeps of a backbone, which `pelt_core.limits.check_against_backbone`
    checks hyperparameters against: model_type, hidden_size, num_layers, num_heads, num_kv_heads,
    head_dim, intermediate_size, max_positions (None: not in the config), vocab_size, num_parameters
    (the built model's count, else `estimate_parameters` of the config)."""
    heads = config.num_attention_heads
    return {
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers,
        "num_heads": heads,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "intermediate_size": config.intermediate_size,
        "max_positions": getattr(config, "max_position_embeddings", None),
        "vocab_size": config.vocab_size,
        "num_parameters": estimate_parameters(config) if num_parameters is None else num_parameters,
    }


def read_backbone_facts(name: str, max_parameters: int | None = None) -> dict[str, Any]:
    """A backbone's facts from its config alone (no weights are read; num_parameters is estimated),
    checked as `Backbone.load` checks it: for a backbone registered without facts."""
    _, path, gguf = resolve_backbone(name)
    config = read_backbone_config(path, gguf, name)
    return backbone_facts(config, check_backbone_config(config, name, max_parameters))


def read_shape_config(name: str) -> Any:
    """A backbone's config for its shapes alone, without transformers where its config.json says them all:
    the JSON object (at most MAX_BACKBONE_CONFIG_BYTES, checked as `read_backbone_config` checks it) as
    attributes, when it names a supported model_type and every REQUIRED_BACKBONE_CONFIG field; otherwise
    (a .gguf file, a field left to transformers' default) `read_backbone_config`'s config."""
    from types import SimpleNamespace

    _, path, gguf = resolve_backbone(name)
    file = Path(path) / "config.json"
    if gguf is None:
        try:
            if file.stat().st_size <= MAX_BACKBONE_CONFIG_BYTES:
                raw = json.loads(file.read_text(encoding="utf-8"))
                if (
                    isinstance(raw, dict)
                    and raw.get("model_type") in SUPPORTED_MODEL_TYPES
                    and all(isinstance(raw.get(key), int) for key in REQUIRED_BACKBONE_CONFIG)
                ):
                    check_config_values(raw, name)
                    return SimpleNamespace(**raw)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, TypeError):
            pass  # read_backbone_config says what is wrong with it
    return read_backbone_config(path, gguf, name)


@dataclass(frozen=True)
class LinearShape:
    """A linear map's sizes, as `nn.Linear` names them."""

    in_features: int
    out_features: int


def linear_shape(config: Any, concrete: str) -> LinearShape:
    """The sizes of a layer's linear map `concrete` (attn.q, ffn.in, …) in the model `config` describes,
    as transformers builds it (BERT: all heads' width is heads x ⌊hidden / heads⌋; Llama: q and o take
    heads x head_dim, k and v kv_heads x head_dim)."""
    arch = architecture_for(config.model_type)
    if concrete not in arch.linear_paths:
        raise BackboneError(f"{arch.family} models have no linear map {concrete!r}")
    facts = backbone_facts(config, 0)
    hidden, ffn = facts["hidden_size"], facts["intermediate_size"]
    if arch.family == "bert":
        heads = facts["num_heads"] * (hidden // facts["num_heads"])
        q = kv = heads
    else:
        q, kv = facts["num_heads"] * facts["head_dim"], facts["num_kv_heads"] * facts["head_dim"]
    sizes = {
        "attn.q": (hidden, q),
        "attn.k": (hidden, kv),
        "attn.v": (hidden, kv),
        "attn.o": (q, hidden),
        "ffn.in": (hidden, ffn),
        "ffn.gate": (hidden, ffn),
        "ffn.up": (hidden, ffn),
        "ffn.out": (ffn, hidden),
    }
    return LinearShape(*sizes[concrete])


def state_dict_hash(model: nn.Module) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes: the backbone's identity for deltas."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


class Backbone:
    """A frozen transformers base model with its tokenizer, architecture map and content hash.

    The model's tensors are never written: every trainable tensor belongs to a job's delta.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        name: str,
        content_hash: str | None = None,
        source: str | None = None,
    ):
        model_type = model.config.model_type
        self.arch = architecture_for(model_type)
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.source = source or name
        self.config = model.config
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        self.content_hash = content_hash or state_dict_hash(model)
        if tokenizer is not None:
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
            tokenizer.padding_side = "right"  # pooling and the padding masks assume right padding
        self.runtime = None  # set by pelt_core.runtime.get_runtime when PELT modules are first attached

    # -- shape facts the PELT modules need ---------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.hidden_size // self.num_heads

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def facts(self) -> dict[str, Any]:
        """Its shape (`backbone_facts`): what the registry keeps of it."""
        return backbone_facts(self.config, self.num_parameters)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        """Where its weights are (and so where its jobs train)."""
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> Backbone:
        """Move the weights to `device` (once per process: a GPU worker's copy); returns self."""
        from pelt_core.devices import resolve_device

        self.model.to(resolve_device(device))
        return self

    def layers(self) -> list[nn.Module]:
        return list(self.model.get_submodule(self.arch.layers_path))

    def linear(self, layer: int, concrete: str) -> nn.Linear:
        return self.layers()[layer].get_submodule(self.arch.linear_paths[concrete])

    def linear_path(self, layer: int, concrete: str) -> str:
        return f"{self.arch.layers_path}.{layer}.{self.arch.linear_paths[concrete]}"

    def layer_norm(self, layer: int, sublayer: str) -> nn.Module:
        return self.layers()[layer].get_submodule(self.arch.layer_norm_paths[sublayer])

    def attention(self, layer: int) -> nn.Module:
        return self.layers()[layer].get_submodule(self.arch.attention_path)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "model_type": self.config.model_type,
            "family": self.arch.family,
            "content_hash": self.content_hash,
            "num_parameters": self.num_parameters,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
        }

    @classmethod
    def load(
        cls,
        name: str,
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        max_parameters: int | None = None,
        device: str | torch.device = "cpu",
    ) -> Backbone:
        """Load a packaged model by alias, a local model directory or a .gguf file, offline, onto `device`
        (`pelt_core.devices.resolve_device`: cpu, cuda, cuda:N or auto). Its config is checked first
        (`read_backbone_config`, `check_backbone_config`, `check_weight_files`): nothing is built for a
        model out of range or above `max_parameters` (estimated). The content hash is the checkpoint's,
        whatever the dtype or device it is held in."""
        from pelt_core.devices import resolve_device

        target = resolve_device(device)  # an unusable device is refused before anything loads
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        canonical, path, gguf = resolve_backbone(name)
        kwargs = {"gguf_file": gguf} if gguf else {}
        config = read_backbone_config(path, gguf, name)
        check_weight_files(path, gguf, check_backbone_config(config, name, max_parameters), name)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
        model, info = AutoModel.from_pretrained(  # built from the config checked above
            path,
            config=config,
            local_files_only=True,
            dtype=torch.float32,
            attn_implementation=attn_implementation,
            output_loading_info=True,
            **kwargs,
        )
        missing = sorted(info.get("missing_keys", []))
        if missing and all(key.startswith("pooler.") for key in missing) and hasattr(model, "pooler"):
            model.pooler = None  # a checkpoint saved without BERT's pooler: never use random weights
        elif missing:
            raise BackboneError(
                f"backbone {name!r} lacks weights for {', '.join(missing[:5])}"
                f"{' …' if len(missing) > 5 else ''}; it would start from random values"
            )
        model.eval()
        content_hash = state_dict_hash(model)  # of the checkpoint's weights, before any cast
        if dtype == "bfloat16":
            model.to(torch.bfloat16)
        elif dtype != "float32":
            raise BackboneError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        model.to(target)
        return cls(model, tokenizer, canonical, content_hash=content_hash, source=path)


class ShapeBackbone(Backbone):
    """A backbone's shapes without its weights, tokenizer or transformers model: enough to build, load,
    compose and save deltas of it (`JobDelta` takes its linear maps' sizes; `save_delta` its name, hash,
    sizes and parameter count), not to run one. Its identity (`content_hash`) and `num_parameters` are
    what the deltas' manifests record (`from_manifest`); its config is read without weights
    (`read_shape_config`). What needs the weights (`layers`, `to`, a forward) raises BackboneError."""

    def __init__(
        self, config: Any, name: str, content_hash: str, num_parameters: int, source: str | None = None
    ):
        self.arch = architecture_for(config.model_type)
        self.model = None
        self.tokenizer = None
        self.name = name
        self.source = source or name
        self.config = config
        self.content_hash = content_hash
        self.runtime = None
        self._num_parameters = int(num_parameters)

    @classmethod
    def from_manifest(cls, recorded: Mapping[str, Any]) -> ShapeBackbone:
        """The backbone a delta's manifest names (its `backbone` entry: name, content_hash,
        num_parameters, and the model_type, num_layers and hidden_size its config must still have)."""
        name = str(recorded["name"])
        canonical = BACKBONE_ALIASES.get(name, name)
        config = read_shape_config(name)
        check_backbone_config(config, name)
        facts = backbone_facts(config, 0)
        for key, fact in (
            ("model_type", "model_type"),
            ("num_layers", "num_layers"),
            ("hidden_size", "hidden_size"),
        ):
            if recorded.get(key) is not None and recorded[key] != facts[fact]:
                raise BackboneError(
                    f"backbone {name!r}: its config has {key} {facts[fact]!r}, the deltas record {recorded[key]!r}"
                )
        parameters = recorded.get("num_parameters")
        if not isinstance(parameters, int) or parameters <= 0:
            parameters = estimate_parameters(config)
        return cls(config, canonical, str(recorded["content_hash"]), parameters)

    @property
    def num_parameters(self) -> int:
        return self._num_parameters

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def to(self, device: str | torch.device) -> Backbone:
        raise BackboneError(
            f"backbone {self.name!r} is loaded as its shapes alone: it has no weights to move"
        )

    def layers(self) -> list[nn.Module]:
        raise BackboneError(f"backbone {self.name!r} is loaded as its shapes alone: it has no layers to run")

    def linear(self, layer: int, concrete: str) -> LinearShape:  # type: ignore[override]
        if not 0 <= layer < self.num_layers:
            raise BackboneError(f"backbone {self.name!r} has no layer {layer}")
        return linear_shape(self.config, concrete)
