"""Method searches: the schedule a budget buys, the configurations drawn around each preset, a search that
queues its first rung or nothing, promotes the best third of each finished rung by the dev score, chooses
by the mean over the last rung's seeds, survives a restart, fails when a rung fails, and cancels its jobs."""

from __future__ import annotations

import pytest
from sqlalchemy import select

import pelt_core
from services.registry import Registry, RegistryValidationError, UnknownSearchError
from services.registry.actor import acting_as
from services.registry.models import SearchTrial
from services.registry.search_plan import (
    Choice,
    LogUniform,
    SameAs,
    SearchPlanError,
    draw_configurations,
    method_space,
    plan_schedule,
    survivors,
)

# --- the arithmetic ------------------------------------------------------------------------------


def test_a_budget_buys_the_most_configurations_it_can_in_three_rungs():
    schedule = plan_schedule(24, 3.0)
    assert [(r.configurations, r.seeds, r.epochs) for r in schedule.rungs] == [
        (44, 1, pytest.approx(1 / 3)),
        (14, 1, 1.0),
        (4, 3, 3.0),
    ]
    assert 21 < schedule.cost <= 24
    bigger = plan_schedule(25, 3.0)
    assert bigger.rungs[0].configurations > 44 and bigger.cost <= 25


def test_a_small_budget_gets_two_rungs_and_one_too_small_for_a_rung_is_refused_naming_the_cost():
    schedule = plan_schedule(4, 3.0)
    assert [(r.configurations, r.seeds) for r in schedule.rungs] == [(3, 1), (1, 3)]
    assert schedule.cost == pytest.approx(4)
    with pytest.raises(SearchPlanError, match=r"too small for one rung.*costs 4") as refused:
        plan_schedule(3.5, 3.0)
    assert refused.value.field == "budget"
    with pytest.raises(SearchPlanError, match="positive"):
        plan_schedule(float("nan"), 3.0)


def test_each_method_varies_its_learning_rate_sizes_and_a_mixtures_module_rates_around_its_preset():
    lora = method_space(pelt_core.get_method("lora").to_dict())
    rate = pelt_core.get_method("lora").defaults["learning_rate"]
    assert lora["learning_rate"] == LogUniform(pytest.approx(rate / 3), pytest.approx(rate * 3))
    assert isinstance(lora["r"], Choice) and len(lora["r"].values) == 3
    unipelt = method_space(pelt_core.get_method("unipelt").to_dict())
    assert {"learning_rate", "r", "bottleneck", "prefix_length"} <= set(unipelt)
    assert any(key.endswith(".lr_multiplier") for key in unipelt)
    assert set(method_space(pelt_core.get_method("bitfit").to_dict())) == {"learning_rate"}
    assert method_space(pelt_core.get_method("bitfit").to_dict(), {"lr": 1e-3}) == {}  # fixed: not searched


def test_a_mixtures_modules_of_one_kind_share_one_drawn_rate_and_other_kinds_draw_their_own():
    unipelt = method_space(pelt_core.get_method("unipelt").to_dict())
    assert unipelt["lora_q.lr_multiplier"] == LogUniform(pytest.approx(1.0), pytest.approx(4.0))
    assert unipelt["lora_v.lr_multiplier"] == SameAs("lora_q.lr_multiplier")
    assert unipelt["lora_v.lr_multiplier"].describe() == "the same as lora_q.lr_multiplier"
    assert "adapter.lr_multiplier" not in unipelt  # the adapter learns at the job's rate: `learning_rate`
    assert isinstance(unipelt["prefix.lr_multiplier"], LogUniform)
    for configuration in draw_configurations({"unipelt": unipelt}, 6, seed=3):
        values = configuration.hyperparameters
        assert values["lora_v.lr_multiplier"] == values["lora_q.lr_multiplier"]
        drawn_from = unipelt["lora_q.lr_multiplier"]  # three digits kept: within 1% of its bounds
        assert drawn_from.low * 0.99 <= values["lora_q.lr_multiplier"] <= drawn_from.high * 1.01
        pelt_core.get_method("unipelt").with_overrides(  # a job of this configuration is a valid spec
            {k: v for k, v in values.items() if k.endswith(".lr_multiplier")}
        )
    fixed = method_space(pelt_core.get_method("unipelt").to_dict(), {"lora_q.lr_multiplier": 3.0})
    assert not any(key.endswith(".lr_multiplier") for key in fixed)  # one fixed: the user's rates


def test_configurations_are_drawn_in_turns_per_method_and_the_same_seed_draws_the_same():
    spaces = {name: method_space(pelt_core.get_method(name).to_dict()) for name in ("lora", "bitfit")}
    drawn = draw_configurations(spaces, 5, seed=7)
    assert [c.method for c in drawn] == ["lora", "bitfit", "lora", "bitfit", "lora"]
    assert drawn == draw_configurations(spaces, 5, seed=7) != draw_configurations(spaces, 5, seed=8)
    for configuration in drawn:
        rate = configuration.hyperparameters["learning_rate"]
        preset = pelt_core.get_method(configuration.method).defaults["learning_rate"]
        assert preset / 3 * 0.99 <= rate <= preset * 3 * 1.01


def test_survivors_are_the_best_by_the_metrics_direction_and_a_failed_job_ranks_last():
    values = [(0, 0.7), (1, None), (2, 0.9), (3, 0.8)]
    assert survivors(values, 2, "max") == [2, 3]
    assert survivors(values, 2, "min") == [0, 3]
    assert survivors(values, 4, "max")[-1] == 1


# --- a search through the registry ---------------------------------------------------------------


def result(test: float, dev: float, tested: bool = True) -> dict:
    """A worker's result; `tested`: the job evaluated its test set (an early rung's job leaves it out)."""
    return {
        "metrics": {"accuracy": test} if tested else {},
        "dev_metrics": {"accuracy": dev, "loss": 0.5, "epoch": 1, "step": 3},
        "trainable_params": 10,
        "total_params": 1000,
        "train_seconds": 1.0,
    }


def run_rung(registry: Registry, search_id: int, score, fail: set[int] = frozenset()) -> list:
    """Claim and end every queued job of the search's current rung: dev score `score(trial)`."""
    search = registry.get_search(search_id)
    trials = [t for t in search.trials if t.rung == search.rung and t.status == "queued"]
    by_job = {trial.job_id: trial for trial in trials}
    for _ in trials:
        claimed = registry.claim_job("w")
        assert claimed is not None and claimed.id in by_job
        trial = by_job[claimed.id]
        if trial.configuration in fail:
            registry.fail_job(trial.job_id, "w", "RuntimeError: diverged", retryable=False)
        else:
            dev = score(trial)
            tested = claimed.train_config["evaluate_test"]
            registry.complete_job(trial.job_id, "w", result(test=dev - 0.05, dev=dev, tested=tested))
    return trials


def by_rate(trial) -> float:
    """A dev score that prefers higher learning rates (and tells the seeds a little apart)."""
    return min(0.99, 0.5 + 40 * trial.hyperparameters["learning_rate"] + 0.001 * trial.seed)


def test_a_search_queues_its_first_rung_with_the_protocols_dev_split_and_shorter_epochs(ready: Registry):
    search = ready.create_search("sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"])
    assert (search.status, search.rung, search.configurations) == ("running", 0, 3)
    assert (search.k_shot, search.dev_rows) == (18, 18)  # 36 training rows (4 held out): half each
    jobs = [ready.get_job(trial.job_id) for trial in search.trials]
    assert [job.method for job in jobs] == ["lora", "bitfit", "lora"]
    for job in jobs:
        assert job.train_config["epochs"] == pytest.approx(1.0) and job.train_config["dev_rows"] == 18
        assert job.k_shot == 18 and job.status == "queued"
    assert search.planned_cost == pytest.approx(4) and search.spent == 0
    assert set(search.space) == {"lora", "bitfit"} and "learning_rate" in search.space["bitfit"]


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"budget": 2}, "budget"),
        ({"methods": ["lora", "lorra"]}, "method"),
        ({"k_shot": 36}, "k_shot"),
        ({"k_shot": 30, "dev_rows": 10}, "dev_rows"),
        ({"hyperparameters": {"max_steps": 5}}, "max_steps"),
        ({"hyperparameters": {"evaluate_test": True}}, "evaluate_test"),
        ({"methods": ["bitfit"], "hyperparameters": {"lr": 1e-3}}, "hyperparameters"),
        ({"seeds": 1}, "seeds"),
    ],
)
def test_a_search_that_cannot_run_is_refused_naming_what_to_change_and_queues_nothing(
    ready: Registry, arguments: dict, field: str
):
    values = {"budget": 4, "methods": ["lora", "bitfit"], **arguments}
    with pytest.raises(RegistryValidationError) as refused:
        ready.create_search("sst2", values.pop("budget"), backbone="tiny-bert", **values)
    assert refused.value.field.startswith(field), refused.value
    assert ready.list_jobs() == [] and ready.list_searches() == []


def test_a_search_promotes_the_best_and_chooses_by_the_mean_over_its_last_rungs_seeds(ready: Registry):
    search = ready.create_search("sst2", 4.5, backbone="tiny-bert", methods=["lora", "pfeiffer"], seed=3)
    schedule = [(r["configurations"], r["seeds"]) for r in search.schedule["rungs"]]
    assert schedule == [(4, 1), (1, 3)]
    assert ready.advance_search(search.id) is False  # its rung is still queued

    first = run_rung(ready, search.id, by_rate)
    assert ready.advance_search(search.id) is True
    assert ready.advance_search(search.id) is False  # a second call queues nothing twice
    best = max(first, key=by_rate)
    final = ready.get_search(search.id)
    assert final.rung == 1
    # the first rung was ranked on dev and left its test set out; the last rung evaluates it
    assert all(ready.get_job(t.job_id).train_config["evaluate_test"] is False for t in first)
    assert all(t.test is None and t.dev is not None for t in final.trials if t.rung == 0)
    assert all(ready.get_job(t.job_id).train_config["evaluate_test"] for t in final.trials if t.rung == 1)
    assert ready.leaderboard("sst2") == []  # no test metric yet: nothing to rank on the test split
    assert len(ready.leaderboard("sst2", split="dev")) == 4  # the first rung's four configurations
    assert [(t.configuration, t.seed) for t in final.trials if t.rung == 1] == [
        (best.configuration, 3),
        (best.configuration, 4),
        (best.configuration, 5),
    ]
    assert all(ready.get_job(t.job_id).train_config["epochs"] == 3.0 for t in final.trials if t.rung == 1)

    last = run_rung(ready, search.id, by_rate)
    assert ready.advance_search(search.id) is True
    done = ready.get_search(search.id)
    assert done.status == "succeeded" and done.finished_at is not None
    chosen = done.chosen
    assert (chosen["configuration"], chosen["method"], chosen["seeds"]) == (
        best.configuration,
        best.method,
        3,
    )
    assert chosen["job_ids"] == [t.job_id for t in last]
    assert chosen["dev_mean"] == pytest.approx(sum(by_rate(t) for t in last) / 3)
    assert chosen["ci_low"] < chosen["test_mean"] < chosen["ci_high"]
    assert done.spent == pytest.approx(done.planned_cost)
    assert [point["spent"] for point in done.best_so_far] == sorted(p["spent"] for p in done.best_so_far)
    (row,) = ready.leaderboard("sst2")  # only the last rung evaluated the test set
    assert (row.config_id, row.seeds, row.mean) == (
        chosen["config_id"],
        3,
        pytest.approx(chosen["test_mean"]),
    )


def test_a_restarted_service_resumes_a_search_from_the_registry(ready: Registry):
    search = ready.create_search("sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"])
    run_rung(ready, search.id, by_rate)
    again = Registry(ready.engine)  # another process's view of the same database
    assert again.advance_searches() == [search.id]
    assert again.get_search(search.id).rung == 1
    assert ready.advance_searches() == []  # nothing twice


def test_a_rung_whose_every_job_failed_fails_the_search_with_their_errors(ready: Registry):
    search = ready.create_search("sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"])
    run_rung(ready, search.id, by_rate, fail={0, 1, 2})
    assert ready.advance_search(search.id) is True
    failed = ready.get_search(search.id)
    assert failed.status == "failed" and "RuntimeError: diverged" in failed.last_error


def test_a_failed_configuration_is_never_promoted(ready: Registry):
    search = ready.create_search("sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"])
    first = run_rung(ready, search.id, lambda trial: 0.9 if trial.configuration == 0 else 0.6, fail={0})
    ready.advance_search(search.id)
    promoted = {t.configuration for t in ready.get_search(search.id).trials if t.rung == 1}
    assert len(first) == 3 and promoted and 0 not in promoted


def test_cancelling_a_search_cancels_its_queued_jobs_and_it_never_advances(ready: Registry):
    search = ready.create_search("sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"])
    cancelled = ready.cancel_search(search.id)
    assert cancelled.status == "cancelled"
    assert {ready.get_job(t.job_id).status for t in cancelled.trials} == {"cancelled"}
    assert ready.advance_search(search.id) is False
    assert ready.cancel_search(search.id).status == "cancelled"  # again: unchanged
    with pytest.raises(UnknownSearchError):
        ready.get_search(search.id + 100)


def test_one_trial_per_configuration_rung_and_seed_whatever_calls_advance(ready: Registry):
    search = ready.create_search("sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"])
    run_rung(ready, search.id, by_rate)
    for _ in range(3):
        ready.advance_searches()
    with ready.engine.connect() as connection:
        keys = connection.execute(
            select(SearchTrial.configuration, SearchTrial.rung, SearchTrial.seed).where(
                SearchTrial.search_id == search.id
            )
        ).all()
    assert len(keys) == len(set(keys)) == 3 + 3


def test_draws_never_repeat_and_a_small_space_leaves_its_turns_to_the_others():
    spaces = {
        "pfeiffer": method_space(pelt_core.get_method("pfeiffer").to_dict(), {"lr": 1e-3}),  # 3 bottlenecks
        "lora": method_space(pelt_core.get_method("lora").to_dict()),
    }
    drawn = draw_configurations(spaces, 9, seed=0)
    pfeiffer = [c.hyperparameters["bottleneck"] for c in drawn if c.method == "pfeiffer"]
    assert sorted(pfeiffer) == [24, 48, 96] and len(drawn) == 9
    with pytest.raises(ValueError, match="fewer than"):
        draw_configurations({"pfeiffer": spaces["pfeiffer"]}, 4, seed=0)
    assert set(method_space(pelt_core.get_method("unipelt").to_dict(), {"size": 8})) == {
        "learning_rate",
        *(
            key
            for key in method_space(pelt_core.get_method("unipelt").to_dict())
            if key.endswith("multiplier")
        ),
    }  # a fixed size, however spelled, fixes every size dimension


def test_three_rungs_only_where_the_first_trains_enough_steps():
    assert len(plan_schedule(24, 3.0, steps_per_epoch=32).rungs) == 3  # K=500 at batch 16
    assert len(plan_schedule(24, 3.0, steps_per_epoch=2).rungs) == 2  # 2/3 of a step: promotions on noise


@pytest.mark.parametrize(
    ("arguments", "field", "words"),
    [
        ({"seed": 2**31 - 1}, "seed", "at most"),  # its last rung's seeds would pass the largest seed
        ({"hyperparameters": {"epochs": 0}}, "epochs", "epochs"),
        ({"budget": 4, "methods": ["lora", "bitfit", "pfeiffer", "prefix"]}, "budget", "never be tried"),
        ({"budget": float("inf")}, "budget", "positive"),
    ],
)
def test_more_searches_that_cannot_run_are_refused_before_anything_is_queued(
    ready: Registry, arguments: dict, field: str, words: str
):
    values = {"budget": 4, "methods": ["lora", "bitfit"], **arguments}
    with pytest.raises(RegistryValidationError, match=words) as refused:  # the words in its message
        ready.create_search("sst2", values.pop("budget"), backbone="tiny-bert", **values)
    assert refused.value.field == field, refused.value
    assert ready.list_jobs() == []


def test_a_fixed_method_value_reaches_the_methods_that_have_its_module(ready: Registry):
    search = ready.create_search(
        "sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"], hyperparameters={"r": 4}
    )
    specs = {ready.get_job(t.job_id).method: ready.get_job(t.job_id).method_spec for t in search.trials}
    assert {module["size"] for module in specs["lora"]["modules"].values()} == {4}
    assert specs["bitfit"]["modules"] == {}
    assert "r" not in search.space["lora"]


def test_the_same_key_with_another_request_is_a_conflict_and_with_the_same_the_same_search(ready: Registry):
    from services.registry import IdempotencyConflictError

    first = ready.create_search(
        "sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"], idempotency_key="k"
    )
    again = ready.create_search(
        "sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"], idempotency_key="k"
    )
    assert again.id == first.id and len(ready.list_jobs()) == 3
    with pytest.raises(IdempotencyConflictError):
        ready.create_search(
            "sst2", 4, backbone="tiny-bert", methods=["lora", "pfeiffer"], idempotency_key="k"
        )


def test_a_search_whose_preset_changed_under_it_fails_saying_so(ready: Registry, monkeypatch):
    import dataclasses

    search = ready.create_search("sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"])
    run_rung(ready, search.id, by_rate)
    edited = dataclasses.replace(pelt_core.get_method("lora"), defaults={"learning_rate": 4e-3})
    monkeypatch.setitem(pelt_core.methods.BUILTIN_METHODS, "lora", edited)
    assert ready.advance_search(search.id) is True
    failed = ready.get_search(search.id)
    assert failed.status == "failed" and "preset of lora changed" in failed.last_error


def test_one_search_that_cannot_advance_ends_failed_and_the_others_go_on(ready: Registry, monkeypatch):
    broken = ready.create_search("sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"])
    fine = ready.create_search("sst2", 4, backbone="tiny-bert", methods=["lora", "pfeiffer"])
    for search in (broken, fine):
        run_rung(ready, search.id, by_rate)
    real = type(ready)._plan_rung

    def plan(self, session, search, *args):
        if search.id == broken.id:
            raise RegistryValidationError("k_shot", "refused now")
        return real(self, session, search, *args)

    monkeypatch.setattr(type(ready), "_plan_rung", plan)
    assert ready.advance_searches() == [broken.id, fine.id]
    assert (
        ready.get_search(broken.id).status == "failed"
        and "refused now" in ready.get_search(broken.id).last_error
    )
    assert ready.get_search(fine.id).rung == 1


def test_the_answer_prefers_a_configuration_whose_every_seed_trained(ready: Registry):
    search = ready.create_search("sst2", 8, backbone="tiny-bert", methods=["lora", "bitfit"])
    assert [r["configurations"] for r in search.schedule["rungs"]] == [6, 2]
    run_rung(ready, search.id, by_rate)
    ready.advance_search(search.id)
    final = [t for t in ready.get_search(search.id).trials if t.rung == 1]
    better = max(final, key=by_rate).configuration  # the higher dev score, but two of its seeds diverge
    by_job = {trial.job_id: trial for trial in final}
    for _ in final:
        trial = by_job[ready.claim_job("w").id]
        if trial.configuration == better and trial.seed != final[0].seed:
            ready.fail_job(trial.job_id, "w", "RuntimeError: diverged", retryable=False)
        else:
            ready.complete_job(trial.job_id, "w", result(test=0.7, dev=by_rate(trial)))
    ready.advance_search(search.id)
    chosen = ready.get_search(search.id).chosen
    assert chosen["configuration"] != better and (chosen["seeds"], chosen["seeds_failed"]) == (3, 0)


def test_a_search_whose_token_was_revoked_queues_no_more_jobs_and_fails_saying_so(ready: Registry):
    ready.create_api_token("alice", scope="write")
    with acting_as("alice"):
        search = ready.create_search("sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"])
    run_rung(ready, search.id, by_rate)
    ready.revoke_api_token("alice")
    jobs_before = len(ready.list_jobs())
    assert ready.advance_search(search.id) is True
    failed = ready.get_search(search.id)
    assert failed.status == "failed" and failed.rung == 0
    assert (
        "'alice'" in failed.last_error
        and "revoked" in failed.last_error
        and "rung 2 of 2" in failed.last_error
    )
    assert len(ready.list_jobs()) == jobs_before  # nothing queued in the revoked token's name
    (event,) = [e for e in ready.audit_events() if e.action == "search.fail"]
    assert event.actor is None and event.detail == {"on_behalf_of": "alice", "reason": "token revoked"}


def test_the_steps_the_service_takes_for_a_search_are_audited_as_its_own_on_the_owners_behalf(
    ready: Registry,
):
    ready.create_api_token("alice", scope="write")
    with acting_as("alice"):
        search = ready.create_search("sst2", 4, backbone="tiny-bert", methods=["lora", "bitfit"])
    run_rung(ready, search.id, by_rate)
    assert ready.advance_search(search.id) is True
    second = [t for t in ready.get_search(search.id).trials if t.rung == 1]
    assert {ready.get_job(t.job_id).submitted_by for t in second} == {"alice"}  # the owner's jobs, quota
    run_rung(ready, search.id, by_rate)
    assert ready.advance_search(search.id) is True
    automatic = [e for e in ready.audit_events() if e.action in ("search.rung", "search.succeed")]
    assert [e.action for e in automatic] == ["search.succeed", "search.rung"]  # newest first
    assert all(e.actor is None and e.detail["on_behalf_of"] == "alice" for e in automatic)
