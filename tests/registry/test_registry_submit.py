"""Submitting jobs and sweeps: validation before any write (errors name the field), idempotency keys,
and a sweep as one all-or-nothing submit of methods × seeds × K values."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from sqlalchemy import func, select

import pelt_core
import pelt_core.methods
from services.registry import (
    IdempotencyConflictError,
    JobStatus,
    Registry,
    RegistryValidationError,
    UnknownBackboneError,
    UnknownMethodError,
    UnknownTaskError,
)
from services.registry.models import Base


def row_counts(registry: Registry) -> dict[str, int]:
    with registry.engine.connect() as connection:
        return {
            name: connection.execute(select(func.count()).select_from(table)).scalar_one()
            for name, table in Base.metadata.tables.items()
        }


def test_a_submitted_job_is_queued_with_its_resolved_training_config_and_method_spec(ready: Registry) -> None:
    job = ready.submit_job(
        "sst2", "lora", "tiny-bert", {"lr": "1e-3", "epochs": 2, "r": 4}, seed=7, k_shot=16
    )
    assert (job.task, job.method, job.backbone, job.status, job.attempts) == (
        "sst2",
        "lora",
        "tiny-bert",
        "queued",
        0,
    )
    assert job.hyperparameters == {"learning_rate": 0.001, "epochs": 2.0, "r": 4}
    assert job.train_config["learning_rate"] == 0.001
    assert (job.train_config["seed"], job.train_config["k_shot"], job.train_config["max_length"]) == (
        7,
        16,
        128,
    )
    assert job.method_spec["modules"]["q"]["size"] == 4 and job.method_spec["modules"]["v"]["size"] == 4
    assert job.max_attempts == 3
    assert [(e.from_status, e.to_status, e.reason) for e in ready.job_events(job.id)] == [
        (None, "queued", "submitted")
    ]


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"task": "mnli"}, "task", "unknown task 'mnli'; known tasks: sst2"),
        ({"method": "lorra"}, "method", "unknown method 'lorra'; known methods: bitfit, houlsby"),
        ({"backbone": "gpt-9"}, "backbone", "unknown backbone 'gpt-9'; known backbones: tiny-bert"),
        ({"hyperparameters": {"lr": 0}}, "lr", "learning_rate: must be in (0, 10]"),  # the table of limits
        ({"hyperparameters": {"learning_rate": -0.1}}, "learning_rate", "must be in (0, 10], got -0.1"),
        ({"hyperparameters": {"r": 0}}, "r", "size: must be in [1, 16384], got 0"),
        ({"hyperparameters": {"rank": 0}}, "rank", "size: must be in [1, 16384]"),
        (
            {"hyperparameters": {"batch_size": "sixteen"}},
            "batch_size",
            "expected a whole number in [1, 4096], got 'sixteen'",
        ),
        ({"hyperparameters": {"batch_size": 1.5}}, "batch_size", "expected int"),
        ({"hyperparameters": {"lr": [0.1]}}, "lr", "expected float"),
        ({"hyperparameters": {"epochs": True}}, "epochs", "expected float"),
        ({"hyperparameters": {"dropout": "lots"}}, "dropout", "expected a number"),
        ({"hyperparameters": {"rnak": 4}}, "rnak", "not a field of any module"),
        ({"hyperparameters": {"epoch": 2}}, "epoch", "did you mean epochs?"),
        ({"hyperparameters": {"seed": 3}}, "seed", "pass seed as its own argument"),
        (
            {"k_shot": 37},
            "k_shot",
            "37 is more than the task's 36 training examples left after the dev split",
        ),
        ({"k_shot": 0}, "k_shot", "must be in [1, 2**31 - 1]"),
        ({"seed": -1}, "seed", "must be in [0, 2**31 - 1]"),
        ({"seed": 1.5}, "seed", "must be a whole number"),
        ({"max_attempts": 0}, "max_attempts", "must be >= 1"),
        ({"device": "tpu"}, "device", "must be one of any, cpu, gpu, got 'tpu'"),
        ({"device": "GPU"}, "device", "must be one of any, cpu, gpu, got 'GPU'"),
        ({"device": None}, "device", "must be one of any, cpu, gpu, got None"),
    ],
)
def test_bad_input_is_refused_naming_the_field_and_nothing_is_written(
    ready: Registry, changes: dict, field: str, message: str
) -> None:
    before = row_counts(ready)
    arguments = {"task": "sst2", "method": "lora", "backbone": "tiny-bert", **changes}
    with pytest.raises(RegistryValidationError) as refused:
        ready.submit_job(**arguments)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"{field}:")
    assert message in str(refused.value)
    assert row_counts(ready) == before


def test_unknown_names_raise_not_found_errors_that_are_validation_errors(ready: Registry) -> None:
    for changes, error in [
        ({"task": "x"}, UnknownTaskError),
        ({"method": "x"}, UnknownMethodError),
        ({"backbone": "x"}, UnknownBackboneError),
    ]:
        with pytest.raises(error) as refused:
            ready.submit_job(**{"task": "sst2", "method": "lora", "backbone": "tiny-bert", **changes})
        assert isinstance(refused.value, LookupError) and refused.value.name == "x"


@pytest.mark.parametrize("packaged", ["all-minilm-l6-v2", "minilm", "smollm2-135m"])
def test_filtering_by_a_packaged_backbone_no_job_has_registered_yet_finds_nothing(
    ready: Registry, packaged: str
) -> None:
    ready.submit_job("sst2", "lora", "tiny-bert")
    assert ready.list_jobs(task="sst2", backbone=packaged) == []
    assert sum(ready.job_counts(task="sst2", backbone=packaged).values()) == 0
    assert ready.leaderboard("sst2", backbone=packaged) == []
    assert ready.leaderboard_by_k("sst2", backbone=packaged) == {}
    assert [job.backbone for job in ready.list_jobs(task="sst2", backbone="tiny-bert")] == ["tiny-bert"]


@pytest.mark.parametrize(
    ("registered", "asked"), [("minilm", "all-minilm-l6-v2"), ("all-minilm-l6-v2", "minilm")]
)
def test_filtering_by_any_name_of_a_packaged_backbone_finds_the_jobs_submitted_under_another(
    ready: Registry, registered: str, asked: str
) -> None:
    ready.register_backbone(registered, "all-minilm-l6-v2", "sha256:" + "cd" * 32, {"hidden_size": 32})
    job = ready.submit_job("sst2", "lora", registered)
    ready.submit_job("sst2", "lora", "tiny-bert")
    assert [j.id for j in ready.list_jobs(task="sst2", backbone=asked)] == [job.id]
    assert sum(ready.job_counts(task="sst2", backbone=asked).values()) == 1


def test_filtering_by_a_backbone_neither_registered_nor_packaged_names_it_in_a_not_found_error(
    ready: Registry,
) -> None:
    for read in (
        lambda: ready.list_jobs(task="sst2", backbone="no-such-bert"),
        lambda: ready.job_counts(backbone="no-such-bert"),
        lambda: ready.leaderboard("sst2", backbone="no-such-bert"),
    ):
        with pytest.raises(
            UnknownBackboneError, match="unknown backbone 'no-such-bert'; known backbones: tiny-bert"
        ):
            read()
    with pytest.raises(UnknownTaskError):  # an unknown task is still named first
        ready.list_jobs(task="nope", backbone="minilm")


def test_a_user_defined_preset_can_be_submitted_like_a_builtin(ready: Registry) -> None:
    spec = {**ready.get_method("lora").spec, "name": "lora_r2"}
    ready.register_method(with_module_fields(spec, size=2))
    job = ready.submit_job("sst2", "lora_r2", "tiny-bert")
    assert job.method == "lora_r2" and job.method_spec["modules"]["q"]["size"] == 2


def with_module_fields(spec: dict, **fields: object) -> dict:
    return {**spec, "modules": {role: {**module, **fields} for role, module in spec["modules"].items()}}


def test_submitting_with_the_same_idempotency_key_returns_the_same_job(ready: Registry) -> None:
    first = ready.submit_job("sst2", "lora", "tiny-bert", {"lr": 1e-3}, seed=1, idempotency_key="req-1")
    again = ready.submit_job(
        "sst2", "lora", "tiny-bert", {"learning_rate": "0.001"}, seed=1, idempotency_key="req-1"
    )
    assert again.id == first.id
    assert ready.job_counts()["queued"] == 1


def test_reusing_an_idempotency_key_for_a_different_job_is_refused(ready: Registry) -> None:
    ready.submit_job("sst2", "lora", "tiny-bert", seed=1, idempotency_key="req-1")
    with pytest.raises(IdempotencyConflictError) as refused:
        ready.submit_job("sst2", "lora", "tiny-bert", seed=2, idempotency_key="req-1")
    assert refused.value.field == "idempotency_key"
    assert ready.job_counts()["queued"] == 1


# --- devices -------------------------------------------------------------------------------------


def test_a_job_runs_on_any_device_unless_it_names_one(ready: Registry) -> None:
    assert ready.submit_job("sst2", "lora", "tiny-bert").device == "any"
    for seed, device in enumerate(["any", "cpu", "gpu"], start=1):
        job = ready.submit_job("sst2", "lora", "tiny-bert", seed=seed, device=device)
        assert job.device == device
        assert ready.get_job(job.id).device == device


def test_every_job_of_a_sweep_gets_its_device(ready: Registry) -> None:
    sweep = ready.submit_sweep("sst2", ["lora", "bitfit"], [0, 1], [8], "tiny-bert", device="gpu")
    assert {job.device for job in ready.list_jobs(sweep_id=sweep.id)} == {"gpu"}
    other = ready.submit_sweep("sst2", ["lora"], [0], [8], "tiny-bert")
    assert [job.device for job in ready.list_jobs(sweep_id=other.id)] == ["any"]


def test_a_sweep_naming_an_unknown_device_writes_nothing(ready: Registry) -> None:
    before = row_counts(ready)
    with pytest.raises(RegistryValidationError, match=r"^device: must be one of any, cpu, gpu") as refused:
        ready.submit_sweep("sst2", ["lora"], [0], [8], "tiny-bert", device="cuda")
    assert refused.value.field == "device"
    assert row_counts(ready) == before


def test_the_device_is_placement_not_identity_a_retry_with_another_device_returns_the_same_job(
    ready: Registry,
) -> None:
    first = ready.submit_job("sst2", "lora", "tiny-bert", seed=1, device="cpu", idempotency_key="req-1")
    again = ready.submit_job("sst2", "lora", "tiny-bert", seed=1, device="gpu", idempotency_key="req-1")
    assert (again.id, again.device) == (first.id, "cpu")  # the job as first made, not moved
    assert ready.job_counts()["queued"] == 1


def test_a_sweep_retried_with_another_device_returns_the_same_sweep(ready: Registry) -> None:
    first = ready.submit_sweep("sst2", ["lora"], [0, 1], [8], "tiny-bert", idempotency_key="s-1")
    again = ready.submit_sweep(
        "sst2", ["lora"], [0, 1], [8], "tiny-bert", device="gpu", idempotency_key="s-1"
    )
    assert (again.id, again.job_ids) == (first.id, first.job_ids)
    assert {job.device for job in ready.list_jobs(sweep_id=first.id)} == {"any"}
    assert ready.job_counts()["queued"] == 2


# --- sweeps --------------------------------------------------------------------------------------


def test_a_sweep_is_one_submit_of_every_method_seed_and_k(ready: Registry) -> None:
    before = row_counts(ready)
    sweep = ready.submit_sweep(
        "sst2", ["lora", "bitfit", "houlsby"], [0, 1], [16, None], "tiny-bert", {"epochs": 1}
    )
    assert len(sweep.job_ids) == 12
    jobs = ready.list_jobs(sweep_id=sweep.id)
    assert {(job.method, job.seed, job.k_shot) for job in jobs} == set(
        itertools.product(["lora", "bitfit", "houlsby"], [0, 1], [16, None])
    )
    assert all(job.status == JobStatus.QUEUED and job.train_config["epochs"] == 1.0 for job in jobs)
    after = row_counts(ready)
    assert (after["sweeps"] - before["sweeps"], after["jobs"] - before["jobs"]) == (1, 12)
    assert after["job_events"] - before["job_events"] == 12
    assert ready.get_sweep(sweep.id) == sweep


def test_checking_a_sweep_counts_its_jobs_or_raises_what_submitting_it_would_and_writes_nothing(
    ready: Registry,
) -> None:
    before = row_counts(ready)  # no method row yet: planning a built-in's jobs makes one, rolled back here

    assert ready.check_sweep("sst2", ["lora", "bitfit"], [0, 1], [8, None], "tiny-bert", {"epochs": 2}) == 8
    with pytest.raises(RegistryValidationError) as checked:
        ready.check_sweep("sst2", ["lora"], [0], [8, 37], "tiny-bert")
    with pytest.raises(RegistryValidationError) as submitted:
        ready.submit_sweep("sst2", ["lora"], [0], [8, 37], "tiny-bert")
    with pytest.raises(UnknownMethodError):
        ready.check_sweep("sst2", ["loar"], [0], [None], "tiny-bert")

    assert (checked.value.field, str(checked.value)) == (submitted.value.field, str(submitted.value))
    assert checked.value.field == "k_shot" and "more than the task's 36" in str(checked.value)
    assert row_counts(ready) == before


def test_a_sweep_is_idempotent_by_key(ready: Registry) -> None:
    first = ready.submit_sweep("sst2", ["lora"], [0, 1, 2], [8], "tiny-bert", idempotency_key="sweep-1")
    again = ready.submit_sweep("sst2", ["lora"], [0, 1, 2], [8], "tiny-bert", idempotency_key="sweep-1")
    assert (again.id, again.job_ids) == (first.id, first.job_ids)
    with pytest.raises(IdempotencyConflictError):
        ready.submit_sweep("sst2", ["lora"], [0, 1], [8], "tiny-bert", idempotency_key="sweep-1")
    assert ready.job_counts()["queued"] == 3


def test_the_same_sweep_submitted_again_without_a_key_answers_with_the_first_and_queues_nothing(
    ready: Registry,
) -> None:
    first = ready.submit_sweep("sst2", ["lora", "bitfit"], [0, 1], [8], "tiny-bert", {"lr": 1e-3})
    assert not first.already_submitted
    before = row_counts(ready)
    # the same jobs, listed in another order and with the training key under its full name
    again = ready.submit_sweep(
        "sst2", ["bitfit", "lora"], [1, 0], [8], "tiny-bert", {"learning_rate": 1e-3}, device="gpu"
    )
    assert again.already_submitted and (again.id, again.job_ids) == (first.id, first.job_ids)
    assert row_counts(ready) == before  # no sweep, job, event or audit row


def test_a_sweep_with_new_seeds_or_asked_again_queues_new_runs(ready: Registry) -> None:
    first = ready.submit_sweep("sst2", ["lora"], [0], [8], "tiny-bert")
    more_seeds = ready.submit_sweep("sst2", ["lora"], [0, 1], [8], "tiny-bert")
    assert not more_seeds.already_submitted and more_seeds.id != first.id and len(more_seeds.job_ids) == 2
    rerun = ready.submit_sweep("sst2", ["lora"], [0], [8], "tiny-bert", again=True)
    assert not rerun.already_submitted and set(rerun.job_ids).isdisjoint(first.job_ids)
    latest = ready.submit_sweep("sst2", ["lora"], [0], [8], "tiny-bert")
    assert latest.already_submitted and latest.id == rerun.id  # the newest runs answer from now on
    assert ready.job_counts()["queued"] == 4


def test_the_same_sweep_after_its_preset_changed_is_a_new_sweep(
    ready: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = ready.submit_sweep("sst2", ["lora"], [0], [8], "tiny-bert")
    edited = dataclasses.replace(pelt_core.get_method("lora"), defaults={"learning_rate": 4e-3})
    monkeypatch.setitem(pelt_core.methods.BUILTIN_METHODS, "lora", edited)  # an upgrade changed the preset
    second = ready.submit_sweep("sst2", ["lora"], [0], [8], "tiny-bert")
    assert not second.already_submitted and set(second.job_ids).isdisjoint(first.job_ids)


def test_a_key_in_the_services_own_sweep_key_form_is_refused_and_writes_nothing(ready: Registry) -> None:
    before = row_counts(ready)
    with pytest.raises(RegistryValidationError, match="idempotency_key: keys starting 'sweep:'"):
        ready.submit_sweep("sst2", ["lora"], [0], [8], "tiny-bert", idempotency_key="sweep:" + "0" * 64)
    assert row_counts(ready) == before


def test_a_sweep_whose_every_job_failed_or_was_cancelled_is_queued_again(ready: Registry) -> None:
    first = ready.submit_sweep("sst2", ["lora", "bitfit"], [0], [8], "tiny-bert")
    ready.cancel_sweep(first.id)
    second = ready.submit_sweep("sst2", ["lora", "bitfit"], [0], [8], "tiny-bert")
    assert not second.already_submitted and second.id != first.id
    assert ready.job_counts(sweep_id=second.id)["queued"] == 2


def test_again_with_an_idempotency_key_is_refused_and_writes_nothing(ready: Registry) -> None:
    before = row_counts(ready)
    with pytest.raises(RegistryValidationError) as refused:
        ready.submit_sweep("sst2", ["lora"], [0], [8], "tiny-bert", idempotency_key="k", again=True)
    assert refused.value.field == "again" and "idempotency_key" in str(refused.value)
    assert row_counts(ready) == before


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"k_values": [16, 41]}, "k_shot"),
        ({"methods": ["lora", "nope"]}, "method"),
        ({"hyperparameters": {"r": 2}}, "r"),  # houlsby has no rank
        ({"seeds": [0, 0]}, "seeds"),
        ({"seeds": []}, "seeds"),
        ({"k_values": [0]}, "k_values[0]"),
        ({"method_hyperparameters": {"prefix": {"prefix_length": 5}}}, "method_hyperparameters.prefix"),
    ],
)
def test_a_sweep_with_any_bad_part_writes_nothing(ready: Registry, changes: dict, field: str) -> None:
    before = row_counts(ready)
    arguments = {
        "task": "sst2",
        "methods": ["lora", "houlsby"],
        "seeds": [0, 1],
        "k_values": [16],
        "backbone": "tiny-bert",
        **changes,
    }
    with pytest.raises(RegistryValidationError) as refused:
        ready.submit_sweep(**arguments)
    assert refused.value.field == field
    assert row_counts(ready) == before


def test_a_sweep_takes_hyperparameters_for_one_method(ready: Registry) -> None:
    sweep = ready.submit_sweep(
        "sst2",
        ["lora", "houlsby"],
        [0],
        [None],
        "tiny-bert",
        {"lr": 1e-4},
        method_hyperparameters={"lora": {"r": 2}, "houlsby": {"bottleneck": 16, "lr": 1e-3}},
    )
    lora, houlsby = (ready.get_job(job_id) for job_id in sweep.job_ids)
    assert (lora.method_spec["modules"]["q"]["size"], lora.train_config["learning_rate"]) == (2, 1e-4)
    assert (houlsby.method_spec["modules"]["ffn_adapter"]["size"], houlsby.train_config["learning_rate"]) == (
        16,
        1e-3,
    )
