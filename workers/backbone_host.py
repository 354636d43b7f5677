"""The backbone host of a node: publishes each (backbone, dtype) once and owns the shared copy.

One `BackboneHost` actor per node, named `pelt-backbones.<node id>`, pinned to its node and detached
(it outlives the worker or dispatcher that started it, so a killed worker never takes the copy with
it). On the first request for a backbone it asks someone on its node to load the model and *return*
the arrays: an actor call's or a task's return value lands in the object store of the node it ran on
and is owned by the caller, so the host owns the copy without ever holding it. That someone is the
worker that asked (`loader`: it has torch and transformers imported already, and it gives the loading's
garbage back to the system afterwards, `release_free_memory`), so publishing starts no process; a
request without a loader runs a one-off loader task on the node, a process that exits with the garbage.
If the loading worker dies, the request fails and the next one loads again. The host itself imports
neither torch nor numpy: it costs a bare Ray worker's memory, not a model's.

This module must stay light: no torch, numpy or transformers imports.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pelt.workers")

HOST_PREFIX = "pelt-backbones."
# the concurrency group of a worker actor's `load_backbone` calls: a thread of its own, so a host's
# request to load never waits behind the jobs that asked for the backbone (workers.worker.worker_actor_class)
LOAD_GROUP = "backbone-load"


@dataclass(frozen=True)
class BackboneHandle:
    """What a worker needs to build a shared backbone: metadata plus an object-store reference to the arrays."""

    name: str
    dtype: str
    content_hash: str
    config: dict[str, Any]
    attn_implementation: str
    arrays: Any  # ray.ObjectRef to {"arrays": dict[str, np.ndarray], "dtypes": dict[str, str]}
    num_bytes: int


def _load(name: str, dtype: str, attn_implementation: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The loader task's body (a separate, short-lived process): (metadata, payload)."""
    from workers.backbone_store import load_shareable

    return load_shareable(name, dtype, attn_implementation)


class BackboneHost:
    """Owns a node's shared backbones (a threaded Ray actor, one per node; see the module docstring).

    `handle(name, dtype)` publishes a backbone on first request and returns the same handle ever after;
    concurrent first requests for one backbone wait for a single load (a failed load publishes nothing,
    and the next request loads again).
    """

    def __init__(self) -> None:
        self._handles: dict[tuple[str, str, str], BackboneHandle] = {}
        self._loading: dict[tuple[str, str, str], threading.Lock] = {}
        self._guard = threading.Lock()
        self._seconds: dict[tuple[str, str, str], float] = {}

    def handle(
        self, name: str, dtype: str = "float32", attn_implementation: str = "sdpa", loader: Any = None
    ) -> BackboneHandle:
        """The node's shared copy of `name` in `dtype`, published on first use: loaded by `loader` (the
        asking worker's actor handle, on this node, with a `load_backbone` method) or by a one-off task."""
        key = (name, dtype, attn_implementation)
        with self._guard:
            lock = self._loading.setdefault(key, threading.Lock())
        with lock:
            if key not in self._handles:
                started = time.perf_counter()
                self._handles[key] = self._publish(name, dtype, attn_implementation, loader)
                self._seconds[key] = time.perf_counter() - started
                log.info("published backbone %s (%s) on this node in %.1f s", name, dtype, self._seconds[key])
            return self._handles[key]

    def _publish(self, name: str, dtype: str, attn_implementation: str, loader: Any) -> BackboneHandle:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if loader is not None:
            load = loader.load_backbone.options(num_returns=2, concurrency_group=LOAD_GROUP)
        else:
            load = ray.remote(num_cpus=0, num_returns=2, max_calls=1, max_retries=0)(_load).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    ray.get_runtime_context().get_node_id(), soft=False
                )
            )
        meta_ref, payload_ref = load.remote(name, dtype, attn_implementation)
        return BackboneHandle(arrays=payload_ref, **ray.get(meta_ref))  # the payload stays unread here

    def published(self) -> list[dict[str, Any]]:
        """What this node holds: one entry per (backbone, dtype) published, with its size and load time."""
        with self._guard:
            return [
                {
                    "name": handle.name,
                    "dtype": handle.dtype,
                    "num_bytes": handle.num_bytes,
                    "content_hash": handle.content_hash,
                    "load_seconds": round(self._seconds[key], 2),
                }
                for key, handle in self._handles.items()
            ]


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
    shutdown); pinned to its node, so the copies it owns live in that node's object store.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node_id or ray.get_runtime_context().get_node_id()
    return (
        _host_class()
        .options(
            name=host_name(node_id),
            namespace=namespace,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=16,
            max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote()
    )


__all__ = ["HOST_PREFIX", "LOAD_GROUP", "BackboneHandle", "BackboneHost", "host_name", "node_host"]
