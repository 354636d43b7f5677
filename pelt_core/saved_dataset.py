"""A folder written by `datasets`' save_to_disk, checked before anything loads it.

`datasets.load_from_disk` joins the split names of dataset_dict.json and the data-file names of each
split's state.json to the folder, so an absolute or `..` name would read Arrow files anywhere on the
machine; it loads a root state.json before a dataset_dict.json; and Image/Audio features (from
dataset_info.json or, without one, from the Arrow schema's metadata) decode files named in the rows.
So pelt never calls it on such a folder. A folder is checked first:
- every split is a plain name (datasets' own rule: `train`, `validation.matched`) of a sub-folder, and a
  DatasetDict has no state.json of its own;
- every data file is a plain `*.arrow` name of a regular file (not a link) in its split's folder;
- dataset_info.json lists the features, and they (and any in the Arrow schema's metadata) are data
  (Value, ClassLabel, lists and dicts of them): none decodes files;
- every Arrow record batch is uncompressed and no column is dictionary-encoded: rows are counted from
  the stream's metadata, nothing is decoded, so nothing can expand in memory (save_to_disk writes
  neither).
Then each split's table is built from its checked Arrow files only (`read_saved_split`, memory-mapped,
the schema's metadata dropped), with the checked features of dataset_info.json.
Errors name the split and the file as the folder names them, never a path of this machine.

Both the service (the registry's probe) and the trainer (`pelt_core.data.load_table`) go through
`inspect_saved_dataset` and `read_saved_split` (`load_saved_dataset` for a `datasets` object). Needs
pyarrow (and `datasets` for `load_saved_dataset`), no torch.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPLIT_NAME = re.compile(r"^\w+(\.\w+)*$")  # datasets' rule for split names
DATA_FILE_NAME = re.compile(r"^\w[\w.-]*\.arrow$")
DATA_FEATURES = frozenset(
    {"Value", "ClassLabel", "Sequence", "List", "LargeList", "Translation", "TranslationVariableLanguages"}
)
MAX_METADATA_BYTES = 16 << 20  # dataset_dict.json, state.json, dataset_info.json (real ones: a few KB)
MAX_FEATURE_DEPTH = 32
_RECORD_BATCH, _DICTIONARY_BATCH, _SCHEMA = 3, 2, 1  # Arrow's MessageHeader union


class SavedDatasetError(ValueError):
    """The folder is not a save_to_disk folder pelt may load; the message names the split and file.
    (`pelt_core.data.load_table` raises it as a DataError.)"""


class SavedDatasetTooLargeError(SavedDatasetError):
    """A split holds more rows than the caller allows (`max_rows`)."""

    def __init__(self, message: str, rows: int, limit: int) -> None:
        super().__init__(message)
        self.rows, self.limit = rows, limit


@dataclass(frozen=True)
class SavedSplit:
    """One split: its Arrow files (in the folder) and its rows, counted from their metadata."""

    name: str
    files: tuple[Path, ...]
    rows: int
    features: dict[str, Any]  # dataset_info.json's features, checked (datasets' Features.to_dict form)


@dataclass(frozen=True)
class SavedDataset:
    """A checked folder: a DatasetDict (`is_dict`) or a lone Dataset, listed as the split "train"."""

    folder: Path
    is_dict: bool
    splits: dict[str, SavedSplit]


def is_saved_dataset(folder: Path) -> bool:
    """Whether the folder looks like save_to_disk output (a DatasetDict or a Dataset)."""
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def inspect_saved_dataset(folder: str | Path, *, max_rows: int | None = None) -> SavedDataset:
    """Check a save_to_disk folder (see the module) and count each split's rows without decoding them.
    SavedDatasetError when it is unsafe or malformed; SavedDatasetTooLargeError beyond `max_rows` rows
    in one split."""
    root = Path(folder)
    if (root / "dataset_dict.json").is_file():
        if (root / "state.json").exists() or (root / "state.json").is_symlink():
            raise SavedDatasetError(
                "the folder has both a dataset_dict.json and a state.json of its own; a "
                "DatasetDict keeps each split's state.json in the split's folder"
            )
        listed = _json_file(root / "dataset_dict.json", "dataset_dict.json")
        names = listed.get("splits") if isinstance(listed, dict) else None
        if not isinstance(names, list) or not names:
            raise SavedDatasetError("dataset_dict.json: 'splits' must be a non-empty list of split names")
        splits = {}
        for name in names:
            if not isinstance(name, str) or not SPLIT_NAME.fullmatch(name):
                raise SavedDatasetError(
                    f"dataset_dict.json: split {_shown(name)} is not a split name (letters, digits, "
                    "'_', dots between them): a split is a sub-folder of the dataset"
                )
            if name in splits:
                raise SavedDatasetError(f"dataset_dict.json: split {name!r} is listed twice")
            splits[name] = _inspect_split(root, name, max_rows)
        return SavedDataset(root, True, splits)
    if (root / "state.json").is_file():
        return SavedDataset(root, False, {"train": _inspect_split(root, None, max_rows)})
    raise SavedDatasetError(
        "not a folder written by datasets' save_to_disk (no dataset_dict.json or state.json)"
    )


def read_saved_split(split: SavedSplit) -> Any:
    """A checked split's rows as one pyarrow Table of its own Arrow files (memory-mapped, not copied),
    without the schema's metadata (features come from the checked dataset_info.json only)."""
    import pyarrow as pa

    tables = []
    for path in split.files:
        try:
            with pa.ipc.open_stream(pa.memory_map(str(path))) as reader:
                tables.append(reader.read_all())
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise SavedDatasetError(
                f"split {split.name!r}: data file {path.name!r} is not a readable Arrow "
                f"stream ({type(exc).__name__})"
            ) from None
    try:
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    except (ValueError, TypeError) as exc:
        raise SavedDatasetError(
            f"split {split.name!r}: its data files have different columns ({exc})"
        ) from None
    return table.replace_schema_metadata(None)


def load_saved_dataset(folder: str | Path, *, max_rows: int | None = None) -> Any:
    """A checked folder as a `datasets` Dataset (a DatasetDict for a dict), built from its own Arrow files
    with the checked features (never `datasets.load_from_disk`), in the plain Python format."""
    import datasets
    from datasets.table import InMemoryTable

    layout = inspect_saved_dataset(folder, max_rows=max_rows)
    loaded = {}
    for name, split in layout.splits.items():
        try:
            features = datasets.Features.from_dict(split.features)
            loaded[name] = datasets.Dataset(
                InMemoryTable(read_saved_split(split)),
                info=datasets.DatasetInfo(features=features),
                split=name,
                fingerprint=split_fingerprint(split),
            )
        except SavedDatasetError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise SavedDatasetError(
                f"split {name!r}: its features do not fit its data ({type(exc).__name__}: "
                f"{_without(exc, Path(folder))})"[:2000]
            ) from None
    return datasets.DatasetDict(loaded) if layout.is_dict else loaded["train"]


def split_fingerprint(split: SavedSplit) -> str:
    """The `datasets` fingerprint of a checked split: sha256 of its name, features and its files' paths, sizes
    and modification times. Without one given, `datasets` pickles and hashes the whole table (another copy)."""
    digest = hashlib.sha256(json.dumps([split.name, split.features], sort_keys=True).encode())
    for path in split.files:
        status = path.stat()
        digest.update(f"\0{path.resolve()}\0{status.st_size}\0{status.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


# --- one split ------------------------------------------------------------------------------------------


def _inspect_split(root: Path, name: str | None, max_rows: int | None) -> SavedSplit:
    where = f"split {name!r}" if name is not None else "the dataset folder"
    folder = root / name if name is not None else root
    _regular(folder, where, directory=True)
    state = _json_file(folder / "state.json", f"{where}: state.json")
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files:
        raise SavedDatasetError(f"{where}: state.json lists no data files ('_data_files')")
    if state.get("_indices_data_files") or state.get("_format_kwargs"):
        raise SavedDatasetError(
            f"{where}: state.json holds indices or format arguments; save the dataset with "
            "save_to_disk (it flattens them)"
        )
    info = _json_file(folder / "dataset_info.json", f"{where}: dataset_info.json")
    features = info.get("features") if isinstance(info, dict) else None
    if not isinstance(features, dict) or not features:
        raise SavedDatasetError(
            f"{where}: dataset_info.json lists no features ('features'); save the dataset "
            "with save_to_disk (it writes them)"
        )
    _check_features(features, where, 0)
    paths, rows = [], 0
    for entry in files:
        filename = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(filename, str) or not DATA_FILE_NAME.fullmatch(filename):
            raise SavedDatasetError(
                f"{where}: data file {_shown(filename)} in state.json is not a plain '*.arrow' "
                "file name: data files must be in the split's own folder"
            )
        path = folder / filename
        _regular(path, f"{where}: data file {filename!r}", directory=False)
        rows += _arrow_rows(path, f"{where}: data file {filename!r}")
        if max_rows is not None and rows > max_rows:
            raise SavedDatasetTooLargeError(f"{where} holds more than {max_rows} rows", rows, max_rows)
        paths.append(path)
    return SavedSplit(name or "train", tuple(paths), rows, features)


def _regular(path: Path, where: str, *, directory: bool) -> None:
    """A real file or folder (not a link, not missing) directly where the folder says."""
    try:
        mode = path.lstat().st_mode
    except (OSError, ValueError):
        raise SavedDatasetError(f"{where}: missing from the dataset folder") from None
    if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        raise SavedDatasetError(f"{where}: not a {'folder' if directory else 'regular file'} of the dataset")


def _json_file(path: Path, where: str) -> Any:
    try:
        if path.is_symlink() or not path.is_file():
            raise SavedDatasetError(f"{where}: missing")
        if path.stat().st_size > MAX_METADATA_BYTES:
            raise SavedDatasetError(f"{where}: larger than {MAX_METADATA_BYTES} bytes")
        return json.loads(path.read_bytes())
    except SavedDatasetError:
        raise
    except RecursionError:
        raise SavedDatasetError(f"{where}: nested too deeply") from None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise SavedDatasetError(f"{where}: not readable JSON ({type(exc).__name__})") from None


def _check_features(features: Any, where: str, depth: int) -> None:
    """Features are data only: Value, ClassLabel, lists and dicts of them (no Image, Audio, ...)."""
    if depth > MAX_FEATURE_DEPTH:
        raise SavedDatasetError(f"{where}: dataset_info.json features nest too deeply")
    if isinstance(features, list):
        for item in features:
            _check_features(item, where, depth + 1)
        return
    if not isinstance(features, dict):
        return
    kind = features.get("_type")
    if kind is not None and kind not in DATA_FEATURES:
        raise SavedDatasetError(
            f"{where}: feature type {kind!r} is not supported (text and label data only: "
            f"{', '.join(sorted(DATA_FEATURES))})"
        )
    for key, value in features.items():
        if key != "_type":
            _check_features(value, where, depth + 1)


# --- Arrow streams, read from their metadata only ----------------------------------------------------------


def _arrow_rows(path: Path, where: str) -> int:
    """Rows of an Arrow IPC stream file, from its messages' metadata; compressed batches are refused."""
    import pyarrow as pa

    rows = 0
    try:
        with pa.memory_map(str(path)) as source:
            _check_schema(pa.ipc.open_stream(source).schema, where)  # reads the schema message only
            source.seek(0)
            for message in pa.ipc.MessageReader.open_stream(source):
                header, batch = _message_header(message.metadata.to_pybytes())
                if header == _DICTIONARY_BATCH:
                    raise SavedDatasetError(
                        f"{where}: holds dictionary-encoded columns (save_to_disk writes none)"
                    )
                if header not in (_SCHEMA, _RECORD_BATCH):
                    raise SavedDatasetError(f"{where}: holds an Arrow message that is not a table")
                if batch is None:
                    continue
                length, compressed = batch
                if compressed:
                    raise SavedDatasetError(
                        f"{where}: holds compressed Arrow buffers (save_to_disk writes them uncompressed)"
                    )
                if header == _RECORD_BATCH:
                    rows += length
    except SavedDatasetError:
        raise
    except (OSError, ValueError, struct.error, IndexError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise SavedDatasetError(f"{where}: not an Arrow stream ({type(exc).__name__})") from None
    return rows


def _check_schema(schema: Any, where: str) -> None:
    """No dictionary-encoded column; features in the schema's `huggingface` metadata (which datasets
    would take when dataset_info.json lists none) are data only, like dataset_info.json's."""
    import pyarrow as pa

    for field in schema:
        if pa.types.is_dictionary(field.type):
            raise SavedDatasetError(
                f"{where}: column {field.name!r} is dictionary-encoded (save_to_disk writes none)"
            )
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw is None:
        return
    if len(raw) > MAX_METADATA_BYTES:
        raise SavedDatasetError(f"{where}: its schema's metadata is larger than {MAX_METADATA_BYTES} bytes")
    try:
        metadata = json.loads(raw)
    except (ValueError, RecursionError):
        raise SavedDatasetError(
            f"{where}: its schema's 'huggingface' metadata is not readable JSON"
        ) from None
    info = metadata.get("info") if isinstance(metadata, dict) else None
    _check_features(info.get("features") if isinstance(info, dict) else None, f"{where} (schema metadata)", 0)


def _message_header(meta: bytes) -> tuple[int, tuple[int, bool] | None]:
    """(header type, (rows, compressed) of its record batch or None) of a flatbuffer `Message`."""
    message = _table(meta, struct.unpack_from("<I", meta, 0)[0])
    header_type = _scalar(meta, message, 1, "<B", 0)
    header = _child(meta, message, 2)
    if header is None or header_type not in (_RECORD_BATCH, _DICTIONARY_BATCH):
        return header_type, None
    batch = header if header_type == _RECORD_BATCH else _child(meta, header, 1)  # DictionaryBatch.data
    if batch is None:
        return header_type, (0, False)
    length = _scalar(meta, batch, 0, "<q", 0)
    if length < 0:
        raise ValueError("negative row count")
    return header_type, (length, _child(meta, batch, 3) is not None)  # RecordBatch.compression


def _table(buffer: bytes, position: int) -> tuple[int, int, int]:
    """(table position, vtable position, vtable size) of the flatbuffer table at `position`."""
    vtable = position - struct.unpack_from("<i", buffer, position)[0]
    if not 0 <= vtable < len(buffer):
        raise ValueError("vtable outside the buffer")
    return position, vtable, struct.unpack_from("<H", buffer, vtable)[0]


def _field_offset(buffer: bytes, table: tuple[int, int, int], index: int) -> int:
    _, vtable, size = table
    entry = 4 + 2 * index
    return struct.unpack_from("<H", buffer, vtable + entry)[0] if entry < size else 0


def _scalar(buffer: bytes, table: tuple[int, int, int], index: int, kind: str, default: int) -> int:
    offset = _field_offset(buffer, table, index)
    return struct.unpack_from(kind, buffer, table[0] + offset)[0] if offset else default


def _child(buffer: bytes, table: tuple[int, int, int], index: int) -> tuple[int, int, int] | None:
    offset = _field_offset(buffer, table, index)
    if not offset:
        return None
    at = table[0] + offset
    return _table(buffer, at + struct.unpack_from("<I", buffer, at)[0])


def _shown(value: Any) -> str:
    """A name from the folder's metadata as an error quotes it: a path only by its last part."""
    if isinstance(value, str) and ("/" in value or "\\" in value):
        return repr("…/" + value.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1])
    return repr(value)[:200]


def _without(exc: BaseException, folder: Path) -> str:
    """An error's text with the folder's path cut out (the folder is named by the caller)."""
    text = str(exc)
    for form in {str(folder), str(folder.resolve())}:
        text = text.replace(form + "/", "").replace(form, "")
    return text


__all__ = [
    "SavedDataset",
    "SavedDatasetError",
    "SavedDatasetTooLargeError",
    "SavedSplit",
    "inspect_saved_dataset",
    "is_saved_dataset",
    "load_saved_dataset",
    "read_saved_split",
    "split_fingerprint",
]
