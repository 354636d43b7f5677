"""The dispatcher: claims queued jobs from the registry for free slots of warm worker actors, hands each
its spec and a `RegistryLease`, and watches for outcomes, cancel requests, dead workers and expired
leases, one round every `poll_seconds` (see the package docstring for the whole picture).

`start()` leads the namespace if no other dispatcher does (`services.dispatcher.leadership`: else it stands by
and takes over when the leader stops), reconciles with what runs and starts the loop in a thread; `step()`
runs one round (tests may drive it by hand); `shutdown()` gives unstarted and running jobs back and stops
the workers; `detach()` stops this dispatcher only, leaving the workers running for the next one (a standby
takes over at once).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from typing import Any

from services.dispatcher.adoption import live_workers, settle_running_jobs
from services.dispatcher.config import DispatcherConfig
from services.dispatcher.job_specs import JobSpecs
from services.dispatcher.leadership import LeaderLock
from services.dispatcher.lease import RegistryLease
from services.dispatcher.placement import Nodes, kill_backbone_host, start_worker
from services.dispatcher.ray_cluster import connect_ray
from services.dispatcher.scaling import NodeRequests, queued_per_device
from services.dispatcher.slots import (
    SlotJob,
    WorkerSlots,
    idle_streams,
    largest_worker_memory,
    running_jobs,
    streams,
)
from services.registry import (
    JobStateError,
    LeaseLostError,
    Registry,
    RegistryBusyError,
    RegistryUnavailableError,
)
from services.settings import Settings, get_settings
from workers.job import DeltaSink, LocalDeltaSink

RESETTLE_JOBS = 1000  # a new leader settles again at most this many of the jobs that ended lately
SETTLE_PER_ROUND = 20  # jobs settled again per reaper round: a round stays short, the lead renewed
SETTLE_TRIES = 10  # a job whose settling failed this often is left to `pelt mlflow reconcile`
log = logging.getLogger("pelt.dispatcher")


class Dispatcher:
    """Claims jobs from the registry and runs them on warm worker actors (see the module docstring)."""

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
        if self.config.idle_worker_seconds is None and self.settings.idle_worker_seconds is not None:
            self.config = replace(self.config, idle_worker_seconds=self.settings.idle_worker_seconds)
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
        self.workers: dict[str, WorkerSlots] = {}
        self.stats: Counter[str] = Counter()
        self.nodes = Nodes(self.config)
        self.specs = JobSpecs(self.registry)
        self._cancels_at = 0.0
        self._reaped_at = 0.0
        self._searched_at = 0.0
        self._unsettled: dict[int, str] = {}  # job id → task: the delta store could not settle them yet
        self._settle_tries: dict[int, int] = {}
        self.scaling = NodeRequests(self.config)
        self.lock = LeaderLock(self.registry, self.config.namespace, self.config.leader_seconds)
        self.lock.worker_memory = lambda: largest_worker_memory(self.workers.values())
        self._reconciled = False
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._failing_since: float | None = None
        self.broken: str | None = None  # why the loop gave up (`_given_up`); None while it runs
        self.stopped = threading.Event()  # set when the loop gave up
        self._closed = False

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> Dispatcher:
        """Lead the namespace if no other dispatcher does, reconcile with the workers and jobs already
        running, and run the loop in a thread; or, while another dispatcher leads, stand by in that thread
        and take over (reconcile, loop) when it stops."""
        import ray

        if not ray.is_initialized():
            connect_ray(self.settings, namespace=self.config.namespace)
        import workers.worker  # noqa: F401 - torch and transformers now, not in the middle of a round

        if self.lock.try_acquire():
            try:
                self.reconcile()
            except BaseException:
                self.lock.release()
                raise
        self._halt.clear()
        self._thread = threading.Thread(target=self._loop, name="pelt-dispatcher", daemon=True)
        self._thread.start()
        return self

    @property
    def role(self) -> str:
        """ "leader" (it claims and runs jobs) or "standby" (it waits to take over)."""
        return "leader" if self.lock.leading else "standby"

    def _loop(self) -> None:
        while not self._halt.is_set():
            try:
                if not self.lock.leading:
                    if not self.lock.try_acquire():
                        self._halt.wait(self.config.standby_poll_seconds)
                        continue
                    self._reconciled = False
                if not self.lock.still_leading():
                    self.workers.clear()  # the new leader adopts them: nothing here touches them any more
                    self.stats["leadership_lost"] += 1
                    continue
                if not self._reconciled:  # the workers and jobs of the dispatcher that led before (retried)
                    self.reconcile()
                self.step(wait=self.config.poll_seconds)
                self._failing_since = None
            except Exception as exc:
                log.exception("dispatcher round failed; retrying")
                if self._given_up(exc):
                    return
                self._halt.wait(self.config.poll_seconds)

    def _given_up(self, exc: Exception) -> bool:
        """Rounds failing for `give_up_seconds` in a row, not because the registry's database was away
        (that is waited out): the dispatcher's Ray connection is broken for good (a Ray head that restarted
        without GCS fault tolerance is another cluster; every call says WrongClusterID). It releases the
        lead, sets `broken` with the reason, and its loop ends: `pelt dispatcher` then exits non-zero, so
        that its supervisor starts it again on the cluster as it is now."""
        if isinstance(exc, RegistryUnavailableError | RegistryBusyError):
            self._failing_since = None  # the database's outage is waited out, and does not count
            return False
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        if now - self._failing_since < self.config.give_up_seconds:
            return False
        self.broken = (
            f"every round failed for {now - self._failing_since:.0f} s; the last: {type(exc).__name__}: {exc}"
        )
        log.error("dispatcher gives up: %s", self.broken)
        self.workers.clear()  # on a cluster it cannot reach: a successor adopts what is still alive
        with contextlib.suppress(Exception):
            self.lock.release()
        self.stopped.set()
        return True

    def _stop_loop(self) -> None:
        self._halt.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def detach(self) -> None:
        """Stop this dispatcher, leaving workers and their jobs running (a successor adopts them; a
        standby takes over at once)."""
        self._stop_loop()
        self.workers.clear()
        self.lock.release()
        self._close_registry()

    def shutdown(
        self, *, drain: bool = False, timeout: float = 60.0, kill_workers: bool = True
    ) -> dict[str, Any]:
        """Stop claiming; give running jobs back to the queue (or, with `drain`, let them finish) and
        stop the workers and backbone hosts. Jobs still held after `timeout` are released here. A standby
        only stops (the workers are the leader's)."""
        self._stop_loop()
        if not self.lock.leading:
            self._close_registry()
            return {"stats": dict(self.stats), "released_by_dispatcher": [], "role": "standby"}
        if not drain:
            for worker in self.workers.values():
                for job in worker.jobs.values():
                    worker.actor.stop.remote(job.job_id, "release")
        deadline = time.monotonic() + timeout
        while any(w.jobs for w in self.workers.values()) and time.monotonic() < deadline:
            if not self.lock.still_leading():  # a standby took over while we waited: its workers now
                return self._stepped_down()
            self._collect(wait=0.2)
            self._watch_adopted()
            time.sleep(0.05)  # (the halted loop's waits return at once)
        if not self.lock.still_leading(force=True):  # never stop workers another leader runs
            return self._stepped_down()
        released = []
        for worker in self.workers.values():
            for job in worker.jobs.values():  # did not answer in time: give the job back ourselves
                with contextlib.suppress(LeaseLostError, JobStateError):
                    self.registry.release_job(job.job_id, job.owner, "the dispatcher shut down")
                    released.append(job.job_id)
        summary = {"stats": dict(self.stats), "released_by_dispatcher": released, "role": "leader"}
        if kill_workers:
            self._kill_workers_and_hosts()
        self.lock.release()
        self._close_registry()
        return summary

    def _stepped_down(self) -> dict[str, Any]:
        """End a shutdown that lost the namespace meanwhile: the new leader owns the workers and jobs."""
        self.workers.clear()
        self.stats["leadership_lost"] += 1
        self._close_registry()
        return {"stats": dict(self.stats), "released_by_dispatcher": [], "role": "stepped down"}

    def _kill_workers_and_hosts(self) -> None:
        import ray

        for worker in self.workers.values():
            with contextlib.suppress(Exception):
                ray.kill(worker.actor, no_restart=True)
        for node_id in {w.node_id for w in self.workers.values()} | set(self.nodes.capacity):
            kill_backbone_host(node_id, self.config.namespace)
        self.workers.clear()
        self.scaling.withdraw()  # no workers kept: nothing asked of the autoscaler any more

    def _close_registry(self) -> None:
        if self._owns_registry and not self._closed:
            self.registry.close()
        self._closed = True

    def reconcile(self) -> dict[str, list[int]]:
        """Adopt the live workers of this namespace and settle the jobs the registry says are running.

        Returns the job ids adopted (running on a live worker), released (claimed for a live worker
        that is not running them: never started) and left to lease expiry (their worker is gone)."""
        adopted = live_workers(self.registry, self.config.namespace)
        self.workers.update(adopted)
        self._reconciled = True
        self.stats["workers_adopted"] += len(adopted)
        settled = settle_running_jobs(self.registry, self.workers)
        log.info("reconciled: %d worker(s) adopted, jobs %s", len(adopted), settled)
        self._resettle_store()
        return settled

    def _resettle_store(self) -> None:
        """The jobs that ended lately (`resettle_seconds`, at most RESETTLE_JOBS) join those to settle again
        in the delta store, a few per round (`_settle_again`): the dispatcher that led before may have died
        between a job's end and its settling, leaving an earlier attempt's version or an alias behind.
        Sinks without `finalize_job` (LocalDeltaSink) need nothing."""
        if getattr(self.sink, "finalize_job", None) is None:
            return
        since = self.registry.now() - timedelta(seconds=self.config.resettle_seconds)
        try:
            recent = self.registry.jobs_finished_since(since, limit=RESETTLE_JOBS)
        except Exception as exc:  # the next leader tries again; `pelt mlflow reconcile` repairs it too
            log.warning("the jobs that ended lately could not be listed for settling: %s", exc)
            return
        for job_id, task in recent:
            self._unsettled.setdefault(job_id, task)

    # --- one round ---------------------------------------------------------------------------------

    def step(self, wait: float = 0.0) -> None:
        """Collect finished jobs and started workers (waiting up to `wait` s for one), push cancel
        requests, take back expired leases, advance method searches, then hand queued jobs to idle workers."""
        self._collect(wait)
        self._watch_adopted()
        self._refresh_nodes()
        self._push_cancels()
        self._reap()
        self._advance_searches()
        self._assign()

    def _advance_searches(self) -> None:
        """On a timer: the method searches whose rung ended queue their next rung (or choose): a search
        needs no process of its own, and a restarted dispatcher picks it up from the registry."""
        now = time.monotonic()
        if now - self._searched_at < self.config.search_seconds:
            return
        self._searched_at = now
        try:
            changed = self.registry.advance_searches()
        except Exception:  # the dispatcher's jobs go on; the next round tries again
            log.exception("advancing the method searches failed")
            return
        if changed:
            log.info("searches advanced: %s", changed)

    def _reap(self) -> None:
        """Claims take back expired leases, but no claim runs while the queue is empty: do it on a timer."""
        now = time.monotonic()
        if now - self._reaped_at >= self.config.reap_seconds:
            self._reaped_at = now
            self._settle_again()
            self.registry.requeue_expired_leases()

    def _collect(self, wait: float) -> None:
        import ray

        refs: dict[Any, tuple[WorkerSlots, int | None]] = {}
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
                self._start_failed(worker)

    def _start_failed(self, worker: WorkerSlots) -> None:
        if worker.device == "gpu":
            self.nodes.gpu_worker_failed(worker.node_id)
        else:
            self.nodes.cool_down(worker.node_id)

    def _started(self, worker: WorkerSlots, ref: Any) -> None:
        import ray

        worker.poll_ref = None
        try:
            info = ray.get(ref)
        except Exception as exc:
            log.error("worker %s failed to start: %s", worker.worker_id, exc)
            self._drop(worker)
            self._start_failed(worker)
            return
        worker.ready = True
        worker.node_id = info["node_id"] or worker.node_id
        worker.memory_bytes = info.get("memory_bytes")
        self.stats["workers_started"] += 1

    def _finished(self, worker: WorkerSlots, slot: int, ref: Any) -> None:
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

    def _worker_died(self, worker: WorkerSlots, exc: BaseException) -> None:
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
        self.nodes.cool_down(worker.node_id)
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
        except Exception as exc:  # the job's outcome stands; tried again on the reaper's timer
            self._unsettled[job_id] = task
            log.warning("job %s: the delta store could not settle it (%s); trying again later", job_id, exc)
        else:
            self._unsettled.pop(job_id, None)

    def _settle_again(self) -> None:
        """Up to SETTLE_PER_ROUND of the jobs still to settle (their settling failed while the MLflow server
        or the registry was away, or a new leader's recent jobs), oldest first; one that failed
        SETTLE_TRIES times is left to `pelt mlflow reconcile`, with a warning."""
        for job_id, task in sorted(self._unsettled.items())[:SETTLE_PER_ROUND]:
            self._settle_sink(task, job_id)
            if job_id not in self._unsettled:
                self._settle_tries.pop(job_id, None)
                continue
            self._settle_tries[job_id] = self._settle_tries.get(job_id, 0) + 1
            if self._settle_tries[job_id] >= SETTLE_TRIES:
                del self._unsettled[job_id], self._settle_tries[job_id]
                log.warning(
                    "job %s: the delta store could not settle it %d times; `pelt mlflow reconcile %s` will",
                    job_id,
                    SETTLE_TRIES,
                    task,
                )

    def _fail_for(self, worker_id: str, job_id: int | None, error: str) -> None:
        """End a job's attempt for a worker that cannot (it died): retried after the backoff."""
        if job_id is None:
            return
        # LeaseLost/JobState: already recorded by the worker, or taken back when its lease expired
        with contextlib.suppress(LeaseLostError, JobStateError):
            self.registry.fail_job(job_id, worker_id, error, retryable=True)

    def _drop(self, worker: WorkerSlots, kill: bool = False) -> None:
        import ray

        self.workers.pop(worker.worker_id, None)
        if kill:
            with contextlib.suppress(Exception):
                ray.kill(worker.actor, no_restart=True)

    def _refresh_nodes(self) -> None:
        """Read the alive nodes again (now and then); forget idle workers on a node that is gone."""
        if not self.nodes.refresh():
            return
        for worker in list(self.workers.values()):
            if worker.node_id not in self.nodes.capacity and not worker.jobs and worker.ready:
                self._drop(worker)

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
        """Hand queued jobs to free places, for each kind of worker in turn (GPU workers first): see
        `_assign_kind`. A job's `device` says which kinds may run it: gpu jobs only GPU workers, cpu jobs
        only CPU workers, and "any" job the GPU workers where some node has a GPU, else the CPU workers."""
        kinds = ("gpu", "cpu") if self.nodes.has_gpus else ("cpu",)
        open_ = {
            k: [w for w in self.workers.values() if w.ready and w.free_slots() and w.device == k]
            for k in kinds
        }
        room = sum(sum(self.nodes.room(self.workers.values(), kind).values()) for kind in kinds)
        scaling = self.scaling.due()
        if not any(open_.values()) and not room and not scaling:
            return
        # one read; claims (writes) only when there is work
        by_backbone = self.registry.queued_by_device_and_backbone() if scaling else None
        queued = (
            queued_per_device(by_backbone) if by_backbone is not None else self.registry.queued_by_device()
        )
        if scaling:  # ask Ray for the nodes the queue needs; let long-idle workers go (scaling.py)
            workers = self.scaling.update(queued, self.workers.values(), self.nodes.has_gpus, by_backbone)
            for worker in workers:
                if not self.lock.may_act():  # a stalled leader's standby may have adopted it meanwhile
                    break
                self._drop(worker, kill=True)
                if not any(w.node_id == worker.node_id for w in self.workers.values()):
                    kill_backbone_host(worker.node_id, self.config.namespace)  # objects keep a node busy
        for kind in kinds:
            waiting = sum(queued.get(device, 0) for device in self._claim_devices(kind))
            if waiting:
                self._assign_kind(kind, open_[kind], waiting)

    def _claim_devices(self, kind: str) -> tuple[str, ...]:
        """The job devices a worker of this kind takes."""
        if kind == "gpu":
            return ("gpu", "any")
        return ("cpu",) if self.nodes.has_gpus else ("cpu", "any")

    def _assign_kind(self, kind: str, open_: list[WorkerSlots], queued: int) -> None:
        """Hand `queued` jobs this kind may run to its free places, spreading them over the node's compute
        before any pack fills: each job first gets a compute stream of its own (a job slot, or a pack
        worker with no job yet), and a pack takes a second job only when every stream has a worker.

        1. warm workers take jobs on the backbones they hold, one per idle stream; 2. more workers start,
        one per job still without a stream, while nodes have room; 3. new workers take anything, one per
        idle stream; and only when no node has room: 4. idle warm workers switch to another backbone, and
        5. packs fill, least loaded first, up to an even share each (the jobs that starting workers will
        take left for them). A pack that runs jobs takes only jobs on their backbone (a pack never mixes
        backbones), so it neither counts as new nor switches."""
        of_kind = [w for w in self.workers.values() if w.device == kind]
        for worker in [w for w in open_ if w.claim_backbones() is not None]:  # 1. warm: backbones it holds
            queued -= self._claim_into(worker, idle_streams(worker), worker.claim_backbones)
        open_ = [w for w in open_ if w.free_slots()]
        starting = sum(streams(w) for w in of_kind if not w.ready)
        fresh = [w for w in open_ if w.claim_backbones() is None]
        waiting = queued - sum(idle_streams(w) for w in fresh) - starting
        per_worker = 1 if self.config.pack_size_of(kind) > 1 else self.config.places(kind)
        for _ in range(max(0, -(-waiting // per_worker))):  # 2. more workers, room allowing
            node_id = self.nodes.roomiest(self.workers.values(), kind)
            if node_id is None or not self.lock.may_act():
                break
            worker = start_worker(
                node_id,
                self.config,
                heartbeat_seconds=self.heartbeat_seconds,
                lease_seconds=self.lease_seconds,
                kind=kind,
            )
            self.workers[worker.worker_id] = worker
            starting += streams(worker)
        for worker in fresh:  # 3. new workers take anything
            limit = idle_streams(worker)
            claimed = self._claim_into(worker, limit, lambda: None)
            queued -= claimed
            if claimed < limit:
                return  # nothing runnable left
        if self.nodes.roomiest(self.workers.values(), kind) is not None:
            return  # every job gets a stream of its own before any pack takes a second one
        # 4. no room: warm workers switch backbone (a pack only while it runs nothing: it never mixes them)
        for worker in [w for w in open_ if w.backbones and not (w.packed and w.jobs)]:
            limit = idle_streams(worker)
            claimed = self._claim_into(worker, limit, lambda: None)
            queued -= claimed
            if claimed < limit:
                return
        self._fill_packs([w for w in open_ if w.packed], queued - starting, starting)

    def _claim_into(self, worker: WorkerSlots, limit: int, backbones: Any) -> int:
        """Claim up to `limit` jobs into the worker's free places, each on one of `backbones()` (None:
        any backbone); how many it claimed (fewer: none runnable)."""
        claimed = 0
        while claimed < limit and worker.free_slots() and self._claim_for(worker, backbones()):
            claimed += 1
        return claimed

    def _fill_packs(self, packs: list[WorkerSlots], spare: int, starting: int) -> None:
        """Every stream has a worker: hand up to `spare` more jobs to the packs' free places, a job at a
        time to the least loaded pack, none above an even share of the running and queued jobs over the
        packs and the `starting` workers (a pack that runs jobs takes only jobs on their backbone)."""
        if not packs or spare <= 0:
            return
        share = -(-(sum(len(w.jobs) for w in packs) + spare + starting) // (len(packs) + starting))
        candidates = list(packs)
        while spare > 0 and candidates:
            worker = min(candidates, key=lambda w: (len(w.jobs), w.worker_id))
            if len(worker.jobs) >= share or not worker.free_slots():
                candidates.remove(worker)
                continue
            if self._claim_for(worker, worker.claim_backbones() if worker.jobs else None):
                spare -= 1
            else:
                candidates.remove(worker)

    def _claim_for(self, worker: WorkerSlots, backbones: list[str] | None) -> bool:
        """Claim a job (on one of `backbones`; None: any) for the worker's first free slot and start it
        there; False when none is runnable."""
        if (backbones is not None and not backbones) or not self.lock.may_act():
            return False
        slot = worker.free_slots()[0]
        owner = worker.owner(slot)
        record = self.registry.claim_job(
            owner,
            lease_seconds=self.lease_seconds,
            backbones=backbones,
            devices=self._claim_devices(worker.device),
        )
        if record is None:
            return False
        try:
            spec = self.specs.build(record)
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
        worker.jobs[slot] = SlotJob(
            record.id,
            owner,
            record.backbone,
            record.task,
            run_ref=worker.actor.run.remote(spec, lease, self.sink),
        )
        self.stats["dispatched"] += 1
        return True

    def describe(self) -> list[dict[str, Any]]:
        """The workers as this dispatcher sees them."""
        return [
            {
                "worker_id": w.worker_id,
                "device": w.device,
                "node_id": w.node_id,
                "ready": w.ready,
                "slots": w.slots,
                "jobs": {w.owner(slot): job.job_id for slot, job in sorted(w.jobs.items())},
                "backbones": sorted(w.backbones),
            }
            for w in self.workers.values()
        ]
