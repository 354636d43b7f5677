"""A study through the service: its plan, one idempotent sweep per task, the wait, and the runs read back.

Submitting is safe to repeat: a study is a grid of cells (task, K, method, seed) under one set of
hyperparameters, and only the cells that no job of the registry fills yet are queued, whichever earlier
study or sweep made the jobs that fill the others. Running the same study again (after an interruption,
or to refresh its report) trains nothing twice; adding a method or a seed trains only those jobs."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pelt_core.config import ALIASES as TRAIN_ALIASES
from services.api.schemas import JobOut
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
        """What the study's jobs with this K are submitted with, training keys under their full names
        (`lr` as `learning_rate`), as the registry stores them."""
        protocol = {"dev_rows": self.dev_rows} | ({"patience": self.patience} if self.patience else {})
        epochs = {"epochs": self.epochs_by_k[k]} if k in self.epochs_by_k else {}
        training = {TRAIN_ALIASES.get(key, key): value for key, value in self.training.items()}
        return {**training, **epochs, **protocol}

    def key(
        self, task: str, k: int, methods: Iterable[str], seeds: Iterable[int], replacing: Iterable[int] = ()
    ) -> str:
        """The idempotency key of a sweep of the study: its task, K, methods, seeds and hyperparameters,
        and the failed or cancelled jobs it replaces."""
        cells = {
            "task": task,
            "k": k,
            "methods": list(methods),
            "seeds": list(seeds),
            "backbone": self.backbone,
            "replacing": sorted(replacing),
        }
        plan = {**cells, "hyperparameters": self.hyperparameters(k)}
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
    device: str | None = None  # where it trained, as its worker said ("cpu", "cuda:0 (…)")


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
        text_fields=info.get("text_fields"),  # None: detected by the registry, as `pelt train` does
        label_field=info.get("label_field", "label"),
        problem_type=info.get("problem_type"),  # None: told by the labels (float scores: regression)
        metric=info.get("metric"),
        label_names=info.get("label_names"),
        description=f"registered by pelt study from {folder.name}/",
    )
    return True


Cell = tuple[str, int, str, int]  # (task, K, method, seed): one job of the study
_PREFERENCE = {"succeeded": 0, "running": 1, "queued": 2, "failed": 3, "cancelled": 4}


def study_cells(plan: StudyPlan) -> list[Cell]:
    """Every job the study needs, task by task, K by K."""
    return [
        (task, k, method, seed)
        for task in plan.tasks
        for k in plan.k_values
        for method in plan.methods
        for seed in plan.seeds
    ]


def existing_jobs(
    client: PeltClient, plan: StudyPlan, current: dict[str, str] | None = None
) -> dict[Cell, JobOut]:
    """The jobs already in the registry that fill a cell of the study: same task, K, method, seed,
    backbone and hyperparameters, whichever study or sweep made them (one that ran the method's current
    preset before one that ran an older version of it; then a succeeded one first, then a running, a
    queued, a failed one). `current`: the methods' fingerprints (`current_fingerprints`), if already asked."""
    current = current or current_fingerprints(client, plan)
    found: dict[Cell, JobOut] = {}
    wanted = set(study_cells(plan))

    def order(job: JobOut) -> tuple[bool, int]:
        return job.method_fingerprint != current[job.method], _PREFERENCE[job.status]

    for task in plan.tasks:
        for job in task_jobs(client, task, plan.backbone):
            cell = (task, job.k_shot, job.method, job.seed)
            if cell not in wanted or job.hyperparameters != plan.hyperparameters(job.k_shot):
                continue
            kept = found.get(cell)
            if kept is None or order(job) < order(kept):
                found[cell] = job
    return found


def current_fingerprints(client: PeltClient, plan: StudyPlan) -> dict[str, str]:
    """The fingerprint of each method's preset as the service has it now (a job records the one it ran)."""
    return {method: client.method(method).fingerprint for method in plan.methods}


def submit_study(client: PeltClient, plan: StudyPlan) -> tuple[list[int], int]:
    """Queue the cells no job fills yet (or only a failed or cancelled one, or one that ran an older version
    of its method's preset), as sweeps of one task and K (methods × their missing seeds), once every one of
    those sweeps has passed the service's check (a K beyond a task's rows fails here, before anything is
    queued), and return (every job id of the study, how many were queued now). A repeat queues nothing
    new; a plan with one more method or seed queues only those jobs."""
    current = current_fingerprints(client, plan)
    found = existing_jobs(client, plan, current)
    ended_badly = ("failed", "cancelled")
    existing = {  # a job of an older version of its preset (edited since, e.g. by an upgrade) is run again
        cell: job
        for cell, job in found.items()
        if job.status not in ended_badly and job.method_fingerprint == current[job.method]
    }
    sweeps = []  # (task, k, methods, seeds, the jobs they replace)
    for task in plan.tasks:
        for k in plan.k_values:
            missing: dict[tuple[int, ...], list[str]] = {}
            for method in plan.methods:
                seeds = tuple(s for s in plan.seeds if (task, k, method, s) not in existing)
                if seeds:
                    missing.setdefault(seeds, []).append(method)
            for seeds, methods in missing.items():
                replacing = [
                    found[(task, k, m, s)].id for m in methods for s in seeds if (task, k, m, s) in found
                ]
                sweeps.append((task, k, methods, seeds, replacing))

    def sweep_of(task: str, k: int | None, methods: list[str], seeds: tuple[int, ...]) -> dict[str, Any]:
        return {
            "task": task,
            "methods": methods,
            "backbone": plan.backbone,
            "seeds": list(seeds),
            "k_values": [k],
            "hyperparameters": plan.hyperparameters(k),
        }

    for task, k, methods, seeds, _ in sweeps:  # the whole grid is checked before anything is queued
        try:
            client.check_sweep(**sweep_of(task, k, methods, seeds))
        except PeltAPIError as exc:
            if exc.status == 405:  # a service older than the check: each sweep is checked as it is queued
                break
            if exc.status not in (404, 409, 422):
                raise
            cell = f"task {task!r}, K={k}: {exc.message}"  # which cell of the grid: the service cannot say
            raise PeltAPIError(exc.status, cell, type=exc.type, field=exc.field) from None
    queued, ids = 0, {job.id for job in existing.values()}
    for task, k, methods, seeds, replacing in sweeps:
        key = plan.key(task, k, methods, seeds, replacing)
        sweep = client.sweep(**sweep_of(task, k, methods, seeds), idempotency_key=key)
        queued += len(sweep.job_ids)
        ids.update(sweep.job_ids)
    return sorted(ids), queued


def study_jobs(client: PeltClient, plan: StudyPlan, job_ids: Iterable[int]) -> list[JobOut]:
    """The study's jobs as they are now (one request per task)."""
    wanted = set(job_ids)
    return [job for task in plan.tasks for job in task_jobs(client, task, plan.backbone) if job.id in wanted]


def task_jobs(client: PeltClient, task: str, backbone: str) -> list[JobOut]:
    """Every job of a task on a backbone (the client fetches them page by page)."""
    return client.jobs(task=task, backbone=backbone, limit=None)


def wait_for(
    client: PeltClient,
    plan: StudyPlan,
    job_ids: Iterable[int],
    *,
    echo: Callable[[str], None],
    poll_seconds: float = 10.0,
    timeout: float | None = None,
) -> list[JobOut]:
    """Poll until every job of the study has ended, printing a line whenever the counts change; returns
    the jobs. TimeoutError after `timeout` seconds (the jobs go on; run the study again to resume)."""
    ids = list(job_ids)
    deadline = None if timeout is None else time.monotonic() + timeout
    said = ""
    while True:
        jobs = study_jobs(client, plan, ids)
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
                device=result.device,
            )
        )
    return runs
