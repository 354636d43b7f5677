"""A task's metric as users write it: the registry accepts the names other tools use, stores the name
pelt_core's results carry, and refuses a metric no job of the task could report (a custom one, `f1` for
three classes), since such a job would fail when its result lacks the task's metric.

The specification: a job of a task with any metric the registry allows trains (tiny BERT, a few steps),
completes through the worker's registry lease, and its stored primary metric is the value the trainer
reported under that name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pelt_core.backbones import Backbone
from pelt_core.delta import read_manifest
from pelt_core.vocabulary import (
    METRIC_HELP,
    METRICS,
    MULTI_LABEL,
    REGRESSION,
    SINGLE_LABEL,
    reported_metrics,
)
from services.api.schemas import TaskDefinition
from services.commands.tasks import task_add
from services.dispatcher import RegistryLease
from services.dispatcher.job_specs import JobSpecs
from services.registry import Registry, RegistryValidationError
from services.registry.records import ResultRecord
from services.registry.testing import write_jsonl
from services.registry.validation import check_result, check_task_definition
from tests.workers.conftest import save_tiny_bert
from workers.backbone_store import LocalBackbones
from workers.job import LocalDeltaSink
from workers.worker import PeltWorker, WorkerConfig

BACKBONE = "tiny-bert"
CUES = ("good great", "bad awful", "boring not")  # the words that give away a row's class


def class_rows(count: int, classes: int) -> list[dict[str, Any]]:
    """Sentences ending in their class's cue words; every class appears."""
    return [
        {"text": f"w{i % 50} the movie {CUES[i % classes]}", "label": f"c{i % classes}"} for i in range(count)
    ]


def write_task_files(folder: Path, problem_type: str, classes: int = 3) -> dict[str, Path]:
    """Train and validation JSON Lines of a tiny task: `classes` classes, tag lists, or a score."""
    folder.mkdir(parents=True, exist_ok=True)
    splits = {"train": 24, "validation": 9}
    files = {}
    for split, count in splits.items():
        rows = class_rows(count, classes)
        if problem_type == MULTI_LABEL:
            rows = [
                {"text": row["text"], "label": [row["label"], "any"][: 1 + i % 2]}
                for i, row in enumerate(rows)
            ]
        elif problem_type == REGRESSION:
            rows = [{"text": row["text"], "label": float(i % 5) / 2} for i, row in enumerate(rows)]
        files[split] = write_jsonl(folder / f"{split}.jsonl", rows)
    return files


# --- names at registration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("problem_type", "given", "stored", "direction"),
    [
        (SINGLE_LABEL, "matthews_correlation", "matthews", "max"),
        (SINGLE_LABEL, "mcc", "matthews", "max"),
        (SINGLE_LABEL, "f1_macro", "macro_f1", "max"),
        (SINGLE_LABEL, "binary_f1", "f1", "max"),
        (SINGLE_LABEL, "eval_loss", "loss", "min"),
        (MULTI_LABEL, "f1_micro", "micro_f1", "max"),
        (REGRESSION, "pearsonr", "pearson", "max"),
        (REGRESSION, "spearmanr", "spearman", "max"),
        (REGRESSION, "mean_squared_error", "mse", "min"),
    ],
)
def test_a_metric_written_as_other_tools_write_it_is_stored_under_pelts_name(
    registry: Registry, tmp_path: Path, problem_type: str, given: str, stored: str, direction: str
) -> None:
    files = write_task_files(tmp_path, problem_type, classes=2)
    task = registry.register_task("t", files, text_fields="text", problem_type=problem_type, metric=given)
    assert (task.metric, task.metric_direction) == (stored, direction)
    again = registry.register_task("t", files, text_fields="text", problem_type=problem_type, metric=stored)
    assert again == task  # the alias and the name are one definition


def test_f1_on_a_three_class_task_is_refused_after_the_data_show_three_classes_and_nothing_is_written(
    registry: Registry, tmp_path: Path
) -> None:
    files = write_task_files(tmp_path, SINGLE_LABEL, classes=3)
    with pytest.raises(RegistryValidationError) as refused:
        registry.register_task("t", files, text_fields="text", metric="f1")
    assert refused.value.field == "metric"
    assert str(refused.value) == (
        "metric: 'f1' is reported for two classes only, and this task has 3: "
        "use one of accuracy, macro_f1, matthews, loss"
    )
    assert registry.list_tasks() == []


def test_f1_with_three_declared_label_names_is_refused_before_the_data_are_read(
    registry: Registry, tmp_path: Path
) -> None:
    with pytest.raises(RegistryValidationError, match="two classes only") as refused:
        registry.register_task(
            "t", tmp_path / "absent.jsonl", text_fields="text", metric="f1", label_names=["a", "b", "c"]
        )
    assert refused.value.field == "metric"


@pytest.mark.parametrize(
    ("problem_type", "metric", "allowed"),
    [
        (MULTI_LABEL, "f1", "accuracy, macro_f1, micro_f1, loss"),
        (MULTI_LABEL, "matthews", "accuracy, macro_f1, micro_f1, loss"),
        (SINGLE_LABEL, "pearsonr", "accuracy, f1, macro_f1, matthews, loss"),
        (REGRESSION, "accuracy", "pearson, spearman, mse, mae, loss"),
    ],
)
def test_a_metric_the_problem_types_evaluation_never_reports_is_refused_naming_those_that_apply(
    registry: Registry, tmp_path: Path, problem_type: str, metric: str, allowed: str
) -> None:
    files = write_task_files(tmp_path, problem_type, classes=2)
    with pytest.raises(RegistryValidationError) as refused:
        registry.register_task("t", files, text_fields="text", problem_type=problem_type, metric=metric)
    assert (
        str(refused.value) == f"metric: {metric!r} is not reported for {problem_type}: use one of {allowed}"
    )


def test_every_name_and_alias_of_the_table_is_accepted_for_the_problem_types_that_report_it() -> None:
    for metric in METRICS:
        for problem_type in metric.problem_types:
            for name in (metric.name, *metric.aliases):
                definition = check_task_definition(
                    text_fields="text",
                    label_field="label",
                    problem_type=problem_type,
                    metric=name,
                    metric_direction=None,
                    label_names=None,
                    max_length=128,
                )
                assert (definition.metric, definition.metric_direction) == (metric.name, metric.direction)


def test_the_cli_and_the_api_advertise_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")  # one line per option: the list is not wrapped
    help_text = CliRunner().invoke(task_add, ["--help"]).output
    assert METRIC_HELP in " ".join(help_text.split())
    assert METRIC_HELP in TaskDefinition.model_json_schema()["properties"]["metric"]["description"]


# --- the specification: each allowed metric trains and is stored -----------------------------------


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(folder, content hash) of the tiny BERT saved as a model folder (what a worker loads)."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    save_tiny_bert(folder)
    return str(folder), Backbone.load(str(folder)).content_hash


@pytest.fixture
def live_registry(migrated_url: str, tiny_bert_dir: tuple[str, str]) -> Iterator[Registry]:
    """A registry on the real clock (the worker's lease opens its own registry on the same database)."""
    with Registry(migrated_url, lease_seconds=60) as opened:
        opened.register_backbone(BACKBONE, *tiny_bert_dir)
        yield opened


@pytest.fixture
def train_job(
    live_registry: Registry, tmp_path: Path
) -> Callable[[str], tuple[ResultRecord, dict[str, Any]]]:
    """Run the task's next job as the dispatcher would (its JobSpec, a RegistryLease, a worker on the
    tiny BERT); returns the stored result and the metrics the trainer wrote into the delta's manifest."""
    specs, sink = JobSpecs(live_registry), LocalDeltaSink(tmp_path / "deltas")
    database_url = live_registry.engine.url.render_as_string(hide_password=False)
    worker = PeltWorker(
        "w-metrics",
        WorkerConfig(threads=None, heartbeat_seconds=5, lease_seconds=60),
        backbones=LocalBackbones(),
    )

    def run(task: str) -> tuple[ResultRecord, dict[str, Any]]:
        live_registry.submit_job(task, "lora", BACKBONE, {"max_steps": 2, "batch_size": 4, "bf16": "false"})
        job = live_registry.claim_job("w-metrics")
        assert job is not None
        lease = RegistryLease(
            database_url,
            job.id,
            "w-metrics",
            live_registry.lease_seconds,
            live_registry.retry_backoff_seconds,
            live_registry.retry_backoff_max_seconds,
        )
        outcome = worker.run(specs.build(job), lease, sink)
        assert outcome.status == "succeeded", outcome.error
        result = live_registry.get_result(job.id)
        assert result is not None and result.delta_uri is not None
        return result, read_manifest(Path(result.delta_uri.removeprefix("file://")))["extra"]["metrics"]

    return run


def register(registry: Registry, folder: Path, problem_type: str, metric: str, classes: int = 3) -> str:
    files = write_task_files(folder, problem_type, classes)
    name = f"{problem_type[:6]}-{classes}-{metric}"
    return registry.register_task(
        name, files, text_fields="text", problem_type=problem_type, metric=metric
    ).name


@pytest.mark.parametrize("metric", reported_metrics(SINGLE_LABEL, num_labels=3))
def test_a_three_class_task_with_each_allowed_metric_trains_and_stores_the_trainers_value(
    live_registry: Registry, train_job: Callable, tmp_path: Path, metric: str
) -> None:
    result, reported = train_job(register(live_registry, tmp_path / "data", SINGLE_LABEL, metric))
    assert result.primary_metric == reported[metric] == result.metrics[metric]


@pytest.mark.parametrize(
    ("problem_type", "classes", "metric", "stored"),
    [
        (SINGLE_LABEL, 2, "f1", "f1"),
        (MULTI_LABEL, 3, "micro_f1", "micro_f1"),
        (REGRESSION, 3, "pearsonr", "pearson"),
    ],
)
def test_f1_for_two_classes_micro_f1_for_tags_and_pearsonr_for_scores_train_and_are_stored(
    live_registry: Registry,
    train_job: Callable,
    tmp_path: Path,
    problem_type: str,
    classes: int,
    metric: str,
    stored: str,
) -> None:
    task = register(live_registry, tmp_path / "data", problem_type, metric, classes)
    assert live_registry.get_task(task).metric == stored
    result, reported = train_job(task)
    assert result.primary_metric == reported[stored] == result.metrics[stored]


@pytest.mark.parametrize(
    ("problem_type", "classes"), [(SINGLE_LABEL, 3), (SINGLE_LABEL, 2), (MULTI_LABEL, 3), (REGRESSION, 3)]
)
def test_the_registry_accepts_exactly_the_metrics_the_trainer_reports_for_the_task(
    live_registry: Registry, train_job: Callable, tmp_path: Path, problem_type: str, classes: int
) -> None:
    """A metric the trainer does not report (`f1` for three classes, a custom one) is refused: the registry
    would refuse such a job's result, and the worker would then fail the job for good."""
    _, reported = train_job(register(live_registry, tmp_path / "data", problem_type, "loss", classes))
    accepted = set()
    for metric in METRICS:
        try:
            register(live_registry, tmp_path / "data", problem_type, metric.name, classes)
            accepted.add(metric.name)
        except RegistryValidationError as refused:
            assert refused.field == "metric"
    assert accepted == set(reported)
    as_reported = {"metrics": reported, "trainable_params": 1, "total_params": 2, "train_seconds": 1.0}
    for metric in {"f1", "macro_recall"} - set(reported):
        with pytest.raises(RegistryValidationError, match=f"the task's primary metric {metric!r} is missing"):
            check_result(as_reported, metric)
