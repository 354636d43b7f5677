"""The dispatcher's knobs, and those of the workers it starts (`DispatcherConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_PACK_SIZE = 1  # jobs a worker trains together by default (1: no packs)
MAX_PACK_SIZE = 64
# A GPU worker trains its jobs as one pack through its GPU's copy of the backbone: 16 small jobs keep a GPU
# busier than one (see benchmarks/bench_gpu.py); a pass that runs out of memory splits its forwards.
DEFAULT_GPU_PACK_SIZE = 16
DEVICE_KINDS = ("cpu", "gpu")  # the kinds of worker; a job's `device` is one of these or "any"
# The environment worker processes need. MALLOC_ARENA_MAX=1: a worker trains in a thread of its actor (so
# `stop` and `info` can answer meanwhile), and glibc would give that thread its own arenas, which keep up to
# a step's worth of freed activations (~0.5 GB per SmolLM2 job at batch 16). glibc reads it when a process
# starts, so it must be in the process's environment (a runtime env, or the raylet's that its workers
# inherit), not set from inside the actor.
WORKER_ENVIRONMENT: dict[str, str] = {"MALLOC_ARENA_MAX": "1"}


@dataclass(frozen=True)
class DispatcherConfig:
    """Knobs of the dispatcher and of the workers it starts."""

    namespace: str = "pelt"  # Ray namespace of the workers and backbone hosts (one dispatcher each)
    cpus_per_worker: float = 1.0  # Ray CPUs per job slot, or per pack (also torch threads, rounded)
    jobs_per_worker: int = 1  # job slots per worker actor: jobs that share one process (threads)
    # > 1: a worker trains up to this many jobs on one backbone together, one backbone pass per step
    # (its places), on one compute stream of cpus_per_worker CPUs; excludes jobs_per_worker > 1
    pack_size: int = DEFAULT_PACK_SIZE
    # GPU workers, on nodes whose Ray resources include GPUs: each asks Ray for this many GPUs (a fraction:
    # several workers share one GPU, each with its own copy of its backbones; 0: no GPU workers), trains a
    # pack of up to gpu_pack_size jobs, and reserves cpus_per_gpu_worker CPUs (its torch threads).
    gpus_per_worker: float = 1.0
    gpu_pack_size: int = DEFAULT_GPU_PACK_SIZE
    cpus_per_gpu_worker: float = 1.0
    gpu_device: str = "cuda"  # the torch device a GPU worker trains on (Ray sets which GPU it sees)
    max_workers_per_node: int | None = None  # default: the node's CPUs // cpus_per_actor
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
    # Scaling from the queue (services/dispatcher/scaling.py): how often the dispatcher asks Ray's autoscaler
    # for the workers its queue needs (0: never), at most how many of each kind, and how long a worker may
    # stay idle, with nothing of its kind queued, before it is stopped (None: workers stay warm)
    scaling_seconds: float = 5.0
    max_requested_workers: int = 16
    idle_worker_seconds: float | None = None
    search_seconds: float = 2.0  # how often running method searches are advanced (a rung that ended)
    # on taking the lead: the delta store settles again the tasks whose jobs ended this recently (a
    # dispatcher that led before may have died between a job's end and its settling)
    resettle_seconds: float = 3600.0
    # rounds failing this long in a row (the registry's outages aside): the dispatcher gives up and exits,
    # for its supervisor to start it again (a Ray head restarted without GCS fault tolerance)
    give_up_seconds: float = 120.0
    # One dispatcher leads a namespace (services/dispatcher/leadership.py): it renews its hold every third of
    # this; a standby asks every standby_poll_seconds and takes over this long after the leader stopped.
    leader_seconds: float = 15.0
    standby_poll_seconds: float = 2.0
    # Environment of the worker processes (WORKER_ENVIRONMENT by default): given to each worker actor as a
    # runtime env, except what a local Ray started by `connect_ray` already gave every process it starts
    # (services/dispatcher/placement.py `start_worker`). Such a Ray gives all its processes
    # WORKER_ENVIRONMENT whatever this says: worker_env can change those values there, not remove them.
    worker_env: dict[str, str] = field(default_factory=lambda: dict(WORKER_ENVIRONMENT))

    def __post_init__(self) -> None:
        if not 1 <= self.pack_size <= MAX_PACK_SIZE:
            raise ValueError(f"--pack-size must be between 1 and {MAX_PACK_SIZE}, got {self.pack_size}")
        if not 1 <= self.gpu_pack_size <= MAX_PACK_SIZE:
            raise ValueError(
                f"--gpu-pack-size must be between 1 and {MAX_PACK_SIZE}, got {self.gpu_pack_size}"
            )
        if self.gpus_per_worker < 0 or (
            self.gpus_per_worker > 1 and not float(self.gpus_per_worker).is_integer()
        ):
            raise ValueError(
                "--gpus-per-worker must be 0 (no GPU workers), a fraction of one GPU, or a whole number, "
                f"got {self.gpus_per_worker}"
            )
        if not 0 < self.standby_poll_seconds < self.leader_seconds <= 3600:
            raise ValueError(
                f"leader_seconds ({self.leader_seconds}) must be in (standby_poll_seconds "
                f"({self.standby_poll_seconds}), 3600]"
            )
        if self.scaling_seconds < 0 or self.max_requested_workers < 0:
            raise ValueError(
                f"--scaling-seconds ({self.scaling_seconds}) and max_requested_workers "
                f"({self.max_requested_workers}) must be 0 or more"
            )
        if self.idle_worker_seconds is not None and self.idle_worker_seconds <= 0:
            raise ValueError(f"--idle-worker-seconds must be above 0, got {self.idle_worker_seconds}")
        if self.cpus_per_gpu_worker <= 0:
            raise ValueError(f"--cpus-per-gpu-worker must be above 0, got {self.cpus_per_gpu_worker}")
        if self.packs and self.jobs_per_worker > 1:
            raise ValueError(
                "choose --pack-size or --jobs-per-worker: a worker either packs its jobs "
                f"(pack size {self.pack_size}) or runs them in job slots ({self.jobs_per_worker})"
            )

    @property
    def packs(self) -> bool:
        """Whether workers train their jobs in packs."""
        return self.pack_size > 1

    @property
    def places_per_worker(self) -> int:
        """Jobs a worker runs at once: its pack places, or its job slots when it does not pack."""
        return self.pack_size if self.packs else self.jobs_per_worker

    @property
    def cpus_per_actor(self) -> float:
        """Ray CPUs a worker actor reserves: one compute stream per pack, one per job slot otherwise."""
        return self.cpus_per_worker if self.packs else self.cpus_per_worker * self.jobs_per_worker

    def places(self, kind: str) -> int:
        """Jobs a worker of this kind (cpu or gpu) runs at once: a GPU worker's pack places."""
        return self.gpu_pack_size if kind == "gpu" else self.places_per_worker

    def pack_size_of(self, kind: str) -> int:
        """The pack size of a worker of this kind (1: it does not pack)."""
        return self.gpu_pack_size if kind == "gpu" else self.pack_size
