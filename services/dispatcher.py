"""The dispatcher: drains the registry's queue into warm Ray worker actors, each with `jobs_per_worker`
job slots (one CPU slot per job), as many per node as its CPUs hold.

    registry queue ──claim (owner "<worker>#<slot>")────────▶ dispatcher ──run(JobSpec, RegistryLease, sink)──▶ worker
                                                                                         │ heartbeat + progress
    registry ◀──────────── complete / fail / cancelled / release, through the RegistryLease ┘

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
off. Ray's token authentication stays on (RAY_AUTH_MODE=token unless set otherwise): a local Ray
writes ~/.ray/auth_token; every process that joins a cluster needs the cluster's token, as
RAY_AUTH_TOKEN or in ~/.ray/auth_token on its machine.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.registry import JobStateError, LeaseLostError, Registry
from services.registry.records import JobRecord, TaskRecord
from services.registry.task_data import EVALUATION_SPLITS  # none of them: each job holds out a dev split
from services.settings import Settings, get_settings
from workers.job import DeltaSink, JobSpec, LeaseLost, LocalDeltaSink, TaskSpec

log = logging.getLogger("pelt.dispatcher")

WORKER_PREFIX = "pelt-worker."


# --- Ray -------------------------------------------------------------------------------------------


def connect_ray(
    settings: Settings | None = None,
    *,
    namespace: str = "pelt",
    num_cpus: int | None = None,
    **init_kwargs: Any,
) -> bool:
    """Join the cluster at PELT_RAY_ADDRESS, or start a local Ray (loopback only, no dashboard).

    Returns True when this call started Ray (`ray.shutdown()` then stops it), False when Ray was
    already initialised in this process or an existing cluster was joined. Token authentication
    stays on: a new local Ray turns it on and creates ~/.ray/auth_token if missing; joining by
    address turns it on here (Ray would not), so the token must be in RAY_AUTH_TOKEN or
    ~/.ray/auth_token. Only an explicit RAY_AUTH_MODE=disabled turns it off (with a warning). The token
    file is made 0600 (`private_ray_token`): whoever reads it can join the cluster and run code.
    """
    import ray

    if ray.is_initialized():
        return False
    settings = settings or get_settings()
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        log.warning(
            "RAY_AUTH_MODE=%s: Ray's token authentication is off; anyone who reaches the cluster's "
            "ports can run code on it",
            mode,
        )
    init_kwargs.setdefault("configure_logging", False)
    if settings.ray_address:
        if mode is None:
            require_token_auth()
        ray.init(address=settings.ray_address, namespace=namespace, **init_kwargs)
        private_ray_token()
        return False
    loopback_only()
    # address="local": always a new local Ray, never one that happens to run on this machine already
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace=namespace, **init_kwargs)
    private_ray_token()
    return True


def private_ray_token() -> Path | None:
    """Make Ray's auth token file (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token) readable by its owner only.

    Ray writes it with the process's umask, 0644 by default, so any local user could read the token,
    join the cluster and run code as this service. Returns the file (None when there is none, e.g. the
    token came in RAY_AUTH_TOKEN). Never fails the start: a file missing or left as it was is a warning.
    """
    given = os.environ.get("RAY_AUTH_TOKEN_PATH")
    try:
        path = Path(given).expanduser() if given else _default_ray_token_path()
    except RuntimeError as exc:  # no home folder to expand
        log.warning("cannot tell where Ray's token file is (%s)", exc)
        return None
    if not path.is_file():
        token_auth = os.environ.get("RAY_AUTH_MODE", "token").lower() == "token"
        if token_auth and not os.environ.get("RAY_AUTH_TOKEN"):  # then Ray's token should be in a file
            log.warning(
                "no Ray token file at %s to make private (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token)", path
            )
        return None
    try:
        path.chmod(0o600)
    except OSError as exc:
        log.warning(
            "cannot make the Ray token file %s readable by its owner only (%s): other local users "
            "may read it and join the cluster",
            path,
            exc,
        )
        return None
    return path


def _default_ray_token_path() -> Path:
    """Where Ray keeps its token without RAY_AUTH_TOKEN_PATH: Ray's own answer where its (private) helper
    can be imported, else the documented default, ~/.ray/auth_token."""
    try:
        from ray._private.authentication.authentication_token_setup import _get_default_token_path

        return Path(_get_default_token_path())
    except (ImportError, AttributeError, TypeError):
        return Path.home() / ".ray" / "auth_token"


def loopback_only() -> None:
    """Make a Ray started from this process bind to 127.0.0.1 only (ports, node address, agents).

    Ray does so when RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, a switch it reads once, when `ray` is first
    imported; set here for child processes and, for a `ray` already imported, on Ray's constant too.
    Not for a process that joins a remote cluster (the cluster must reach it at its own address).
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def require_token_auth() -> None:
    """RAY_AUTH_MODE=token for this process and its children, and Ray's cached config refreshed
    (Ray reads the variable once, at import; `ray.init(address=...)` would not turn it on)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()


# --- the lease a worker holds ------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _worker_registry(url: str, lease_seconds: float, backoff: float, backoff_max: float) -> Registry:
    """One Registry per worker process and configuration (engines are thread-safe)."""
    return Registry(
        url, lease_seconds=lease_seconds, retry_backoff_seconds=backoff, retry_backoff_max_seconds=backoff_max
    )


@contextlib.contextmanager
def _lease_errors() -> Iterator[None]:
    """The registry's "you no longer hold it" errors, as the worker's LeaseLost."""
    try:
        yield
    except (LeaseLostError, JobStateError) as exc:
        raise LeaseLost(str(exc)) from exc


@dataclass(frozen=True)
class RegistryLease:
    """A worker's lease on one job, backed by the registry (implements workers.job.JobLease).

    Picklable: it travels to the worker with the job and opens the registry there from the URL (which
    carries the database password, if any; it stays inside the authenticated Ray cluster).
    """

    database_url: str
    job_id: int
    worker_id: str
    lease_seconds: float
    retry_backoff_seconds: float
    retry_backoff_max_seconds: float

    def _registry(self) -> Registry:
        return _worker_registry(
            self.database_url, self.lease_seconds, self.retry_backoff_seconds, self.retry_backoff_max_seconds
        )

    def heartbeat(self, progress: dict[str, Any] | None = None) -> bool:
        """Renew the lease, record progress; True when cancellation was requested."""
        with _lease_errors():
            return self._registry().heartbeat(self.job_id, self.worker_id, progress, self.lease_seconds)

    def complete(self, result: dict[str, Any]) -> None:
        """Record the result; the job succeeds (once, ever)."""
        with _lease_errors():
            self._registry().complete_job(self.job_id, self.worker_id, result)

    def fail(self, error: str, retryable: bool) -> None:
        """End the attempt with an error (retried after the backoff while attempts remain, if retryable)."""
        with _lease_errors():
            self._registry().fail_job(self.job_id, self.worker_id, error, retryable=retryable)

    def cancelled(self) -> None:
        """The worker stopped on a cancel request: the job ends cancelled."""
        with _lease_errors():
            self._registry().confirm_cancelled(self.job_id, self.worker_id)

    def release(self, reason: str) -> None:
        """Give the job back to the queue without counting the attempt."""
        with _lease_errors():
            self._registry().release_job(self.job_id, self.worker_id, reason)


# --- the dispatcher ---------------------------------------------------------------------------------


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


@dataclass
class _Job:
    """A job running in one slot of a worker, as the dispatcher sees it."""

    job_id: int
    owner: str  # its lease owner: "<worker id>#<slot>"
    backbone: str | None = None  # registry name of its backbone
    task: str | None = None
    run_ref: Any = None  # the run() call this dispatcher made (None for a job adopted on restart)
    cancel_pushed: bool = False


@dataclass
class _Worker:
    """The dispatcher's view of one worker actor and its job slots."""

    worker_id: str
    node_id: str
    actor: Any
    slots: int = 1
    ready: bool = False
    started_at: float = field(default_factory=time.monotonic)
    jobs: dict[int, _Job] = field(default_factory=dict)  # slot -> the job running there
    poll_ref: Any = None  # a pending info() call (startup, or watching adopted jobs)
    backbones: set[str] = field(default_factory=set)  # registry backbone names it keeps warm

    def free_slots(self) -> list[int]:
        return [slot for slot in range(self.slots) if slot not in self.jobs]

    def owner(self, slot: int) -> str:
        return slot_owner(self.worker_id, slot, self.slots)


def slot_owner(worker_id: str, slot: int, slots: int) -> str:
    """The lease owner of a worker's job slot: "<worker id>#<slot>", or the worker id itself when the
    worker has a single slot (as before job slots existed)."""
    return worker_id if slots == 1 else f"{worker_id}#{slot}"


def running_jobs(info: dict[str, Any], worker_id: str) -> list[dict[str, Any]]:
    """The jobs a worker's info() says it runs ([{job_id, owner}]); a worker from before job slots
    reports a single `job_id`, owned by the worker itself."""
    if info.get("jobs") is not None:
        return info["jobs"]
    return [] if info.get("job_id") is None else [{"job_id": info["job_id"], "owner": worker_id}]


def owner_worker(owner: str) -> tuple[str, int | None]:
    """(worker id, slot) of a lease owner ("<worker id>#<slot>"; a bare worker id: slot None)."""
    worker_id, _, slot = owner.partition("#")
    return worker_id, int(slot) if slot.isdigit() else None


class Dispatcher:
    """Claims jobs from the registry and runs them on warm worker actors (see the module docstring).

    `start()` reconciles with what runs and starts the loop in a thread; `step()` runs one round (tests
    may drive it by hand); `shutdown()` gives unstarted and running jobs back and stops the workers;
    `detach()` stops this dispatcher only, leaving the workers running for the next one.
    """

    def __init__(
        self,
        registry: Registry | str | None = None,
        sink: DeltaSink | None = None,
        *,
        config: DispatcherConfig | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        self.config = config or DispatcherConfig()
        self._owns_registry = not isinstance(registry, Registry)
        self.registry = (
            registry if isinstance(registry, Registry) else Registry(registry, settings=self.settings)
        )
        self.database_url = self.registry.engine.url.render_as_string(hide_password=False)
        if self.registry.engine.url.get_backend_name() == "sqlite" and self.registry.engine.url.database in (
            None,
            "",
            ":memory:",
        ):
            raise ValueError("the dispatcher needs a database its workers can open: not an in-memory SQLite")
        self.sink: DeltaSink = sink or LocalDeltaSink(self.settings.data_dir / "deltas")
        self.lease_seconds = float(self.config.lease_seconds or self.registry.lease_seconds)
        self.heartbeat_seconds = float(self.config.heartbeat_seconds or self.settings.heartbeat_seconds)
        if self.config.jobs_per_worker < 1:
            raise ValueError(f"jobs_per_worker must be at least 1, got {self.config.jobs_per_worker}")
        if self.heartbeat_seconds >= self.lease_seconds:
            raise ValueError(
                f"heartbeat_seconds ({self.heartbeat_seconds}) must be shorter than the lease "
                f"({self.lease_seconds} s)"
            )
        self.workers: dict[str, _Worker] = {}
        self.stats: Counter[str] = Counter()
        self._nodes: dict[str, int] = {}  # alive node id -> worker slots
        self._nodes_at = 0.0
        self._too_small: set[str] = set()  # nodes warned about: fewer CPUs than one worker needs
        self._cooldown: dict[str, float] = {}  # node id -> no new workers there before this time
        self._cancels_at = 0.0
        self._reaped_at = 0.0
        self._tasks: dict[str, TaskSpec] = {}
        self._backbones: dict[str, tuple[str, str]] = {}  # registry name -> (source, content hash)
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._closed = False

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> Dispatcher:
        """Reconcile with the workers and jobs already running, then run the loop in a thread."""
        import ray

        if not ray.is_initialized():
            connect_ray(self.settings, namespace=self.config.namespace)
        self.reconcile()
        self._halt.clear()
        self._thread = threading.Thread(target=self._loop, name="pelt-dispatcher", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._halt.is_set():
            try:
                self.step(wait=self.config.poll_seconds)
            except Exception:
                log.exception("dispatcher round failed; retrying")
                self._halt.wait(self.config.poll_seconds)

    def _stop_loop(self) -> None:
        self._halt.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def detach(self) -> None:
        """Stop this dispatcher, leaving workers and their jobs running (a successor adopts them)."""
        self._stop_loop()
        self.workers.clear()
        self._close_registry()

    def shutdown(
        self, *, drain: bool = False, timeout: float = 60.0, kill_workers: bool = True
    ) -> dict[str, Any]:
        """Stop claiming; give running jobs back to the queue (or, with `drain`, let them finish) and
        stop the workers and backbone hosts. Jobs still held after `timeout` are released here."""
        import ray

        self._stop_loop()
        if not drain:
            for worker in self.workers.values():
                for job in worker.jobs.values():
                    worker.actor.stop.remote(job.job_id, "release")
        deadline = time.monotonic() + timeout
        while any(w.jobs for w in self.workers.values()) and time.monotonic() < deadline:
            self._collect(wait=0.2)
            self._watch_adopted()
            time.sleep(0.05)  # (the halted loop's waits return at once)
        released = []
        for worker in self.workers.values():
            for job in worker.jobs.values():  # did not answer in time: give the job back ourselves
                with contextlib.suppress(LeaseLostError, JobStateError):
                    self.registry.release_job(job.job_id, job.owner, "the dispatcher shut down")
                    released.append(job.job_id)
        summary = {"stats": dict(self.stats), "released_by_dispatcher": released}
        if kill_workers:
            from workers.backbone_host import host_name

            for worker in self.workers.values():
                with contextlib.suppress(Exception):
                    ray.kill(worker.actor, no_restart=True)
            for node_id in {w.node_id for w in self.workers.values()} | set(self._nodes):
                with contextlib.suppress(ValueError):
                    ray.kill(
                        ray.get_actor(host_name(node_id), namespace=self.config.namespace), no_restart=True
                    )
            self.workers.clear()
        self._close_registry()
        return summary

    def _close_registry(self) -> None:
        if self._owns_registry and not self._closed:
            self.registry.close()
        self._closed = True

    # --- reconcile (start-up) ----------------------------------------------------------------------

    def reconcile(self) -> dict[str, list[int]]:
        """Adopt the live workers of this namespace and settle the jobs the registry says are running.

        Returns the job ids adopted (running on a live worker), released (claimed for a live worker
        that is not running them: never started) and left to lease expiry (their worker is gone)."""
        import ray

        namespace = self.config.namespace
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace and a["name"].startswith(WORKER_PREFIX)
        ]
        infos: dict[str, tuple[Any, dict[str, Any]]] = {}
        for name in names:
            try:
                actor = ray.get_actor(name, namespace=namespace)
                infos[name] = (actor, ray.get(actor.info.remote(), timeout=30))
            except Exception as exc:  # gone meanwhile, or hung: not adopted
                log.warning("not adopting worker %s: %s", name, exc)
        sources = self._source_names()
        for name, (actor, info) in infos.items():
            worker = _Worker(name, info["node_id"], actor, slots=int(info.get("slots", 1)), ready=True)
            worker.backbones = {sources[src] for src, _ in info["backbones"] if src in sources}
            for entry in running_jobs(
                info, name
            ):  # busy slots, whatever the registry says, until the worker frees them
                _, slot = owner_worker(entry.get("owner") or "")
                if slot is None or slot in worker.jobs or slot >= worker.slots:
                    slot = (worker.free_slots() or [len(worker.jobs)])[0]
                worker.jobs[slot] = _Job(entry["job_id"], entry.get("owner") or worker.owner(slot))
            if worker.jobs:
                worker.poll_ref = actor.info.remote()
            self.workers[name] = worker
            self.stats["workers_adopted"] += 1
        settled: dict[str, list[int]] = {"adopted": [], "released": [], "left_to_lease_expiry": []}
        for record in self.registry.list_jobs(status="running", limit=100_000):
            owner = record.lease_owner or ""
            if not owner.startswith(WORKER_PREFIX):
                continue
            worker = self.workers.get(owner_worker(owner)[0])
            job = (
                None
                if worker is None
                else next(
                    (j for j in worker.jobs.values() if j.job_id == record.id and j.owner == owner), None
                )
            )
            if job is not None:
                job.backbone, job.task = record.backbone, record.task
                settled["adopted"].append(record.id)
            elif worker is not None:
                with contextlib.suppress(LeaseLostError, JobStateError):
                    self.registry.release_job(record.id, owner, "claimed for a worker that never started it")
                    settled["released"].append(record.id)
            else:
                settled["left_to_lease_expiry"].append(record.id)
                log.warning(
                    "job %s: its worker %s is gone; it comes back when its lease expires at %s",
                    record.id,
                    owner,
                    record.lease_expires_at,
                )
        log.info("reconciled: %d worker(s) adopted, jobs %s", len(infos), settled)
        return settled

    def _source_names(self) -> dict[str, str]:
        """Canonical backbone source -> registry name."""
        from pelt_core.backbones import BackboneError, resolve_backbone

        names = {}
        for record in self.registry.list_backbones():
            with contextlib.suppress(BackboneError):
                names[resolve_backbone(record.source)[0]] = record.name
        return names

    # --- one round ---------------------------------------------------------------------------------

    def step(self, wait: float = 0.0) -> None:
        """Collect finished jobs and started workers (waiting up to `wait` s for one), push cancel
        requests, take back expired leases, then hand queued jobs to idle workers."""
        self._collect(wait)
        self._watch_adopted()
        self._refresh_nodes()
        self._push_cancels()
        self._reap()
        self._assign()

    def _reap(self) -> None:
        """Claims take back expired leases, but no claim runs while the queue is empty: do it on a timer."""
        now = time.monotonic()
        if now - self._reaped_at >= self.config.reap_seconds:
            self._reaped_at = now
            self.registry.requeue_expired_leases()

    def _collect(self, wait: float) -> None:
        import ray

        refs: dict[Any, tuple[_Worker, int | None]] = {}
        for worker in self.workers.values():
            refs.update(
                {job.run_ref: (worker, slot) for slot, job in worker.jobs.items() if job.run_ref is not None}
            )
            if worker.poll_ref is not None and not worker.ready:
                refs[worker.poll_ref] = (worker, None)
        if not refs:
            if wait:
                self._halt.wait(wait)
            return
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=wait)
        if ready:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            worker, slot = refs[ref]
            if slot is None:
                self._started(worker, ref)
            elif (
                worker.jobs.get(slot) is not None and worker.jobs[slot].run_ref is ref
            ):  # (not failed meanwhile)
                self._finished(worker, slot, ref)
        now = time.monotonic()
        for worker in list(self.workers.values()):
            if not worker.ready and now - worker.started_at > self.config.worker_start_timeout:
                log.error(
                    "worker %s did not start within %.0f s; dropping it",
                    worker.worker_id,
                    self.config.worker_start_timeout,
                )
                self._drop(worker, kill=True)

    def _started(self, worker: _Worker, ref: Any) -> None:
        import ray

        worker.poll_ref = None
        try:
            info = ray.get(ref)
        except Exception as exc:
            log.error("worker %s failed to start: %s", worker.worker_id, exc)
            self._drop(worker)
            self._cool_down(worker.node_id)
            return
        worker.ready = True
        worker.node_id = info["node_id"] or worker.node_id
        self.stats["workers_started"] += 1

    def _finished(self, worker: _Worker, slot: int, ref: Any) -> None:
        import ray
        from ray.exceptions import RayActorError

        try:
            outcome = ray.get(ref)
        except RayActorError as exc:
            self._worker_died(worker, exc)
            return
        except Exception as exc:  # run() itself raised: the attempt was not recorded
            job = worker.jobs.pop(slot)
            log.error("job %s: worker %s raised: %s", job.job_id, job.owner, exc)
            self._fail_for(job.owner, job.job_id, f"the worker raised: {exc}")
            self._settle_sink(job.task, job.job_id)
            return
        job = worker.jobs.pop(slot)
        self.stats[outcome.status] += 1
        self._settle_sink(job.task, job.job_id)
        if outcome.status == "succeeded" and job.backbone:
            worker.backbones.add(job.backbone)
            while len(worker.backbones) > self.config.max_backbones_per_worker:
                worker.backbones.pop()

    def _watch_adopted(self) -> None:
        """Jobs adopted on restart have no run() reference here: poll the worker's info() until each
        of them is no longer running there."""
        import ray
        from ray.exceptions import RayActorError

        for worker in list(self.workers.values()):
            adopted = {slot: job for slot, job in worker.jobs.items() if job.run_ref is None}
            if not worker.ready or not adopted:
                continue
            if worker.poll_ref is None:
                worker.poll_ref = worker.actor.info.remote()
                continue
            done, _ = ray.wait([worker.poll_ref], timeout=0)
            if not done:
                continue
            ref, worker.poll_ref = worker.poll_ref, None
            try:
                info = ray.get(ref)
            except RayActorError as exc:
                self._worker_died(worker, exc)
                continue
            running = {entry["job_id"] for entry in running_jobs(info, worker.worker_id)}
            outcomes = info.get("outcomes") or {}
            for slot, job in adopted.items():
                if job.job_id not in running:
                    worker.jobs.pop(slot)
                    self.stats[outcomes.get(job.job_id) or info.get("last_outcome") or "finished"] += 1
                    self._settle_sink(job.task, job.job_id)

    def _worker_died(self, worker: _Worker, exc: BaseException) -> None:
        """The actor is gone (SIGKILL, node lost): every job it ran is failed as retryable."""
        self.stats["worker_deaths"] += 1
        jobs = sorted(worker.jobs.values(), key=lambda job: job.owner)
        worker.jobs.clear()
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        log.warning(
            "worker %s died%s: %s",
            worker.worker_id,
            f" running job(s) {', '.join(str(j.job_id) for j in jobs)}" if jobs else "",
            first_line or type(exc).__name__,
        )
        self._drop(worker)
        self._cool_down(worker.node_id)
        for job in jobs:
            self._fail_for(
                job.owner, job.job_id, f"worker {job.owner} died: {type(exc).__name__}: {first_line}"
            )
            self._settle_sink(job.task, job.job_id)

    def _settle_sink(self, task: str | None, job_id: int | None) -> None:
        """After the registry has decided about a job's attempt, let a sink that keeps more than bytes
        tidy up (MlflowDeltaStore.finalize_job: keep the recorded version, drop the others, move the
        task's aliases). Sinks without `finalize_job` (LocalDeltaSink) need nothing."""
        finalize = getattr(self.sink, "finalize_job", None)
        if finalize is None or task is None or job_id is None:
            return
        try:
            finalize(task, job_id, self.registry)
        except Exception:  # the job's outcome stands; the sink's own reconcile repairs it later
            log.exception("job %s: the delta store could not settle it", job_id)

    def _fail_for(self, worker_id: str, job_id: int | None, error: str) -> None:
        """End a job's attempt for a worker that cannot (it died): retried after the backoff."""
        if job_id is None:
            return
        # LeaseLost/JobState: already recorded by the worker, or taken back when its lease expired
        with contextlib.suppress(LeaseLostError, JobStateError):
            self.registry.fail_job(job_id, worker_id, error, retryable=True)

    def _cool_down(self, node_id: str) -> None:
        """A worker died or could not start there: the node may be going away; look again soon."""
        self._cooldown[node_id] = time.monotonic() + self.config.node_cooldown_seconds
        self._nodes_at = 0.0

    def _drop(self, worker: _Worker, kill: bool = False) -> None:
        import ray

        self.workers.pop(worker.worker_id, None)
        if kill:
            with contextlib.suppress(Exception):
                ray.kill(worker.actor, no_restart=True)

    def _refresh_nodes(self) -> None:
        import ray

        now = time.monotonic()
        if now - self._nodes_at < self.config.node_refresh_seconds and self._nodes:
            return
        self._nodes_at = now
        nodes = {}
        per_worker = self.config.cpus_per_worker * self.config.jobs_per_worker
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            cpus = node.get("Resources", {}).get("CPU", 0)
            slots = int(cpus // per_worker)
            if not slots and cpus and node["NodeID"] not in self._too_small:
                self._too_small.add(node["NodeID"])
                log.warning(
                    "node %s has %g CPU(s): too few for a worker of %d job slot(s) x %g CPU(s)",
                    node["NodeID"][:12],
                    cpus,
                    self.config.jobs_per_worker,
                    self.config.cpus_per_worker,
                )
            if self.config.max_workers_per_node is not None:
                slots = min(slots, self.config.max_workers_per_node)
            nodes[node["NodeID"]] = slots
        for worker in list(self.workers.values()):  # idle workers on a lost node: forget them
            if worker.node_id not in nodes and not worker.jobs and worker.ready:
                self._drop(worker)
        self._nodes = nodes

    def _push_cancels(self) -> None:
        now = time.monotonic()
        if now - self._cancels_at < self.config.poll_seconds:
            return
        self._cancels_at = now
        running = {
            job.job_id: (worker, job)
            for worker in self.workers.values()
            for job in worker.jobs.values()
            if not job.cancel_pushed
        }
        if not running:
            return
        for job_id in self.registry.cancel_requests(running):
            worker, job = running[job_id]
            worker.actor.stop.remote(job_id, "cancel")
            job.cancel_pushed = True
            self.stats["cancels_pushed"] += 1

    # --- placement ---------------------------------------------------------------------------------

    def _assign(self) -> None:
        open_ = [w for w in self.workers.values() if w.ready and w.free_slots()]
        if not open_ and not self._free_slots():
            return
        queued = self.registry.job_counts()["queued"]  # one read; claims (writes) only when there is work
        if not queued:
            return
        for worker in [w for w in open_ if w.backbones]:  # 1. warm: jobs on a backbone it holds
            while worker.free_slots() and queued > 0 and self._claim_for(worker, sorted(worker.backbones)):
                queued -= 1
        open_ = [w for w in open_ if w.free_slots()]
        starting = sum(w.slots for w in self.workers.values() if not w.ready)
        fresh = [w for w in open_ if not w.backbones]
        waiting = queued - sum(len(w.free_slots()) for w in fresh) - starting
        for _ in range(
            max(0, -(-waiting // self.config.jobs_per_worker))
        ):  # 2. more workers while nodes have room
            node_id = self._node_with_free_slot()
            if node_id is None:
                break
            self._start_worker(node_id)
        for worker in fresh:  # 3. new workers take anything
            while worker.free_slots():
                if not self._claim_for(worker, None):
                    return  # nothing runnable left
        if self._node_with_free_slot() is None:  # 4. no room for a worker: warm workers switch backbones
            for worker in [w for w in open_ if w.backbones]:
                while worker.free_slots():
                    if not self._claim_for(worker, None):
                        return

    def _free(self) -> dict[str, int]:
        """Room for more workers per usable node (nodes cooling down after a failure excluded)."""
        now = time.monotonic()
        used = Counter(w.node_id for w in self.workers.values())
        return {
            node: slots - used[node]
            for node, slots in self._nodes.items()
            if slots > used[node] and self._cooldown.get(node, 0.0) <= now
        }

    def _free_slots(self) -> int:
        return sum(self._free().values())

    def _node_with_free_slot(self) -> str | None:
        free = self._free()
        return max(free, key=lambda node: (free[node], node)) if free else None

    def _start_worker(self, node_id: str) -> _Worker:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from workers.worker import WorkerConfig, worker_actor_class  # torch: only where workers start

        worker_id = f"{WORKER_PREFIX}{node_id[:12]}.{secrets.token_hex(4)}"
        slots = self.config.jobs_per_worker
        config = WorkerConfig(
            threads=max(1, round(self.config.cpus_per_worker)),
            slots=slots,
            heartbeat_seconds=self.heartbeat_seconds,
            lease_seconds=self.lease_seconds,
            max_backbones=self.config.max_backbones_per_worker,
            namespace=self.config.namespace,
        )
        actor = (
            worker_actor_class()
            .options(
                name=worker_id,
                namespace=self.config.namespace,
                lifetime="detached",
                max_restarts=0,
                num_cpus=self.config.cpus_per_worker * slots,
                max_concurrency=slots + 3,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                runtime_env={"env_vars": dict(self.config.worker_env)} if self.config.worker_env else None,
            )
            .remote(worker_id, config)
        )
        worker = _Worker(worker_id, node_id, actor, slots=slots, poll_ref=actor.info.remote())
        self.workers[worker_id] = worker
        log.info("starting worker %s (%d job slot(s)) on node %s", worker_id, slots, node_id[:12])
        return worker

    def _claim_for(self, worker: _Worker, backbones: list[str] | None) -> bool:
        """Claim a job for the worker's first free slot and start it there; False when none is runnable."""
        slot = worker.free_slots()[0]
        owner = worker.owner(slot)
        record = self.registry.claim_job(owner, lease_seconds=self.lease_seconds, backbones=backbones)
        if record is None:
            return False
        try:
            spec = self.job_spec(record)
        except Exception as exc:
            log.exception("job %s: cannot build its spec", record.id)
            self._fail_for(owner, record.id, f"the dispatcher could not prepare the job: {exc}")
            return True
        lease = RegistryLease(
            self.database_url,
            record.id,
            owner,
            self.lease_seconds,
            self.registry.retry_backoff_seconds,
            self.registry.retry_backoff_max_seconds,
        )
        worker.jobs[slot] = _Job(
            record.id,
            owner,
            record.backbone,
            record.task,
            run_ref=worker.actor.run.remote(spec, lease, self.sink),
        )
        self.stats["dispatched"] += 1
        return True

    # --- what a worker is told -----------------------------------------------------------------------

    def job_spec(self, job: JobRecord) -> JobSpec:
        """Everything the worker needs, resolved from the registry (the worker looks nothing up)."""
        if job.task not in self._tasks:
            self._tasks[job.task] = task_spec(self.registry.get_task(job.task))
        if job.backbone not in self._backbones:
            record = self.registry.get_backbone(job.backbone)
            self._backbones[job.backbone] = (record.source, record.content_hash)
        source, content_hash = self._backbones[job.backbone]
        return JobSpec(
            job_id=job.id,
            task=self._tasks[job.task],
            method=job.method,
            method_spec=job.method_spec,
            train_config=job.train_config,
            backbone=source,
            backbone_dtype=job.train_config.get("backbone_dtype", "float32"),
            backbone_hash=content_hash,
            attempt=job.attempts,
            sweep_id=job.sweep_id,
            tags={"backbone": job.backbone, "seed": str(job.seed), "k_shot": str(job.k_shot)},
        )

    def describe(self) -> list[dict[str, Any]]:
        """The workers as this dispatcher sees them."""
        return [
            {
                "worker_id": w.worker_id,
                "node_id": w.node_id,
                "ready": w.ready,
                "slots": w.slots,
                "jobs": {w.owner(slot): job.job_id for slot, job in sorted(w.jobs.items())},
                "backbones": sorted(w.backbones),
            }
            for w in self.workers.values()
        ]


def task_spec(task: TaskRecord) -> TaskSpec:
    """A registered task as the worker sees it: where its training and evaluation data are."""
    if task.source_kind == "datasets":
        folder = task.source["path"]
        splits = list(task.split_sizes)
        train_path = f"{folder}:train" if "train" in splits or not splits else f"{folder}:{splits[0]}"
        evaluation = next((s for s in EVALUATION_SPLITS if s in splits), None)
        validation_path = f"{folder}:{evaluation}" if evaluation else None
    else:
        train_path = task.source["train"]
        validation_path = next((task.source[s] for s in EVALUATION_SPLITS if s in task.source), None)
    return TaskSpec(
        name=task.name,
        train_path=train_path,
        validation_path=validation_path,
        text_fields=tuple(task.text_fields),
        label_field=task.label_field,
        problem_type=task.problem_type,
        label_names=None if task.label_names is None else tuple(task.label_names),
        metric=task.metric,
        metric_direction=task.metric_direction,
        max_length=task.max_length,
    )


# --- command line ------------------------------------------------------------------------------------


def serve(
    registry_url: str | None = None,
    *,
    config: DispatcherConfig | None = None,
    num_cpus: int | None = None,
    drain: bool = False,
    delta_store: str = "local",
) -> None:
    """Run a dispatcher until SIGTERM/SIGINT, then shut it down (the `pelt dispatcher` command).

    delta_store: "local" (LocalDeltaSink under PELT_DATA_DIR/deltas) or "mlflow" (MlflowDeltaStore on
    PELT_MLFLOW_TRACKING_URI, its schema created or upgraded first)."""
    settings = get_settings()
    config = config or DispatcherConfig()
    started = connect_ray(settings, namespace=config.namespace, num_cpus=num_cpus)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    registry = Registry(registry_url, settings=settings)
    sink: DeltaSink | None = None
    if delta_store == "mlflow":
        from services.delta_store import MlflowDeltaStore

        sink = MlflowDeltaStore.from_settings(settings, registry=registry, ensure=True)
    elif delta_store != "local":
        raise ValueError(f"delta_store must be local or mlflow, got {delta_store!r}")
    dispatcher = Dispatcher(registry, sink, config=config, settings=settings).start()
    print(
        f"dispatcher running (namespace {config.namespace}, Ray {'started here' if started else 'joined'})",
        flush=True,
    )
    try:
        stop.wait()
    finally:
        summary = dispatcher.shutdown(drain=drain)
        registry.close()
        print(f"dispatcher stopped: {summary}", flush=True)
        if started:
            import ray

            ray.shutdown()


def _command() -> Any:
    import click

    @click.command("dispatcher")
    @click.option("--database-url", default=None, help="registry (default: PELT_DATABASE_URL)")
    @click.option("--namespace", default="pelt", show_default=True, help="Ray namespace of the workers")
    @click.option(
        "--cpus-per-worker",
        default=1.0,
        show_default=True,
        help="Ray CPUs per job slot (each job's torch threads, rounded)",
    )
    @click.option(
        "--jobs-per-worker",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="job slots per worker process: jobs that share its runtime and mapped backbones",
    )
    @click.option(
        "--max-workers-per-node",
        type=int,
        default=None,
        help="default: CPUs // (cpus-per-worker * jobs-per-worker)",
    )
    @click.option("--num-cpus", type=int, default=None, help="CPUs of a local Ray (without PELT_RAY_ADDRESS)")
    @click.option("--heartbeat-seconds", type=float, default=None, help="default: PELT_HEARTBEAT_SECONDS")
    @click.option(
        "--drain", is_flag=True, help="on SIGTERM, let running jobs finish instead of requeueing them"
    )
    @click.option(
        "--delta-store",
        type=click.Choice(["local", "mlflow"]),
        default="local",
        show_default=True,
        help="where deltas go: a folder under PELT_DATA_DIR, or MLflow (PELT_MLFLOW_TRACKING_URI)",
    )
    def dispatcher_command(
        database_url: str | None,
        namespace: str,
        cpus_per_worker: float,
        jobs_per_worker: int,
        max_workers_per_node: int | None,
        num_cpus: int | None,
        heartbeat_seconds: float | None,
        drain: bool,
        delta_store: str,
    ) -> None:
        """Drain the job queue into Ray workers (joins PELT_RAY_ADDRESS or starts a local Ray)."""
        from services.filemodes import private_files

        private_files()  # what the dispatcher and its local Ray write is for its user only (0600 / 0700)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        config = DispatcherConfig(
            namespace=namespace,
            cpus_per_worker=cpus_per_worker,
            jobs_per_worker=jobs_per_worker,
            max_workers_per_node=max_workers_per_node,
            heartbeat_seconds=heartbeat_seconds,
        )
        serve(database_url, config=config, num_cpus=num_cpus, drain=drain, delta_store=delta_store)

    return dispatcher_command


dispatcher_command = _command()


__all__ = [
    "Dispatcher",
    "DispatcherConfig",
    "RegistryLease",
    "connect_ray",
    "loopback_only",
    "private_ray_token",
    "require_token_auth",
    "serve",
    "task_spec",
]
