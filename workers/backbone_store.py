"""One frozen backbone per node, shared zero-copy through Ray's object store.

`publish_backbone` loads a backbone once and puts its tensors (as numpy arrays) into the object store.
Every worker process on a node that calls `materialize` maps the same shared-memory pages read-only and
builds its model around them without copying: the model skeleton is created on the meta device and
every parameter and buffer is assigned a tensor that views the shared array. Writing to such a tensor
fails, which is the point: anything a job trains lives in its own delta.

bfloat16 has no numpy dtype, so bf16 tensors travel as uint16 and are viewed back as bf16.

Each node has one `BackboneHost` actor, named `pelt-backbones.<node id>` and pinned to its node: it
publishes each (backbone, dtype) once, owns the object-store copy (so the copy outlives any worker, a
killed one included) and hands the same `BackboneHandle` to every worker of the node. `node_host()`
finds or starts the host of the node it runs on; `NodeBackbones` is what a worker calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pelt_core.backbones import Backbone, resolve_backbone

log = logging.getLogger("pelt.workers")

HOST_PREFIX = "pelt-backbones."


@dataclass(frozen=True)
class BackboneHandle:
    """What a worker needs to build a shared backbone: metadata plus an object-store reference to the arrays."""

    name: str
    dtype: str
    content_hash: str
    config: dict[str, Any]
    attn_implementation: str
    arrays: Any  # ray.ObjectRef to dict[str, np.ndarray]
    num_bytes: int


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


def publish_backbone(name: str, dtype: str = "float32", attn_implementation: str = "sdpa") -> BackboneHandle:
    """Load `name` once in this process and put its tensors into the object store of this node."""
    import ray

    backbone = Backbone.load(name, dtype=dtype, attn_implementation=attn_implementation)
    tensors = backbone_tensors(backbone.model)
    arrays = to_shareable(tensors)
    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()}
    payload = {"arrays": arrays, "dtypes": dtypes}
    ref = ray.put(payload)
    return BackboneHandle(
        name=backbone.name, dtype=dtype, content_hash=backbone.content_hash, config=backbone.config.to_dict(),
        attn_implementation=attn_implementation, arrays=ref,
        num_bytes=sum(a.nbytes for a in arrays.values()),
    )


def assemble(config_dict: dict[str, Any], tensors: dict[str, torch.Tensor], attn_implementation: str) -> nn.Module:
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


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str):
    """The backbone's tokenizer, loaded once per worker process (tokenizers are read-only once built)."""
    from transformers import AutoTokenizer

    _, path, gguf = resolve_backbone(name)
    kwargs = {"gguf_file": gguf} if gguf else {}
    return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)


# --- one publication per node ----------------------------------------------------------------------


def _return_free_memory() -> None:
    """Give the loader's freed heap back to the OS (glibc keeps it otherwise), so the host keeps only
    the object-store copy."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class BackboneHost:
    """Owns a node's shared backbones (a threaded Ray actor, one per node, started by `node_host`).

    `handle(name, dtype)` loads and publishes a backbone on first request and returns the same handle
    ever after; concurrent first requests for one backbone wait for a single load.
    """

    def __init__(self) -> None:
        self._handles: dict[tuple[str, str, str], BackboneHandle] = {}
        self._loading: dict[tuple[str, str, str], threading.Lock] = {}
        self._guard = threading.Lock()
        self._seconds: dict[tuple[str, str, str], float] = {}

    def handle(self, name: str, dtype: str = "float32", attn_implementation: str = "sdpa") -> BackboneHandle:
        """The node's shared copy of `name` in `dtype`, published on first use."""
        key = (resolve_backbone(name)[0], dtype, attn_implementation)
        with self._guard:
            lock = self._loading.setdefault(key, threading.Lock())
        with lock:
            if key not in self._handles:
                started = time.perf_counter()
                self._handles[key] = publish_backbone(name, dtype, attn_implementation)
                self._seconds[key] = time.perf_counter() - started
                _return_free_memory()
                log.info("published backbone %s (%s) on this node in %.1f s", key[0], dtype, self._seconds[key])
            return self._handles[key]

    def published(self) -> list[dict[str, Any]]:
        """What this node holds: one entry per (backbone, dtype) published, with its size and load time."""
        with self._guard:
            return [
                {"name": handle.name, "dtype": handle.dtype, "num_bytes": handle.num_bytes,
                 "content_hash": handle.content_hash, "load_seconds": round(self._seconds[key], 2)}
                for key, handle in self._handles.items()
            ]

    def pid(self) -> int:
        import os

        return os.getpid()


@functools.lru_cache(maxsize=1)
def _host_class() -> Any:
    import ray

    return ray.remote(BackboneHost)


def host_name(node_id: str) -> str:
    """The actor name of a node's backbone host."""
    return f"{HOST_PREFIX}{node_id}"


def node_host(namespace: str | None = None, node_id: str | None = None) -> Any:
    """The backbone host of `node_id` (default: the node this process runs on), started if missing.

    Detached, so it outlives the worker or dispatcher that started it (the dispatcher kills it at
    shutdown); pinned to its node, so its `ray.put` lands in that node's object store.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node_id or ray.get_runtime_context().get_node_id()
    return _host_class().options(
        name=host_name(node_id), namespace=namespace, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_concurrency=16, max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote()


class NodeBackbones:
    """What a worker calls for a backbone: the node's shared copy, mapped zero-copy into this process."""

    def __init__(self, namespace: str | None = None) -> None:
        self.namespace = namespace

    def prestart(self) -> None:
        """Start the node's host now (in the background), so the first job does not wait for it."""
        node_host(self.namespace)

    def __call__(self, name: str, dtype: str = "float32") -> tuple[Backbone, int]:
        """(backbone, bytes of shared weights it maps)."""
        import ray

        handle = ray.get(node_host(self.namespace).handle.remote(name, dtype))
        return materialize(handle), handle.num_bytes


class LocalBackbones:
    """Loads backbones in this process (no Ray, nothing shared): for running a worker outside a cluster."""

    def __call__(self, name: str, dtype: str = "float32") -> tuple[Backbone, int]:
        backbone = Backbone.load(name, dtype=dtype)
        return backbone, sum(t.numel() * t.element_size() for t in backbone_tensors(backbone.model).values())
