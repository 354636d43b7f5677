"""The dispatcher's knobs, and those of the workers it starts (`DispatcherConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DispatcherConfig:
    """Knobs of the dispatcher and of the workers it starts."""

    namespace: str = "pelt"  # Ray namespace of the workers and backbone hosts (one dispatcher each)
    cpus_per_worker: float = 1.0  # Ray CPUs per job slot (also each job's torch threads, rounded)
    jobs_per_worker: int = 1  # job slots per worker actor: jobs that share one process (threads)
    max_workers_per_node: int | None = None  # default: the node's CPUs // (cpus_per_worker * jobs_per_worker)
    poll_seconds: float = 0.5  # loop period: collect outcomes, push cancels, claim for idle workers
    heartbeat_seconds: float | None = None  # default: settings.heartbeat_seconds
    lease_seconds: float | None = None  # default: the registry's lease_seconds
    max_backbones_per_worker: int = 2
    worker_start_timeout: float = 180.0  # a worker not up by then is dropped
    node_refresh_seconds: float = 2.0
    node_cooldown_seconds: float = (
        10.0  # no new worker on a node for this long after one died or failed there
    )
    reap_seconds: float = 5.0  # how often expired leases are taken back (also when the queue is empty)
    # Environment of the worker processes. MALLOC_ARENA_MAX=1: a worker trains in a thread of its actor
    # (so `stop` and `info` can answer meanwhile), and glibc would give that thread its own arenas,
    # which keep up to a step's worth of freed activations (~0.5 GB per SmolLM2 job at batch 16).
    worker_env: dict[str, str] = field(default_factory=lambda: {"MALLOC_ARENA_MAX": "1"})
