"""What a worker receives and what it hands back: plain data plus two small protocols.

Workers never import the service layer. The dispatcher (in services/) gives each job:
- a `JobSpec`: everything needed to train it (task data location and fields, resolved method spec and
  training config, backbone name);
- a `JobLease`: heartbeat + progress + cancel flag, backed by the registry;
- a `DeltaSink`: where the trained delta goes (MLflow in the service; a local folder by default).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol


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


@dataclass(frozen=True)
class JobSpec:
    """One training job, fully resolved (the worker looks nothing up)."""

    job_id: int
    task: TaskSpec
    method: str
    method_spec: dict[str, Any]
    train_config: dict[str, Any]
    backbone: str
    backbone_dtype: str = "float32"
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


class JobLease(Protocol):
    """The worker's side of a job's lease in the registry."""

    def heartbeat(self, progress: dict[str, Any] | None = None) -> bool:
        """Renew the lease and report progress; True when cancellation was requested.

        Raises when the lease was lost (another worker now owns the job): the worker must stop.
        """


class DeltaSink(Protocol):
    """Stores a trained delta folder and returns where it went; storing the same job twice is idempotent."""

    def store(self, job: JobSpec, delta_dir: Path, result: dict[str, Any],
              history: list[dict[str, Any]]) -> StoredDelta: ...


class LocalDeltaSink:
    """Keeps deltas in `<root>/<task>/job-<id>/` (the default when no MLflow store is configured)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def store(self, job: JobSpec, delta_dir: Path, result: dict[str, Any],
              history: list[dict[str, Any]]) -> StoredDelta:
        target = self.root / job.task.name / f"job-{job.job_id}"
        if target.exists():
            shutil.rmtree(target)  # a retried job replaces its own folder, never adds a second one
        shutil.copytree(delta_dir, target)
        (target / "history.json").write_text(json.dumps(history, indent=2))
        digest = hashlib.sha256((target / "delta.safetensors").read_bytes()).hexdigest()
        return StoredDelta(uri=target.resolve().as_uri(), sha256=digest)
