"""The dispatcher: drains the registry's queue into warm Ray worker actors, each with `jobs_per_worker`
job slots (one CPU slot per job) or the `pack_size` places of a pack, as many per node as its CPUs hold.

    registry queue ──claim (owner "<worker>#<slot>")────────▶ dispatcher ──run(JobSpec, RegistryLease, sink)──▶ worker
                                                                                         │ heartbeat + progress
    registry ◀──────────── complete / fail / cancelled / release, through the RegistryLease ┘

Modules: `dispatcher` (the Dispatcher and its rounds), `config` (DispatcherConfig), `slots` (its view of
workers, job slots and lease owners), `placement` (nodes' room, starting a worker), `adoption` (start-up:
adopt live workers, settle running jobs), `job_specs` (what a worker is told), `lease` (RegistryLease),
`ray_cluster` (joining or starting Ray), `cli` (`serve`, the `pelt dispatcher` command).

- Leases, progress and results go from the worker straight to the registry: the dispatcher claims a
  job *for* a free slot of a ready worker (the lease owner is "<worker's actor name>#<slot>", unique per
  running job; just the actor name for a worker with one slot) and hands it a `RegistryLease`,
  a small picklable object that opens a `Registry` on the database URL inside the worker process
  (SQLite's cross-process write gate or PostgreSQL's row locks keep that safe). So a job runs to its
  end, and its outcome is recorded, even while no dispatcher is alive.
- Cancellation: the worker sees the registry's flag at its heartbeat; the dispatcher also polls the
  flags of its running jobs every `poll_seconds` and pushes `stop(job, "cancel")` to the worker, so a
  cancel takes effect within about a second whatever the heartbeat interval.
- Placement: a worker keeps its backbones warm; a worker's free slots first claim jobs on the backbones
  it holds; work on other backbones goes to a new worker where a node has room for one (started while
  there is queued work), and only when no node has room to a warm worker that then maps another
  backbone. Each node keeps one shared copy of each backbone (`workers.backbone_store.BackboneHost`).
- Job slots: with `jobs_per_worker` N > 1 a worker actor runs up to N jobs at once, each in its own
  thread, sharing the process's runtime and mapped backbones (what a job costs in memory beyond its
  activations); it reserves N x `cpus_per_worker` Ray CPUs, and torch runs each job's ops on
  round(cpus_per_worker) threads (see workers.worker).
- Packs: with `pack_size` P > 1 (`--pack-size`; it excludes `--jobs-per-worker` > 1) a worker has P
  places and trains the jobs in them together, one backbone pass per step (methods may differ, the
  backbone may not); each job is still its own run() call with its own lease ("<worker>#<place>"). One
  compute stream: the worker reserves `cpus_per_worker` Ray CPUs whatever P. A pack that runs jobs
  claims only jobs on their backbone; only an empty pack worker switches backbones.
- Failures: a worker whose actor dies (SIGKILL, node lost) has every job it ran failed as retryable at
  once, so the jobs go back to the queue after the backoff; if no dispatcher saw the death, the lease
  expires and the registry takes the job back. A cancelled job is never retried (registry rule).
- Restarts: workers and backbone hosts are detached named actors in the Ray namespace, so they
  survive the dispatcher. A new dispatcher adopts the live workers (every running job continues),
  gives back jobs claimed for a live worker that is not running them (claimed, never started), and
  leaves jobs of workers that are gone to lease expiry. One dispatcher per namespace.
- Delta stores: the worker writes the delta through the `DeltaSink` it is handed (LocalDeltaSink by
  default; any picklable sink, e.g. services.delta_store.MlflowDeltaStore). When an attempt has
  ended, the dispatcher calls the sink's `finalize_job(task, job_id, registry)` if it has one
  (MLflow: keep the recorded version, move the task's aliases).
- Shutdown: `shutdown()` tells the workers to give their jobs back (`release`: queued again, the
  attempt not counted) or, with `drain=True`, lets them finish; then kills the workers and hosts.

Ray: `connect_ray` joins PELT_RAY_ADDRESS, or starts a local Ray bound to 127.0.0.1 with the dashboard
off, its session folders private to its user, Ray's token authentication on (see `ray_cluster`).
"""

import importlib
from typing import Any

# Imported on first use (PEP 562), so that what needs one of them (`pelt --help`, a worker unpickling its
# RegistryLease) does not import the dispatcher with it (the lease still imports the registry it opens).
_EXPORTS = {
    "WORKER_PREFIX": "services.dispatcher.slots",
    "Dispatcher": "services.dispatcher.dispatcher",
    "DispatcherConfig": "services.dispatcher.config",
    "RegistryLease": "services.dispatcher.lease",
    "connect_ray": "services.dispatcher.ray_cluster",
    "dispatcher_command": "services.dispatcher.cli",
    "loopback_only": "services.dispatcher.ray_cluster",
    "private_ray_token": "services.dispatcher.ray_cluster",
    "require_token_auth": "services.dispatcher.ray_cluster",
    "serve": "services.dispatcher.cli",
    "task_spec": "services.dispatcher.job_specs",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "WORKER_PREFIX",
    "Dispatcher",
    "DispatcherConfig",
    "RegistryLease",
    "connect_ray",
    "dispatcher_command",
    "loopback_only",
    "private_ray_token",
    "require_token_auth",
    "serve",
    "task_spec",
]
