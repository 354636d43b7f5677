"""Cheap looks at a task's dataset: its columns, split sizes and every split's label column.

Kept apart so that it can be swapped for `pelt_core.data` (which reads the same sources for training):
the registry only calls `resolve_source(...)` and `probe_dataset(...)`.

A source is a JSON Lines (.jsonl/.ndjson), CSV (.csv/.tsv) or Parquet file, a mapping of split name
to such files (a "train" split is required), or a folder written by `datasets`' `save_to_disk`
(a DatasetDict with a "train" split, or a single Dataset, taken as the training split).

Data come from users, so the probe streams and bounds what it reads (`DatasetLimits`): JSON Lines in
chunks of whole lines, CSV block by block, Parquet batch by batch after its metadata (rows, declared
sizes) passed; rows of one split and decoded bytes of all splits are counted as they are read and
refused beyond PELT_MAX_DATASET_ROWS / PELT_MAX_DATASET_BYTES (413). Text files must be UTF-8 (the
trainer reads them so); a JSON Lines row may nest at most `limits.MAX_JSON_ROW_DEPTH` deep (checked on
its bytes: pyarrow's reader crashes on deep ones). A `datasets` folder is checked by
`pelt_core.saved_dataset` first (its own Arrow files only, rows counted from metadata), its tables built
from those files as the trainer builds them (`read_saved_split`) and fully validated. Label columns
are summarized without decoding a dictionary-encoded one; a class label is at most
`limits.MAX_LABEL_CHARS` characters. Errors name the split (`source.<split>`), never a path of this
machine.

Decoding is the part a crafted file can turn against the process (memory, a native reader's crash):
the service runs it in a child process (`probe_dataset_in_child`, `services.sandbox`) under
PELT_DATASET_PROBE_MEMORY_BYTES and PELT_DATASET_PROBE_TIMEOUT_SECONDS; a child that dies is a 422
naming the split it was reading.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pelt_core.json_nesting import too_deep_line
from pelt_core.limits import MAX_DATASET_BYTES, MAX_DATASET_ROWS, MAX_JSON_ROW_DEPTH, MAX_LABEL_CHARS
from services.registry.errors import RegistryValidationError

FILE_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}
FORMAT_NAMES = {"jsonl": "JSON Lines", "csv": "CSV", "tsv": "TSV", "parquet": "Parquet"}
MAX_DISTINCT_LABELS = 10_000
STREAM_BLOCK_BYTES = 1 << 20  # a CSV block, a chunk of JSON Lines, a step of the UTF-8 check
MAX_ROW_BYTES = 16 << 20  # the longest JSON Lines row
BATCH_BYTES = 16 << 20  # Parquet: rows per batch are chosen so that a batch decodes to about this much
MAX_BATCH_ROWS = (
    8_192  # ... as declared by the file's metadata, which its writer chose: a cap whatever it says
)
Report = Callable[[dict[str, Any]], None]  # a progress note ({"split": name}) to the parent of a child probe


@dataclass(frozen=True)
class DatasetLimits:
    """What the probe reads at most: rows of one split (PELT_MAX_DATASET_ROWS) and decoded bytes of all
    splits together (PELT_MAX_DATASET_BYTES)."""

    max_rows: int = MAX_DATASET_ROWS
    max_bytes: int = MAX_DATASET_BYTES


@dataclass(frozen=True)
class DatasetSource:
    """Where a task's data lives. kind "files": `paths` maps split → file; "datasets": {"path": folder}."""

    kind: str
    paths: dict[str, str]


@dataclass(frozen=True)
class LabelSummary:
    """The label column of one split: its kind, null count and distinct values."""

    kind: str  # "string", "integer", "float", "bool", "list" (multi-label) or "other"
    nulls: int
    values: list[Any] | None  # distinct values (list elements for "list"); None when there are too many
    names: list[str] | None = None  # class names declared by the data itself (a `datasets` ClassLabel)
    non_finite: bool = False  # a float label is NaN or infinite


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
                f"{path.name!r} is a folder but not one written by datasets' save_to_disk "
                "(no dataset_dict.json or state.json); give the data files instead",
            )
        return DatasetSource("datasets", {"path": str(path.resolve())})
    return DatasetSource("files", {"train": _existing_file(path, "source")})


def probe_dataset(
    source: DatasetSource,
    label_field: str | None = None,
    limits: DatasetLimits | None = None,
    report: Report | None = None,
) -> DatasetProbe:
    """Read the columns and split sizes, and summarize the label column of every split, streaming within
    `limits` (TooLargeError beyond them); `report` hears of each split before it is read."""
    limits = limits or DatasetLimits()
    budget = _Budget(limits.max_bytes)
    report = report or (lambda note: None)
    if source.kind == "datasets":
        return _probe_saved_dataset(Path(source.paths["path"]), label_field, limits, budget, report)
    sizes: dict[str, int] = {}
    columns: dict[str, list[str]] = {}
    labels: dict[str, LabelSummary] = {}
    for split, path in source.paths.items():
        report({"split": split})
        read = _probe_file(Path(path), split, label_field, limits, budget)
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


def probe_dataset_in_child(
    source: DatasetSource,
    label_field: str | None,
    limits: DatasetLimits,
    *,
    memory_bytes: int,
    timeout_seconds: float,
) -> DatasetProbe:
    """`probe_dataset` in a child process (`services.sandbox`) under `memory_bytes` of address space
    (PELT_DATASET_PROBE_MEMORY_BYTES) and `timeout_seconds` (PELT_DATASET_PROBE_TIMEOUT_SECONDS). Its
    refusals come back as they are; a child that runs out of either, or crashes, is a 422 naming the
    split it was reading (`source.<split>`; `source` for a `datasets` folder or before any split)."""
    from services.sandbox import run_in_child

    request = {"source": asdict(source), "label_field": label_field, "limits": asdict(limits)}
    outcome = run_in_child(
        "dataset_probe", request, memory_bytes=memory_bytes, timeout_seconds=timeout_seconds
    )
    answer = outcome.answer or {}
    if "probe" in answer:
        return _probe_from_json(answer["probe"])
    if "refused" in answer:
        refusal = answer["refused"]
        error = _too_large if refusal["kind"] == "too_large" else RegistryValidationError
        raise error(str(refusal["field"]), str(refusal["message"]))
    split = outcome.last_progress.get("split")
    field_name = f"source.{split}" if split is not None and source.kind == "files" else "source"
    what = f"the {split} split" if split is not None else "the data"
    if outcome.timed_out:
        raise RegistryValidationError(
            field_name,
            f"{what} could not be read within PELT_DATASET_PROBE_TIMEOUT_SECONDS ({timeout_seconds:g} s)",
        )
    if answer.get("memory") or outcome.out_of_memory or outcome.answer is None:
        how = (
            "it ran out of"
            if answer.get("memory") or outcome.out_of_memory
            else f"the reader ended ({outcome.how_it_ended()}); it may have run past"
        )
        raise RegistryValidationError(
            field_name,
            f"{what} could not be read: {how} its memory limit, "
            f"PELT_DATASET_PROBE_MEMORY_BYTES ({memory_bytes:,} bytes)",
        )
    error_type = str(answer.get("error_type") or "error")[:100]  # its text may name files of this machine
    raise RegistryValidationError(field_name, f"{what} could not be read: the reader failed ({error_type})")


def probe_in_child(request: dict[str, Any], report: Report) -> dict[str, Any]:
    """The child's side of `probe_dataset_in_child` (run by services.sandbox): the probe as JSON, or
    the refusal ({"refused": {kind, field, message}})."""
    from services.errors import TooLargeError

    source = DatasetSource(**request["source"])
    try:
        probe = probe_dataset(source, request["label_field"], DatasetLimits(**request["limits"]), report)
    except RegistryValidationError as exc:
        kind = "too_large" if isinstance(exc, TooLargeError) else "validation"
        return {
            "refused": {"kind": kind, "field": exc.field, "message": str(exc).removeprefix(f"{exc.field}: ")}
        }
    return {"probe": asdict(probe)}


def _probe_from_json(data: dict[str, Any]) -> DatasetProbe:
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


# --- files ---------------------------------------------------------------------------------------


def _existing_file(raw: str | Path, where: str) -> str:
    if not isinstance(raw, str | Path) or not str(raw):
        raise RegistryValidationError(where, f"expected a file path, got {raw!r}")
    path = Path(raw).expanduser()
    if not path.is_file():
        raise RegistryValidationError(where, f"no such file: {path.name!r}")
    if path.suffix.lower() not in FILE_FORMATS:
        raise RegistryValidationError(
            where,
            f"{path.name}: unsupported format; use one of {', '.join(FILE_FORMATS)} or a datasets folder",
        )
    return str(path.resolve())


@dataclass
class _SplitRead:
    columns: list[str]
    rows: int
    label: LabelSummary | None


@dataclass
class _Stream:
    """Record batches of one file, with its columns and class names when known before reading."""

    batches: Iterator[Any]
    columns: list[str] | None = None
    class_names: list[str] | None = None


class _Budget:
    """Decoded bytes left for the task's data (PELT_MAX_DATASET_BYTES)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.left = limit, limit

    def spend(self, count: int, where: str) -> None:
        self.left -= max(count, 0)
        if self.left < 0:
            raise _too_large(
                where, f"the data decode to more than {self.limit} bytes (PELT_MAX_DATASET_BYTES)"
            )


class _NotUtf8(ValueError):
    def __init__(self, position: int) -> None:
        super().__init__(f"not UTF-8 text (an invalid byte near byte {position}); save the file as UTF-8")


def _too_large(where: str, message: str) -> Exception:
    from services.errors import TooLargeError  # late: services.errors imports the registry's errors

    return TooLargeError(where, message)


def _probe_file(
    path: Path, split: str, label_field: str | None, limits: DatasetLimits, budget: _Budget
) -> _SplitRead:
    where = f"source.{split}"
    kind = FILE_FORMATS[path.suffix.lower()]
    try:
        if kind == "parquet":
            stream = _parquet_stream(path, split, label_field, limits, budget)
        else:
            _check_utf8(path)
            stream = (
                _csv_stream(path, split, kind, label_field) if kind in ("csv", "tsv") else _jsonl_stream(path)
            )
        return _read_stream(stream, split, label_field, limits, budget)
    except RegistryValidationError:
        raise
    except _NotUtf8 as exc:
        raise RegistryValidationError(where, f"the {split} split is {exc}") from None
    except Exception as exc:
        import pyarrow as pa

        if not isinstance(
            exc, OSError | ValueError | pa.ArrowException
        ):  # a bug, or memory: not the data's fault
            raise
        reason = str(exc).replace(str(path), path.name) if not isinstance(exc, OSError) else exc.strerror
        raise RegistryValidationError(
            where, f"cannot read the {split} split as {FORMAT_NAMES[kind]}: {reason or type(exc).__name__}"
        ) from None


def _read_stream(
    stream: _Stream, split: str, label_field: str | None, limits: DatasetLimits, budget: _Budget
) -> _SplitRead:
    where = f"source.{split}"
    columns = list(stream.columns or [])
    label = _LabelColumn(label_field, split, stream.class_names)
    rows = 0
    for batch in stream.batches:
        names = list(batch.schema.names)
        _refuse_duplicate_columns(names, split)
        columns.extend(name for name in names if name not in columns)
        rows += batch.num_rows
        if rows > limits.max_rows:
            raise _too_large(
                where, f"the {split} split holds more than {limits.max_rows} rows (PELT_MAX_DATASET_ROWS)"
            )
        budget.spend(batch.nbytes, where)
        if label_field is not None:
            position = batch.schema.get_field_index(label_field)
            label.add(batch.column(position) if position >= 0 else None, batch.num_rows)
    return _SplitRead(columns, rows, label.summary() if label_field in columns else None)


def _refuse_duplicate_columns(names: list[str], split: str) -> None:
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise RegistryValidationError(
            f"source.{split}",
            f"the {split} split has the column {twice[0]!r} twice; give every column its own name",
        )


def _check_utf8(path: Path) -> None:
    """The trainer reads text files as UTF-8: refuse others here, reading the file in blocks."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with path.open("rb") as stream:
        while block := stream.read(STREAM_BLOCK_BYTES):
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                raise _NotUtf8(offset - pending + exc.start) from None
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise _NotUtf8(offset) from None


def _csv_stream(path: Path, split: str, kind: str, label_field: str | None) -> _Stream:
    """Block by block; every column but the label is text (as the trainer reads it: no type guessed from
    the first block that a later block breaks)."""
    import pyarrow as pa
    import pyarrow.csv

    read = pyarrow.csv.ReadOptions(block_size=STREAM_BLOCK_BYTES)
    parse = pyarrow.csv.ParseOptions(delimiter="\t" if kind == "tsv" else ",", newlines_in_values=True)
    with pyarrow.csv.open_csv(path, read_options=read, parse_options=parse) as head:
        names = list(head.schema.names)
    _refuse_duplicate_columns(names, split)
    text = pyarrow.csv.ConvertOptions(
        column_types={name: pa.string() for name in names if name != label_field}
    )
    reader = pyarrow.csv.open_csv(path, read_options=read, parse_options=parse, convert_options=text)
    return _Stream(iter(reader), names)


def _jsonl_stream(path: Path) -> _Stream:
    """Chunks of whole lines (a row at most MAX_ROW_BYTES), each parsed on its own."""
    import pyarrow as pa
    import pyarrow.json

    def batches() -> Iterator[Any]:
        lines = 0
        for chunk in _line_chunks(path):
            deep = too_deep_line(chunk, MAX_JSON_ROW_DEPTH)
            if deep is not None:
                raise ValueError(
                    f"line {lines + deep + 1} is JSON nested more than {MAX_JSON_ROW_DEPTH} levels deep"
                )
            lines += chunk.count(b"\n")
            options = pyarrow.json.ReadOptions(use_threads=False, block_size=len(chunk) + 1)
            yield from pyarrow.json.read_json(pa.BufferReader(chunk), read_options=options).to_batches()

    return _Stream(batches())


def _line_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as stream:
        pending = b""
        while block := stream.read(STREAM_BLOCK_BYTES):
            data = pending + block
            cut = data.rfind(b"\n") + 1
            if not cut:
                if len(data) > MAX_ROW_BYTES:
                    raise ValueError(f"a row is longer than {MAX_ROW_BYTES} bytes")
                pending = data
                continue
            if data[:cut].strip():
                yield data[:cut]
            pending = data[cut:]
        if pending.strip():
            yield pending


def _parquet_stream(
    path: Path, split: str, label_field: str | None, limits: DatasetLimits, budget: _Budget
) -> _Stream:
    """The metadata first (rows, each row group's declared size), then batch by batch, row group by row
    group, sized so that a batch decodes to about BATCH_BYTES."""
    import pyarrow as pa
    import pyarrow.parquet

    where = f"source.{split}"
    parquet = pyarrow.parquet.ParquetFile(path)
    metadata = parquet.metadata
    if metadata.num_rows > limits.max_rows:
        raise _too_large(
            where,
            f"the {split} split holds {metadata.num_rows} rows, more than {limits.max_rows} "
            "(PELT_MAX_DATASET_ROWS)",
        )
    groups = [metadata.row_group(index) for index in range(metadata.num_row_groups)]
    declared = sum(max(group.total_byte_size, 0) for group in groups)
    if declared > budget.left:
        raise _too_large(
            where,
            f"the {split} split decodes to {declared} bytes, more than the "
            f"{budget.limit} bytes allowed for the task's data (PELT_MAX_DATASET_BYTES)",
        )
    names = list(parquet.schema_arrow.names)
    _refuse_duplicate_columns(names, split)
    widest = max(
        (group.total_byte_size / group.num_rows for group in groups if group.num_rows > 0), default=1.0
    )
    batch_rows = int(max(1, min(MAX_BATCH_ROWS, BATCH_BYTES // max(widest, 1.0))))
    class_names = (
        _class_names_from_hf_metadata(parquet.schema_arrow.metadata, label_field) if label_field else None
    )
    if label_field in names:  # a string label is read dictionary-encoded: _LabelColumn never decodes it
        kind_of = parquet.schema_arrow.field(label_field).type
        if pa.types.is_string(kind_of) or pa.types.is_large_string(kind_of) or pa.types.is_binary(kind_of):
            parquet = pyarrow.parquet.ParquetFile(path, read_dictionary=[label_field])
    return _Stream(parquet.iter_batches(batch_size=batch_rows), names, class_names)


def _class_names_from_hf_metadata(metadata: dict[bytes, bytes] | None, label_field: str) -> list[str] | None:
    """Parquet files written by `datasets` keep their features (ClassLabel names) in the schema metadata."""
    if not metadata or b"huggingface" not in metadata:
        return None
    try:
        features = json.loads(metadata[b"huggingface"]).get("info", {}).get("features", {})
    except (ValueError, AttributeError, RecursionError):
        return None
    return _class_label_names(features.get(label_field) if isinstance(features, dict) else None)


# --- `datasets` folders --------------------------------------------------------------------------


def _is_saved_dataset(path: Path) -> bool:
    from pelt_core.saved_dataset import is_saved_dataset

    return is_saved_dataset(path)


def _probe_saved_dataset(
    path: Path, label_field: str | None, limits: DatasetLimits, budget: _Budget, report: Report
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
        raise _too_large("source", f"{exc} (PELT_MAX_DATASET_ROWS)") from None
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
        _refuse_duplicate_columns(list(table.column_names), split)
        try:
            table.validate(full=True)
        except (pa.ArrowException, ValueError) as exc:
            raise RegistryValidationError(
                "source", f"split {split!r} holds invalid Arrow data: {exc}"
            ) from None
        sizes[split], columns[split] = table.num_rows, list(table.column_names)
        if label_field in columns[split]:
            summary = _LabelColumn(label_field, split, _class_label_names(saved.features.get(label_field)))
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


def _class_label_names(feature: Any) -> list[str] | None:
    """The names of a ClassLabel feature (as datasets writes features to JSON), or of a list of them."""
    candidates = [feature]
    if isinstance(feature, dict):
        candidates.append(feature.get("feature"))  # Sequence / List of ClassLabel
    elif isinstance(feature, list) and feature:
        candidates.append(feature[0])
    for candidate in candidates:
        if (
            isinstance(candidate, dict)
            and candidate.get("_type") == "ClassLabel"
            and isinstance(candidate.get("names"), list)
        ):
            return [str(name) for name in candidate["names"]] or None
    return None


# --- the label column ----------------------------------------------------------------------------


class _LabelColumn:
    """The label column of one split, summarized batch by batch: kinds, nulls, distinct values."""

    def __init__(self, field_name: str | None, split: str, names: list[str] | None) -> None:
        self.field, self.split, self.names = field_name, split, names
        self.kinds: set[str] = set()
        self.nulls = 0
        self.values: set[Any] = set()
        self.too_many = False
        self.non_finite = False

    def add(self, column: Any, rows: int) -> None:
        """One batch's column (None: the batch has no such column, so its rows have no label)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if column is None or pa.types.is_null(column.type):
            self.nulls += rows
            return
        if pa.types.is_dictionary(column.type):  # its dictionary's values in use, never decoded per row
            values, nulls = _dictionary_values(column)
            self.nulls += nulls
            kind = self._scalar_kind(values.type) or self._refuse(values.type)
        else:
            self.nulls += column.null_count
            kind, values = self._kind(column)
        if kind is None:
            return
        self.kinds.add(kind)
        if kind in ("string", "list") and self._scalar_kind(values.type) == "string":
            text = (
                values.cast(pa.large_string()) if pa.types.is_string_view(values.type) else values
            )  # no kernel
            longest = pc.max(pc.utf8_length(text)).as_py() if len(values) else None
            if longest is not None and longest > MAX_LABEL_CHARS:
                raise RegistryValidationError(
                    "label_field",
                    f"{self.field!r} holds a label of {longest} characters in the {self.split} "
                    f"split; a class label is at most {MAX_LABEL_CHARS} characters",
                )
        if pa.types.is_floating(values.type) and pc.any(pc.invert(pc.is_finite(values.drop_null()))).as_py():
            self.non_finite = True
        if self.too_many:
            return
        self.values.update(pc.unique(values).drop_null().to_pylist())
        if len(self.values) > MAX_DISTINCT_LABELS:
            self.too_many, self.values = True, set()

    def _kind(self, column: Any) -> tuple[str | None, Any]:
        import pyarrow as pa
        import pyarrow.compute as pc

        values, kind_of = column, column.type
        if (
            pa.types.is_list(kind_of)
            or pa.types.is_large_list(kind_of)
            or pa.types.is_fixed_size_list(kind_of)
        ):
            values = pc.list_flatten(column)
            if pa.types.is_dictionary(values.type):
                values, _ = _dictionary_values(values)
            element = self._scalar_kind(values.type)
            return (
                "list" if element is not None or pa.types.is_null(values.type) else self._refuse(values.type)
            ), values
        if pa.types.is_null(kind_of):
            return None, values
        return (self._scalar_kind(kind_of) or self._refuse(kind_of)), values

    @staticmethod
    def _scalar_kind(kind_of: Any) -> str | None:
        import pyarrow as pa

        if (
            pa.types.is_string(kind_of)
            or pa.types.is_large_string(kind_of)
            or pa.types.is_string_view(kind_of)
        ):
            return "string"
        if pa.types.is_boolean(kind_of):
            return "bool"
        if pa.types.is_integer(kind_of):
            return "integer"
        if pa.types.is_floating(kind_of):
            return "float"
        return None

    def _refuse(self, kind_of: Any) -> str:
        raise RegistryValidationError(
            "label_field",
            f"{self.field!r} holds {kind_of} values in the {self.split} split: a label is a string, a number or "
            "a boolean (a list of them for a multi-label task)",
        )

    def summary(self) -> LabelSummary:
        kinds = set(self.kinds)
        if kinds == {"integer", "float"}:
            kinds = {"float"}
        if len(kinds) > 1:
            raise RegistryValidationError(
                "label_field",
                f"{self.field!r} holds values of different kinds in the {self.split} split "
                f"({' and '.join(sorted(kinds))}); give every row the same kind of label",
            )
        return LabelSummary(
            kind=next(iter(kinds), "other"),
            nulls=self.nulls,
            values=None if self.too_many else list(self.values),
            names=self.names,
            non_finite=self.non_finite,
        )


def _dictionary_values(array: Any) -> tuple[Any, int]:
    """(the dictionary's values the indices use, rows that are null) of a dictionary-encoded array,
    without decoding it: a million indices into one 100 KB value stay a million indices."""
    import pyarrow as pa
    import pyarrow.compute as pc

    indices, dictionary = array.indices, array.dictionary
    values = dictionary.take(pc.unique(indices.drop_null()))
    nulls = indices.null_count
    if values.null_count:
        null_positions = pc.indices_nonzero(pc.is_null(dictionary)).cast(indices.type)
        nulls += int(pc.sum(pc.is_in(indices, value_set=null_positions)).as_py() or 0)
    if pa.types.is_dictionary(values.type):
        raise ValueError("a dictionary of dictionaries")
    return values, nulls


__all__ = [
    "FILE_FORMATS",
    "DatasetLimits",
    "DatasetProbe",
    "DatasetSource",
    "LabelSummary",
    "probe_dataset",
    "probe_dataset_in_child",
    "resolve_source",
]
