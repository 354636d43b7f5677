"""The delta format on disk, in one place: file names, format versions, sha256, manifests and the
multi-task bundle. Torch-free (no torch, numpy, safetensors or transformers import), so the MLflow
store, the workers' local sink and the HTTP client read and check deltas without loading a model;
writing and loading the tensors is `pelt_core.delta`'s part.

A delta folder:

    delta.safetensors   the delta's tensors (never pickle); its sha256 is the delta's identity
    manifest.json       format, format_version, method spec, backbone (name, content hash, ...), head, extra

A multi-task bundle folder (several task deltas on one backbone, served together):

    bundle.json         format, format_version, backbone (name, content hash) and per route name its path
                        (tasks/<name>), the sha256 of its delta.safetensors and where it came from
    tasks/<name>/       a delta folder per route name

A bundle's identity is the sha256 of bundle.json, which names every part's sha256.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DELTA_FILE = "delta.safetensors"
MANIFEST_FILE = "manifest.json"
FORMAT = "pelt-delta"
FORMAT_VERSION = 1

BUNDLE_FILE = "bundle.json"
BUNDLE_FORMAT = "pelt-multi-task"
BUNDLE_FORMAT_VERSION = 1
BUNDLE_TASKS_DIR = "tasks"
BUNDLE_ROUTE_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,100}$")  # a route name: also a folder name


class DeltaError(ValueError):
    """A delta folder is incomplete, corrupted, or meant for another backbone."""


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: str | Path, manifest: Mapping[str, Any]) -> None:
    """Write `manifest.json` into a delta folder (sorted keys: the same manifest gives the same bytes)."""
    (Path(folder) / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def read_manifest(path: str | Path) -> dict[str, Any]:
    """A delta folder's manifest, checked: both files present, this format, a version this pelt reads,
    and the backbone's content hash (a delta loads only onto that backbone)."""
    folder = Path(path)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file() or not (folder / DELTA_FILE).is_file():
        raise DeltaError(f"{folder} is not a pelt delta: it needs {DELTA_FILE} and {MANIFEST_FILE}")
    manifest = _read_json(manifest_path)
    _check_format(manifest_path, manifest, FORMAT, FORMAT_VERSION)
    _check_backbone(manifest_path, manifest)
    return manifest


def bundle_task_path(name: str) -> str:
    """Where a route's delta folder lies inside a bundle: `tasks/<name>`."""
    if not isinstance(name, str) or not BUNDLE_ROUTE_PATTERN.fullmatch(name):
        raise DeltaError(f"multi-task route name {name!r}: letters, digits, '_' and '-' only")
    return f"{BUNDLE_TASKS_DIR}/{name}"


def bundle_entry(name: str, sha256: str, **source: Any) -> dict[str, Any]:
    """bundle.json's entry of one route: its folder, the sha256 of its delta file, plus `source`
    (e.g. the task and version it was pulled from)."""
    return {"path": bundle_task_path(name), "sha256": sha256, **source}


def write_bundle_manifest(
    folder: str | Path, backbone_name: str, content_hash: str, entries: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """Write `bundle.json` for the route folders already saved under `tasks/`; returns what it wrote."""
    bundle = {
        "format": BUNDLE_FORMAT,
        "format_version": BUNDLE_FORMAT_VERSION,
        "backbone": {"name": backbone_name, "content_hash": content_hash},
        "tasks": {name: dict(entry) for name, entry in entries.items()},
    }
    (Path(folder) / BUNDLE_FILE).write_text(json.dumps(bundle, indent=2, sort_keys=True))
    return bundle


def read_bundle(path: str | Path) -> dict[str, Any]:
    """A bundle folder's bundle.json, checked: this format and version, the backbone's content hash, and
    per route a sha256 and the path `tasks/<name>` (so no entry can point outside the folder)."""
    bundle_path = Path(path) / BUNDLE_FILE
    if not bundle_path.is_file():
        raise DeltaError(f"{Path(path)} is not a pelt multi-task bundle: it needs {BUNDLE_FILE}")
    bundle = _read_json(bundle_path)
    _check_format(bundle_path, bundle, BUNDLE_FORMAT, BUNDLE_FORMAT_VERSION)
    _check_backbone(bundle_path, bundle)
    tasks = bundle.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        raise DeltaError(f"{bundle_path}: no tasks")
    for name, entry in tasks.items():
        if not isinstance(entry, dict) or entry.get("path") != bundle_task_path(name):
            raise DeltaError(f"{bundle_path}: task {name!r} must lie in {BUNDLE_TASKS_DIR}/{name}")
        if not isinstance(entry.get("sha256"), str):
            raise DeltaError(f"{bundle_path}: task {name!r} has no sha256")
    return bundle


def sha256_mismatch(folder: str | Path, expected: str | None, *, bundle: bool = False) -> str | None:
    """None when a downloaded folder matches its recorded sha256; else which file differs and how
    ("delta.safetensors has sha256 X, not the recorded Y"). A bundle: bundle.json against `expected`,
    then each route's delta file against the sha256 bundle.json records."""
    folder = Path(folder)
    name = BUNDLE_FILE if bundle else DELTA_FILE
    actual = sha256_file(folder / name) if (folder / name).is_file() else None
    if actual != expected:
        return f"{name} has sha256 {actual}, not the recorded {expected}"
    if not bundle:
        return None
    for route, entry in read_bundle(folder)["tasks"].items():
        part = folder / entry["path"] / DELTA_FILE
        actual = sha256_file(part) if part.is_file() else None
        if actual != entry["sha256"]:
            return f"task {route!r} has sha256 {actual}, not the recorded {entry['sha256']}"
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DeltaError(f"{path}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise DeltaError(f"{path}: not a JSON object")
    return value


def _check_format(path: Path, document: Mapping[str, Any], name: str, version: int) -> None:
    if document.get("format") != name:
        raise DeltaError(f"{path}: format {document.get('format')!r} is not {name!r}")
    found = document.get("format_version", 0)
    if not isinstance(found, int) or found > version:
        raise DeltaError(
            f"{path}: format version {found!r} is newer than this pelt understands ({version}); upgrade pelt"
        )


def _check_backbone(path: Path, document: Mapping[str, Any]) -> None:
    backbone = document.get("backbone")
    if not isinstance(backbone, dict) or not isinstance(backbone.get("content_hash"), str):
        raise DeltaError(f"{path}: no backbone content hash")


__all__ = [
    "BUNDLE_FILE",
    "BUNDLE_FORMAT",
    "BUNDLE_FORMAT_VERSION",
    "BUNDLE_ROUTE_PATTERN",
    "BUNDLE_TASKS_DIR",
    "DELTA_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "DeltaError",
    "bundle_entry",
    "bundle_task_path",
    "read_bundle",
    "read_manifest",
    "sha256_file",
    "sha256_mismatch",
    "write_bundle_manifest",
]
