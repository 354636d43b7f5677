"""What a worker is told about a job: the registry's records resolved into a `workers.job.JobSpec`
(the worker looks nothing up)."""

from __future__ import annotations

from typing import Any

from pelt_core.limits import MAX_DATASET_BYTES
from services.registry import Registry
from services.registry.records import JobRecord, TaskRecord
from services.registry.task_data import EVALUATION_SPLITS  # none of them: each job holds out a dev split
from workers.job import JobSpec, TaskSpec


class JobSpecs:
    """Builds the JobSpec of a claimed job; tasks and backbones are read from the registry once each."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._tasks: dict[str, TaskSpec] = {}
        # registry name -> (source, content hash, facts)
        self._backbones: dict[str, tuple[str, str, dict[str, Any] | None]] = {}

    def build(self, job: JobRecord) -> JobSpec:
        """Everything the worker needs to train the job, resolved from the registry."""
        if job.task not in self._tasks:
            self._tasks[job.task] = task_spec(
                self.registry.get_task(job.task), max_data_bytes=self.registry.dataset_limits.max_bytes
            )
        if job.backbone not in self._backbones:
            record = self.registry.get_backbone(job.backbone)
            self._backbones[job.backbone] = (record.source, record.content_hash, record.facts)
        source, content_hash, facts = self._backbones[job.backbone]
        return JobSpec(
            job_id=job.id,
            task=self._tasks[job.task],
            method=job.method,
            method_spec=job.method_spec,
            train_config=job.train_config,
            backbone=source,
            backbone_dtype=job.train_config.get("backbone_dtype", "float32"),
            backbone_hash=content_hash,
            backbone_facts=facts,
            attempt=job.attempts,
            sweep_id=job.sweep_id,
            tags={"backbone": job.backbone, "seed": str(job.seed), "k_shot": str(job.k_shot)},
        )


def task_spec(task: TaskRecord, max_data_bytes: int = MAX_DATASET_BYTES) -> TaskSpec:
    """A registered task as the worker sees it: where its training and evaluation data are, and the
    bytes a split may decode to (PELT_MAX_DATASET_BYTES, which the registry checked it against)."""
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
        max_data_bytes=max_data_bytes,
    )
