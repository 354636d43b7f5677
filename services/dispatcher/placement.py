"""Where workers go: the cluster's alive nodes and how many workers of each kind each has room for, and
starting a worker actor pinned to a node.

A node with GPUs (Ray's "GPU" resource) has room for GPUs // `gpus_per_worker` GPU workers, each reserving
`cpus_per_gpu_worker` CPUs; with its remaining CPUs, and on a node without GPUs, room for CPUs //
`cpus_per_actor` CPU workers (cpus_per_worker x jobs_per_worker; a pack worker, which trains its places
through one compute stream: cpus_per_worker), at most `max_workers_per_node` of each kind. A node where a
worker died or failed to start cools down for `node_cooldown_seconds` before it gets another (it may be
going away). Each node keeps one shared copy of each backbone in host memory
(`workers.backbone_store.BackboneHost`), whatever the number of workers on it; a GPU worker copies what it
needs once onto its GPU.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Iterable

from services.dispatcher.config import DispatcherConfig
from services.dispatcher.ray_cluster import local_ray_environment
from services.dispatcher.slots import GPU_WORKER_PREFIX, WORKER_PREFIX, WorkerSlots

log = logging.getLogger("pelt.dispatcher")
GPU_START_FAILURES = 3  # GPU workers that may fail to start on a node before its GPUs are left alone


class Nodes:
    """Ray's alive nodes, each with the number of workers it has room for (read again at most every
    `node_refresh_seconds`), and the nodes cooling down after a worker died or failed there."""

    def __init__(self, config: DispatcherConfig) -> None:
        self.config = config
        self.capacity: dict[str, int] = {}  # alive node id -> CPU workers it has room for
        self.gpu_capacity: dict[str, int] = {}  # alive node id -> GPU workers it has room for
        self._read_at = 0.0
        self._too_small: set[str] = set()  # nodes warned about: fewer CPUs than one worker needs
        self._cooldown: dict[str, float] = {}  # node id -> no new workers there before this time
        self._gpu_failures: Counter[str] = Counter()  # node id -> GPU workers that failed to start there

    def refresh(self) -> bool:
        """Read the alive nodes from Ray, unless they were read less than `node_refresh_seconds` ago;
        True when they were read now."""
        import ray

        now = time.monotonic()
        if now - self._read_at < self.config.node_refresh_seconds and self.capacity:
            return False
        self._read_at = now
        capacity, gpu_capacity = {}, {}
        per_worker = self.config.cpus_per_actor
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            cpus = node.get("Resources", {}).get("CPU", 0)
            gpu_workers = self._gpu_workers(node.get("Resources", {}).get("GPU", 0), cpus)
            if gpu_workers and self._gpu_failures[node["NodeID"]] >= GPU_START_FAILURES:
                gpu_workers = (
                    0  # its GPUs are not usable by pelt (e.g. a CPU build of torch): CPU workers only
                )
            gpu_capacity[node["NodeID"]] = gpu_workers
            cpus -= gpu_workers * self.config.cpus_per_gpu_worker
            workers = math.floor(cpus / per_worker + 1e-9)
            if not workers and cpus and node["NodeID"] not in self._too_small:
                self._too_small.add(node["NodeID"])
                log.warning(
                    "node %s has %g CPU(s): too few for a worker of %g CPU(s)",
                    node["NodeID"][:12],
                    cpus,
                    per_worker,
                )
            if self.config.max_workers_per_node is not None:
                workers = min(workers, self.config.max_workers_per_node)
            capacity[node["NodeID"]] = workers
        self.capacity, self.gpu_capacity = capacity, gpu_capacity
        return True

    def _gpu_workers(self, gpus: float, cpus: float) -> int:
        """GPU workers a node with `gpus` GPUs and `cpus` CPUs has room for."""
        if not gpus or not self.config.gpus_per_worker:
            return 0
        workers = math.floor(gpus / self.config.gpus_per_worker + 1e-9)
        workers = min(workers, math.floor(cpus / self.config.cpus_per_gpu_worker + 1e-9))
        if self.config.max_workers_per_node is not None:
            workers = min(workers, self.config.max_workers_per_node)
        return workers

    @property
    def has_gpus(self) -> bool:
        """Whether some alive node has room for a GPU worker (GPUs, and --gpus-per-worker above 0)."""
        return any(self.gpu_capacity.values())

    def gpu_worker_failed(self, node_id: str) -> None:
        """A GPU worker failed to start on the node; after GPU_START_FAILURES of them its GPUs are left
        alone (it gets CPU workers only, and `any` jobs go to CPU workers if no other node has GPUs)."""
        self._gpu_failures[node_id] += 1
        if self._gpu_failures[node_id] == GPU_START_FAILURES:
            log.error(
                "%d GPU workers failed to start on node %s (a CPU build of torch, or no driver?): its GPUs "
                "are left alone from now on; see the workers' errors above",
                GPU_START_FAILURES,
                node_id[:12],
            )
        self.cool_down(node_id)

    def cool_down(self, node_id: str) -> None:
        """A worker died or could not start there: the node may be going away; look again soon."""
        self._cooldown[node_id] = time.monotonic() + self.config.node_cooldown_seconds
        self._read_at = 0.0

    def room(self, workers: Iterable[WorkerSlots], kind: str = "cpu") -> dict[str, int]:
        """Room for more workers of a kind (cpu, gpu) per usable node (nodes cooling down after a failure
        excluded)."""
        now = time.monotonic()
        used = Counter(w.node_id for w in workers if w.device == kind)
        capacity = self.gpu_capacity if kind == "gpu" else self.capacity
        return {
            node: slots - used[node]
            for node, slots in capacity.items()
            if slots > used[node] and self._cooldown.get(node, 0.0) <= now
        }

    def roomiest(self, workers: Iterable[WorkerSlots], kind: str = "cpu") -> str | None:
        """The node with the most room for another worker of a kind; None when no node has room."""
        room = self.room(workers, kind)
        return max(room, key=lambda node: (room[node], node)) if room else None


def start_worker(
    node_id: str,
    config: DispatcherConfig,
    *,
    heartbeat_seconds: float,
    lease_seconds: float,
    kind: str = "cpu",
) -> WorkerSlots:
    """Start a detached, named worker actor of a kind on the node: a CPU worker with
    `config.places_per_worker` places (job slots, or the places of its pack), or a GPU worker that asks
    Ray for `gpus_per_worker` GPUs and trains a pack of up to `gpu_pack_size` jobs on its GPU."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from workers.worker import WorkerConfig, worker_actor_class  # torch: only where workers start

    gpu = kind == "gpu"
    worker_id = f"{GPU_WORKER_PREFIX if gpu else WORKER_PREFIX}{node_id[:12]}.{secrets.token_hex(4)}"
    places = config.places(kind)
    worker_config = WorkerConfig(
        threads=max(1, round(config.cpus_per_gpu_worker if gpu else config.cpus_per_worker)),
        slots=1 if gpu else config.jobs_per_worker,
        pack_size=config.pack_size_of(kind),
        heartbeat_seconds=heartbeat_seconds,
        lease_seconds=lease_seconds,
        max_backbones=config.max_backbones_per_worker,
        namespace=config.namespace,
        device=config.gpu_device if gpu else "cpu",
    )
    inherited = local_ray_environment()  # a local Ray started here gave its processes WORKER_ENVIRONMENT
    own_env = {name: value for name, value in config.worker_env.items() if inherited.get(name) != value}
    actor = (
        worker_actor_class()
        .options(
            name=worker_id,
            namespace=config.namespace,
            lifetime="detached",
            max_restarts=0,
            num_cpus=config.cpus_per_gpu_worker if gpu else config.cpus_per_actor,
            num_gpus=config.gpus_per_worker if gpu else 0,
            max_concurrency=places + 3,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env={"env_vars": own_env} if own_env else None,
        )
        .remote(worker_id, worker_config)
    )
    packed = config.pack_size_of(kind) > 1
    log.info(
        "starting %s worker %s (%d %s) on node %s",
        kind.upper(),
        worker_id,
        places,
        "places of a pack" if packed else "job slot(s)",
        node_id[:12],
    )
    return WorkerSlots(
        worker_id, node_id, actor, slots=places, packed=packed, device=kind, poll_ref=actor.info.remote()
    )


def kill_backbone_host(node_id: str, namespace: str) -> None:
    """Stop the node's backbone host, if it has one: its shared backbone copies leave the node's object store
    (a node holding objects is never idle to Ray's autoscaler)."""
    import contextlib

    import ray

    from workers.backbone_host import host_name

    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(host_name(node_id), namespace=namespace), no_restart=True)
