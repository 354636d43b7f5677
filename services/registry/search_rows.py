"""A method search's rows as the registry reads them (services/registry/searches.py writes them): the records
it hands out, its trials with their jobs, and the answer chosen from the last rung."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from services.registry.errors import NotFoundError
from services.registry.leaderboard import Run, run_settings, seed_statistics
from services.registry.models import Job, JobStatus, Search, SearchTrial
from services.registry.search_plan import Schedule
from services.registry.validation import check_int


class UnknownSearchError(NotFoundError):
    kind = "search"

    def __init__(self, search_id: object) -> None:
        super().__init__("search_id", search_id, listing=False)


@dataclass(frozen=True)
class SearchTrialRecord:
    """One job of a search as its evidence shows it."""

    configuration: int
    method: str
    hyperparameters: dict[str, Any]
    rung: int
    epochs: float
    seed: int
    job_id: int
    status: str
    dev: float | None  # the dev split's primary metric (what rungs rank by)
    test: float | None  # the evaluation split's primary metric
    cost: float  # full-job equivalents
    finished_at: datetime | None


@dataclass(frozen=True)
class SearchRecord:
    """A search: what it was asked, its schedule, its trials, and (once it ended) what it chose."""

    id: int
    task: str
    metric: str
    metric_direction: str
    backbone: str
    status: str
    budget: float
    k_shot: int
    dev_rows: int
    methods: list[str]
    hyperparameters: dict[str, Any]
    schedule: dict[str, Any]
    space: dict[str, Any]
    configurations: int  # drawn at the start
    rung: int  # the rung running now (the last one once it ended)
    planned_cost: float  # full-job equivalents of the whole schedule
    spent: float  # full-job equivalents of the jobs that ended (succeeded or failed)
    chosen: dict[str, Any] | None
    last_error: str | None
    submitted_by: str | None
    created_at: datetime
    finished_at: datetime | None
    trials: list[SearchTrialRecord]
    best_so_far: list[dict[str, float]]  # [{"spent", "dev": best so far, "job_id": the job that ended}]


def search_record(session: Session, search: Search) -> SearchRecord:
    """The search as the registry hands it out: its rows, its trials with their jobs' scores, its spending."""
    schedule = Schedule.from_dict(search.schedule)
    drawn = {c["index"]: c for c in search.configurations}
    trials = []
    for trial, job in trials_of(session, search.id):
        epochs = schedule.rungs[trial.rung].epochs
        trials.append(
            SearchTrialRecord(
                configuration=trial.configuration,
                method=drawn[trial.configuration]["method"],
                hyperparameters=dict(drawn[trial.configuration]["hyperparameters"]),
                rung=trial.rung,
                epochs=epochs,
                seed=trial.seed,
                job_id=job.id,
                status=job.status,
                dev=dev_score(job),
                test=None if job.result is None else job.result.primary_metric,
                cost=epochs / schedule.full_epochs,
                finished_at=job.finished_at,
            )
        )
    return SearchRecord(
        id=search.id,
        task=search.task.name,
        metric=search.task.metric,
        metric_direction=search.task.metric_direction,
        backbone=search.backbone.name,
        status=search.status,
        budget=search.budget,
        k_shot=search.k_shot,
        dev_rows=search.dev_rows,
        methods=list(search.methods),
        hyperparameters=dict(search.hyperparameters),
        schedule=dict(search.schedule),
        space=dict(search.space),
        configurations=len(search.configurations),
        rung=max((t.rung for t in trials), default=0),
        planned_cost=schedule.cost,
        spent=sum(t.cost for t in trials if t.status in (JobStatus.SUCCEEDED, JobStatus.FAILED)),
        chosen=None if search.chosen is None else dict(search.chosen),
        last_error=search.last_error,
        submitted_by=search.submitted_by,
        created_at=search.created_at,
        finished_at=search.finished_at,
        trials=trials,
        best_so_far=best_so_far(trials, search.task.metric_direction),
    )


def find_search(session: Session, search_id: int, lock: bool = False) -> Search:
    check_int(search_id, "search_id", minimum=1)
    query = select(Search).where(Search.id == search_id)
    search = session.scalar(query.with_for_update() if lock else query)
    if search is None:
        raise UnknownSearchError(search_id)
    return search


def trials_of(session: Session, search_id: int) -> list[tuple[SearchTrial, Job]]:
    query = (
        select(SearchTrial, Job)
        .join(Job, SearchTrial.job_id == Job.id)
        .where(SearchTrial.search_id == search_id)
        .order_by(SearchTrial.rung, SearchTrial.configuration, SearchTrial.seed)
        .options(selectinload(Job.result))
    )
    return [(trial, job) for trial, job in session.execute(query)]


def rung_running(session: Session, search_id: int) -> bool:
    """Whether a job of the search's latest rung has not ended yet (one read, no lock)."""
    latest = (
        select(SearchTrial.rung).where(SearchTrial.search_id == search_id).order_by(SearchTrial.rung.desc())
    )
    rung = session.scalar(latest.limit(1))
    waiting = (
        select(Job.id)
        .join(SearchTrial, SearchTrial.job_id == Job.id)
        .where(
            SearchTrial.search_id == search_id,
            SearchTrial.rung == rung,
            Job.status.in_([JobStatus.QUEUED.value, JobStatus.RUNNING.value]),
        )
        .limit(1)
    )
    return session.scalar(waiting) is not None


def request_of(search: Search) -> dict[str, Any]:
    """What a search was asked (compared on an idempotent retry)."""
    asked = (search.schedule or {}).get("request", {})
    return {
        "budget": search.budget,
        "methods": list(search.methods),
        "k_shot": asked.get("k_shot"),
        "dev_rows": asked.get("dev_rows"),
        "hyperparameters": dict(search.hyperparameters),
        "seeds": Schedule.from_dict(search.schedule).rungs[-1].seeds,
        "seed": search.seed,
        "task": search.task_id,
        "backbone": search.backbone_id,
    }


def dev_score(job: Job) -> float | None:
    """A job's dev score, or None unless it succeeded with one."""
    if job.status != JobStatus.SUCCEEDED or job.result is None:
        return None
    return job.result.dev_primary_metric


def choose(search: Search, final: list[tuple[SearchTrial, Job]], direction: str) -> dict[str, Any]:
    """The last rung's answer: the configuration with the best mean dev score over its seeds (ties: the
    earlier configuration), with its test mean and 95% interval over the same seeds."""
    by_configuration: dict[int, list[Job]] = {}
    for trial, job in final:
        by_configuration.setdefault(trial.configuration, []).append(job)
    sign = -1.0 if direction == "max" else 1.0
    summaries, failed = {}, {}
    for index, jobs in by_configuration.items():
        devs = {job.seed: [dev_score(job)] for job in jobs if dev_score(job) is not None}
        failed[index] = len(jobs) - len(devs)
        if devs:
            summaries[index] = seed_statistics(devs)
    # every seed trained beats a better mean over fewer seeds (a seed that diverged is evidence too)
    best = min(summaries, key=lambda index: (failed[index], sign * summaries[index].mean, index))
    jobs = [job for job in by_configuration[best] if dev_score(job) is not None]
    test = seed_statistics({job.seed: [job.result.primary_metric] for job in jobs})
    drawn = {c["index"]: c for c in search.configurations}[best]
    first = jobs[0]
    config_id = Run(
        drawn["method"],
        first.id,
        first.seed,
        first.k_shot,
        0.0,
        0,
        0.0,
        0.0,
        backbone=search.backbone.name,
        settings=run_settings(first.train_config, first.method_spec),
    ).config_id
    return {
        "configuration": best,
        "method": drawn["method"],
        "hyperparameters": dict(drawn["hyperparameters"]),
        "epochs": Schedule.from_dict(search.schedule).full_epochs,
        "dev_mean": summaries[best].mean,
        "test_mean": test.mean,
        "test_std": test.std,
        "ci_low": test.ci_low,
        "ci_high": test.ci_high,
        "seeds": test.seeds,
        "seeds_failed": failed[best],
        "job_ids": [job.id for job in jobs],
        "config_id": config_id,
    }


def best_so_far(trials: Sequence[SearchTrialRecord], direction: str) -> list[dict[str, float]]:
    """The best dev score seen against the budget spent, as the jobs ended (any rung): one point per ended
    job once a dev score was seen, naming the job that ended there."""
    sign = 1.0 if direction == "max" else -1.0
    ended = sorted(
        (
            t
            for t in trials
            if t.finished_at is not None and t.status in (JobStatus.SUCCEEDED, JobStatus.FAILED)
        ),
        key=lambda t: (t.finished_at, t.job_id),
    )
    spent, best, points = 0.0, None, []
    for trial in ended:
        spent += trial.cost
        if trial.dev is not None and (best is None or sign * trial.dev > sign * best):
            best = trial.dev
        if best is not None:
            points.append({"spent": round(spent, 6), "dev": best, "job_id": trial.job_id})
    return points


__all__ = [
    "SearchRecord",
    "SearchTrialRecord",
    "UnknownSearchError",
    "best_so_far",
    "choose",
    "dev_score",
    "find_search",
    "request_of",
    "rung_running",
    "search_record",
    "trials_of",
]
