"""Cheap looks at a task's dataset: its columns, split sizes and the label column's values.

Kept apart so that it can be swapped for `pelt_core.data` (which reads the same sources for training):
the registry only calls `resolve_source(...)` and `probe_dataset(...)`.

A source is a JSON Lines (.jsonl/.ndjson), CSV (.csv/.tsv) or Parquet file, a mapping of split name
to such files (a "train" split is required), or a folder written by `datasets`' `save_to_disk`
(a DatasetDict with a "train" split, or a single Dataset, taken as the training split).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.registry.errors import RegistryValidationError

FILE_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}
MAX_DISTINCT_LABELS = 10_000


@dataclass(frozen=True)
class DatasetSource:
    """Where a task's data lives. kind "files": `paths` maps split → file; "datasets": {"path": folder}."""

    kind: str
    paths: dict[str, str]


@dataclass(frozen=True)
class LabelSummary:
    """The label column of the training split: its kind, null count and distinct values."""

    kind: str  # "string", "integer", "float", "bool", "list" (multi-label) or "other"
    nulls: int
    values: list[Any] | None  # distinct values (list elements for "list"); None when there are too many
    names: list[str] | None = None  # class names declared by the data itself (a `datasets` ClassLabel)


@dataclass(frozen=True)
class DatasetProbe:
    """What the registry needs to know about a dataset to validate a task against it."""

    columns: list[str]
    split_sizes: dict[str, int]
    label: LabelSummary | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def train_rows(self) -> int:
        return self.split_sizes["train"]


def resolve_source(source: str | Path | Mapping[str, str | Path]) -> DatasetSource:
    """Check that a source exists and has a supported format; paths become absolute."""
    if isinstance(source, Mapping):
        if not source:
            raise RegistryValidationError("source", "an empty mapping; give at least {'train': path}")
        paths = {}
        for split, raw in source.items():
            if not isinstance(split, str) or not split:
                raise RegistryValidationError(
                    "source", f"split names must be non-empty strings, got {split!r}"
                )
            paths[split] = _existing_file(raw, f"source.{split}")
        if "train" not in paths:
            raise RegistryValidationError("source", f"needs a 'train' split; got {', '.join(paths)}")
        return DatasetSource("files", paths)
    if not isinstance(source, str | Path) or not str(source):
        raise RegistryValidationError(
            "source", f"expected a path or a mapping of split to path, got {source!r}"
        )
    path = Path(source).expanduser()
    if path.is_dir():
        if not _is_saved_dataset(path):
            raise RegistryValidationError(
                "source",
                f"{path} is a folder but not one written by datasets' save_to_disk "
                "(no dataset_dict.json or state.json); give the data files instead",
            )
        return DatasetSource("datasets", {"path": str(path.resolve())})
    return DatasetSource("files", {"train": _existing_file(path, "source")})


def probe_dataset(source: DatasetSource, label_field: str | None = None) -> DatasetProbe:
    """Read the columns and split sizes, and summarize the label column of the training split."""
    if source.kind == "datasets":
        return _probe_saved_dataset(Path(source.paths["path"]), label_field)
    sizes: dict[str, int] = {}
    columns: list[str] = []
    label: LabelSummary | None = None
    for split, path in source.paths.items():
        where = f"source.{split}"
        try:
            if split == "train":
                columns, rows, label = _probe_file(Path(path), label_field)
            else:
                rows = _count_rows(Path(path))
        except (OSError, ValueError) as exc:  # pyarrow's parse errors are ValueErrors (ArrowInvalid)
            raise RegistryValidationError(where, f"cannot read {path}: {exc}") from exc
        sizes[split] = rows
    return DatasetProbe(columns=columns, split_sizes=sizes, label=label)


# --- files ---------------------------------------------------------------------------------------


def _existing_file(raw: str | Path, where: str) -> str:
    if not isinstance(raw, str | Path) or not str(raw):
        raise RegistryValidationError(where, f"expected a file path, got {raw!r}")
    path = Path(raw).expanduser()
    if not path.is_file():
        raise RegistryValidationError(where, f"no such file: {path}")
    if path.suffix.lower() not in FILE_FORMATS:
        raise RegistryValidationError(
            where,
            f"{path.name}: unsupported format; use one of {', '.join(FILE_FORMATS)} or a datasets folder",
        )
    return str(path.resolve())


def _read_table(path: Path, columns: list[str] | None = None) -> Any:
    import pyarrow.csv
    import pyarrow.json
    import pyarrow.parquet

    kind = FILE_FORMATS[path.suffix.lower()]
    if kind == "parquet":
        return pyarrow.parquet.read_table(path, columns=columns)
    if kind == "jsonl":
        table = pyarrow.json.read_json(path)
    else:
        delimiter = "\t" if kind == "tsv" else ","
        table = pyarrow.csv.read_csv(path, parse_options=pyarrow.csv.ParseOptions(delimiter=delimiter))
    return table.select(columns) if columns is not None else table


def _probe_file(path: Path, label_field: str | None) -> tuple[list[str], int, LabelSummary | None]:
    if FILE_FORMATS[path.suffix.lower()] == "parquet":
        import pyarrow.parquet

        parquet = pyarrow.parquet.ParquetFile(path)
        columns = list(parquet.schema_arrow.names)
        rows = parquet.metadata.num_rows
        label = None
        if label_field in columns:
            names = _class_names_from_hf_metadata(parquet.schema_arrow.metadata, label_field)
            label = _summarize(parquet.read(columns=[label_field]).column(label_field), names)
        return columns, rows, label
    table = _read_table(path)
    columns = list(table.column_names)
    label = _summarize(table.column(label_field)) if label_field in columns else None
    return columns, table.num_rows, label


def _count_rows(path: Path) -> int:
    if FILE_FORMATS[path.suffix.lower()] == "parquet":
        import pyarrow.parquet

        return pyarrow.parquet.ParquetFile(path).metadata.num_rows
    return _read_table(path).num_rows


def _class_names_from_hf_metadata(metadata: dict[bytes, bytes] | None, label_field: str) -> list[str] | None:
    """Parquet files written by `datasets` keep their features (ClassLabel names) in the schema metadata."""
    if not metadata or b"huggingface" not in metadata:
        return None
    try:
        features = json.loads(metadata[b"huggingface"]).get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return None
    feature = features.get(label_field) or {}
    if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" and feature.get("names"):
        return [str(name) for name in feature["names"]]
    return None


# --- `datasets` folders --------------------------------------------------------------------------


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _probe_saved_dataset(path: Path, label_field: str | None) -> DatasetProbe:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as exc:
        raise RegistryValidationError("source", f"cannot load the datasets folder {path}: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise RegistryValidationError(
                "source", f"{path} has splits {', '.join(loaded)} but no 'train' split"
            )
        sizes = {split: ds.num_rows for split, ds in loaded.items()}
        train = loaded["train"]
    else:
        sizes = {"train": loaded.num_rows}
        train = loaded
    columns = list(train.column_names)
    label = None
    if label_field in columns:
        feature = train.features[label_field]
        names = None
        if isinstance(feature, datasets.ClassLabel):
            names = list(feature.names)
        elif isinstance(getattr(feature, "feature", None), datasets.ClassLabel):
            names = list(feature.feature.names)
        elif isinstance(feature, list) and feature and isinstance(feature[0], datasets.ClassLabel):
            names = list(feature[0].names)
        label = _summarize(train.with_format("arrow")[label_field], names)
    return DatasetProbe(columns=columns, split_sizes=sizes, label=label)


# --- the label column ----------------------------------------------------------------------------


def _summarize(column: Any, names: list[str] | None = None) -> LabelSummary:
    import pyarrow as pa
    import pyarrow.compute as pc

    kind_of = column.type
    values_array = column
    if pa.types.is_list(kind_of) or pa.types.is_large_list(kind_of) or pa.types.is_fixed_size_list(kind_of):
        kind = "list"
        values_array = pc.list_flatten(column)
        kind_of = values_array.type
    elif pa.types.is_string(kind_of) or pa.types.is_large_string(kind_of):
        kind = "string"
    elif pa.types.is_boolean(kind_of):
        kind = "bool"
    elif pa.types.is_integer(kind_of):
        kind = "integer"
    elif pa.types.is_floating(kind_of):
        kind = "float"
    else:
        kind = "other"
    distinct = pc.unique(values_array).drop_null()
    values = None if len(distinct) > MAX_DISTINCT_LABELS else distinct.to_pylist()
    return LabelSummary(kind=kind, nulls=column.null_count, values=values, names=names)


__all__ = ["FILE_FORMATS", "DatasetProbe", "DatasetSource", "LabelSummary", "probe_dataset", "resolve_source"]
