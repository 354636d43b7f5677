"""The Registry's reading side: jobs (filtered, counted), their events and results, and leaderboards."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Literal, TypeVar

from sqlalchemy import false, func, select
from sqlalchemy.orm import Session

from services.registry import presets
from services.registry.core import RegistryCore
from services.registry.errors import RegistryValidationError
from services.registry.leaderboard import (
    FULL_SET,
    ORDERS,
    SPLITS,
    LeaderboardRow,
    OrderBy,
    Run,
    Split,
    rank_by_k,
    rank_methods,
    run_settings,
)
from services.registry.models import Backbone, Job, JobEvent, JobStatus, Method, Result, Task
from services.registry.records import JobEventRecord, JobRecord, LossHistoryRecord, ResultRecord
from services.registry.rows import backbone_filter_ids, find_job, find_task
from services.registry.validation import check_int

MAX_KEPT_LEADERBOARDS = 256  # rankings a registry keeps (per task, K, backbone, order, split), oldest out
_Ranked = TypeVar("_Ranked")


class JobResults(RegistryCore):
    """Jobs, events, results and leaderboards: one part of `Registry`."""

    def get_job(self, job_id: int) -> JobRecord:
        """The job (UnknownJobError when there is none)."""
        with self._reading() as session:
            return self._job_records(session, [find_job(session, job_id)])[0]

    def list_jobs(
        self,
        *,
        task: str | None = None,
        status: str | Iterable[str] | None = None,
        method: str | None = None,
        backbone: str | None = None,
        sweep_id: int | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[JobRecord]:
        """Jobs matching every filter given, oldest first."""
        check_int(limit, "limit", minimum=1, maximum=100_000)
        check_int(offset, "offset", minimum=0)
        with self._reading() as session:
            query = self._job_filter(session, select(Job), task, status, method, backbone, sweep_id)
            query = query.order_by(Job.id).limit(limit).offset(offset)
            return self._job_records(session, session.scalars(query))

    def jobs_finished_since(self, since: datetime, limit: int = 1000) -> list[tuple[int, str]]:
        """(job id, task name) of the jobs that ended (succeeded, failed or cancelled) at `since` or later,
        the latest `limit` of them."""
        check_int(limit, "limit", minimum=1, maximum=100_000)
        with self._reading() as session:
            query = (
                select(Job.id, Task.name)
                .join(Task, Job.task_id == Task.id)
                .where(Job.finished_at >= since)
                .order_by(Job.finished_at.desc(), Job.id.desc())
                .limit(limit)
            )
            return [(job_id, task) for job_id, task in session.execute(query)]

    def job_counts(
        self, *, task: str | None = None, sweep_id: int | None = None, backbone: str | None = None
    ) -> dict[str, int]:
        """How many jobs are in each status (every status present, zeros included)."""
        with self._reading() as session:
            query = self._job_filter(
                session,
                select(Job.status, func.count()).group_by(Job.status),
                task,
                None,
                None,
                backbone,
                sweep_id,
            )
            counts = {status.value: 0 for status in JobStatus}
            counts.update({status: count for status, count in session.execute(query)})
            return counts

    def _job_filter(
        self,
        session: Session,
        query: Any,
        task: str | None,
        status: str | Iterable[str] | None,
        method: str | None,
        backbone: str | None,
        sweep_id: int | None,
    ) -> Any:
        if task is not None:
            query = query.where(Job.task_id == find_task(session, task).id)
        if method is not None:
            presets.check_known(session, method)
            query = query.where(Job.method_id.in_(select(Method.id).where(Method.name == method)))
        if backbone is not None:
            query = _on_backbone(query, backbone_filter_ids(session, backbone))
        if sweep_id is not None:
            query = query.where(Job.sweep_id == sweep_id)
        if status is not None:
            statuses = [status] if isinstance(status, str) else list(status)
            for value in statuses:
                if value not in JobStatus.__members__.values():
                    raise RegistryValidationError("status", f"{value!r} is not one of {', '.join(JobStatus)}")
            query = query.where(Job.status.in_([str(value) for value in statuses]))
        return query

    def job_events(self, job_id: int) -> list[JobEventRecord]:
        """The job's history: every status change (and cancel request), oldest first."""
        with self._reading() as session:
            find_job(session, job_id)
            rows = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
            return [JobEventRecord.of(row) for row in rows]

    def loss_history(self, job_id: int) -> LossHistoryRecord:
        """The loss curve of the job's current attempt (UnknownJobError when there is no such job)."""
        with self._reading() as session:
            return LossHistoryRecord.of(find_job(session, job_id, loss_history=True))

    def get_result(self, job_id: int) -> ResultRecord | None:
        """The job's result, or None while it has none."""
        with self._reading() as session:
            find_job(session, job_id)
            row = session.scalar(select(Result).where(Result.job_id == job_id))
            return None if row is None else ResultRecord.of(row)

    # --- leaderboard -----------------------------------------------------------------------------

    def leaderboard(
        self,
        task: str,
        k_shot: int | Literal["full"] | None = None,
        *,
        backbone: str | None = None,
        order_by: OrderBy = "mean",
        split: Split = "test",
        exclude_job_ids: Iterable[int] = (),
    ) -> list[LeaderboardRow]:
        """One row per method and configuration over the task's succeeded jobs (only K = `k_shot` when
        given, "full": only the runs on the full training set; every K, each its own rows, when None),
        seeds pooled: mean, std and 95% interval over seeds, whether it is separable from the top row,
        the best run and its delta, trainable percentage and median train time (how: the module
        services.registry.leaderboard). Ranked by the mean over seeds (`order_by="best"`: by the best
        run) in the metric's direction; ties go to fewer trainable parameters. `split`: rank by the metric on the task's evaluation split ("test": not the jobs that left it
        out, `evaluate_test=false`) or on the study protocol's dev split ("dev": only jobs that had one). `exclude_job_ids`: jobs left out
        (the delta store's archived versions, for its aliases)."""
        if k_shot is not None and k_shot != FULL_SET:
            check_int(k_shot, "k_shot", minimum=1)
        _check_order(order_by)
        left_out = frozenset(exclude_job_ids)
        return self._ranked(
            ("one", task, k_shot, backbone, order_by, split, left_out),
            task,
            k_shot,
            backbone,
            split,
            lambda runs, direction: rank_methods(
                [run for run in runs if run.job_id not in left_out], direction, order_by
            ),
        )

    def leaderboard_by_k(
        self, task: str, *, backbone: str | None = None, order_by: OrderBy = "mean", split: Split = "test"
    ) -> dict[int | None, list[LeaderboardRow]]:
        """The task's leaderboard for each K its succeeded jobs used, in one read: K ascending, None (the
        full training set) last; {} while no job has succeeded with a score on `split`."""
        _check_order(order_by)
        return self._ranked(
            ("by_k", task, backbone, order_by, split),
            task,
            None,
            backbone,
            split,
            lambda runs, direction: rank_by_k(runs, direction, order_by),
        )

    def _ranked(
        self,
        key: tuple,
        task: str,
        k_shot: int | Literal["full"] | None,
        backbone: str | None,
        split: Split,
        rank: Callable[[list[Run], str], _Ranked],
    ) -> _Ranked:
        """rank(the task's succeeded runs, its metric's direction), as ranked before for `key` while the
        task's results are the same ones. A leaderboard over 1,000 results costs about 100 ms of CPU
        (benchmarks/README.md, bench_api_load.py) and clients poll it; its inputs change only when a job
        of the task succeeds: results are written once, with their job's last transition, and never
        change, a succeeded job stays succeeded, and no job or result is ever deleted; so the count of
        results and the newest one's id (of every task: a new result anywhere drops every kept ranking;
        results come far less often than polls), read in the same transaction as the runs would be, tell
        whether a kept ranking holds. The count too: on PostgreSQL a result with a lower id may commit
        after one with a higher id."""
        if split not in SPLITS:
            raise RegistryValidationError("split", f"must be one of {', '.join(SPLITS)}, got {split!r}")
        with self._reading() as session:
            task_row = find_task(session, task)
            written = session.execute(select(func.count(Result.id), func.max(Result.id))).one()
            state = (task_row.id, task_row.metric_direction, *written)
            with self._leaderboards_lock:
                kept = self._leaderboards.get(key)
            if kept is not None and kept[0] == state:
                return kept[1]
            runs = self._succeeded_runs(session, task_row, k_shot, backbone, split)
        ranked = rank(runs, task_row.metric_direction)
        with self._leaderboards_lock:
            if len(self._leaderboards) >= MAX_KEPT_LEADERBOARDS:
                self._leaderboards.pop(next(iter(self._leaderboards)))  # the oldest kept
            self._leaderboards[key] = (state, ranked)
        return ranked

    def _succeeded_runs(
        self,
        session: Session,
        task_row: Any,
        k_shot: int | Literal["full"] | None,
        backbone: str | None,
        split: Split,
    ) -> list[Run]:
        """The task's succeeded jobs as leaderboard runs (only K = `k_shot` when given; their metric on
        `split`); an unknown backbone raises its registry error."""
        value = Result.primary_metric if split == "test" else Result.dev_primary_metric
        query = (
            select(
                Method.name,
                Job.id,
                Job.seed,
                Job.k_shot,
                value,
                Result.trainable_params,
                Result.trainable_percent,
                Result.train_seconds,
                Result.delta_uri,
                Result.delta_sha256,
                Job.method_fingerprint,
                Backbone.name,
                Job.train_config,
                Job.method_spec,
            )
            .select_from(Result)
            .join(Job, Result.job_id == Job.id)
            .join(Method, Job.method_id == Method.id)
            .join(Backbone, Job.backbone_id == Backbone.id)
            .where(Job.task_id == task_row.id, Job.status == JobStatus.SUCCEEDED.value)
        )
        query = query.where(value.is_not(None))  # dev: the protocol's runs; test: not a test set left out
        if k_shot == FULL_SET:
            query = query.where(Job.k_shot.is_(None))
        elif k_shot is not None:
            query = query.where(Job.k_shot == k_shot)
        if backbone is not None:
            query = _on_backbone(query, backbone_filter_ids(session, backbone))
        return [
            Run(*fields, backbone=backbone_name, settings=run_settings(train_config, method_spec))
            for *fields, backbone_name, train_config, method_spec in session.execute(query)
        ]


def _check_order(order_by: str) -> None:
    if order_by not in ORDERS:
        raise RegistryValidationError("order_by", f"must be one of {', '.join(ORDERS)}, got {order_by!r}")


def _on_backbone(query: Any, backbone_ids: list[int]) -> Any:
    """The query narrowed to jobs on those backbones (none: to nothing)."""
    return query.where(Job.backbone_id.in_(backbone_ids)) if backbone_ids else query.where(false())


__all__ = ["JobResults"]
