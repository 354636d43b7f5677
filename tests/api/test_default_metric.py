"""A task registered without a metric gets its problem type's default (`pelt_core.vocabulary.DEFAULT_METRIC`):
`pearson` for regression, `micro_f1` for multi-label, `accuracy` for single-label, whether it comes through
the Registry, the HTTP API or `pelt task register`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pelt_core.vocabulary import DEFAULT_METRIC, MULTI_LABEL, REGRESSION, SINGLE_LABEL
from services.api.schemas import TaskDefinition
from services.registry.testing import write_jsonl
from tests.api.conftest import Api

DEFAULTS = [(SINGLE_LABEL, "accuracy"), (MULTI_LABEL, "micro_f1"), (REGRESSION, "pearson")]


def label(problem_type: str, index: int) -> Any:
    if problem_type == MULTI_LABEL:
        return ["news", "sport"][: 1 + index % 2]
    if problem_type == REGRESSION:
        return index % 5 / 2
    return index % 2


def task_file(folder: Path, problem_type: str) -> Path:
    """A tiny training split whose labels fit `problem_type`."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"text": f"row {index} of the task", "label": label(problem_type, index)} for index in range(12)]
    return write_jsonl(folder / "train.jsonl", rows)


def test_the_default_metrics_are_pelt_cores() -> None:
    assert dict(DEFAULTS) == DEFAULT_METRIC


@pytest.mark.parametrize(("problem_type", "metric"), DEFAULTS)
def test_the_registry_gives_a_task_without_a_metric_its_problem_types_default(
    api: Api, tmp_path: Path, problem_type: str, metric: str
) -> None:
    train = task_file(tmp_path, problem_type)
    task = api.registry.register_task("scored", train, text_fields="text", problem_type=problem_type)
    assert (task.metric, task.metric_direction) == (metric, "max")


@pytest.mark.parametrize(("problem_type", "metric"), DEFAULTS)
@pytest.mark.parametrize("given", ["left out", "null"])
def test_the_api_gives_a_task_without_a_metric_its_problem_types_default(
    api: Api, tmp_path: Path, problem_type: str, metric: str, given: str
) -> None:
    definition: dict[str, Any] = {"text_fields": ["text"], "problem_type": problem_type}
    if given == "null":
        definition["metric"] = None
    train = task_file(tmp_path, problem_type)
    with api.client() as client:
        response = client.http.post(
            "/v1/tasks",
            data={"name": "scored", "definition": json.dumps(definition)},
            files={"train": ("train.jsonl", train.read_bytes())},
        )
    assert response.status_code in (200, 201), response.text
    assert (response.json()["metric"], response.json()["metric_direction"]) == (metric, "max")
    assert TaskDefinition(text_fields="text").metric is None


@pytest.mark.parametrize(("problem_type", "metric"), DEFAULTS)
def test_the_python_client_gives_a_task_without_a_metric_its_problem_types_default(
    api: Api, tmp_path: Path, problem_type: str, metric: str
) -> None:
    train = task_file(tmp_path, problem_type)
    with api.client() as client:
        task = client.register_task("scored", train, text_fields="text", problem_type=problem_type)
    assert (task.metric, task.metric_direction) == (metric, "max")


@pytest.mark.parametrize(("problem_type", "metric"), DEFAULTS)
def test_pelt_task_add_without_metric_gives_the_problem_types_default(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, problem_type: str, metric: str
) -> None:
    from services.commands import tasks

    monkeypatch.setattr(tasks, "PeltClient", api.client)
    train = task_file(tmp_path, problem_type)
    arguments = ["scored", "--train", str(train), "--text-field", "text", "--problem-type", problem_type]
    result = CliRunner().invoke(tasks.task_group, ["add", *arguments])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(f"metric {metric}")
    assert api.registry.get_task("scored").metric == metric


def test_pelt_task_add_says_the_default_metric_of_each_problem_type(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.commands import tasks

    monkeypatch.setenv("COLUMNS", "10000")  # one line per option
    help_text = " ".join(CliRunner().invoke(tasks.task_group, ["add", "--help"]).output.split())
    for problem_type, metric in DEFAULTS:
        assert f"{metric} for {problem_type}" in help_text
