"""The bytes a Parquet file decodes to, counted from its footer and batch by batch, never by decoding it.

Parquet stores a repeated value once (a dictionary page) and run-length encodes the rows' references to
it: a 1 KB file holds 1,000 rows of one 10 MiB text, 10 GiB once decoded. Arrow keeps such a column
dictionary-encoded when asked (`read_dictionary`) or when the file's stored Arrow schema says so, so
what a reader holds (`nbytes`: the dictionary once) says nothing of what a consumer that decodes it
(`datasets`, the trainer) allocates. Here:

- `footer_decoded_bytes`: from the footer alone, before anything is read: the larger of the row groups'
  declared sizes and every column's values times their width, where a text (BYTE_ARRAY) column chunk
  counts its declared uncompressed size (at least its values' 4-byte offsets): distinct long texts that
  compress well are refused here, before a batch is decoded;
- `open_parquet`: the file with every text (BYTE_ARRAY) column read dictionary-encoded, so that a batch
  holds each distinct text once however many rows repeat it;
- `decoded_bytes`: an Arrow array's, batch's or table's decoded size, a dictionary value counted once per
  row that uses it;
- `check_parquet_decoded_size`: the footer, then the file in batches (`parquet_batch_rows`), refused with
  `DecodedSizeError` as soon as it decodes past a limit.

The registry's probe (`services.registry.dataset_probe`) and the trainer's loader (`pelt_core.data`)
count the same way. Needs pyarrow and numpy, no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BATCH_BYTES = 16 << 20  # rows per batch are chosen so that a batch decodes to about this much (as declared)
WORKER_BATCH_BYTES = 4 << 20  # the same, in a worker's check (pelt_core.data): its memory is its jobs'
MAX_BATCH_ROWS = 8_192  # ... and never more rows than this, whatever the file declares

_VALUE_WIDTHS = {  # decoded bytes of one value of a Parquet physical type (a text: its offset)
    "BOOLEAN": 0.125,
    "INT32": 4,
    "INT64": 8,
    "INT96": 12,
    "FLOAT": 4,
    "DOUBLE": 8,
    "BYTE_ARRAY": 4,
}


class DecodedSizeError(ValueError):
    """A Parquet file decodes to more bytes than allowed; the message says how many and the limit."""


def footer_decoded_bytes(metadata: Any) -> int:
    """What a Parquet file decodes to at least, from its footer (`pyarrow.parquet.FileMetaData`): the
    larger of its row groups' declared sizes and its columns' values times their width, a text column's
    chunk by its declared uncompressed size (`_chunk_bytes`). Run-length encoded numbers count in full
    here; a text repeated through a dictionary is counted as it is read (`decoded_bytes`)."""
    declared = 0
    values = 0.0
    widths = [_leaf_width(metadata.schema.column(index)) for index in range(metadata.num_columns)]
    for group_index in range(metadata.num_row_groups):
        group = metadata.row_group(group_index)
        declared += max(group.total_byte_size, 0)
        for column_index in range(group.num_columns):
            values += _chunk_bytes(group.column(column_index), widths[column_index])
    return max(declared, int(values))


def _chunk_bytes(chunk: Any, width: float) -> float:
    """A column chunk's decoded bytes by its footer: its values times their width; a text chunk at least
    its declared uncompressed size (its pages' text bytes, a dictionary's values once)."""
    values = max(chunk.num_values, 0) * width
    if chunk.physical_type == "BYTE_ARRAY":
        return max(values, float(max(chunk.total_uncompressed_size, 0)))
    return values


def _leaf_width(column: Any) -> float:
    if column.physical_type == "FIXED_LEN_BYTE_ARRAY":
        return max(column.length, 0)
    return _VALUE_WIDTHS.get(column.physical_type, 8)


def parquet_batch_rows(metadata: Any, batch_bytes: int = BATCH_BYTES) -> int:
    """Rows per batch such that a batch decodes to about `batch_bytes` by the row groups' declared sizes
    (a group: the larger of its total and its columns' `_chunk_bytes`), between 1 and MAX_BATCH_ROWS."""
    widths = [_leaf_width(metadata.schema.column(index)) for index in range(metadata.num_columns)]
    widest = 1.0
    for group in (metadata.row_group(index) for index in range(metadata.num_row_groups)):
        if group.num_rows > 0:
            columns = sum(_chunk_bytes(group.column(i), widths[i]) for i in range(group.num_columns))
            widest = max(widest, max(group.total_byte_size, columns) / group.num_rows)
    return int(max(1, min(MAX_BATCH_ROWS, batch_bytes // widest)))


def open_parquet(path: str | Path, metadata: Any | None = None) -> Any:
    """A `pyarrow.parquet.ParquetFile` whose text (BYTE_ARRAY) columns, nested ones too, are read
    dictionary-encoded: a batch holds each distinct text once, whatever the file's encoding."""
    import pyarrow.parquet as pq

    metadata = metadata if metadata is not None else pq.read_metadata(path)
    texts = [
        index
        for index in range(metadata.num_columns)
        if metadata.schema.column(index).physical_type == "BYTE_ARRAY"
    ]
    return pq.ParquetFile(path, metadata=metadata, read_dictionary=texts or None)


def decoded_bytes(data: Any) -> int:
    """Bytes `data` (a pyarrow Array, ChunkedArray, RecordBatch or Table) takes once decoded: its own
    size, except that a dictionary-encoded value counts once for every row that uses it. ValueError for
    a dictionary index past its dictionary or dictionary-encoded values in a type it cannot walk."""
    import pyarrow as pa

    if isinstance(data, pa.RecordBatch | pa.Table):
        return sum(decoded_bytes(column) for column in data.columns)
    if isinstance(data, pa.ChunkedArray):
        return sum(decoded_bytes(chunk) for chunk in data.chunks)
    if not _holds_dictionary(data.type):
        return int(data.nbytes)
    if pa.types.is_dictionary(data.type):
        return _dictionary_bytes(data)
    if isinstance(data, pa.StructArray):
        return len(data) // 8 + sum(decoded_bytes(child) for child in data.flatten())
    if isinstance(
        data,
        pa.ListArray | pa.LargeListArray | pa.FixedSizeListArray | pa.ListViewArray | pa.LargeListViewArray,
    ):
        return 8 * len(data) + decoded_bytes(data.flatten())
    raise ValueError(f"a column of type {data.type} holds dictionary-encoded values; pelt does not read it")


def _holds_dictionary(kind: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        return True
    return any(_holds_dictionary(kind.field(index).type) for index in range(kind.num_fields))


def _dictionary_bytes(array: Any) -> int:
    """A dictionary-encoded array's decoded bytes: each used value's size times its uses (and a validity
    bitmap). Linear in the rows: a reader may hand every batch the whole dictionary read so far."""
    values = array.dictionary
    used = array.indices.drop_null().to_numpy(zero_copy_only=False)
    if used.size and (used.min() < 0 or used.max() >= len(values)):
        raise ValueError("a dictionary index points past the end of its dictionary")
    return int(_value_sizes(values, used).sum()) + len(array) // 8


def _value_sizes(values: Any, used: Any) -> Any:
    """The decoded bytes of the dictionary values at the positions `used` (numpy int64): a text's length
    plus its offset, read from the dictionary's offsets without touching the other values."""
    import numpy as np
    import pyarrow as pa

    kind = values.type
    if pa.types.is_string_view(kind) or pa.types.is_binary_view(kind):
        values, offset_dtype, extra = values.cast(pa.large_binary()), np.int64, 16  # views have no offsets
    elif pa.types.is_large_string(kind) or pa.types.is_large_binary(kind):
        offset_dtype, extra = np.int64, 8
    elif pa.types.is_string(kind) or pa.types.is_binary(kind):
        offset_dtype, extra = np.int32, 4
    else:
        try:
            width = max(kind.bit_width // 8, 1)
        except ValueError:
            raise ValueError(f"dictionary values of type {kind}; pelt does not read them") from None
        return np.full(used.size, width, dtype=np.int64)
    offsets = np.frombuffer(values.buffers()[1], dtype=offset_dtype)[
        values.offset : values.offset + len(values) + 1
    ]
    used = used.astype(np.int64)
    return (offsets[used + 1] - offsets[used]).astype(np.int64) + extra


def check_parquet_decoded_size(path: str | Path, max_bytes: int, batch_bytes: int = BATCH_BYTES) -> int:
    """The bytes the Parquet file at `path` decodes to, counted from its footer, then in batches of about
    `batch_bytes` (`parquet_batch_rows`; texts read dictionary-encoded: no batch decodes a repeated text
    per row); DecodedSizeError naming the file and `max_bytes` as soon as they pass it."""
    import pyarrow.parquet as pq

    name = Path(path).name
    metadata = pq.read_metadata(path)
    declared = footer_decoded_bytes(metadata)
    if declared > max_bytes:
        raise DecodedSizeError(
            f"{name} decodes to at least {declared:,} bytes by its own footer, more than the "
            f"{max_bytes:,} bytes allowed for a task's data (PELT_MAX_DATASET_BYTES)"
        )
    total = 0
    for batch in open_parquet(path, metadata).iter_batches(
        batch_size=parquet_batch_rows(metadata, batch_bytes)
    ):
        total += decoded_bytes(batch)
        if total > max_bytes:
            raise DecodedSizeError(
                f"{name} decodes to more than the {max_bytes:,} bytes allowed for a task's data "
                "(PELT_MAX_DATASET_BYTES; a repeated text counts once per row)"
            )
    return total


__all__ = [
    "BATCH_BYTES",
    "MAX_BATCH_ROWS",
    "WORKER_BATCH_BYTES",
    "DecodedSizeError",
    "check_parquet_decoded_size",
    "decoded_bytes",
    "footer_decoded_bytes",
    "open_parquet",
    "parquet_batch_rows",
]
