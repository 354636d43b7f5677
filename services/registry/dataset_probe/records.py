"""What the probe reads at most (`DatasetLimits`, the shared byte `Budget`) and what it finds
(`DatasetProbe`, one `LabelSummary` per split's label column), as the registry and the child process
exchange them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pelt_core.limits import MAX_DATASET_BYTES, MAX_DATASET_ROWS

Report = Callable[[dict[str, Any]], None]  # a progress note ({"split": name}) to the parent of a child probe


@dataclass(frozen=True)
class DatasetLimits:
    """What the probe reads at most: rows of one split (PELT_MAX_DATASET_ROWS) and decoded bytes of all
    splits together (PELT_MAX_DATASET_BYTES)."""

    max_rows: int = MAX_DATASET_ROWS
    max_bytes: int = MAX_DATASET_BYTES


@dataclass(frozen=True)
class LabelSummary:
    """The label column of one split: its kind, null count and distinct values."""

    kind: str  # "string", "integer", "float", "bool", "list" (multi-label) or "other"
    nulls: int
    values: list[Any] | None  # distinct values (list elements for "list"); None when there are too many
    names: list[str] | None = None  # class names declared by the data itself (a `datasets` ClassLabel)
    non_finite: bool = False  # a float label is NaN or infinite
    fractional: bool = False  # a float label has a fractional part (regression: pelt_core.labels)


@dataclass(frozen=True)
class DatasetProbe:
    """What the registry needs to know about a dataset to validate a task against it."""

    columns: list[str]
    split_sizes: dict[str, int]
    label: LabelSummary | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    split_columns: dict[str, list[str]] = field(default_factory=dict)  # every split's columns
    split_labels: dict[str, LabelSummary] = field(
        default_factory=dict
    )  # every split's label column (train too)

    @property
    def train_rows(self) -> int:
        return self.split_sizes["train"]


def probe_from_json(data: dict[str, Any]) -> DatasetProbe:
    """The probe a child process sent (`dataclasses.asdict` of a DatasetProbe)."""

    def label(summary: dict[str, Any] | None) -> LabelSummary | None:
        return None if summary is None else LabelSummary(**summary)

    return DatasetProbe(
        columns=list(data["columns"]),
        split_sizes=dict(data["split_sizes"]),
        label=label(data["label"]),
        extra=dict(data["extra"]),
        split_columns=dict(data["split_columns"]),
        split_labels={split: label(summary) for split, summary in data["split_labels"].items()},
    )


class Budget:
    """Decoded bytes left for the task's data (PELT_MAX_DATASET_BYTES)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.left = limit, limit

    def spend(self, count: int, where: str) -> None:
        self.left -= max(count, 0)
        if self.left < 0:
            raise too_large(
                where,
                f"the data decode to more than {self.limit:,} bytes (PELT_MAX_DATASET_BYTES; a value "
                "that many rows repeat counts once per row)",
            )


def too_large(where: str, message: str) -> Exception:
    from services.errors import TooLargeError  # late: services.errors imports the registry's errors

    return TooLargeError(where, message)


__all__ = [
    "Budget",
    "DatasetLimits",
    "DatasetProbe",
    "LabelSummary",
    "Report",
    "probe_from_json",
    "too_large",
]
