"""A study through the service: its plan, one idempotent sweep per task, the wait, and the runs read back.

Submitting is safe to repeat: each task's sweep carries a key made from the plan, so running the same
study again (after an interruption, or to refresh its report) finds the sweeps it made and trains
nothing twice; a changed plan is a new study."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.api.schemas import JobOut, SweepOut
from services.client import PeltAPIError, PeltClient

TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class StudyPlan:
    """Tasks × K values × seeds × methods on one backbone, every job under the protocol: `dev_rows`
    training rows held out by seed for model selection, early stopping after `patience` evaluations
    without improvement, the task's validation split as the test set; `training` holds the other
    hyperparameters, the same for every task (a method's own learning rate comes from its preset unless
    `training` sets one); `epochs_by_k` may give each K its own number of epochs."""

    tasks: tuple[str, ...]
    k_values: tuple[int, ...]
    seeds: tuple[int, ...]
    methods: tuple[str, ...]
    backbone: str
    dev_rows: int = 1000
    patience: int | None = 10
    training: Mapping[str, Any] = field(default_factory=dict)
    epochs_by_k: Mapping[int, float] = field(default_factory=dict)

    def hyperparameters(self, k: int | None = None) -> dict[str, Any]:
        """What the study's jobs with this K are submitted with."""
        protocol = {"dev_rows": self.dev_rows} | ({"patience": self.patience} if self.patience else {})
        epochs = {"epochs": self.epochs_by_k[k]} if k in self.epochs_by_k else {}
        return {**self.training, **epochs, **protocol}

    def key(self, task: str, k: int) -> str:
        """The idempotency key of the sweep of one task and K: the same plan, the same sweep."""
        plan = {**self.to_dict(), "tasks": None, "k_values": None, "task": task, "k": k}
        digest = hashlib.sha256(json.dumps(plan, sort_keys=True, default=str).encode()).hexdigest()
        return f"study-{task}-{k}-{digest[:24]}"

    @property
    def job_count(self) -> int:
        return len(self.tasks) * len(self.k_values) * len(self.seeds) * len(self.methods)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "training": dict(self.training),
            "epochs_by_k": {str(k): e for k, e in self.epochs_by_k.items()},
            "hyperparameters": {str(k): self.hyperparameters(k) for k in self.k_values},
        }


@dataclass(frozen=True)
class StudyRun:
    """One succeeded job of a study: its place in the grid and its test and dev metric (in [0, 1] for
    accuracy and F1), where the kept checkpoint was, and its cost."""

    task: str
    method: str
    k: int
    seed: int
    job_id: int
    test: float
    dev: float | None
    best_epoch: float | None
    best_step: int | None
    train_seconds: float
    trainable_percent: float


def register_task_folder(client: PeltClient, name: str, folder: str | Path) -> bool:
    """Register a GLUE-style task folder (train.jsonl, validation.jsonl and, if present, task.json with
    text_fields, label_names, problem_type and metric) as task `name`, unless a task of that name exists.
    Returns whether it registered it."""
    try:
        client.task(name)
        return False
    except PeltAPIError as exc:
        if exc.status != 404:
            raise
    folder = Path(folder)
    described = folder / "task.json"
    info = json.loads(described.read_text()) if described.is_file() else {}
    train, validation = folder / "train.jsonl", folder / "validation.jsonl"
    if not train.is_file():
        raise FileNotFoundError(
            f"{folder}: no train.jsonl (a study task folder holds train.jsonl and validation.jsonl)"
        )
    client.register_task(
        name,
        train,
        validation if validation.is_file() else None,
        text_fields=info.get("text_fields") or ["sentence"],
        label_field=info.get("label_field", "label"),
        problem_type=info.get("problem_type", "single_label_classification"),
        metric=info.get("metric"),
        label_names=info.get("label_names"),
        description=f"registered by pelt study from {folder.name}/",
    )
    return True


def submit_study(client: PeltClient, plan: StudyPlan) -> dict[str, SweepOut]:
    """One sweep per task and K (methods × seeds), each under its plan key: a repeat returns the sweeps
    already made. Returns {"task K=k": sweep}."""
    return {
        f"{task} K={k}": client.sweep(
            task,
            list(plan.methods),
            backbone=plan.backbone,
            seeds=list(plan.seeds),
            k_values=[k],
            hyperparameters=plan.hyperparameters(k),
            idempotency_key=plan.key(task, k),
        )
        for task in plan.tasks
        for k in plan.k_values
    }


def study_jobs(client: PeltClient, sweeps: Mapping[str, SweepOut]) -> list[JobOut]:
    """Every job of the study's sweeps as it is now."""
    return [job for sweep in sweeps.values() for job in client.jobs(sweep_id=sweep.id, limit=10_000)]


def wait_for(
    client: PeltClient,
    sweeps: Mapping[str, SweepOut],
    *,
    echo: Callable[[str], None],
    poll_seconds: float = 10.0,
    timeout: float | None = None,
) -> list[JobOut]:
    """Poll until every job of the study has ended, printing a line whenever the counts change; returns
    the jobs. TimeoutError after `timeout` seconds (the jobs go on; run the study again to resume)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    said = ""
    while True:
        jobs = study_jobs(client, sweeps)
        counts = {
            status: sum(job.status == status for job in jobs) for status in ("queued", "running", *TERMINAL)
        }
        line = (
            f"study: {sum(counts[s] for s in TERMINAL)}/{len(jobs)} ended ({counts['succeeded']} succeeded, "
            f"{counts['failed']} failed, {counts['cancelled']} cancelled), {counts['running']} running, "
            f"{counts['queued']} queued"
        )
        if line != said:
            echo(line)
            said = line
        if all(job.status in TERMINAL for job in jobs):
            return jobs
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the study's jobs had not ended after {timeout} s; run it again to resume")
        time.sleep(poll_seconds)


def collect_runs(client: PeltClient, jobs: Iterable[JobOut]) -> list[StudyRun]:
    """The succeeded jobs' results as study runs (their task's primary metric, on test and dev)."""
    runs = []
    for job in jobs:
        if job.status != "succeeded" or job.k_shot is None:
            continue
        result = client.result(job.id)
        dev = result.dev_metrics or {}
        runs.append(
            StudyRun(
                task=job.task,
                method=job.method,
                k=job.k_shot,
                seed=job.seed,
                job_id=job.id,
                test=result.primary_metric,
                dev=result.dev_primary_metric,
                best_epoch=dev.get("epoch"),
                best_step=dev.get("step"),
                train_seconds=result.train_seconds,
                trainable_percent=result.trainable_percent,
            )
        )
    return runs
