"""A task's checks against its data: its columns, rows and labels in the training split and in the split
its jobs evaluate on. Each raises RegistryValidationError naming the field (`source.<split>` for a split).

Registration refuses only what no job could train on: a missing column, empty or odd labels, evaluation
labels outside the task's classes, too few rows to hold out a dev split when there is no evaluation split.
Label values map to classes by the one rule the trainer uses too (`pelt_core.labels`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pelt_core import limits
from pelt_core.labels import class_names, label_index, problem_type_for
from pelt_core.vocabulary import MULTI_LABEL, SINGLE_LABEL, find_text_fields
from services.registry.dataset_probe import DatasetProbe, LabelSummary
from services.registry.errors import RegistryValidationError
from services.registry.validation import TaskDefinition, check_metric_for_labels

EVALUATION_SPLITS = ("validation", "dev", "test")  # a task's jobs evaluate on the first of these it has


def evaluation_split(split_sizes: Mapping[str, int]) -> str | None:
    """The split a task's jobs evaluate on (the first of validation, dev, test it has); None: each job
    holds out a dev split from the training rows instead (pelt_core.limits.dev_split_rows)."""
    return next((split for split in EVALUATION_SPLITS if split in split_sizes), None)


def held_out_rows(split_sizes: Mapping[str, int], train_size: int) -> int:
    """Training rows each job of the task holds out as its dev split (0 when it has an evaluation split)."""
    return 0 if evaluation_split(split_sizes) else limits.dev_split_rows(train_size)


def detect_text_fields(definition: TaskDefinition, probe: DatasetProbe, where: str) -> list[str]:
    """The task's text fields: as given, else the GLUE-style columns `pelt train` takes
    (`pelt_core.vocabulary.find_text_fields`); a RegistryValidationError naming `text_fields` if none fit."""
    if definition.text_fields:
        return list(definition.text_fields)
    found = find_text_fields([c for c in probe.columns if c != definition.label_field])
    if found is None:
        raise RegistryValidationError(
            "text_fields",
            f"cannot tell which column of {where} holds the text (columns: {', '.join(probe.columns)}); "
            "name it (--text-field, text_fields in the API)",
        )
    return list(found)


def detect_problem_type(definition: TaskDefinition, probe: DatasetProbe) -> str:
    """The task's problem type: as given, else by the one rule of `pelt_core.labels` from the training
    split's labels (lists: multi-label; numbers with a fractional part: regression; else single-label);
    declared class names (the task's or a ClassLabel) mean classification."""
    if definition.problem_type is not None:
        return definition.problem_type
    label = probe.label
    if label is None:  # no such column: check_task_against_data names it
        return SINGLE_LABEL
    if definition.label_names or label.names:
        return MULTI_LABEL if label.kind == "list" else SINGLE_LABEL
    try:
        return problem_type_for({label.kind}, label.fractional, definition.label_field)
    except ValueError as exc:
        raise RegistryValidationError("problem_type", str(exc)) from None


def check_task_against_data(definition: TaskDefinition, probe: DatasetProbe, where: str) -> list[str] | None:
    """Check the fields exist in the training data (`where` names it) and in the split jobs evaluate on,
    and that their labels fit the task's classes; return the label names (given or inferred).

    Refused: only what no job could train on (a missing column, empty or odd labels, evaluation labels
    outside the classes, too few rows to hold out a dev split when there is no evaluation split)."""
    columns = ", ".join(probe.columns)
    for name in definition.text_fields:
        if name not in probe.columns:
            raise RegistryValidationError(
                "text_fields",
                f"{name!r} is not a column of {where} (columns: {columns})",
            )
    if definition.label_field not in probe.columns or probe.label is None:
        raise RegistryValidationError(
            "label_field",
            f"{definition.label_field!r} is not a column of {where} (columns: {columns})",
        )
    if probe.train_rows < 1:
        raise RegistryValidationError("source", f"{where} has no rows")
    evaluation = evaluation_split(probe.split_sizes)
    if evaluation is None and probe.train_rows < 2:
        raise RegistryValidationError(
            "source.validation",
            f"the task has no validation split and {probe.train_rows} training row: each job then holds out a "
            "dev split from the training rows, which needs at least 2 (or send a validation split)",
        )
    label = probe.label
    if label.nulls:
        raise RegistryValidationError(
            "label_field", f"{definition.label_field!r} is empty in {label.nulls} training rows of {where}"
        )
    _check_label_kind(definition, label, "label_field", where)
    names: list[str] | None = None
    if definition.problem_type != "regression":
        given = definition.label_names or label.names  # declared or a ClassLabel: positions apply
        names = given or _names_from_values(label.values or [], definition.label_field)
        _check_labels_fit(
            names,
            label.values or [],
            definition.label_field,
            "label_names" if definition.label_names else "label_field",
            where,
            positions=bool(given),
        )
    if evaluation is not None:
        _check_evaluation_split(
            definition, probe, evaluation, names, positions=bool(definition.label_names or label.names)
        )
    check_metric_for_labels(definition, names)  # `f1` needs two classes, known only now
    return None if definition.problem_type == "regression" else names


def _check_label_kind(definition: TaskDefinition, label: LabelSummary, field: str, where: str) -> None:
    """The label column's kind fits the problem type; class labels are few enough to list."""
    name = definition.label_field
    if definition.problem_type == "regression":
        if label.kind not in ("integer", "float"):
            raise RegistryValidationError(
                field, f"a regression label must be numeric; {name!r} holds {label.kind} values in {where}"
            )
        if label.non_finite:
            raise RegistryValidationError(field, f"{name!r} holds NaN or infinite values in {where}")
        return
    if definition.problem_type == "multi_label_classification" and label.kind != "list":
        raise RegistryValidationError(
            field,
            f"a multi-label task needs a list of labels per row; {name!r} holds {label.kind} values in {where}",
        )
    if definition.problem_type == "single_label_classification" and label.kind == "list":
        raise RegistryValidationError(
            "problem_type" if field == "label_field" else field,
            f"{name!r} holds lists of labels in {where}: use multi_label_classification",
        )
    if label.values is None:
        raise RegistryValidationError(
            field, f"{name!r} has too many distinct values for class labels in {where}"
        )


def _check_evaluation_split(
    definition: TaskDefinition, probe: DatasetProbe, split: str, names: list[str] | None, *, positions: bool
) -> None:
    """The split jobs evaluate on has the task's columns, rows, and labels among the task's classes."""
    field, where = f"source.{split}", f"the {split} split"
    columns = probe.split_columns.get(split)
    if probe.split_sizes.get(split, 0) < 1:
        raise RegistryValidationError(field, f"{where} (which jobs evaluate on) has no rows")
    if columns is not None:
        for name in (*definition.text_fields, definition.label_field):
            if name not in columns:
                raise RegistryValidationError(
                    field,
                    f"{name!r} is not a column of {where}, which jobs evaluate on (columns: {', '.join(columns)})",
                )
    label = probe.split_labels.get(split)
    if label is None:
        return
    if label.nulls:
        raise RegistryValidationError(
            field, f"{definition.label_field!r} is empty in {label.nulls} rows of {where}"
        )
    _check_label_kind(definition, label, field, where)
    if names is not None:
        _check_labels_fit(
            names, label.values or [], definition.label_field, field, where, positions=positions
        )


def _names_from_values(values: list[Any], field: str) -> list[str]:
    try:
        return class_names(values)
    except ValueError as exc:
        raise RegistryValidationError("label_field", f"{field!r} holds {values[:5]!r}: {exc}") from None


def _check_labels_fit(
    names: list[str], values: list[Any], field: str, error_field: str, where: str, *, positions: bool
) -> None:
    """Every label value is one of the classes: by name, or (`positions`: names declared or a ClassLabel)
    a whole number as a position (pelt_core.labels)."""
    lookup = {name: index for index, name in enumerate(names)}
    for value in values:
        if label_index(value, names, lookup, positions=positions) is None:
            raise RegistryValidationError(
                error_field,
                f"{field!r} holds {value!r} in {where}, which is not among the task's labels {names!r}",
            )


__all__ = [
    "EVALUATION_SPLITS",
    "check_task_against_data",
    "detect_problem_type",
    "detect_text_fields",
    "evaluation_split",
    "held_out_rows",
]
