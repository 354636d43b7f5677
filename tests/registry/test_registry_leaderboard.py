"""Leaderboards: one row per method, best and mean ± std over seeds, ordered by the metric's direction,
ties broken by fewer trainable parameters."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pelt_core
from services.registry import Registry
from services.registry.leaderboard import Run, rank_methods
from services.registry.testing import write_jsonl


def run_job(
    registry: Registry,
    task: str,
    method: str,
    value: float,
    *,
    seed: int,
    params: int = 1000,
    k_shot: int | None = None,
    seconds: float = 10.0,
    metric: str = "accuracy",
) -> int:
    job = registry.submit_job(task, method, "tiny-bert", seed=seed, k_shot=k_shot)
    claimed = registry.claim_job("worker")
    assert claimed is not None and claimed.id == job.id
    registry.complete_job(
        job.id,
        "worker",
        {
            "metrics": {metric: value},
            "trainable_params": params,
            "total_params": 100_000,
            "train_seconds": seconds,
            "delta_uri": f"deltas/{job.id}.safetensors",
            "delta_sha256": f"{job.id:064x}",
        },
    )
    return job.id


def test_accuracy_leaderboard_puts_the_highest_first_and_breaks_ties_by_fewer_parameters(
    ready: Registry,
) -> None:
    lora = [
        run_job(ready, "sst2", "lora", v, seed=s, seconds=t)
        for s, (v, t) in enumerate([(0.80, 10), (0.84, 30), (0.82, 20)])
    ]
    bitfit = [run_job(ready, "sst2", "bitfit", v, seed=s, params=100) for s, v in enumerate([0.84, 0.70])]
    houlsby = run_job(ready, "sst2", "houlsby", 0.90, seed=0, params=50_000)

    rows = ready.leaderboard("sst2")
    assert [(row.rank, row.method) for row in rows] == [(1, "houlsby"), (2, "bitfit"), (3, "lora")]
    houlsby_row, bitfit_row, lora_row = rows
    assert (houlsby_row.best_job_id, houlsby_row.runs, houlsby_row.std) == (houlsby, 1, 0.0)
    assert bitfit_row.best == lora_row.best == 0.84  # the tie goes to bitfit's 100 parameters
    assert (lora_row.best_job_id, lora_row.runs, lora_row.seeds) == (lora[1], 3, 3)
    assert lora_row.mean == pytest.approx(0.82)
    assert lora_row.std == pytest.approx(statistics.stdev([0.80, 0.84, 0.82]))
    assert lora_row.median_train_seconds == 20
    assert (lora_row.trainable_params, lora_row.trainable_percent) == (1000, 1.0)
    assert lora_row.best_delta_uri == f"deltas/{lora[1]}.safetensors"
    assert lora_row.best_delta_sha256 == f"{lora[1]:064x}"
    assert bitfit_row.best_job_id == bitfit[0]


def test_within_a_method_the_best_run_ties_go_to_fewer_parameters(ready: Registry) -> None:
    run_job(ready, "sst2", "lora", 0.9, seed=0, params=2000)
    smaller = run_job(ready, "sst2", "lora", 0.9, seed=1, params=500)
    (row,) = ready.leaderboard("sst2")
    assert (row.best_job_id, row.trainable_params) == (smaller, 500)


def test_a_lower_is_better_metric_puts_the_smallest_error_first_with_ties_to_fewer_parameters(
    ready: Registry, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "stsb.jsonl", [{"text": f"t{i}", "score": i / 10} for i in range(20)])
    ready.register_task(
        "stsb", path, text_fields="text", label_field="score", problem_type="regression", metric="mse"
    )
    run_job(ready, "stsb", "lora", 0.30, seed=0, metric="mse")
    run_job(ready, "stsb", "lora", 0.50, seed=1, metric="mse")
    run_job(ready, "stsb", "bitfit", 0.30, seed=0, params=100, metric="mse")
    run_job(ready, "stsb", "houlsby", 0.25, seed=0, params=90_000, metric="mse")
    run_job(ready, "stsb", "prefix", 0.90, seed=0, params=10, metric="mse")
    rows = ready.leaderboard("stsb")
    assert [row.method for row in rows] == ["houlsby", "bitfit", "lora", "prefix"]
    assert [row.best for row in rows] == [0.25, 0.30, 0.30, 0.90]
    assert rows[2].mean == pytest.approx(0.40)


def test_ordering_by_mean_uses_the_average_over_seeds(ready: Registry) -> None:
    for seed, value in enumerate([0.95, 0.55]):
        run_job(ready, "sst2", "lora", value, seed=seed)
    for seed, value in enumerate([0.80, 0.80]):
        run_job(ready, "sst2", "bitfit", value, seed=seed)
    assert [row.method for row in ready.leaderboard("sst2")] == ["lora", "bitfit"]
    assert [row.method for row in ready.leaderboard("sst2", order_by="mean")] == ["bitfit", "lora"]


def test_a_k_shot_leaderboard_counts_only_runs_with_that_k(ready: Registry) -> None:
    run_job(ready, "sst2", "lora", 0.60, seed=0, k_shot=16)
    run_job(ready, "sst2", "lora", 0.90, seed=0)
    run_job(ready, "sst2", "bitfit", 0.65, seed=0, k_shot=16)
    few_shot = ready.leaderboard("sst2", k_shot=16)
    assert [(row.method, row.best, row.k_values) for row in few_shot] == [
        ("bitfit", 0.65, [16]),
        ("lora", 0.60, [16]),
    ]
    assert ready.leaderboard("sst2", k_shot=32) == []
    everything = ready.leaderboard("sst2")
    assert [(row.method, row.runs, row.k_values) for row in everything] == [
        ("lora", 2, [16, None]),
        ("bitfit", 1, [16]),
    ]


def test_only_succeeded_jobs_count(ready: Registry) -> None:
    run_job(ready, "sst2", "lora", 0.7, seed=0)
    failed = ready.submit_job("sst2", "bitfit", "tiny-bert")
    ready.claim_job("worker")
    ready.fail_job(failed.id, "worker", "boom", retryable=False)
    ready.submit_job("sst2", "houlsby", "tiny-bert")  # still queued
    assert [row.method for row in ready.leaderboard("sst2")] == ["lora"]


def test_the_leaderboard_tells_runs_of_an_older_preset_from_the_current_one(
    ready: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = run_job(ready, "sst2", "lora", 0.9, seed=0)
    edited = dataclasses.replace(pelt_core.get_method("lora"), defaults={"learning_rate": 4e-3})
    monkeypatch.setitem(pelt_core.methods.BUILTIN_METHODS, "lora", edited)  # a preset edited in pelt_core
    run_job(ready, "sst2", "lora", 0.8, seed=1)
    old_version, current = ready.get_job(old).method_fingerprint, ready.get_method("lora").fingerprint
    (row,) = ready.leaderboard("sst2")
    assert (row.best_job_id, row.best_method_fingerprint) == (old, old_version)
    assert row.method_fingerprints == [old_version, current] and old_version != current


# --- the ranking rule itself, for any runs -------------------------------------------------------

runs_strategy = st.lists(
    st.builds(
        Run,
        method=st.sampled_from(["lora", "bitfit", "houlsby", "prefix"]),
        job_id=st.integers(1, 10_000),
        seed=st.integers(0, 5),
        k_shot=st.sampled_from([None, 16]),
        value=st.sampled_from([0.5, 0.6, 0.7, 0.8]),
        trainable_params=st.sampled_from([10, 100, 1000]),
        trainable_percent=st.just(1.0),
        train_seconds=st.floats(0, 100),
    ),
    min_size=1,
    max_size=30,
    unique_by=lambda run: run.job_id,
)


@settings(max_examples=200, deadline=None)
@given(runs=runs_strategy, direction=st.sampled_from(["max", "min"]))
def test_rows_are_ordered_by_best_value_then_fewer_parameters(runs: list[Run], direction: str) -> None:
    rows = rank_methods(runs, direction)
    assert sorted(row.method for row in rows) == sorted({run.method for run in runs})
    assert [row.rank for row in rows] == list(range(1, len(rows) + 1))
    sign = -1 if direction == "max" else 1
    keys = [(sign * row.best, row.trainable_params) for row in rows]
    assert keys == sorted(keys)
    for row in rows:
        values = [run.value for run in runs if run.method == row.method]
        assert row.best == (max(values) if direction == "max" else min(values))
        assert min(values) - 1e-12 <= row.mean <= max(values) + 1e-12
        assert row.runs == len(values)
        best_runs = [run for run in runs if run.method == row.method and run.value == row.best]
        assert row.trainable_params == min(run.trainable_params for run in best_runs)
