"""Leaderboard arithmetic: one row per method *and configuration* from the succeeded runs of a task, seeds
pooled, ranked by the mean over seeds with a confidence interval, ties with the top marked (no SQL here).

A configuration is everything that decides a run except its seed: the method's resolved spec (sizes,
placements, per-module rates), the resolved training hyperparameters (learning rate, epochs, ...), K and
the backbone. Runs that differ in anything else than their seed are different rows: a leaderboard never
averages K=50 with the full set, or one seed trained for 2 epochs with the same seed for 0.5.

The statistics, per row (n = distinct seeds; a seed run twice counts once, at the mean of its runs):
- mean and sample standard deviation over the seeds;
- a 95% Student-t interval of the mean, mean ± t(0.975, n-1)·s/√n: the seeds are few (2 to 5 is usual),
  where the normal approximation is too narrow and a bootstrap cannot resample three values usefully;
  it needs n ≥ 2 (one seed: no interval, said as such, never a zero-width one);
- `tied_with_top`: whether the row is *not* separable from the top row, by Welch's two-sided t-test
  (unequal variances: methods differ in how much they vary by seed) at α = 0.05: True when p ≥ 0.05
  (the top row itself is True), False when p < 0.05, None when either row has one seed (nothing to test).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

OrderBy = Literal["best", "mean"]
ORDERS: tuple[str, ...] = ("mean", "best")
# which evaluation a leaderboard ranks by: "test", the task's evaluation split (a result's `metrics`; the
# study protocol's test set), or "dev", the protocol's held-out dev split (only results that have one)
Split = Literal["test", "dev"]
SPLITS: tuple[str, ...] = ("test", "dev")

FULL_SET = "full"  # a leaderboard's K filter for the runs on the full training set (K None)
CONFIDENCE = 0.95
INTERVAL = "95% Student-t interval of the mean over seeds (needs 2 or more seeds)"
TIE_TEST = "Welch's two-sided t-test against the top row: tied when p >= 0.05 (needs 2 or more seeds on both)"

# training hyperparameters that are not part of a configuration: the seed is what rows pool over, K is
# a configuration's own field, and whether the test set was evaluated changes nothing trained
_NOT_SETTINGS = frozenset({"seed", "k_shot", "evaluate_test"})
# a method spec's fields that describe it without changing what it trains
_SPEC_LABELS = frozenset({"name", "description", "reference", "defaults"})


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
    backbone: str | None = None
    # everything else that decided the run besides seed, K and backbone: `run_settings` of its job
    settings: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def config_id(self) -> str:
        """12 hex digits naming the run's method and configuration (equal for runs that differ only in
        their seed)."""
        identity = {"method": self.method, "backbone": self.backbone, "k_shot": self.k_shot, **self.settings}
        text = json.dumps(identity, sort_keys=True, default=str, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def run_settings(train_config: Mapping[str, Any], method_spec: Mapping[str, Any]) -> dict[str, Any]:
    """A job's configuration besides seed, K and backbone, flat: its training hyperparameters (the
    learning rate resolved from the method's default when the job left it out) and its method spec's
    fields as `role.field` (plus `bias` and `layer_norm`)."""
    settings = {name: value for name, value in train_config.items() if name not in _NOT_SETTINGS}
    if settings.get("learning_rate") is None:
        settings["learning_rate"] = float((method_spec.get("defaults") or {}).get("learning_rate", 1e-3))
    for name, value in method_spec.items():
        if name == "modules":
            for role, module in (value or {}).items():
                settings.update({f"{role}.{key}": item for key, item in module.items()})
        elif name == "fusion":  # which stored deltas it fused, by version: a row per set of sources
            sources = (value or {}).get("sources", [])
            settings["fusion.sources"] = ", ".join(f"{s.get('task')}@{s.get('version')}" for s in sources)
            settings["fusion.regularization"] = (value or {}).get("regularization")
        elif name not in _SPEC_LABELS:
            settings[name] = value
    return settings


@dataclass(frozen=True)
class SeedStatistics:
    """A set of runs pooled over seeds: each seed's value (the mean of that seed's runs), then the mean,
    sample standard deviation and the 95% Student-t interval of the mean over seeds (None with one seed)."""

    seed_values: tuple[float, ...]
    mean: float
    std: float | None
    ci_low: float | None
    ci_high: float | None

    @property
    def seeds(self) -> int:
        return len(self.seed_values)


def seed_statistics(
    values_by_seed: Mapping[int, Iterable[float]], confidence: float = CONFIDENCE
) -> SeedStatistics:
    """Pool runs by seed (a seed run more than once counts once, at its runs' mean) and summarize."""
    per_seed = tuple(statistics.fmean(values) for _, values in sorted(values_by_seed.items()))
    if not per_seed:
        raise ValueError("no runs to summarize")
    mean = statistics.fmean(per_seed)
    if len(per_seed) < 2:
        return SeedStatistics(per_seed, mean, None, None, None)
    from scipy import stats  # here: importing the registry should not import scipy

    std = statistics.stdev(per_seed)
    half = float(stats.t.ppf(0.5 + confidence / 2, len(per_seed) - 1)) * std / math.sqrt(len(per_seed))
    return SeedStatistics(per_seed, mean, std, mean - half, mean + half)


def tied(top: Sequence[float], other: Sequence[float], confidence: float = CONFIDENCE) -> bool | None:
    """Whether two sets of per-seed values are *not* separable by Welch's two-sided t-test at
    α = 1 - confidence; None when either has fewer than two seeds."""
    if len(top) < 2 or len(other) < 2:
        return None
    if statistics.variance(top) == 0 and statistics.variance(other) == 0:
        return statistics.fmean(top) == statistics.fmean(other)  # no noise: equal means are the only tie
    from scipy import stats

    with warnings.catch_warnings():  # values equal to the last digits: scipy warns, and its p may be NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        p_value = float(stats.ttest_ind(top, other, equal_var=False).pvalue)
    if math.isnan(p_value):
        return statistics.fmean(top) == statistics.fmean(other)
    return p_value >= 1 - confidence


@dataclass(frozen=True)
class LeaderboardRow:
    """A method in one configuration on a task: its seeds pooled (mean, std and interval over seeds), its
    best run, and whether it is separable from the top row.

    A method's runs may come from several versions of its preset (a built-in edited in pelt_core, a user
    preset replaced): when the edit changed what trains, they are different configurations (rows);
    `method_fingerprints` lists the versions among a row's runs, oldest job first; compare with the
    method's current `MethodRecord.fingerprint`."""

    rank: int
    method: str
    config_id: str  # 12 hex digits: the method and configuration (`Run.config_id`)
    k_shot: int | None  # the configuration's K (None: the full training set)
    backbone: str | None
    config: dict[str, Any]  # the settings in which this row differs from the method's other rows
    mean: float  # over seeds (each seed at the mean of its runs)
    std: float | None  # sample std over seeds; None with one seed
    ci_low: float | None  # the 95% Student-t interval of the mean; None with one seed
    ci_high: float | None
    tied_with_top: bool | None  # not separable from rank 1 (Welch, α=0.05); None: a side has one seed
    best: float
    runs: int
    seeds: int  # distinct seeds among the runs
    trainable_params: int  # of the best run
    trainable_percent: float  # of the best run
    median_train_seconds: float
    best_job_id: int
    best_delta_uri: str | None
    best_delta_sha256: str | None
    k_values: list[int | None]  # [k_shot]: kept for readers of the one-row-per-method board
    best_method_fingerprint: str | None  # the preset version of the best run
    method_fingerprints: list[str]  # the preset versions among the runs, oldest job first
    seed_values: list[float]  # each seed's value, seeds ascending


def rank_methods(
    runs: Iterable[Run], direction: str, order_by: OrderBy = "mean", confidence: float = CONFIDENCE
) -> list[LeaderboardRow]:
    """Group runs by method and configuration and order the rows by the metric's direction ("max" or
    "min"): by the mean over seeds (`order_by="mean"`, the default) or by the best run ("best").

    A row's best run is its best metric value (ties: fewer trainable parameters, then the older job).
    Ties between rows go to fewer trainable parameters, then to the other statistic, then to the method
    name and configuration. `tied_with_top` compares each row with rank 1 (see the module's docstring).
    """
    if direction not in ("max", "min"):
        raise ValueError(f"direction must be 'max' or 'min', got {direction!r}")
    if order_by not in ORDERS:
        raise ValueError(f"order_by must be 'mean' or 'best', got {order_by!r}")
    sign = -1.0 if direction == "max" else 1.0  # sort ascending on sign * value: best first
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.method, run.config_id), []).append(run)
    differing = _differing_settings(groups)

    rows = []
    for (method, config_id), group in groups.items():
        best = min(group, key=lambda r: (sign * r.value, r.trainable_params, r.job_id))
        by_seed: dict[int, list[float]] = {}
        for run in group:
            by_seed.setdefault(run.seed, []).append(run.value)
        summary = seed_statistics(by_seed, confidence)
        first = group[0]
        rows.append(
            LeaderboardRow(
                rank=0,
                method=method,
                config_id=config_id,
                k_shot=first.k_shot,
                backbone=first.backbone,
                config=_shown(first, differing.get(method, ())),
                mean=summary.mean,
                std=summary.std,
                ci_low=summary.ci_low,
                ci_high=summary.ci_high,
                tied_with_top=None,
                best=best.value,
                runs=len(group),
                seeds=summary.seeds,
                trainable_params=best.trainable_params,
                trainable_percent=best.trainable_percent,
                median_train_seconds=statistics.median(r.train_seconds for r in group),
                best_job_id=best.job_id,
                best_delta_uri=best.delta_uri,
                best_delta_sha256=best.delta_sha256,
                k_values=[first.k_shot],
                best_method_fingerprint=best.method_fingerprint,
                method_fingerprints=_fingerprints(group),
                seed_values=list(summary.seed_values),
            )
        )

    def key(row: LeaderboardRow) -> tuple[float, int, float, str, str]:
        first, second = (row.best, row.mean) if order_by == "best" else (row.mean, row.best)
        return (sign * first, row.trainable_params, sign * second, row.method, row.config_id)

    rows.sort(key=key)
    if not rows:
        return []
    top = rows[0].seed_values
    return [
        replace(
            row,
            rank=position,
            tied_with_top=True if position == 1 else tied(top, row.seed_values, confidence),
        )
        for position, row in enumerate(rows, start=1)
    ]


def rank_by_k(
    runs: Iterable[Run], direction: str, order_by: OrderBy = "mean"
) -> dict[int | None, list[LeaderboardRow]]:
    """`rank_methods` for each K among the runs: K ascending, None (the full training set) last."""
    by_k: dict[int | None, list[Run]] = {}
    for run in runs:
        by_k.setdefault(run.k_shot, []).append(run)
    return {
        k: rank_methods(by_k[k], direction, order_by) for k in sorted(by_k, key=lambda k: (k is None, k or 0))
    }


def _differing_settings(groups: Mapping[tuple[str, str], list[Run]]) -> dict[str, tuple[str, ...]]:
    """Per method, the settings (and "backbone") whose values differ between its configurations on this
    board: what a reader needs to tell its rows apart (K is a row's own field)."""
    by_method: dict[str, list[Run]] = {}
    for (method, _), group in groups.items():
        by_method.setdefault(method, []).append(group[0])
    differing: dict[str, tuple[str, ...]] = {}
    for method, firsts in by_method.items():
        if len(firsts) < 2:
            continue
        names = sorted({name for run in firsts for name in run.settings})
        varying = [name for name in names if len({_canonical(run.settings.get(name)) for run in firsts}) > 1]
        if len({run.backbone for run in firsts}) > 1:
            varying.insert(0, "backbone")
        differing[method] = tuple(varying)
    return differing


def _shown(run: Run, names: Iterable[str]) -> dict[str, Any]:
    return {name: run.backbone if name == "backbone" else run.settings.get(name) for name in names}


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _fingerprints(runs: list[Run]) -> list[str]:
    """The distinct preset versions of the runs, oldest job first."""
    ordered = sorted(runs, key=lambda run: run.job_id)
    return list(dict.fromkeys(run.method_fingerprint for run in ordered if run.method_fingerprint))


__all__ = [
    "CONFIDENCE",
    "FULL_SET",
    "INTERVAL",
    "ORDERS",
    "SPLITS",
    "TIE_TEST",
    "LeaderboardRow",
    "OrderBy",
    "Run",
    "SeedStatistics",
    "Split",
    "rank_by_k",
    "rank_methods",
    "run_settings",
    "seed_statistics",
    "tied",
]
