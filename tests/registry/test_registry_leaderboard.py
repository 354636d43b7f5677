"""Leaderboards: one row per method and configuration (runs that differ only in their seed pool into a row),
ranked by the mean over seeds with a 95% Student-t interval, the rows not separable from the top marked
(Welch's t-test), ties broken by fewer trainable parameters; ranking by the best run stays an option."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pelt_core
from services.registry import Registry, RegistryValidationError
from services.registry.leaderboard import Run, rank_methods, run_settings, seed_statistics, tied
from services.registry.testing import write_jsonl

T_975_2 = 4.302652729911275  # Student's t, 97.5th percentile, 2 degrees of freedom (3 seeds)


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
    hyperparameters: dict | None = None,
) -> int:
    job = registry.submit_job(task, method, "tiny-bert", hyperparameters, seed=seed, k_shot=k_shot)
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


def test_rows_rank_by_the_mean_over_seeds_and_carry_the_best_run_and_its_delta(ready: Registry) -> None:
    lora = [
        run_job(ready, "sst2", "lora", v, seed=s, seconds=t)
        for s, (v, t) in enumerate([(0.80, 10), (0.84, 30), (0.82, 20)])
    ]
    bitfit = [run_job(ready, "sst2", "bitfit", v, seed=s, params=100) for s, v in enumerate([0.84, 0.70])]
    houlsby = run_job(ready, "sst2", "houlsby", 0.90, seed=0, params=50_000)

    rows = ready.leaderboard("sst2")
    assert [(row.rank, row.method) for row in rows] == [(1, "houlsby"), (2, "lora"), (3, "bitfit")]
    houlsby_row, lora_row, bitfit_row = rows
    assert (houlsby_row.best_job_id, houlsby_row.runs, houlsby_row.seeds) == (houlsby, 1, 1)
    assert (lora_row.best_job_id, lora_row.runs, lora_row.seeds) == (lora[1], 3, 3)
    assert lora_row.mean == pytest.approx(0.82) and lora_row.best == 0.84
    assert lora_row.std == pytest.approx(statistics.stdev([0.80, 0.84, 0.82]))
    assert lora_row.seed_values == pytest.approx([0.80, 0.84, 0.82])
    assert lora_row.median_train_seconds == 20
    assert (lora_row.trainable_params, lora_row.trainable_percent) == (1000, 1.0)
    assert lora_row.best_delta_uri == f"deltas/{lora[1]}.safetensors"
    assert lora_row.best_delta_sha256 == f"{lora[1]:064x}"
    assert (bitfit_row.best_job_id, bitfit_row.mean) == (bitfit[0], pytest.approx(0.77))
    assert [row.k_shot for row in rows] == [None, None, None] and lora_row.config == {}


def test_ranking_by_the_best_run_stays_an_option_with_ties_to_fewer_parameters(ready: Registry) -> None:
    for seed, value in enumerate([0.80, 0.84, 0.82]):
        run_job(ready, "sst2", "lora", value, seed=seed)
    for seed, value in enumerate([0.84, 0.70]):
        run_job(ready, "sst2", "bitfit", value, seed=seed, params=100)
    assert [row.method for row in ready.leaderboard("sst2", order_by="best")] == ["bitfit", "lora"]
    assert [row.method for row in ready.leaderboard("sst2")] == ["lora", "bitfit"]
    with pytest.raises(RegistryValidationError, match="order_by"):
        ready.leaderboard("sst2", order_by="median")  # type: ignore[arg-type]


def test_a_row_carries_the_95_percent_student_t_interval_of_its_mean(ready: Registry) -> None:
    for seed, value in enumerate([0.80, 0.84, 0.82]):
        run_job(ready, "sst2", "lora", value, seed=seed)
    (row,) = ready.leaderboard("sst2")
    half = T_975_2 * statistics.stdev([0.80, 0.84, 0.82]) / math.sqrt(3)
    assert (row.ci_low, row.ci_high) == (pytest.approx(0.82 - half), pytest.approx(0.82 + half))


def test_one_seed_says_so_no_std_no_interval_and_no_tie_verdict(ready: Registry) -> None:
    run_job(ready, "sst2", "houlsby", 0.90, seed=0)
    for seed, value in enumerate([0.80, 0.84]):
        run_job(ready, "sst2", "lora", value, seed=seed)
    top, lora = ready.leaderboard("sst2")
    assert (top.method, top.std, top.ci_low, top.ci_high, top.tied_with_top) == (
        "houlsby",
        None,
        None,
        None,
        True,
    )
    assert lora.ci_low is not None and lora.tied_with_top is None  # the top has one seed: nothing to test


def test_rows_not_separable_from_the_top_are_marked_tied_and_separable_ones_are_not(ready: Registry) -> None:
    for seed, value in enumerate([0.80, 0.84, 0.82]):
        run_job(ready, "sst2", "lora", value, seed=seed)
    for seed, value in enumerate([0.84, 0.70, 0.78]):  # a lower mean, within the noise
        run_job(ready, "sst2", "bitfit", value, seed=seed)
    for seed, value in enumerate([0.50, 0.51, 0.52]):  # far below
        run_job(ready, "sst2", "prefix", value, seed=seed)
    assert [(row.method, row.tied_with_top) for row in ready.leaderboard("sst2")] == [
        ("lora", True),
        ("bitfit", True),
        ("prefix", False),
    ]


def test_runs_that_differ_in_more_than_their_seed_are_separate_rows_named_by_what_differs(
    ready: Registry,
) -> None:
    """One seed trained for 2 epochs and for 0.5 is two configurations, not a spread over seeds; nor do
    K=16 and the full set pool."""
    run_job(ready, "sst2", "bitfit", 0.70, seed=0, hyperparameters={"epochs": 2})
    run_job(ready, "sst2", "bitfit", 0.60, seed=0, hyperparameters={"epochs": 0.5})
    run_job(ready, "sst2", "bitfit", 0.66, seed=1, hyperparameters={"epochs": 2})
    run_job(ready, "sst2", "bitfit", 0.55, seed=0, k_shot=16, hyperparameters={"epochs": 2})
    run_job(ready, "sst2", "lora", 0.75, seed=0, hyperparameters={"lr": 5e-3, "r": 4})
    run_job(ready, "sst2", "lora", 0.72, seed=0, hyperparameters={"r": 4})
    rows = ready.leaderboard("sst2")
    shown = [(row.method, row.k_shot, row.config, row.seeds) for row in rows]
    assert shown == [
        ("lora", None, {"learning_rate": 5e-3}, 1),
        ("lora", None, {"learning_rate": 2e-3}, 1),  # the preset's rate, resolved
        ("bitfit", None, {"epochs": 2.0}, 2),
        ("bitfit", None, {"epochs": 0.5}, 1),
        ("bitfit", 16, {"epochs": 2.0}, 1),
    ]
    assert len({row.config_id for row in rows}) == len(rows)
    assert rows[2].mean == pytest.approx(0.68)


def test_the_same_seed_run_twice_counts_once_at_the_mean_of_its_runs(ready: Registry) -> None:
    for value in (0.70, 0.80):
        run_job(ready, "sst2", "lora", value, seed=0)
    run_job(ready, "sst2", "lora", 0.90, seed=1)
    (row,) = ready.leaderboard("sst2")
    assert (row.runs, row.seeds, row.seed_values) == (3, 2, pytest.approx([0.75, 0.90]))
    assert row.mean == pytest.approx(0.825)


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
    assert [row.mean for row in rows] == pytest.approx([0.25, 0.30, 0.40, 0.90])
    assert [row.method for row in ready.leaderboard("stsb", order_by="best")] == [
        "houlsby",
        "bitfit",
        "lora",
        "prefix",
    ]


def test_a_k_shot_leaderboard_counts_only_runs_with_that_k_and_full_only_the_full_set(
    ready: Registry,
) -> None:
    run_job(ready, "sst2", "lora", 0.60, seed=0, k_shot=16)
    run_job(ready, "sst2", "lora", 0.90, seed=0)
    run_job(ready, "sst2", "bitfit", 0.65, seed=0, k_shot=16)
    few_shot = ready.leaderboard("sst2", k_shot=16)
    assert [(row.method, row.best, row.k_shot) for row in few_shot] == [
        ("bitfit", 0.65, 16),
        ("lora", 0.60, 16),
    ]
    assert ready.leaderboard("sst2", k_shot=32) == []
    assert [(row.method, row.k_shot) for row in ready.leaderboard("sst2", k_shot="full")] == [("lora", None)]
    everything = ready.leaderboard("sst2")
    assert [(row.method, row.runs, row.k_shot) for row in everything] == [
        ("lora", 1, None),
        ("bitfit", 1, 16),
        ("lora", 1, 16),
    ]
    assert {k: [row.method for row in rows] for k, rows in ready.leaderboard_by_k("sst2").items()} == {
        16: ["bitfit", "lora"],
        None: ["lora"],
    }


def test_only_succeeded_jobs_count(ready: Registry) -> None:
    run_job(ready, "sst2", "lora", 0.7, seed=0)
    failed = ready.submit_job("sst2", "bitfit", "tiny-bert")
    ready.claim_job("worker")
    ready.fail_job(failed.id, "worker", "boom", retryable=False)
    ready.submit_job("sst2", "houlsby", "tiny-bert")  # still queued
    assert [row.method for row in ready.leaderboard("sst2")] == ["lora"]


def test_runs_of_an_edited_preset_are_their_own_row_with_the_preset_version_they_ran(
    ready: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = run_job(ready, "sst2", "lora", 0.9, seed=0)
    edited = dataclasses.replace(pelt_core.get_method("lora"), defaults={"learning_rate": 4e-3})
    monkeypatch.setitem(pelt_core.methods.BUILTIN_METHODS, "lora", edited)  # a preset edited in pelt_core
    new = run_job(ready, "sst2", "lora", 0.8, seed=1)
    old_version, current = ready.get_job(old).method_fingerprint, ready.get_method("lora").fingerprint
    assert old_version != current
    rows = ready.leaderboard("sst2")
    assert [(row.best_job_id, row.method_fingerprints, row.config) for row in rows] == [
        (old, [old_version], {"learning_rate": 2e-3}),
        (new, [current], {"learning_rate": 4e-3}),
    ]


def test_a_runs_settings_resolve_the_learning_rate_and_flatten_the_spec() -> None:
    spec = pelt_core.get_method("lora").to_dict()
    train = pelt_core.TrainConfig(seed=3, k_shot=16).to_dict()
    settings = run_settings(train, spec)
    assert "seed" not in settings and "k_shot" not in settings and "name" not in settings
    assert settings["learning_rate"] == spec["defaults"]["learning_rate"]
    role = next(iter(spec["modules"]))
    assert settings[f"{role}.size"] == spec["modules"][role]["size"]


def test_fusions_of_different_source_versions_are_different_configurations_named_by_their_sources() -> None:
    from pelt_core.methods.fusion import Source, fusion_method

    pfeiffer = pelt_core.get_method("pfeiffer")
    train = pelt_core.TrainConfig(seed=0).to_dict()

    def settings(mrpc_version: int) -> dict:
        spec = fusion_method(
            [Source("sst2", "a" * 64, pfeiffer, 3), Source("mrpc", "b" * 64, pfeiffer, mrpc_version)]
        )
        return run_settings(train, spec.to_dict())

    first, second = settings(1), settings(2)
    assert first["fusion.sources"] == "sst2@3, mrpc@1" and first["fusion.regularization"] == 0.01
    assert first["learning_rate"] == 5e-5  # the fusion's own default
    runs = [Run("fusion", i, 0, None, 0.7, 1, 0.1, 1.0, settings=s) for i, s in enumerate((first, second), 1)]
    assert runs[0].config_id != runs[1].config_id  # one row each


def test_the_tie_test_needs_two_seeds_a_side_and_noise_free_rows_tie_only_when_equal() -> None:
    assert tied([0.8], [0.7, 0.9]) is None and tied([0.7, 0.9], [0.8]) is None
    assert tied([0.8, 0.8], [0.8, 0.8]) is True and tied([0.8, 0.8], [0.7, 0.7]) is False
    assert tied([0.80, 0.84, 0.82], [0.50, 0.51, 0.52]) is False
    assert seed_statistics({0: [0.5]}).ci_low is None
    with pytest.raises(ValueError):
        seed_statistics({})


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
        settings=st.sampled_from([{}, {"learning_rate": 1e-3}, {"learning_rate": 5e-3}]),
    ),
    min_size=1,
    max_size=30,
    unique_by=lambda run: run.job_id,
)


@settings(max_examples=200, deadline=None)
@given(
    runs=runs_strategy, direction=st.sampled_from(["max", "min"]), order_by=st.sampled_from(["mean", "best"])
)
def test_rows_pool_exactly_the_runs_that_differ_in_their_seed_and_are_ordered(
    runs: list[Run], direction: str, order_by: str
) -> None:
    rows = rank_methods(runs, direction, order_by)  # type: ignore[arg-type]
    groups = {(run.method, run.k_shot, tuple(sorted(run.settings.items()))) for run in runs}
    assert len(rows) == len(groups) == len({row.config_id for row in rows})
    assert [row.rank for row in rows] == list(range(1, len(rows) + 1))
    sign = -1 if direction == "max" else 1
    keys = [(sign * getattr(row, order_by), row.trainable_params) for row in rows]
    assert keys == sorted(keys)
    assert rows[0].tied_with_top is True
    for row in rows:
        members = [run for run in runs if (run.method, run.config_id) == (row.method, row.config_id)]
        values = [run.value for run in members]
        assert row.best == (max(values) if direction == "max" else min(values))
        assert min(values) - 1e-12 <= row.mean <= max(values) + 1e-12
        assert (row.runs, row.seeds) == (len(values), len({run.seed for run in members}))
        assert {run.k_shot for run in members} == {row.k_shot}
        best_runs = [run for run in members if run.value == row.best]
        assert row.trainable_params == min(run.trainable_params for run in best_runs)
        if row.seeds > 1:
            assert row.ci_low <= row.mean <= row.ci_high
        else:
            assert row.std is row.ci_low is row.ci_high is None


def test_a_ranking_is_kept_while_no_result_is_written_and_the_next_result_is_ranked_at_once(
    ready: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients poll the leaderboard; it is computed again only when a result has been written since."""
    first = run_job(ready, "sst2", "lora", 0.80, seed=0)
    computed = []
    read_runs = ready._succeeded_runs
    monkeypatch.setattr(ready, "_succeeded_runs", lambda *a: computed.append(a[2:]) or read_runs(*a))

    rows = ready.leaderboard("sst2")
    assert ready.leaderboard("sst2") == rows and len(computed) == 1  # kept
    assert ready.leaderboard_by_k("sst2") == ready.leaderboard_by_k("sst2") and len(computed) == 2
    best = ready.leaderboard("sst2", order_by="best")
    assert len(computed) == 3 and best[0].best_job_id == first  # another question: its own ranking
    assert ready.leaderboard("sst2", exclude_job_ids=[first]) == [] and len(computed) == 4

    second = run_job(ready, "sst2", "bitfit", 0.90, seed=0)  # a result: every kept ranking is stale
    assert [row.method for row in ready.leaderboard("sst2")] == ["bitfit", "lora"]
    assert [row.best_job_id for row in ready.leaderboard("sst2")] == [second, first] and len(computed) == 5
    assert next(iter(ready.leaderboard_by_k("sst2").values()))[0].best_job_id == second


def test_a_job_that_left_its_test_set_out_ranks_on_dev_only_and_its_result_must_say_so(
    ready: Registry,
) -> None:
    protocol = {"dev_rows": 8, "learning_rate": 1e-3}
    untested = ready.submit_job(
        "sst2", "lora", "tiny-bert", protocol | {"evaluate_test": False}, seed=0, k_shot=16
    )
    assert ready.claim_job("worker").id == untested.id
    base = {"trainable_params": 10, "total_params": 1000, "train_seconds": 1.0}
    dev = {"accuracy": 0.7, "epoch": 1, "step": 2}
    for wrong, field in (
        ({"metrics": {"accuracy": 0.9}, "dev_metrics": dev}, "result.metrics"),
        ({"metrics": {}}, "result.dev_metrics"),
    ):
        with pytest.raises(RegistryValidationError) as refused:
            ready.complete_job(untested.id, "worker", base | wrong)
        assert refused.value.field == field and ready.get_job(untested.id).status == "running"
    result = ready.complete_job(untested.id, "worker", base | {"metrics": {}, "dev_metrics": dev})
    assert (result.primary_metric, result.dev_primary_metric) == (None, 0.7)

    tested = ready.submit_job("sst2", "lora", "tiny-bert", protocol, seed=1, k_shot=16)
    assert ready.claim_job("worker").id == tested.id
    ready.complete_job(
        tested.id, "worker", base | {"metrics": {"accuracy": 0.8}, "dev_metrics": dev | {"accuracy": 0.75}}
    )
    (on_test,) = ready.leaderboard("sst2")  # the job without a test metric is not ranked on test
    assert (on_test.best_job_id, on_test.seeds) == (tested.id, 1)
    (on_dev,) = ready.leaderboard(
        "sst2", split="dev"
    )  # one configuration: leaving the test out is no setting
    assert (on_dev.seeds, on_dev.mean, on_dev.config_id) == (2, pytest.approx(0.725), on_test.config_id)


def test_a_job_from_before_evaluate_test_existed_must_still_report_its_test_metric(
    ready: Registry, migrated_url: str
) -> None:
    import sqlalchemy as sa

    from services.registry import db

    job = ready.submit_job("sst2", "lora", "tiny-bert", {"dev_rows": 8}, k_shot=16)
    jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("train_config", sa.JSON))
    config = {k: v for k, v in ready.get_job(job.id).train_config.items() if k != "evaluate_test"}
    with db.connect(migrated_url) as engine, engine.begin() as connection:  # as a job queued before 0017
        connection.execute(jobs.update().where(jobs.c.id == job.id).values(train_config=config))
    assert "evaluate_test" not in ready.get_job(job.id).train_config
    ready.claim_job("worker")
    dev_only = {"metrics": {}, "dev_metrics": {"accuracy": 0.7}, "trainable_params": 1, "total_params": 10}
    with pytest.raises(RegistryValidationError, match="primary metric 'accuracy' is missing"):
        ready.complete_job(job.id, "worker", dev_only | {"train_seconds": 1.0})
