"""Where a task's data live: split files of a supported format, or a `datasets` save_to_disk folder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.registry.errors import RegistryValidationError

FILE_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}


FORMAT_NAMES = {"jsonl": "JSON Lines", "csv": "CSV", "tsv": "TSV", "parquet": "Parquet"}


@dataclass(frozen=True)
class DatasetSource:
    """Where a task's data lives. kind "files": `paths` maps split → file; "datasets": {"path": folder}."""

    kind: str
    paths: dict[str, str]


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


def _is_saved_dataset(path: Path) -> bool:
    from pelt_core.saved_dataset import is_saved_dataset

    return is_saved_dataset(path)


__all__ = ["FILE_FORMATS", "FORMAT_NAMES", "DatasetSource", "resolve_source"]
