"""Limits of numbers (issue #11, findings 5, 7 and 12): one table of ranges (pelt_core/limits.py) that the
CLI, the API, the registry and the trainer all apply; ranges that depend on the backbone; a memory
estimate under a worker's budget; sweep seeds and sizes; a busy registry answers 503, never 500.

Every refused request is a 4xx naming the field and writes nothing."""

from __future__ import annotations

import math
import sqlite3
import threading
from pathlib import Path

import pytest

from pelt_core import limits
from pelt_core.config import ConfigError, TrainConfig, parse_settings
from pelt_core.limits import LimitError, Range, check_against_backbone, estimate_job_memory
from pelt_core.limits_table import limits_table_markdown
from pelt_core.methods import get_method
from pelt_core.spec import MethodSpec, SpecError
from services.errors import classify
from services.registry import Registry, RegistryValidationError
from services.registry.db import SQLiteWriteGate, sqlite_path
from services.registry.errors import RegistryBusyError
from services.settings import Settings
from tests.api.conftest import BACKBONE, Api
from tests.api.helpers import refused

ROOT = Path(__file__).resolve().parents[2]
TINY_FACTS = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 4,
    "head_dim": 8,
    "intermediate_size": 64,
    "max_positions": 64,
    "vocab_size": 114,
    "num_parameters": 40_000,
}
SIZED = "tiny-bert-facts"  # the tiny backbone registered with its facts


def all_ranges() -> list[tuple[str, Range]]:
    tables = {"train": limits.TRAIN_RANGES, "spec": limits.SPEC_RANGES, "compose": limits.COMPOSE_RANGES}
    return [(f"{table}.{name}", bound) for table, ranges in tables.items() for name, bound in ranges.items()]


@pytest.fixture
def sized(api: Api, tiny_bert_dir: Path) -> str:
    """The tiny backbone again, registered with its facts (so ranges that depend on it apply)."""
    content_hash = api.registry.get_backbone(BACKBONE).content_hash
    api.registry.register_backbone(SIZED, str(tiny_bert_dir), content_hash, facts=TINY_FACTS)
    return SIZED


# --- the table ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "bound"), all_ranges(), ids=[name for name, _ in all_ranges()])
def test_every_range_refuses_non_numbers_non_finite_numbers_and_values_outside_it(field, bound):
    for value in (True, "1", None, [1], math.inf, -math.inf, math.nan):
        with pytest.raises(LimitError, match=f"^{field}: ") as caught:
            bound.check(value, field)
        assert caught.value.field == field
    for outside in (
        (bound.low - 1) if bound.low is not None else None,
        (bound.high + 1) if bound.high is not None else None,
        2**70,
        -(2**70),
    ):
        if outside is not None and not (bound.low is None and outside < 0):
            with pytest.raises(LimitError, match=f"^{field}: "):
                bound.check(outside, field)
    if bound.kind == "int":
        with pytest.raises(LimitError):
            bound.check(float(bound.low or 1), field)  # 1.0 is not a whole number here


def test_command_line_text_is_read_through_the_table_and_inf_nan_are_refused():
    assert parse_settings(
        {
            "lr": "2e-3",
            "epochs": "5",
            "r": "16",
            "q.size": "4",
            "max_steps": "none",
            "layers": "0,1",
            "gate": "true",
            "pooling": "mean",
        }
    ) == {
        "lr": 2e-3,
        "epochs": 5.0,
        "r": 16,
        "q.size": 4,
        "max_steps": None,
        "layers": [0, 1],
        "gate": True,
        "pooling": "mean",
    }
    for key, text in (
        ("epochs", "inf"),
        ("lr", "nan"),
        ("max_grad_norm", "Infinity"),
        ("weight_decay", "-nan"),
        ("epochs", "1e400"),
        ("batch_size", "1e3"),
        ("r", "1e9"),
        ("seed", str(2**63)),
    ):
        with pytest.raises(ConfigError, match=f"^{key}: "):
            parse_settings({key: text})


def test_one_alias_table_says_what_r_bottleneck_and_prefix_length_set_everywhere():
    from pelt_core.spec import SIZE_ALIASES
    from services.registry.validation import check_json_numbers

    kinds = {"lora": {"lora_q", "lora_v"}, "adapter": {"adapter"}, "prefix": {"prefix"}}
    for alias, kind in SIZE_ALIASES.items():
        assert parse_settings({alias: "4"}) == {alias: 4}  # the command line reads it as the size it is
        with pytest.raises(ConfigError, match=f"^{alias}: must be in \\[1, 16384\\]"):
            parse_settings({alias: "0"})
        with pytest.raises(RegistryValidationError) as caught:  # JSON: a number, never text
            check_json_numbers({alias: "4"})
        assert caught.value.field == alias
        spec = get_method("unipelt", {alias: 4})
        assert {role for role, module in spec.modules.items() if module.size == 4} == kinds[kind]


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"epochs": 1e308}, "epochs"),
        ({"max_steps": 2**70}, "max_steps"),
        ({"batch_size": 2**70}, "batch_size"),
        ({"max_length": 10**9}, "max_length"),
        ({"learning_rate": math.nan}, "learning_rate"),
        ({"epochs": "inf"}, "epochs"),  # text (the CLI's) is read by the table, which refuses inf and nan
        ({"max_grad_norm": "1e400"}, "max_grad_norm"),
        ({"seed": 2**31}, "seed"),
    ],
)
def test_training_hyperparameters_beyond_their_range_are_refused_by_the_trainer_config(values, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        TrainConfig.from_dict(values)


def test_a_method_spec_with_a_huge_size_or_too_many_modules_is_refused():
    with pytest.raises(SpecError, match=r"lora\.modules\.q\.size: must be in \[1, 16384\]"):
        get_method("lora", {"r": 10**9})
    with pytest.raises(SpecError, match=r"size"):
        get_method("lora", {"q.size": 10**6})
    big = {"name": "big", "modules": {"a": {"form": "bottleneck", "representation": "ffn", "size": 10**9}}}
    with pytest.raises(SpecError, match=r"big\.modules\.a\.size"):
        MethodSpec.from_dict(big)
    many = {
        "name": "many",
        "modules": {
            f"m{i}": {"form": "bottleneck", "representation": "ffn", "size": 2}
            for i in range(limits.MAX_MODULES + 1)
        },
    }
    with pytest.raises(SpecError, match="modules"):
        MethodSpec.from_dict(many)
    with pytest.raises(SpecError, match="scale"):
        get_method("scaled_parallel_adapter", {"scale": math.inf})


def test_ranks_lengths_and_layers_are_bounded_by_the_backbone():
    config = TrainConfig(max_length=64).to_dict()
    check_against_backbone(config, get_method("lora", {"r": 32}).to_dict(), TINY_FACTS)  # r = hidden: allowed
    cases = [
        (TrainConfig(max_length=65).to_dict(), get_method("lora").to_dict(), "max_length"),
        (config, get_method("lora", {"r": 33}).to_dict(), "lora.modules.q.size"),
        (config, get_method("lora", {"layers": "0,2"}).to_dict(), "lora.modules.q.layers"),
        (config, get_method("prefix", {"prefix_length": 65}).to_dict(), "prefix.modules.prefix.size"),
    ]
    for train_config, spec, field in cases:
        with pytest.raises(LimitError) as caught:
            check_against_backbone(train_config, spec, TINY_FACTS)
        assert caught.value.field == field, caught.value
    # an adapter may be wider than the backbone (the built-in parallel adapters are 512 wide): memory bounds it
    check_against_backbone(config, get_method("pfeiffer", {"bottleneck": 512}).to_dict(), TINY_FACTS)
    check_against_backbone(
        TrainConfig(max_length=10**5).to_dict(), get_method("lora").to_dict(), {}
    )  # no facts


def test_a_job_whose_memory_estimate_exceeds_the_budget_is_refused_naming_what_to_lower():
    spec = get_method("lora").to_dict()
    small = TrainConfig(max_length=64, batch_size=16).to_dict()
    estimate = estimate_job_memory(small, spec, TINY_FACTS)
    assert 0 < estimate.total < 64 << 20 and estimate.backbone == 4 * TINY_FACTS["num_parameters"]
    check_against_backbone(small, spec, TINY_FACTS, memory_budget=1 << 30)
    large = TrainConfig(max_length=64, batch_size=4096).to_dict()
    assert estimate_job_memory(large, spec, TINY_FACTS).total > 200 * estimate.total
    with pytest.raises(LimitError, match=r"more than a worker's 1\.0 GiB") as caught:
        check_against_backbone(large, spec, TINY_FACTS, memory_budget=1 << 30)
    assert caught.value.field == "batch_size"
    wide = get_method("prefix", {"reparam_hidden": 16_384}).to_dict()
    smollm = {
        "hidden_size": 576,
        "num_layers": 30,
        "num_heads": 9,
        "intermediate_size": 1536,
        "max_positions": 8192,
        "num_parameters": 134_515_008,
    }
    with pytest.raises(LimitError) as caught:
        check_against_backbone(small, wide, smollm, memory_budget=4 << 30)
    assert caught.value.field == "prefix.modules.prefix.size"
    full = get_method("full").to_dict()  # four copies of SmolLM2's layers: about 1.4 GiB
    one_row = TrainConfig(max_length=64, batch_size=1, eval_batch_size=1).to_dict()
    check_against_backbone(one_row, full, smollm, memory_budget=4 << 30)
    with pytest.raises(
        LimitError, match=r"full trains dense deltas as large as the backbone's layers"
    ) as caught:
        check_against_backbone(one_row, full, smollm, memory_budget=2 << 30)
    assert caught.value.field == "method"


def test_the_trainer_refuses_a_rank_above_the_backbone_with_the_registrys_message(tmp_path):
    from pelt_core.model import JobDelta
    from pelt_core.testing import tiny_bert

    backbone = tiny_bert(str(tmp_path))
    with pytest.raises(SpecError, match=r"^lora\.modules\.q\.size: must be at most 32, min\(d_in, d_out\)"):
        JobDelta(get_method("lora", {"r": 4096}), backbone, num_labels=2)
    JobDelta(get_method("lora", {"r": 32}), backbone, num_labels=2)


def test_the_readme_lists_the_table_of_limits():
    assert limits_table_markdown() in (ROOT / "README.md").read_text()


# --- over the API: refused with the field named, nothing queued or registered ------------------------------


@pytest.mark.parametrize(
    ("hyperparameters", "field"),
    [
        ({"r": 10**9}, "r"),
        ({"q.size": 10**6}, "q.size"),
        ({"epochs": 1e308}, "epochs"),
        ({"max_steps": 2**70}, "max_steps"),
        ({"batch_size": 2**70}, "batch_size"),
        ({"max_length": 10**9}, "max_length"),
        ({"epochs": "inf"}, "epochs"),
        ({"lr": "nan"}, "lr"),
        ({"max_grad_norm": "inf"}, "max_grad_norm"),
        ({"weight_decay": "nan"}, "weight_decay"),
        ({"lr": "1e-3"}, "lr"),
    ],
)
def test_hyperparameters_out_of_range_or_not_numbers_are_422_naming_the_field_and_queue_nothing(
    client, toy_task, api, hyperparameters, field
):
    refused(
        lambda: client.submit(toy_task, "lora", backbone=BACKBONE, hyperparameters=hyperparameters),
        422,
        field,
    )
    assert api.registry.list_jobs() == []


def test_a_job_of_more_steps_than_the_bound_is_422_naming_epochs(client, toy_task, api, monkeypatch):
    monkeypatch.setattr(limits, "MAX_TRAIN_STEPS", 1000)  # 200 rows, 10 epochs at batch 1: 2,000 steps
    refused(
        lambda: client.submit(toy_task, "lora", backbone=BACKBONE, hyperparameters={"epochs": 10, "bs": 1}),
        422,
        "epochs",
        "2,000 steps; at most 1,000",
    )
    assert api.registry.list_jobs() == []


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_json_numbers_are_422_and_queue_nothing(client, toy_task, api, literal):
    body = f'{{"task": "toy", "method": "lora", "backbone": "{BACKBONE}", "hyperparameters": {{"epochs": {literal}}}}}'
    response = client.http.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "epochs"
    assert api.registry.list_jobs() == []


def test_a_method_spec_with_a_huge_size_is_422_and_not_registered(client, api):
    spec = {"name": "huge", "modules": {"a": {"form": "bottleneck", "representation": "ffn", "size": 10**9}}}
    refused(lambda: client.register_method(spec), 422, "huge.modules.a.size")
    assert "huge" not in [m.name for m in client.methods()]


@pytest.mark.parametrize(
    ("hyperparameters", "field", "words"),
    [
        ({"r": 33}, "r", "at most 32"),
        ({"layers": "0,2"}, "layers", "the backbone has 2 layers"),
        ({"max_length": 65}, "max_length", "at most 64, the backbone's positions"),
    ],
)
def test_ranks_layers_and_lengths_beyond_the_backbone_are_422(
    client, toy_task, api, sized, hyperparameters, field, words
):
    values = {
        key: ([int(i) for i in value.split(",")] if key == "layers" else value)
        for key, value in hyperparameters.items()
    }
    refused(
        lambda: client.submit(toy_task, "lora", backbone=sized, hyperparameters=values), 422, field, words
    )
    refused(
        lambda: client.sweep(
            toy_task, ["bitfit", "lora"], backbone=sized, method_hyperparameters={"lora": values}
        ),
        422,
        field,
        words,
    )
    assert api.registry.list_jobs() == []


def test_the_tasks_default_length_is_cut_to_the_backbones_positions(client, toy_task, api, sized):
    job = client.submit(toy_task, "lora", backbone=sized)  # the task says 128; the backbone takes 64
    assert job.train_config["max_length"] == 64
    registry_alone = api.registry.submit_job(toy_task, "lora", BACKBONE)  # a backbone without facts: not cut
    assert (
        api.registry.get_backbone(BACKBONE).facts is None and registry_alone.train_config["max_length"] == 128
    )


def test_a_backbone_registered_without_facts_gets_them_from_its_config_and_its_bounds_apply(
    client, toy_task, api, tiny_bert_dir
):
    from pelt_core.backbones import Backbone

    assert api.registry.get_backbone(BACKBONE).facts is None  # as a backbone registered before migration 0006
    refused(
        lambda: client.submit(toy_task, "lora", backbone=BACKBONE, hyperparameters={"r": 33}),
        422,
        "r",
        "at most 32",
    )
    assert api.registry.list_jobs() == []
    facts, loaded = api.registry.get_backbone(BACKBONE).facts, Backbone.load(str(tiny_bert_dir)).facts
    assert {key: value for key, value in facts.items() if key != "num_parameters"} == {
        key: value for key, value in loaded.items() if key != "num_parameters"
    }
    assert facts["num_parameters"] == pytest.approx(
        loaded["num_parameters"], rel=0.05
    )  # estimated from the config
    assert (
        client.submit(toy_task, "lora", backbone=BACKBONE).train_config["max_length"]
        == facts["max_positions"]
    )


def test_a_tasks_max_length_has_the_one_range_of_the_table_in_the_api_and_the_registry():
    from pydantic import ValidationError

    from services.api.schemas import TaskDefinition
    from services.registry.validation import check_task_definition

    bound = limits.TRAIN_RANGES["max_length"]
    definition = {
        "text_fields": ["sentence"],
        "label_field": "label",
        "problem_type": "single_label_classification",
        "metric": "accuracy",
        "metric_direction": None,
        "label_names": None,
    }
    assert check_task_definition(**definition, max_length=int(bound.high)).max_length == bound.high
    assert TaskDefinition(text_fields="sentence", max_length=int(bound.high)).max_length == bound.high
    for outside in (int(bound.low) - 1, int(bound.high) + 1):
        with pytest.raises(RegistryValidationError, match=r"\[1, 131072\]") as caught:
            check_task_definition(**definition, max_length=outside)
        assert caught.value.field == "max_length"
        with pytest.raises(ValidationError):
            TaskDefinition(text_fields="sentence", max_length=outside)


def test_a_job_over_the_worker_memory_budget_is_422_naming_what_to_lower(client, toy_task, api, sized):
    api.registry.worker_memory_bytes = 1 << 30
    refused(
        lambda: client.submit(toy_task, "lora", backbone=sized, hyperparameters={"batch_size": 4096}),
        422,
        "batch_size",
        "PELT_WORKER_MEMORY_BYTES",
    )
    assert api.registry.list_jobs() == []
    assert client.submit(toy_task, "lora", backbone=sized, hyperparameters={"batch_size": 16})


def test_a_job_no_worker_of_the_cluster_can_hold_is_refused_naming_the_largest_worker(
    client, toy_task, api, sized
):
    """The leading dispatcher reports its workers' budgets (measured where they run: their cgroup limit
    included); a submit checks against the largest worker that could run the job, not the API host's."""
    api.registry.worker_memory_bytes = 64 << 30  # the API's host: plenty
    registry = api.registry
    assert registry.acquire_leadership("pelt", "dispatcher-a", ttl_seconds=60)
    assert registry.renew_leadership("pelt", "dispatcher-a", 60, worker_memory={"cpu": 1 << 30})
    assert registry.largest_workers() == {"cpu": 1 << 30}
    big = {"batch_size": 4096}
    refused(
        lambda: client.submit(toy_task, "lora", backbone=sized, hyperparameters=big, device="cpu"),
        422,
        "batch_size",
        "the cluster's largest CPU worker: 1.0 GiB",
    )
    refused(lambda: client.sweep(toy_task, ["lora"], backbone=sized, hyperparameters=big), 422, "batch_size")
    assert registry.list_jobs() == []
    # no GPU worker reported (one may join): a GPU job is checked against PELT_WORKER_MEMORY_BYTES
    assert client.submit(toy_task, "lora", backbone=sized, hyperparameters=big, device="gpu")
    registry.renew_leadership("pelt", "dispatcher-a", 60, worker_memory={"cpu": 1 << 30, "gpu": 80 << 30})
    assert client.submit(
        toy_task, "lora", backbone=sized, hyperparameters=big
    )  # `any`: the GPU worker holds it
    registry.release_leadership("pelt", "dispatcher-a")  # no leader: nothing reported, the API host's budget
    assert client.submit(toy_task, "lora", backbone=sized, hyperparameters=big, device="cpu")


@pytest.mark.parametrize(("memory_gib", "probes"), [(8, 1), (24, 2), (4, 1), (64, 2)])
def test_the_dataset_probes_at_once_follow_the_apis_memory(monkeypatch, memory_gib, probes):
    """By default as many probes (each up to PELT_DATASET_PROBE_MEMORY_BYTES: 6 GiB with the default 4 GiB
    datasets) as the machine's memory, its cgroup limit included, holds beside 2 GiB for the API: one in the
    Kubernetes API pod's 8 GiB, never none, at most the table's default; an explicit value is kept."""
    import services.settings as settings_module

    monkeypatch.setattr(settings_module, "machine_memory_bytes", lambda: memory_gib << 30)
    assert Settings(data_dir="/nonexistent").dataset_probe_concurrency == probes
    assert Settings(data_dir="/nonexistent", dataset_probe_concurrency=3).dataset_probe_concurrency == 3


def test_the_default_budget_is_the_machines_memory_and_the_sweep_cap_comes_from_the_table():
    settings = Settings(data_dir="/nonexistent")
    assert settings.worker_memory_bytes == limits.machine_memory_bytes()  # see test_workers_side.py
    assert settings.max_sweep_jobs == limits.DEFAULT_MAX_SWEEP_JOBS


# --- sweeps ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**63, 2**40, 2**31, -1])
def test_sweep_seeds_outside_the_job_seed_range_are_422_naming_the_entry(client, toy_task, api, seed):
    refused(lambda: client.sweep(toy_task, ["lora"], backbone=BACKBONE, seeds=[0, seed]), 422, "seeds.1")
    with pytest.raises(RegistryValidationError) as caught:
        api.registry.submit_sweep(toy_task, ["lora"], [0, seed], [None], BACKBONE)
    assert caught.value.field == "seeds[1]"
    assert api.registry.list_jobs() == []
    assert client.sweep(toy_task, ["lora"], backbone=BACKBONE, seeds=[2**31 - 1]).seeds == [2**31 - 1]


def test_a_sweep_above_the_job_cap_is_422_and_queues_nothing(client, toy_task, api):
    api.registry.max_sweep_jobs = 5
    refused(
        lambda: client.sweep(toy_task, ["lora", "bitfit"], backbone=BACKBONE, seeds=[0, 1, 2]),
        422,
        "methods",
        "6 jobs; at most 5 (PELT_MAX_SWEEP_JOBS)",
    )
    assert api.registry.list_jobs() == []
    assert len(client.sweep(toy_task, ["lora"], backbone=BACKBONE, seeds=[0, 1, 2, 3, 4]).job_ids) == 5


# --- a busy registry -----------------------------------------------------------------------------------------


def hold_write_turn(database: Path, held: threading.Event, release: threading.Event) -> threading.Thread:
    """Another writer holding the registry's write gate until `release` is set."""

    def hold() -> None:
        gate = SQLiteWriteGate(database, timeout=5)
        try:
            with gate.hold():
                held.set()
                release.wait(30)
        finally:
            gate.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    return thread


def test_a_busy_registry_answers_503_with_retry_after_and_writes_nothing(client, toy_task, api):
    job = client.submit(toy_task, "lora", backbone=BACKBONE)
    api.registry._gate.timeout = 0.05  # how long a writer waits for its turn (PELT_DB_BUSY_TIMEOUT_SECONDS)
    held, release = threading.Event(), threading.Event()
    holder = hold_write_turn(sqlite_path(api.registry.engine.url).resolve(), held, release)
    try:
        response = client.http.post(f"/v1/jobs/{job.id}/cancel")
        assert response.status_code == 503, response.text
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["type"] == "RegistryBusyError"
        response = client.http.post(
            "/v1/jobs", json={"task": toy_task, "method": "lora", "backbone": BACKBONE}
        )
        assert response.status_code == 503
    finally:
        release.set()
        holder.join()
    assert [j.status for j in api.registry.list_jobs()] == ["queued"]
    assert client.cancel(job.id).status == "cancelled"


def test_sqlite_database_is_locked_becomes_a_registry_busy_error(api, tmp_path):
    path = sqlite_path(api.registry.engine.url)
    quick = Registry(f"sqlite:///{path}", settings=Settings(data_dir=tmp_path, db_busy_timeout_seconds=0.05))
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")  # a writer that does not use the gate (another tool)
        with pytest.raises(RegistryBusyError) as caught:
            quick.create_api_token("busy")
        view = classify(caught.value)
        assert view is not None and view.status == 503 and "Retry-After" in (view.headers or {})
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        quick.close()
    assert "busy" not in [t.name for t in api.registry.list_api_tokens()]


# --- the command lines ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("epochs=inf", "epochs: must be a finite number"),
        ("lr=nan", "lr: must be a finite number"),
        ("r=1000000", "r: must be in [1, 16384]"),
        ("max_length=65", "max_length: must be at most 64, the backbone's positions"),
        ("r=64", "must be at most 32, min(d_in, d_out)"),
    ],
)
def test_pelt_train_refuses_what_the_service_refuses(tiny_bert_dir, toy_files, tmp_path, setting, words):
    from click.testing import CliRunner

    from services.cli import main

    result = CliRunner().invoke(
        main,
        [
            "train",
            "--backbone",
            str(tiny_bert_dir),
            "--train",
            str(toy_files["train"]),
            "--method",
            "lora",
            "--set",
            setting,
            "--out",
            str(tmp_path / "out"),
            "--quiet",
        ],
    )
    assert result.exit_code == 1, result.output
    assert words in result.output
    assert not (tmp_path / "out").exists()


def test_the_service_cli_reads_set_values_through_the_table_before_sending_anything():
    import click

    from services.commands.common import parse_set_options

    assert parse_set_options(("lr=2e-3", "r=8", "note=[1, 2]", "max_steps=none")) == {
        "lr": 2e-3,
        "r": 8,
        "note": [1, 2],
        "max_steps": None,
    }
    assert parse_set_options(("weights=[0.7,0.3]", "density=0.5", "how=ties"), compose=True) == {
        "weights": [0.7, 0.3],
        "density": 0.5,
        "how": "ties",
    }
    for settings, compose in (
        (("epochs=inf",), False),
        (("seed=9223372036854775808",), False),
        (("weights=1,nan",), True),
        (("lora_rank=1e6",), True),
    ):
        with pytest.raises(click.BadParameter):
            parse_set_options(settings, compose=compose)
