"""A long-lived worker: warm backbones, several jobs at a time (packed or in slots), their leases kept alive.

`PeltWorker` is a plain class; the dispatcher runs it as a threaded Ray actor (`worker_actor_class`),
so each `run` call (one per job) runs in its own thread while `stop` and `info` answer in others. Its jobs
share the process (one Python/torch/transformers/Ray runtime instead of one per job), its warm backbones
(the node's shared tensors are mapped once per process) and their tokenizers. Two ways to run several:

- **Packs** (`WorkerConfig.pack_size` N > 1, the dispatcher's `--pack-size`): N places; every job on a warm
  backbone joins that backbone's `PackRunner` (`workers.pack_runner`), whose one thread steps them
  together through shared backbone passes (`pelt_core.pack`); each `run` waits for its own job's end.
- **Job slots** (`WorkerConfig.slots`, the dispatcher's `jobs_per_worker`): each job trains in its own
  thread around a *replica* of the backbone: a second module tree over the same tensors (no copy), so jobs
  running at once never share the per-forward routing state pelt_core keeps on a backbone's modules
  (`workers.backbone_store.replicate`).

Either way a job's initialisation (seeded under a lock) and its dropout masks (its own generator) come from
its seed, whatever else runs in the process.

Devices: a CPU worker's backbones are views of the node's shared copy. A GPU worker (`WorkerConfig.device`
"cuda"; the dispatcher starts one per GPU, Ray sets which GPU it sees) copies each backbone it warms once onto
its GPU and trains its jobs as a pack there; a job that runs out of GPU memory even alone fails as retryable
(`pelt_core.devices.DeviceOutOfMemory`), its pack-mates go on.

Threads: torch's intra-op thread count is per process, and each training thread runs its ops with that
many threads (OpenMP gives every calling thread its own team), so a worker sets it to `WorkerConfig.threads`
(one slot's CPUs, or the whole pack's) and the dispatcher reserves that many CPUs per slot (per pack).

For each job it:

0. checks the job's memory estimate against its own budget (`workers.memory_budget`: the API host may have
   more memory than this worker's machine) and fails it, permanently, when it would not fit: before
   reading anything with the registry's backbone facts, else once the backbone is mapped;
1. renews the lease from a heartbeat thread every `heartbeat_seconds` (also while the backbone loads
   or the delta uploads), sending the trainer's last progress {step, total, loss, tokens_per_second};
2. takes the backbone from its warm cache, or maps the node's shared copy (`NodeBackbones`; the first
   worker to ask for a backbone loads it for the node's host): the weights are read-only views of the
   node's object store, never written;
3. trains with `pelt_core.train`, whose stop flag is raised by a cancel request (seen at heartbeat, or
   pushed by the dispatcher through `stop`), by a shutdown (`stop(..., "release")`) or by a lost lease;
4. writes the delta through the `DeltaSink`, then records the result through the lease.

Every attempt ends through the lease (complete, fail, cancelled, release) before `run` returns, so a
job's outcome is recorded even if the dispatcher is gone; a lost lease ends it without recording
anything (another worker owns the job).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pelt_core.backbones import Backbone, BackboneError, resolve_backbone
from pelt_core.config import ConfigError, TrainConfig
from pelt_core.data import DataError, TaskFields, hold_out_dev_split, load_split
from pelt_core.delta import load_delta, save_delta
from pelt_core.delta_format import DeltaError
from pelt_core.devices import DeviceOutOfMemory
from pelt_core.limits import MemoryBudgetError
from pelt_core.methods import get_method
from pelt_core.spec import SpecError
from pelt_core.train import TrainingCancelled, TrainingError, train
from workers.attempt import Attempt, Heartbeat, finite
from workers.job import DeltaSink, JobLease, JobOutcome, JobSpec, LeaseLost
from workers.memory_budget import JobMemoryCheck, process_memory, worker_memory_budget
from workers.pack_runner import PackRunner

log = logging.getLogger("pelt.workers")

# Errors that will happen again on any worker: the job fails at once, without a retry.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    TrainingError,
    DataError,
    ConfigError,
    SpecError,
    BackboneError,
    DeltaError,
    MemoryBudgetError,  # the job's memory estimate is above this worker's budget (workers.memory_budget)
)
BackboneSource = Callable[[str, str], tuple[Backbone, int]]
# Jobs in one process load their data one at a time: two threads inside `datasets.Dataset.from_json` at once
# can break its tqdm progress bars' class-level lock ("type object 'tqdm' has no attribute '_lock'").
_DATA_LOCK = threading.Lock()


class WorkerBusyError(RuntimeError):
    """Every job slot of the worker is taken (or the job already runs there)."""


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker runs its jobs."""

    threads: int | None = (
        1  # torch intra-op threads of every job (one slot's CPUs); None leaves torch's default
    )
    slots: int = 1  # jobs run at once, each in its own thread, sharing this process and its backbones
    pack_size: int = 1  # > 1: the worker has this many places, and jobs on one backbone train as a pack
    heartbeat_seconds: float = 15.0  # how often the lease is renewed (and progress reported, at the least)
    # once the trainer has taken a step, a heartbeat goes out this often (its steps, its losses; and a
    # cancel request is seen this soon, in training and in evaluation); at most heartbeat_seconds
    progress_seconds: float = 2.0
    lease_seconds: float = 60.0  # after this long without a heartbeat getting through, assume the lease lost
    max_backbones: int = 2  # warm backbones kept per worker (least recently used dropped first)
    namespace: str | None = None  # Ray namespace of the node's backbone host
    work_dir: str | None = None  # scratch folder for delta files before the sink stores them
    # where its jobs train: "cpu" (weights are views of the node's shared copy), or "cuda"/"cuda:N"/"auto"
    # (each warm backbone copied once onto this process's GPU: one worker per GPU holds one copy)
    device: str = "cpu"
    # a job's memory here, in bytes (its estimate above it fails the job before it starts); None:
    # PELT_WORKER_MEMORY_BYTES in the worker's environment, else its machine's memory (workers.memory_budget)
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("heartbeat_seconds", "progress_seconds", "lease_seconds"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    @property
    def places(self) -> int:
        """Jobs the worker runs at once: its pack places, or its job slots when it does not pack."""
        return self.pack_size if self.pack_size > 1 else self.slots


class _Warm:
    """A warm backbone of this process: the shared copy as mapped, and the replicas its slots are not
    using right now (the mapped copy itself is the first one lent out)."""

    def __init__(self, backbone: Backbone, shared_bytes: int) -> None:
        self.backbone = backbone
        self.shared_bytes = shared_bytes
        self.free: list[Backbone] = [backbone]
        self.runner: PackRunner | None = None  # packing workers: the pack runner of this backbone


class PeltWorker:
    """Runs up to `config.slots` jobs at once on warm, shared backbones (see the module docstring)."""

    def __init__(
        self, worker_id: str, config: WorkerConfig | None = None, backbones: BackboneSource | None = None
    ) -> None:
        self.worker_id = worker_id
        self.config = config or WorkerConfig()
        if self.config.slots < 1 or self.config.pack_size < 1:
            raise ValueError(
                f"a worker needs at least one job slot and a pack size of at least 1, got "
                f"slots={self.config.slots}, pack_size={self.config.pack_size}"
            )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if self.config.threads:
            import torch

            torch.set_num_threads(self.config.threads)
        if self.config.places > 1:
            _import_eagerly()
        from pelt_core.devices import resolve_device

        self.device = resolve_device(self.config.device)  # a GPU worker on a node without one fails here
        self.memory_check = JobMemoryCheck(self.config.memory_bytes or worker_memory_budget(), worker_id)
        if backbones is None:
            from workers.backbone_store import NodeBackbones

            backbones = NodeBackbones(self.config.namespace, load_here=True)
            backbones.prestart()
        self._source = backbones
        self._backbones: OrderedDict[tuple[str, str], _Warm] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[tuple[str, str], threading.Lock] = {}  # one mapping at a time per backbone
        self._attempts: dict[int, Attempt] = {}  # running jobs by id, in the order they started
        self._finished: list[JobOutcome] = []
        self._started = time.time()
        self._loaded_for_host = False  # a backbone loaded here for the node's host since the last release

    # --- what the dispatcher calls ----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Who and where this worker is, what it runs and which backbones it keeps warm.

        jobs: every running job ({job_id, owner, progress}); job_id/progress: the first of them (None
        when idle); outcomes: how the last finished jobs ended, by job id."""
        with self._lock:
            attempts = list(self._attempts.values())
            first = attempts[0] if attempts else None
            return {
                "worker_id": self.worker_id,
                "node_id": _node_id(),
                "pid": os.getpid(),
                "slots": self.config.places,
                "pack_size": self.config.pack_size,
                "device": self.device.type,
                "packs": [w.runner.describe() for w in self._backbones.values() if w.runner is not None],
                "jobs": [
                    {"job_id": a.job_id, "owner": a.owner, "backbone": a.backbone, "progress": a.progress}
                    for a in attempts
                ],
                "job_id": None if first is None else first.job_id,
                "progress": None if first is None else first.progress,
                "backbones": [list(key) for key in self._backbones],
                "jobs_done": len(self._finished),
                "last_outcome": None if not self._finished else self._finished[-1].status,
                "outcomes": {o.job_id: o.status for o in self._finished},
                "threads": self.config.threads,
                "memory_bytes": self.memory_check.budget,  # a job's memory budget here
                "uptime_seconds": round(time.time() - self._started, 1),
            }

    def warm(self, backbone: str, dtype: str = "float32") -> dict[str, Any]:
        """Map a backbone now so the next job on it starts at once."""
        warm = self._warm(backbone, dtype)
        return {
            "name": warm.backbone.name,
            "dtype": dtype,
            "shared_bytes": warm.shared_bytes,
            "parameters": warm.backbone.num_parameters,
        }

    def stop(self, job_id: int, reason: str = "cancel") -> bool:
        """Stop one job if it runs here: "cancel" (it ends cancelled) or "release" (it goes back to the
        queue, not counted as an attempt). The worker's other jobs go on. True if it was running here."""
        if reason not in ("cancel", "release"):
            raise ValueError(f"reason must be cancel or release, got {reason!r}")
        with self._lock:
            attempt = self._attempts.get(job_id)
        if attempt is None:
            return False
        attempt.stop(reason, "cancellation requested" if reason == "cancel" else "released by the dispatcher")
        return True

    def load_backbone(
        self, name: str, dtype: str = "float32", attn_implementation: str = "sdpa"
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load a backbone for this node's host (metadata, arrays): the host calls it (in the actor's
        `LOAD_GROUP` thread) when this worker asks for a backbone the node has not published yet, and
        owns the arrays it returns (workers/backbone_host.py)."""
        from workers.backbone_store import load_shareable

        self._loaded_for_host = True
        return load_shareable(name, dtype, attn_implementation)

    def release_free_memory(self) -> bool:
        """Give what this process freed back to the system, once after each `load_backbone` (a no-op
        otherwise). True if anything was released."""
        from workers.backbone_store import release_free_memory

        if not self._loaded_for_host:
            return False
        self._loaded_for_host = False
        return release_free_memory()

    def memory(self) -> dict[str, int]:
        """This process's memory (bytes): rss, pss, uss (private_clean + private_dirty) and anonymous."""
        return process_memory()

    def ping(self) -> int:
        return os.getpid()

    def run(self, job: JobSpec, lease: JobLease, sink: DeltaSink) -> JobOutcome:
        """Train one job under its lease in a free slot and record how it ended (see the module
        docstring). Raises WorkerBusyError when every slot is taken or the job already runs here."""
        owner = getattr(lease, "worker_id", None) or self.worker_id
        attempt = Attempt(job.job_id, owner, (job.tags or {}).get("backbone"))
        with self._lock:
            if job.job_id in self._attempts:
                raise WorkerBusyError(f"worker {self.worker_id} is already running job {job.job_id}")
            if len(self._attempts) >= self.config.places:
                raise WorkerBusyError(
                    f"worker {self.worker_id} has {self.config.places} place(s), all taken by "
                    f"job(s) {', '.join(str(j) for j in self._attempts)}"
                )
            self._attempts[job.job_id] = attempt
        beat = Heartbeat(
            lease,
            attempt,
            self.config.heartbeat_seconds,
            self.config.lease_seconds,
            self.config.progress_seconds,
        )
        beat.start()
        try:
            outcome = self._attempt_job(job, lease, sink, attempt, beat)
        finally:
            beat.finish()
            with self._lock:
                self._attempts.pop(job.job_id, None)
        outcome = replace(outcome, seconds=round(time.monotonic() - attempt.started, 3))
        with self._lock:
            self._finished.append(outcome)
            del self._finished[:-100]
        log.info(
            "job %s on %s: %s%s",
            job.job_id,
            attempt.owner,
            outcome.status,
            f" ({outcome.error.strip().splitlines()[-1]})" if outcome.error else "",
        )  # a traceback's message
        return outcome

    # --- one attempt ------------------------------------------------------------------------------

    def _attempt_job(
        self, job: JobSpec, lease: JobLease, sink: DeltaSink, attempt: Attempt, beat: Heartbeat
    ) -> JobOutcome:
        def ended(status: str, **fields: Any) -> JobOutcome:
            return JobOutcome(job_id=job.job_id, worker_id=attempt.owner, status=status, **fields)

        try:
            result, backbone, stored = self._train_and_store(job, sink, attempt)
            beat.finish()  # no heartbeat may race the final call
            if attempt.reason == "lease_lost":
                return ended("lease_lost", error=attempt.detail)
            self._final_progress(lease, attempt, result)
            try:
                lease.complete(
                    {
                        **result_fields(result, backbone),
                        "delta_uri": stored.uri,
                        "delta_sha256": stored.sha256,
                        "mlflow_run_id": stored.run_id,
                        "mlflow_model_version": stored.model_version,
                    }
                )
            except ValueError as exc:  # the registry refused the result (e.g. no primary metric): permanent
                error = f"the registry refused the result: {exc}"
                lease.fail(error, retryable=False)
                return ended("failed", error=error)
            return ended("succeeded", delta_uri=stored.uri, delta_sha256=stored.sha256)
        except TrainingCancelled:
            beat.finish()
            if attempt.reason == "lease_lost":
                return ended("lease_lost", error=attempt.detail)
            try:
                if attempt.reason == "release":
                    lease.release(f"released by worker {self.worker_id} before it finished")
                    return ended("released")
                lease.cancelled()
                return ended("cancelled")
            except LeaseLost as exc:
                return ended("lease_lost", error=str(exc))
        except LeaseLost as exc:
            return ended("lease_lost", error=str(exc))
        except Exception as exc:
            beat.finish()
            permanent = isinstance(exc, PERMANENT_ERRORS)
            explained = permanent or isinstance(exc, DeviceOutOfMemory)  # its message says it all
            error = f"{type(exc).__name__}: {exc}" if explained else traceback.format_exc()
            if not explained:  # the registry keeps the message for the job, the traceback for admins
                log.error("job %s on %s failed", job.job_id, attempt.owner, exc_info=exc)
            if attempt.reason == "lease_lost":
                return ended("lease_lost", error=error)
            try:
                lease.fail(error, retryable=not permanent)
            except LeaseLost as lost:
                return ended("lease_lost", error=str(lost))
            return ended("failed", error=error, retryable=not permanent)

    def _final_progress(self, lease: JobLease, attempt: Attempt, result: Any) -> None:
        """Report the last step and loss and the rest of the loss curve before the result (a job shorter
        than a heartbeat has no other report); best effort: the result is recorded either way."""
        report = attempt.final_report(int(result.steps), bool(result.stopped_early))
        if report is None:
            return
        try:
            try:
                lease.heartbeat(report)
            except ValueError as exc:  # its loss points refused: the last step and loss still count
                if not report.get("losses"):
                    raise
                log.error("job %s: the registry refused its loss points (%s)", attempt.job_id, exc)
                lease.heartbeat({k: v for k, v in report.items() if k != "losses"})
        except Exception as exc:  # LeaseLost too: completing may still be allowed, and it tells
            log.warning("job %s: its final progress was not recorded: %s", attempt.job_id, exc)

    def _train_and_store(self, job: JobSpec, sink: DeltaSink, attempt: Attempt) -> tuple[Any, Backbone, Any]:
        """Train the job on a replica of its backbone lent to this slot, then store its delta."""

        def should_stop() -> bool:
            return attempt.stopping.is_set()

        if should_stop():
            raise TrainingCancelled("stopped before it started")
        config = TrainConfig.from_dict(job.train_config)
        spec = get_method(job.method_spec)
        if job.backbone_facts:  # the registry's: checked before its data or backbone take any memory
            self.memory_check.check(job, config, job.backbone_facts)
        task = job.task
        fields = TaskFields(
            tuple(task.text_fields), task.label_field, task.problem_type, list(task.label_names or [])
        )
        with _DATA_LOCK:  # `datasets` is not thread-safe while it loads (its progress bars' shared lock)
            train_data = load_split(task.train_path, max_decoded_bytes=task.max_data_bytes)
            if task.validation_path:
                eval_data = load_split(task.validation_path, max_decoded_bytes=task.max_data_bytes)
            else:  # no evaluation split: a dev split held out from the training rows by the job's seed
                train_data, eval_data = hold_out_dev_split(train_data, config.seed)
        with self._lend(job.backbone, job.backbone_dtype or config.backbone_dtype) as (backbone, trainer):
            expected = (job.backbone_hash or "").removeprefix("sha256:")
            if expected and expected != backbone.content_hash:
                raise BackboneError(
                    f"backbone {job.backbone!r} has content hash {backbone.content_hash[:16]}…, "
                    f"but the registry recorded {expected[:16]}…; register the changed model "
                    "under a new name"
                )
            if not job.backbone_facts:
                self.memory_check.check(job, config, backbone.facts)
            if should_stop():
                raise TrainingCancelled("stopped before training")
            with tempfile.TemporaryDirectory(
                prefix=f"pelt-job-{job.job_id}-sources-", dir=self.config.work_dir
            ) as tmp:
                sources = fusion_sources(spec, sink, backbone, Path(tmp)) if spec.fusion is not None else None
                result = trainer(
                    spec,
                    train_data,
                    eval_data,
                    config,
                    task=fields,
                    progress=attempt.report,
                    should_stop=should_stop,
                    metric=task.metric,
                    sources=sources,
                )
            stored = self._store(job, sink, result, backbone)
        return result, backbone, stored

    def _store(self, job: JobSpec, sink: DeltaSink, result: Any, backbone: Backbone) -> Any:
        extra = {
            "job_id": job.job_id,
            "attempt": job.attempt,
            "task": job.task.name,
            "method": job.method,
            "metrics": _finite_dict(result.metrics),
            "train": job.train_config,
        }
        with tempfile.TemporaryDirectory(prefix=f"pelt-job-{job.job_id}-", dir=self.config.work_dir) as tmp:
            saved = save_delta(result.delta, backbone, Path(tmp) / "delta", extra=extra)
            record = {**result_fields(result, backbone), "delta_sha256": saved.sha256}
            return sink.store(job, saved.path, record, result.history)

    # --- backbones ----------------------------------------------------------------------------------

    def _warm(self, name: str, dtype: str) -> _Warm:
        """A warm backbone, or the node's shared copy mapped now (least recently used one dropped).
        Slots asking for the same backbone at once wait for one mapping."""
        key = (resolve_backbone(name)[0], dtype)
        with self._lock:
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            with self._lock:
                if key in self._backbones:
                    self._backbones.move_to_end(key)
                    return self._backbones[key]
            warm = _Warm(*self._source(name, dtype))
            if warm.backbone.device != self.device:  # a GPU worker: its own copy, once, on its GPU
                warm.backbone.to(self.device)
            if self.config.places > 1:  # its jobs may tokenize at the same moment
                from workers.backbone_store import SerializedTokenizer

                warm.backbone.tokenizer = SerializedTokenizer(warm.backbone.tokenizer)
            with self._lock:
                self._backbones[key] = warm
                idle = [k for k, w in self._backbones.items() if w.runner is None or not w.runner.active]
                while len(self._backbones) > max(self.config.max_backbones, 1) and idle:
                    self._backbones.pop(idle.pop(0))  # least recently used first; a running pack stays
        return warm

    @contextlib.contextmanager
    def _lend(self, name: str, dtype: str) -> Iterator[tuple[Backbone, Callable[..., Any]]]:
        """A backbone for one job and the trainer to call (`pelt_core.train.train` without its first argument).

        Packing: every job on a warm backbone joins its `PackRunner` (one module tree, one stepping thread).
        Otherwise a replica: its own module tree over the shared tensors, so jobs training at once in slots
        never share pelt_core's per-forward state. The mapped copy is the first replica; more are built when
        slots train on the same backbone at once, and kept for the next jobs."""
        warm = self._warm(name, dtype)
        if self.config.pack_size > 1:
            with self._lock:
                if warm.runner is None:
                    warm.runner = PackRunner(warm.backbone, name=f"pack-{warm.backbone.name}-{dtype}")
            yield warm.backbone, warm.runner.train
            return
        with self._lock:
            backbone = warm.free.pop() if warm.free else None
        if backbone is None:
            from workers.backbone_store import replicate

            backbone = replicate(warm.backbone)
        try:
            yield backbone, functools.partial(train, backbone)
        finally:
            with self._lock:
                warm.free.append(backbone)  # dropped with `warm` if it left the cache meanwhile


def fusion_sources(spec: Any, sink: DeltaSink, backbone: Backbone, folder: Path) -> dict[str, Any]:
    """An AdapterFusion job's source deltas, by the sha256 its spec records: each fetched from the sink
    and loaded onto the job's backbone, its file checked against that sha256 (a DeltaError otherwise)."""
    fetch = getattr(sink, "fetch", None)
    if fetch is None:
        raise DeltaError(f"this worker's delta sink ({type(sink).__name__}) cannot hand back stored deltas")
    loaded = {}
    for index, source in enumerate(spec.fusion.sources):
        path = fetch(source.task, source.version, source.sha256, folder / f"source-{index}")
        loaded[source.sha256] = load_delta(path, backbone, expected_sha256=source.sha256)
    return loaded


def _import_eagerly() -> None:
    """Import what jobs use before they run in threads: transformers resolves its names lazily on first
    access, and two threads doing that at once can see a half-initialised module ("module 'transformers'
    has no attribute 'PreTrainedTokenizerBase'"), measured with two slots in a fresh worker."""
    import datasets  # noqa: F401
    import transformers
    from transformers import AutoConfig, AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase  # noqa: F401

    import pelt_core.data
    import pelt_core.delta
    import pelt_core.metrics
    import pelt_core.model
    import pelt_core.train  # noqa: F401

    transformers.modeling_utils  # noqa: B018 - touching it finishes its lazy import


def result_fields(result: Any, backbone: Backbone) -> dict[str, Any]:
    """A TrainResult as the registry's result fields (metrics, sizes, time, memory)."""
    return {
        "metrics": _finite_dict(result.metrics),
        "dev_metrics": _finite_dict(result.dev_metrics) if result.dev_metrics else None,
        "trainable_params": int(result.parameter_counts["trained"]),  # a fusion's frozen sources left out
        "total_params": int(backbone.num_parameters),
        "trainable_percent": float(result.trainable_percent),
        "train_seconds": float(result.train_seconds),
        "peak_memory_bytes": int(result.peak_memory_bytes),
        "job_memory_bytes": int(result.job_memory_bytes),
        "device": result.device,
    }


def _finite_dict(values: dict[str, Any]) -> dict[str, Any]:
    """Metrics with NaN/inf as None (JSON columns refuse them)."""
    return {k: (finite(v) if isinstance(v, float) else v) for k, v in values.items()}


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # not inside Ray
        return None


@functools.lru_cache(maxsize=1)
def worker_actor_class() -> Any:
    """PeltWorker as a Ray actor class (the dispatcher sets name, node, CPUs and concurrency), with a
    thread of its own for the loads its node's backbone host asks of it."""
    import ray

    from workers.backbone_host import LOAD_GROUP

    return ray.remote(concurrency_groups={LOAD_GROUP: 1})(PeltWorker)


__all__ = [
    "PERMANENT_ERRORS",
    "PeltWorker",
    "WorkerBusyError",
    "WorkerConfig",
    "result_fields",
    "worker_actor_class",
]
