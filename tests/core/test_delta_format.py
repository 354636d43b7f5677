"""The delta format's one home (`pelt_core.delta_format`): torch-free, and its checks of manifests, bundles
and sha256 (writing and loading tensors: test_lora_and_deltas.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pelt_core.delta_format import (
    BUNDLE_FILE,
    DELTA_FILE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    DeltaError,
    bundle_entry,
    read_bundle,
    read_manifest,
    sha256_file,
    sha256_mismatch,
    write_bundle_manifest,
    write_manifest,
)

HEAVY = ("torch", "numpy", "safetensors", "transformers", "mlflow")


@pytest.mark.parametrize("module", ["pelt_core.delta_format", "pelt_core.pulled"])
def test_the_format_and_the_pull_types_import_without_torch(module):
    code = f"import json, sys; import {module}; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def delta_folder(folder: Path, **manifest_changes) -> Path:
    """A delta folder with placeholder tensor bytes and a minimal manifest (plus `manifest_changes`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / DELTA_FILE).write_bytes(b"tensors of " + folder.name.encode())
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "backbone": {"name": "b", "content_hash": "h"},
    }
    write_manifest(folder, {**manifest, **manifest_changes})
    return folder


def test_a_manifest_is_read_with_its_checks(tmp_path):
    assert read_manifest(delta_folder(tmp_path / "ok"))["backbone"]["content_hash"] == "h"
    refused = {
        "format": ({"format": "other"}, "format 'other' is not 'pelt-delta'"),
        "newer": ({"format_version": FORMAT_VERSION + 1}, "newer than this pelt understands"),
        "no-hash": ({"backbone": {"name": "b"}}, "no backbone content hash"),
    }
    for name, (changes, message) in refused.items():
        with pytest.raises(DeltaError, match=message):
            read_manifest(delta_folder(tmp_path / name, **changes))
    (tmp_path / "ok" / DELTA_FILE).unlink()
    with pytest.raises(DeltaError, match=f"it needs {DELTA_FILE} and {MANIFEST_FILE}"):
        read_manifest(tmp_path / "ok")
    (tmp_path / "bad-json" / MANIFEST_FILE).parent.mkdir()
    (tmp_path / "bad-json" / DELTA_FILE).write_bytes(b"x")
    (tmp_path / "bad-json" / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(DeltaError, match="not JSON"):
        read_manifest(tmp_path / "bad-json")


def bundle_folder(folder: Path) -> Path:
    entries = {}
    for name in ("sst2", "topic"):
        part = delta_folder(folder / "tasks" / name)
        entries[name] = bundle_entry(name, sha256_file(part / DELTA_FILE), task=name, version="1")
    write_bundle_manifest(folder, "b", "h", entries)
    return folder


def test_a_bundle_names_each_parts_sha256_and_is_checked_part_by_part(tmp_path):
    folder = bundle_folder(tmp_path / "bundle")
    bundle = read_bundle(folder)
    assert bundle["tasks"]["sst2"] == {
        "path": "tasks/sst2",
        "sha256": sha256_file(folder / "tasks" / "sst2" / DELTA_FILE),
        "task": "sst2",
        "version": "1",
    }
    recorded = sha256_file(folder / BUNDLE_FILE)
    assert sha256_mismatch(folder, recorded, bundle=True) is None
    assert sha256_mismatch(folder, "0" * 64, bundle=True) == (
        f"{BUNDLE_FILE} has sha256 {recorded}, not the recorded {'0' * 64}"
    )
    (folder / "tasks" / "topic" / DELTA_FILE).write_bytes(b"changed")
    assert sha256_mismatch(folder, recorded, bundle=True).startswith("task 'topic' has sha256 ")


def test_a_single_delta_is_checked_by_its_tensor_file(tmp_path):
    folder = delta_folder(tmp_path / "d")
    recorded = sha256_file(folder / DELTA_FILE)
    assert sha256_mismatch(folder, recorded) is None
    (folder / DELTA_FILE).unlink()
    assert sha256_mismatch(folder, recorded) == f"{DELTA_FILE} has sha256 None, not the recorded {recorded}"


@pytest.mark.parametrize("path", ["../outside", "/etc", "tasks/other", "tasks/sst2/.."])
def test_a_bundle_entry_cannot_point_outside_its_folder(tmp_path, path):
    folder = bundle_folder(tmp_path / "bundle")
    bundle = json.loads((folder / BUNDLE_FILE).read_text())
    bundle["tasks"]["sst2"]["path"] = path
    (folder / BUNDLE_FILE).write_text(json.dumps(bundle))
    with pytest.raises(DeltaError, match="must lie in tasks/sst2"):
        read_bundle(folder)


def test_a_route_name_is_a_folder_name(tmp_path):
    with pytest.raises(DeltaError, match="route name"):
        bundle_entry("../x", "0" * 64)
