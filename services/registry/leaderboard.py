"""Leaderboard arithmetic: one row per method from the succeeded runs of a task (no SQL here)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

OrderBy = Literal["best", "mean"]
# which evaluation a leaderboard ranks by: "test", the task's evaluation split (a result's `metrics`; the
# study protocol's test set), or "dev", the protocol's held-out dev split (only results that have one)
Split = Literal["test", "dev"]
SPLITS: tuple[str, ...] = ("test", "dev")


@dataclass(frozen=True)
class Run:
    """One succeeded job as the leaderboard sees it."""

    method: str
    job_id: int
    seed: int
    k_shot: int | None
    value: float  # the task's primary metric
    trainable_params: int
    trainable_percent: float
    train_seconds: float
    delta_uri: str | None = None
    delta_sha256: str | None = None
    method_fingerprint: str | None = None  # the version of the method's preset the job ran


@dataclass(frozen=True)
class LeaderboardRow:
    """A method's standing on a task: best and mean ± std (sample std; 0 for one run) of the metric.

    A method's runs may come from several versions of its preset (a built-in edited in pelt_core, a user
    preset replaced): `method_fingerprints` lists them, oldest job first; compare with the method's
    current `MethodRecord.fingerprint`."""

    rank: int
    method: str
    best: float
    mean: float
    std: float
    runs: int
    seeds: int  # distinct seeds among the runs
    trainable_params: int  # of the best run
    trainable_percent: float  # of the best run
    median_train_seconds: float
    best_job_id: int
    best_delta_uri: str | None
    best_delta_sha256: str | None
    k_values: list[int | None]  # the K values the runs used (None: the full training set)
    best_method_fingerprint: str | None  # the preset version of the best run
    method_fingerprints: list[str]  # the preset versions among the runs, oldest job first


def rank_methods(runs: Iterable[Run], direction: str, order_by: OrderBy = "best") -> list[LeaderboardRow]:
    """Group runs by method and order the rows by the metric's direction ("max" or "min").

    A method's best run is its best metric value (ties: fewer trainable parameters, then the older
    job). Rows are ordered by `order_by` ("best" or "mean"); ties go to fewer trainable parameters,
    then to the other statistic, then to the method name.
    """
    if direction not in ("max", "min"):
        raise ValueError(f"direction must be 'max' or 'min', got {direction!r}")
    if order_by not in ("best", "mean"):
        raise ValueError(f"order_by must be 'best' or 'mean', got {order_by!r}")
    sign = -1.0 if direction == "max" else 1.0  # sort ascending on sign * value: best first
    by_method: dict[str, list[Run]] = {}
    for run in runs:
        by_method.setdefault(run.method, []).append(run)

    rows = []
    for method, method_runs in by_method.items():
        best = min(method_runs, key=lambda r: (sign * r.value, r.trainable_params, r.job_id))
        values = [r.value for r in method_runs]
        rows.append(
            LeaderboardRow(
                rank=0,
                method=method,
                best=best.value,
                mean=statistics.fmean(values),
                std=statistics.stdev(values) if len(values) > 1 else 0.0,
                runs=len(method_runs),
                seeds=len({r.seed for r in method_runs}),
                trainable_params=best.trainable_params,
                trainable_percent=best.trainable_percent,
                median_train_seconds=statistics.median(r.train_seconds for r in method_runs),
                best_job_id=best.job_id,
                best_delta_uri=best.delta_uri,
                best_delta_sha256=best.delta_sha256,
                k_values=sorted({r.k_shot for r in method_runs}, key=lambda k: (k is None, k or 0)),
                best_method_fingerprint=best.method_fingerprint,
                method_fingerprints=_fingerprints(method_runs),
            )
        )

    def key(row: LeaderboardRow) -> tuple[float, int, float, str]:
        first, second = (row.best, row.mean) if order_by == "best" else (row.mean, row.best)
        return (sign * first, row.trainable_params, sign * second, row.method)

    rows.sort(key=key)
    return [replace(row, rank=position) for position, row in enumerate(rows, start=1)]


def rank_by_k(
    runs: Iterable[Run], direction: str, order_by: OrderBy = "best"
) -> dict[int | None, list[LeaderboardRow]]:
    """`rank_methods` for each K among the runs: K ascending, None (the full training set) last."""
    by_k: dict[int | None, list[Run]] = {}
    for run in runs:
        by_k.setdefault(run.k_shot, []).append(run)
    return {
        k: rank_methods(by_k[k], direction, order_by) for k in sorted(by_k, key=lambda k: (k is None, k or 0))
    }


def _fingerprints(runs: list[Run]) -> list[str]:
    """The distinct preset versions of the runs, oldest job first."""
    ordered = sorted(runs, key=lambda run: run.job_id)
    return list(dict.fromkeys(run.method_fingerprint for run in ordered if run.method_fingerprint))


__all__ = ["SPLITS", "LeaderboardRow", "OrderBy", "Run", "Split", "rank_by_k", "rank_methods"]
