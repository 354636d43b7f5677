"""benchmarks/bench_search.py's arithmetic: which grid configuration a user would pick, the oracle, and
whether the leaderboard's "not separable" marks agree between two halves of the seeds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_search
from bench_search import GridRun, grid_summary, mark_agreement, separable_marks


def runs(method: str, lr: float, scores: list[tuple[float, float]]) -> list[GridRun]:
    return [GridRun(method, lr, seed, dev, test, 10.0) for seed, (dev, test) in enumerate(scores)]


def test_the_grid_picks_by_mean_dev_and_the_oracle_by_mean_test():
    grid = [
        *runs("lora", 0.002, [(0.9, 0.70), (0.8, 0.72), (0.85, 0.71)]),
        *runs("bitfit", 0.001, [(0.7, 0.80), (0.7, 0.80), (0.7, 0.80)]),
    ]
    summary = grid_summary(grid, [0, 1, 2])
    assert summary["picked"] == "lora lr=0.002"
    assert summary["oracle"] == "bitfit lr=0.001"
    assert summary["configurations"]["lora lr=0.002"]["test_mean"] == pytest.approx(0.71)


def test_a_configuration_with_a_failed_or_missing_seed_is_not_picked():
    grid = [
        *runs("lora", 0.002, [(0.9, 0.9), (None, None), (0.9, 0.9)]),
        *runs("prefix", 0.005, [(0.6, 0.6), (0.6, 0.6)]),  # seed 2 never ran
        *runs("bitfit", 0.001, [(0.5, 0.5), (0.5, 0.5), (0.5, 0.5)]),
    ]
    summary = grid_summary(grid, [0, 1, 2])
    assert summary["picked"] == summary["oracle"] == "bitfit lr=0.001"
    assert summary["configurations"]["lora lr=0.002"]["dev_mean"] is None


def test_a_lower_is_better_metric_picks_the_smallest():
    grid = [*runs("lora", 0.002, [(0.3, 0.3), (0.3, 0.3)]), *runs("bitfit", 0.001, [(0.1, 0.2), (0.1, 0.2)])]
    assert grid_summary(grid, [0, 1], direction="min")["picked"] == "bitfit lr=0.001"


def test_marks_are_the_leaderboards_welch_test_against_the_top_by_mean_test():
    grid = [
        *runs("lora", 0.002, [(0, 0.90), (0, 0.91), (0, 0.50), (0, 0.52)]),
        *runs("bitfit", 0.001, [(0, 0.60), (0, 0.61), (0, 0.80), (0, 0.81)]),
        *runs("prefix", 0.005, [(0, 0.89), (0, 0.92), (0, 0.79), (0, 0.83)]),
    ]
    first, second = separable_marks(grid, [0, 1]), separable_marks(grid, [2, 3])
    assert first == {"lora lr=0.002": True, "bitfit lr=0.001": False, "prefix lr=0.005": True}
    assert second["bitfit lr=0.001"] is True and second["lora lr=0.002"] is False
    agreement = mark_agreement(first, second)
    assert (agreement["agree"], agreement["configurations"]) == (1, 3)  # only prefix is marked alike
    assert agreement["share"] == pytest.approx(1 / 3)


def test_one_seed_per_half_gives_no_mark_and_no_share():
    grid = runs("lora", 0.002, [(0, 0.9), (0, 0.8)]) + runs("bitfit", 0.001, [(0, 0.7), (0, 0.6)])
    first = separable_marks(grid, [0])
    assert first["bitfit lr=0.001"] is None
    assert mark_agreement(first, separable_marks(grid, [1]))["configurations"] == 1  # the top rows only


def test_the_arguments_refuse_a_grid_with_fewer_seeds_than_the_search_compares():
    with pytest.raises(SystemExit):
        bench_search.parse_args(["--grid-seeds", "2", "--search-seeds", "3"])
    args = bench_search.parse_args(["--tasks", "rte", "--lr-factors", "0.5,2"])
    assert (args.tasks, args.lr_factors, args.methods[0]) == (["rte"], [0.5, 2.0], "bitfit")
