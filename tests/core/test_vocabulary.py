"""pelt_core.vocabulary: the one table of problem types, metric names (and the names other tools use),
and what each evaluation reports, checked against what pelt_core.metrics really computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pelt_core.metrics import compute_metrics
from pelt_core.vocabulary import (
    DEFAULT_METRIC,
    DIRECTIONS,
    METRIC_ALIASES,
    METRICS,
    METRICS_BY_NAME,
    MULTI_LABEL,
    PROBLEM_TYPES,
    REGRESSION,
    SINGLE_LABEL,
    canonical_metric,
    canonical_problem_type,
    check_task_metric,
    metric_direction,
    metrics_table_markdown,
    reported_metrics,
)

README = Path(__file__).resolve().parents[2] / "README.md"


def evaluation_of(problem_type: str, num_labels: int) -> set[str]:
    """The metric names an evaluation reports: pelt_core.metrics' own, plus the dev loss (pelt_core.train)."""
    rng = np.random.default_rng(0)
    rows = 12
    if problem_type == REGRESSION:
        logits, labels = rng.normal(size=(rows, 1)), rng.normal(size=rows)
    elif problem_type == MULTI_LABEL:
        logits, labels = rng.normal(size=(rows, num_labels)), rng.integers(0, 2, size=(rows, num_labels))
    else:
        logits, labels = rng.normal(size=(rows, num_labels)), rng.integers(0, num_labels, size=rows)
    return {*compute_metrics(problem_type, logits, labels), "loss"}


@pytest.mark.parametrize(
    ("problem_type", "num_labels"),
    [(SINGLE_LABEL, 2), (SINGLE_LABEL, 3), (SINGLE_LABEL, 5), (MULTI_LABEL, 3), (REGRESSION, 1)],
)
def test_the_table_names_exactly_what_an_evaluation_reports(problem_type: str, num_labels: int) -> None:
    assert set(reported_metrics(problem_type, num_labels)) == evaluation_of(problem_type, num_labels)


def test_names_and_aliases_are_distinct_and_every_row_is_well_formed() -> None:
    names = [metric.name for metric in METRICS]
    aliases = [alias for metric in METRICS for alias in metric.aliases]
    assert len(set(names)) == len(names) and len(set(aliases)) == len(aliases)
    assert not set(names) & set(aliases)
    for metric in METRICS:
        assert metric.direction in DIRECTIONS and metric.doc
        assert metric.problem_types and set(metric.problem_types) <= set(PROBLEM_TYPES)
        assert not metric.binary_only or metric.problem_types == (SINGLE_LABEL,)
    for problem_type in PROBLEM_TYPES:
        assert DEFAULT_METRIC[problem_type] in reported_metrics(problem_type)


@pytest.mark.parametrize(
    ("name", "canonical", "direction"),
    [
        ("matthews_correlation", "matthews", "max"),
        ("mcc", "matthews", "max"),
        ("f1_macro", "macro_f1", "max"),
        ("pearsonr", "pearson", "max"),
        ("mean_absolute_error", "mae", "min"),
        ("eval_loss", "loss", "min"),
        ("accuracy", "accuracy", "max"),
    ],
)
def test_a_name_other_tools_use_means_pelts_metric(name: str, canonical: str, direction: str) -> None:
    assert canonical_metric(name) == canonical and METRIC_ALIASES.get(name, name) == canonical
    assert metric_direction(name) == direction == METRICS_BY_NAME[canonical].direction


def test_an_unknown_metric_is_refused_with_the_table() -> None:
    with pytest.raises(
        ValueError, match=r"'bleu' is not a metric pelt reports; .*matthews \(matthews_correlation"
    ):
        canonical_metric("bleu")


def test_f1_is_allowed_for_two_classes_or_an_unknown_count_and_refused_for_three_naming_what_applies() -> (
    None
):
    assert check_task_metric("binary_f1", SINGLE_LABEL, 2) == "f1"
    assert check_task_metric("f1", "classification", None) == "f1"
    with pytest.raises(ValueError) as refused:
        check_task_metric("f1", SINGLE_LABEL, 3)
    assert str(refused.value) == (
        "'f1' is reported for two classes only, and this task has 3: use one of accuracy, macro_f1, matthews, loss"
    )
    with pytest.raises(ValueError, match="'mcc' is not reported for multi_label_classification: use one of"):
        check_task_metric("mcc", MULTI_LABEL)


def test_problem_type_aliases_and_an_unknown_problem_type() -> None:
    assert canonical_problem_type("multi_label") == MULTI_LABEL
    with pytest.raises(ValueError, match="'ranking' is not a problem type; use one of single_label"):
        canonical_problem_type("ranking")


def test_readme_shows_the_metric_table() -> None:
    assert metrics_table_markdown() in README.read_text()
