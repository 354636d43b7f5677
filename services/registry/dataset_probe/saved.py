"""A `datasets` save_to_disk folder: checked by `pelt_core.saved_dataset`, then each split's table built
from its own files as the trainer builds it, fully validated, and its label column summarized."""

from __future__ import annotations

from pathlib import Path

from services.registry.dataset_probe.files import refuse_duplicate_columns
from services.registry.dataset_probe.labels import LabelColumn, class_label_names
from services.registry.dataset_probe.records import (
    Budget,
    DatasetLimits,
    DatasetProbe,
    LabelSummary,
    Report,
    too_large,
)
from services.registry.errors import RegistryValidationError


def probe_saved_dataset(
    path: Path, label_field: str | None, limits: DatasetLimits, budget: Budget, report: Report
) -> DatasetProbe:
    """Check the folder (pelt_core.saved_dataset: its own files only, rows from metadata), then build
    each split's table from those files as the trainer does and validate it fully (offsets, UTF-8)
    before its label column is summarized."""
    import pyarrow as pa

    from pelt_core.saved_dataset import (
        SavedDatasetError,
        SavedDatasetTooLargeError,
        inspect_saved_dataset,
        read_saved_split,
    )

    try:
        layout = inspect_saved_dataset(path, max_rows=limits.max_rows)
    except SavedDatasetTooLargeError as exc:
        raise too_large("source", f"{exc} (PELT_MAX_DATASET_ROWS)") from None
    except SavedDatasetError as exc:
        raise RegistryValidationError("source", str(exc)) from None
    if "train" not in layout.splits:
        raise RegistryValidationError(
            "source", f"the dataset has splits {', '.join(layout.splits)} but no 'train' split"
        )
    budget.spend(
        sum(file.stat().st_size for split in layout.splits.values() for file in split.files), "source"
    )
    sizes: dict[str, int] = {}
    columns: dict[str, list[str]] = {}
    labels: dict[str, LabelSummary] = {}
    for split, saved in layout.splits.items():
        report({"split": split})
        try:
            table = read_saved_split(saved)
        except SavedDatasetError as exc:
            raise RegistryValidationError("source", str(exc)) from None
        refuse_duplicate_columns(list(table.column_names), split)
        try:
            table.validate(full=True)
        except (pa.ArrowException, ValueError) as exc:
            raise RegistryValidationError(
                "source", f"split {split!r} holds invalid Arrow data: {exc}"
            ) from None
        sizes[split], columns[split] = table.num_rows, list(table.column_names)
        if label_field in columns[split]:
            summary = LabelColumn(label_field, split, class_label_names(saved.features.get(label_field)))
            for chunk in table.column(label_field).chunks:
                summary.add(chunk, len(chunk))
            labels[split] = summary.summary()
    return DatasetProbe(
        columns=columns["train"],
        split_sizes=sizes,
        label=labels.get("train"),
        split_columns=columns,
        split_labels=labels,
    )


__all__ = ["probe_saved_dataset"]
