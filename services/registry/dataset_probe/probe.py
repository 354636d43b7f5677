"""The probe in this process: every split of a source read within the limits."""

from __future__ import annotations

from pathlib import Path

from services.registry.dataset_probe.files import probe_file
from services.registry.dataset_probe.records import Budget, DatasetLimits, DatasetProbe, LabelSummary, Report
from services.registry.dataset_probe.saved import probe_saved_dataset
from services.registry.dataset_probe.source import DatasetSource


def probe_dataset(
    source: DatasetSource,
    label_field: str | None = None,
    limits: DatasetLimits | None = None,
    report: Report | None = None,
) -> DatasetProbe:
    """Read the columns and split sizes, and summarize the label column of every split, streaming within
    `limits` (TooLargeError beyond them); `report` hears of each split before it is read."""
    limits = limits or DatasetLimits()
    budget = Budget(limits.max_bytes)
    report = report or (lambda note: None)
    if source.kind == "datasets":
        return probe_saved_dataset(Path(source.paths["path"]), label_field, limits, budget, report)
    sizes: dict[str, int] = {}
    columns: dict[str, list[str]] = {}
    labels: dict[str, LabelSummary] = {}
    for split, path in source.paths.items():
        report({"split": split})
        read = probe_file(Path(path), split, label_field, limits, budget)
        sizes[split], columns[split] = read.rows, read.columns
        if read.label is not None:
            labels[split] = read.label
    return DatasetProbe(
        columns=columns.get("train", []),
        split_sizes=sizes,
        label=labels.get("train"),
        split_columns=columns,
        split_labels=labels,
    )


__all__ = ["probe_dataset"]
