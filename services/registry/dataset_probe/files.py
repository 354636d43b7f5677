"""Split files read as streams of record batches within the limits: JSON Lines in chunks of whole lines,
CSV/TSV block by block, Parquet batch by batch after its footer passed, its texts dictionary-encoded
(`pelt_core.parquet_size`); text files checked as UTF-8. Every batch spends its decoded bytes
(`decoded_bytes`: a repeated text once per row) from the task's budget."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pelt_core.json_nesting import too_deep_line
from pelt_core.limits import MAX_JSON_ROW_DEPTH
from pelt_core.parquet_size import decoded_bytes, footer_decoded_bytes, open_parquet, parquet_batch_rows
from services.registry.dataset_probe.labels import LabelColumn, class_label_names
from services.registry.dataset_probe.records import Budget, DatasetLimits, LabelSummary, too_large
from services.registry.dataset_probe.source import FILE_FORMATS, FORMAT_NAMES
from services.registry.errors import RegistryValidationError

STREAM_BLOCK_BYTES = 1 << 20  # a CSV block, a chunk of JSON Lines, a step of the UTF-8 check


MAX_ROW_BYTES = 16 << 20  # the longest JSON Lines row


@dataclass
class SplitRead:
    columns: list[str]
    rows: int
    label: LabelSummary | None


@dataclass
class _Stream:
    """Record batches of one file, with its columns and class names when known before reading."""

    batches: Iterator[Any]
    columns: list[str] | None = None
    class_names: list[str] | None = None


class _NotUtf8(ValueError):
    def __init__(self, position: int) -> None:
        super().__init__(f"not UTF-8 text (an invalid byte near byte {position}); save the file as UTF-8")


def probe_file(
    path: Path, split: str, label_field: str | None, limits: DatasetLimits, budget: Budget
) -> SplitRead:
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

        if isinstance(exc, MemoryError) or not isinstance(exc, OSError | ValueError | pa.ArrowException):
            raise  # out of memory (ArrowMemoryError is a MemoryError), or a bug: not the data's fault
        reason = str(exc).replace(str(path), path.name) if not isinstance(exc, OSError) else exc.strerror
        raise RegistryValidationError(
            where, f"cannot read the {split} split as {FORMAT_NAMES[kind]}: {reason or type(exc).__name__}"
        ) from None


def _read_stream(
    stream: _Stream, split: str, label_field: str | None, limits: DatasetLimits, budget: Budget
) -> SplitRead:
    where = f"source.{split}"
    columns = list(stream.columns or [])
    label = LabelColumn(label_field, split, stream.class_names)
    rows = 0
    for batch in stream.batches:
        names = list(batch.schema.names)
        refuse_duplicate_columns(names, split)
        columns.extend(name for name in names if name not in columns)
        rows += batch.num_rows
        if rows > limits.max_rows:
            raise too_large(
                where, f"the {split} split holds more than {limits.max_rows} rows (PELT_MAX_DATASET_ROWS)"
            )
        budget.spend(decoded_bytes(batch), where)
        if label_field is not None:
            position = batch.schema.get_field_index(label_field)
            label.add(batch.column(position) if position >= 0 else None, batch.num_rows)
    return SplitRead(columns, rows, label.summary() if label_field in columns else None)


def refuse_duplicate_columns(names: list[str], split: str) -> None:
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
    refuse_duplicate_columns(names, split)
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
    path: Path, split: str, label_field: str | None, limits: DatasetLimits, budget: Budget
) -> _Stream:
    """The footer first (rows; what the row groups declare and the columns' values take at least), then
    batch by batch, row group by row group, sized so that a batch decodes to about
    `parquet_size.BATCH_BYTES`, every text column read dictionary-encoded: a text that a thousand rows
    repeat is held once, and `_read_stream` counts it once per row."""
    import pyarrow.parquet

    where = f"source.{split}"
    metadata = pyarrow.parquet.read_metadata(path)
    if metadata.num_rows > limits.max_rows:
        raise too_large(
            where,
            f"the {split} split holds {metadata.num_rows} rows, more than {limits.max_rows} "
            "(PELT_MAX_DATASET_ROWS)",
        )
    declared = footer_decoded_bytes(metadata)
    if declared > budget.left:
        raise too_large(
            where,
            f"the {split} split decodes to at least {declared} bytes, more than the "
            f"{budget.limit} bytes allowed for the task's data (PELT_MAX_DATASET_BYTES)",
        )
    parquet = open_parquet(path, metadata)  # LabelColumn never decodes a dictionary-encoded label either
    names = list(parquet.schema_arrow.names)
    refuse_duplicate_columns(names, split)
    class_names = (
        _class_names_from_hf_metadata(parquet.schema_arrow.metadata, label_field) if label_field else None
    )
    return _Stream(parquet.iter_batches(batch_size=parquet_batch_rows(metadata)), names, class_names)


def _class_names_from_hf_metadata(metadata: dict[bytes, bytes] | None, label_field: str) -> list[str] | None:
    """Parquet files written by `datasets` keep their features (ClassLabel names) in the schema metadata."""
    if not metadata or b"huggingface" not in metadata:
        return None
    try:
        features = json.loads(metadata[b"huggingface"]).get("info", {}).get("features", {})
    except (ValueError, AttributeError, RecursionError):
        return None
    return class_label_names(features.get(label_field) if isinstance(features, dict) else None)


__all__ = ["SplitRead", "probe_file", "refuse_duplicate_columns"]
