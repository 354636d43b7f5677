"""What a worker receives and what it hands back: plain data plus two small protocols.

Workers never import the service layer. The dispatcher (in services/) gives each job:
- a `JobSpec`: everything needed to train it (task data location and fields, resolved method spec and
  training config, backbone to load);
- a `JobLease`: heartbeat + progress + cancel flag, and the calls that end the attempt (complete, fail,
  cancelled, release), backed by the registry;
- a `DeltaSink`: where the trained delta goes (MLflow in the service; a local folder by default), and
  where an AdapterFusion job's source deltas come from (`DeltaSource.fetch`).

The worker ends every attempt itself through its lease, so a job's outcome is recorded even when the
dispatcher that handed it out is gone; what it returns (`JobOutcome`) only tells the dispatcher that
the slot is free again.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pelt_core.delta_format import DELTA_FILE, DeltaError, sha256_file
from pelt_core.limits import MAX_DATASET_BYTES


@dataclass(frozen=True)
class TaskSpec:
    """A task's data and label space, as the registry recorded them."""

    name: str
    train_path: str
    validation_path: str | None
    text_fields: tuple[str, ...]
    label_field: str
    problem_type: str
    label_names: tuple[str, ...] | None
    metric: str
    metric_direction: str = "max"
    max_length: int = 128
    max_data_bytes: int = MAX_DATASET_BYTES  # a split decoding past this is refused (PELT_MAX_DATASET_BYTES)


@dataclass(frozen=True)
class JobSpec:
    """One training job, fully resolved (the worker looks nothing up)."""

    job_id: int
    task: TaskSpec
    method: str
    method_spec: dict[str, Any]
    train_config: dict[str, Any]
    backbone: str  # what pelt_core's Backbone.load accepts: a packaged alias or a local model path
    backbone_dtype: str = "float32"
    backbone_hash: str | None = None  # the registered content hash; a different backbone fails the job
    # the registry's facts of the backbone (pelt_core.backbones.backbone_facts): the worker checks the job's
    # memory estimate with them before it reads anything; None: with the backbone's own, once it is mapped
    backbone_facts: dict[str, Any] | None = None
    attempt: int = 1
    sweep_id: int | None = None
    tags: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StoredDelta:
    """Where a sink put a job's delta."""

    uri: str
    sha256: str
    run_id: str | None = None
    model_version: str | None = None


@dataclass(frozen=True)
class JobOutcome:
    """How an attempt ended, as the worker recorded it through the lease.

    status: "succeeded", "failed" (error given; `retryable` says whether the registry may retry it),
    "cancelled", "released" (given back unstarted or at shutdown; not counted as an attempt) or
    "lease_lost" (the job belongs to someone else now; nothing was recorded).
    """

    job_id: int
    worker_id: str
    status: str
    error: str | None = None
    retryable: bool = False
    delta_uri: str | None = None
    delta_sha256: str | None = None
    seconds: float = 0.0


class LeaseLost(RuntimeError):
    """The lease is gone (expired and taken back, or the job ended elsewhere): stop and record nothing."""


TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")  # the registry's rule for task names
LOSS_POINTS = 256  # a job's loss curve: at most this many [step, loss] points (the registry keeps as many)


class JobLease(Protocol):
    """The worker's side of a job's lease in the registry. Every call raises LeaseLost when the lease
    is gone; other exceptions are transient (the worker retries heartbeats until the lease would lapse)."""

    job_id: int
    worker_id: str

    def heartbeat(self, progress: dict[str, Any] | None = None) -> bool:
        """Renew the lease and report progress ({step, total, loss, tokens_per_second, epoch,
        learning_rate}, and `losses`: the loss curve's [step, mean loss] points since the last report);
        True when cancellation was requested."""

    def complete(self, result: dict[str, Any]) -> None:
        """Record the result (metrics, parameter counts, train_seconds, delta_uri, delta_sha256, ...)."""

    def fail(self, error: str, retryable: bool) -> None:
        """End the attempt with an error: retried after a backoff while attempts remain (if retryable)."""

    def cancelled(self) -> None:
        """The worker saw the cancel request and stopped: the job ends cancelled (never retried)."""

    def release(self, reason: str) -> None:
        """Give the job back to the queue without counting the attempt (shutdown, never started)."""


class DeltaSink(Protocol):
    """Stores a trained delta folder and returns where it went; storing the same job twice is idempotent."""

    def store(
        self, job: JobSpec, delta_dir: Path, result: dict[str, Any], history: list[dict[str, Any]]
    ) -> StoredDelta: ...


class DeltaSource(Protocol):
    """A sink that can also hand back a stored delta: what an AdapterFusion job's sources come from."""

    def fetch(self, task: str, version: int | None, sha256: str, dest: Path) -> Path:
        """Download the delta stored as `task`'s `version` (the one whose file has `sha256` when `version` is
        None) into `dest` and return its folder; an error naming it when none matches `sha256`."""


class LocalDeltaSink:
    """Keeps deltas in `<root>/<task>/job-<id>/` (the default when no MLflow store is configured)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def store(
        self, job: JobSpec, delta_dir: Path, result: dict[str, Any], history: list[dict[str, Any]]
    ) -> StoredDelta:
        target = self.root / job.task.name / f"job-{job.job_id}"
        if target.exists():
            shutil.rmtree(target)  # a retried job replaces its own folder, never adds a second one
        shutil.copytree(delta_dir, target)
        (target / "history.json").write_text(json.dumps(history, indent=2))
        return StoredDelta(uri=target.resolve().as_uri(), sha256=sha256_file(target / DELTA_FILE))

    def fetch(self, task: str, version: int | None, sha256: str, dest: Path) -> Path:
        """The delta of `task` whose file has `sha256` (this sink keeps no version numbers), copied to `dest`."""
        tasks = self.root.resolve()
        if not TASK_NAME.fullmatch(task) or (tasks / task).resolve().parent != tasks:
            raise DeltaError(f"{task!r} is not a task name")
        for folder in sorted((self.root / task).glob("job-*")):
            if (folder / DELTA_FILE).is_file() and sha256_file(folder / DELTA_FILE) == sha256:
                shutil.copytree(folder, dest)
                return dest
        raise DeltaError(f"no stored delta of task {task!r} has sha256 {sha256[:12]}… under {self.root}")
