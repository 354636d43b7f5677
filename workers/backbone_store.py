"""One frozen backbone per node, shared zero-copy through Ray's object store.

`publish_backbone` loads a backbone once and puts its tensors (as numpy arrays) into the object store.
Every worker process on a node that calls `materialize` maps the same shared-memory pages read-only and
builds its model around them without copying: the model skeleton is created on the meta device and
every parameter and buffer is assigned a tensor that views the shared array. Writing to such a tensor
fails, which is the point: anything a job trains lives in its own delta.

bfloat16 has no numpy dtype, so bf16 tensors travel as uint16 and are viewed back as bf16.

Per node, a light `BackboneHost` actor (workers/backbone_host.py) publishes each (backbone, dtype)
once and owns the copy; `NodeBackbones` is what a worker calls to map its node's copy (the first
worker to ask loads it for the host).

Inside one worker process, jobs that train at once (job slots) each get a `replicate`d backbone: another
module tree over the very same tensors, because pelt_core keeps a forward's routing state on the
backbone's modules; their shared tokenizer is wrapped in a `SerializedTokenizer`."""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import threading
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from pelt_core.backbones import Backbone, resolve_backbone
from workers.backbone_host import HOST_PREFIX, LOAD_GROUP, BackboneHandle, BackboneHost, host_name, node_host

__all__ = [
    "HOST_PREFIX",
    "BackboneHandle",
    "BackboneHost",
    "LocalBackbones",
    "NodeBackbones",
    "SerializedTokenizer",
    "assemble",
    "backbone_tensors",
    "from_shareable",
    "host_name",
    "load_shareable",
    "materialize",
    "node_host",
    "publish_backbone",
    "release_free_memory",
    "replicate",
    "to_shareable",
]


def to_shareable(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Tensors as numpy arrays (bf16 as uint16), contiguous, ready for ray.put."""
    arrays = {}
    for name, tensor in tensors.items():
        t = tensor.detach().contiguous().cpu()
        arrays[name] = t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return arrays


def from_shareable(arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Zero-copy torch views of (read-only) shared arrays."""
    tensors = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, array in arrays.items():
            tensor = torch.from_numpy(array)
            tensors[name] = tensor.view(torch.bfloat16) if dtypes.get(name) == "bfloat16" else tensor
    return tensors


def backbone_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) by its dotted name."""
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    return tensors


def load_shareable(
    name: str, dtype: str = "float32", attn_implementation: str = "sdpa"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load `name` and return (metadata, payload): the payload ({"arrays", "dtypes"}) is what goes into
    the object store; the metadata is what a BackboneHandle needs besides the reference to it."""
    backbone = Backbone.load(name, dtype=dtype, attn_implementation=attn_implementation)
    tensors = backbone_tensors(backbone.model)
    arrays = to_shareable(tensors)
    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()}
    config = json.loads(
        backbone.config.to_json_string(use_diff=False)
    )  # plain JSON: a reader imports nothing
    meta = {
        "name": backbone.name,
        "dtype": dtype,
        "content_hash": backbone.content_hash,
        "config": config,
        "attn_implementation": attn_implementation,
        "num_bytes": sum(a.nbytes for a in arrays.values()),
    }
    return meta, {"arrays": arrays, "dtypes": dtypes}


def publish_backbone(name: str, dtype: str = "float32", attn_implementation: str = "sdpa") -> BackboneHandle:
    """Load `name` once in this process and put its tensors into the object store of this node
    (this process owns the copy; a node's BackboneHost has a worker or a one-off task load it instead)."""
    import ray

    meta, payload = load_shareable(name, dtype, attn_implementation)
    return BackboneHandle(arrays=ray.put(payload), **meta)


def assemble(
    config_dict: dict[str, Any], tensors: dict[str, torch.Tensor], attn_implementation: str
) -> nn.Module:
    """Build a transformers base model around existing tensors (no allocation, no copy)."""
    from transformers import AutoConfig, AutoModel

    config_dict = dict(config_dict)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    for dotted, tensor in tensors.items():
        owner_name, _, leaf = dotted.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        else:
            owner._buffers[leaf] = tensor
    leftover = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftover and all(n.startswith("pooler.") for n in leftover) and hasattr(model, "pooler"):
        model.pooler = None  # a checkpoint saved without BERT's pooler
        leftover = []
    if leftover:
        raise RuntimeError(f"backbone tensors missing from the shared store: {leftover[:5]}")
    return model.eval()


def materialize(handle: BackboneHandle, payload: dict | None = None) -> Backbone:
    """A Backbone whose weights are zero-copy views of the node's shared copy."""
    import ray

    payload = payload if payload is not None else ray.get(handle.arrays)
    tensors = from_shareable(payload["arrays"], payload["dtypes"])
    model = assemble(handle.config, tensors, handle.attn_implementation)
    return Backbone(model, load_tokenizer(handle.name), name=handle.name, content_hash=handle.content_hash)


def replicate(backbone: Backbone) -> Backbone:
    """Another Backbone over the same tensors: a new module tree (its own hooks and pelt_core runtime)
    whose parameters and buffers are the original's tensors, neither copied nor allocated. Two jobs
    may train at once on two replicas in two threads; the tokenizer is shared (see SerializedTokenizer)."""
    config = json.loads(backbone.config.to_json_string(use_diff=False))
    attn = (getattr(backbone.config, "_attn_implementation", None) or "sdpa").removeprefix("pelt_")
    tensors = {name: tensor.detach() for name, tensor in backbone_tensors(backbone.model).items()}
    model = assemble(config, tensors, attn)
    return Backbone(
        model,
        backbone.tokenizer,
        name=backbone.name,
        content_hash=backbone.content_hash,
        source=backbone.source,
    )


_TOKENIZER_LOCK = threading.RLock()


class SerializedTokenizer:
    """A tokenizer shared by jobs training in threads of one process: its methods run one call at a
    time (a Rust fast tokenizer refuses a call while another thread holds it: "Already borrowed").
    Attributes read and set through to the wrapped tokenizer. pelt_core tokenizes a job's data once,
    before training, so the lock costs nothing while jobs train."""

    def __init__(self, tokenizer: Any) -> None:
        object.__setattr__(self, "wrapped", tokenizer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _TOKENIZER_LOCK:
            return self.wrapped(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.wrapped, name)
        if not callable(value) or isinstance(value, type):
            return value

        @functools.wraps(value)
        def serialized(*args: Any, **kwargs: Any) -> Any:
            with _TOKENIZER_LOCK:
                return value(*args, **kwargs)

        return serialized

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.wrapped, name, value)

    def __len__(self) -> int:
        return len(self.wrapped)


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str):
    """The backbone's tokenizer, loaded once per worker process (tokenizers are read-only once built)."""
    from transformers import AutoTokenizer

    _, path, gguf = resolve_backbone(name)
    kwargs = {"gguf_file": gguf} if gguf else {}
    return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None (another C library)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> bool:
    """Give the memory this process freed back to the system (glibc's `malloc_trim`; a no-op elsewhere):
    after a load, the model's freed tensors would otherwise stay in the allocator's free lists and count
    in this process's resident memory. True if glibc released anything."""
    gc.collect()  # a loaded model's reference cycles, if any, before the trim
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


class NodeBackbones:
    """What a worker calls for a backbone: the node's shared copy, mapped zero-copy into this process.

    With `load_here` (a worker actor with `load_backbone` and `release_free_memory` methods in a
    `LOAD_GROUP` of one thread, as `PeltWorker`), a backbone the node has not published yet is loaded in
    this process for the host, and the loading's garbage given back afterwards by a call queued behind the
    load in that thread (so after the load's return value is stored and dropped; not waited for, and a
    no-op unless this process loaded); otherwise the host loads it in a one-off task."""

    def __init__(self, namespace: str | None = None, load_here: bool = False) -> None:
        self.namespace = namespace
        self.load_here = load_here

    def prestart(self) -> None:
        """Start the node's host now (in the background), so the first job does not wait for it."""
        node_host(self.namespace)

    def __call__(self, name: str, dtype: str = "float32") -> tuple[Backbone, int]:
        """(backbone, bytes of shared weights it maps)."""
        import ray

        canonical = resolve_backbone(name)[0]  # one key per model, whatever alias a job used
        loader = _this_actor() if self.load_here else None
        handle = ray.get(node_host(self.namespace).handle.remote(canonical, dtype, loader=loader))
        if loader is not None:  # give back what a load here left behind, once the load's thread let go of it
            loader.release_free_memory.options(concurrency_group=LOAD_GROUP).remote()  # not waited for
        return materialize(handle), handle.num_bytes


def _this_actor() -> Any:
    """This process's own actor handle (None outside an actor)."""
    import ray

    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:  # not an actor
        return None


class LocalBackbones:
    """Loads backbones in this process (no Ray, nothing shared): for running a worker outside a cluster."""

    def __call__(self, name: str, dtype: str = "float32") -> tuple[Backbone, int]:
        backbone = Backbone.load(name, dtype=dtype)
        return backbone, sum(t.numel() * t.element_size() for t in backbone_tensors(backbone.model).values())
