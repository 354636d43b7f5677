"""Compositions and the API's memory (issue "Harden, second round", finding 1): a composition is refused from
an estimate of its memory (the sources' stored sizes x the op's working factor) above PELT_COMPOSE_MEMORY_BYTES
before anything is downloaded or loaded, and is computed in a child process under an address-space limit, so
the API's process never loads a source's tensors; a child that runs out of memory or time is a clear error
that leaves no version, no audit event and no temporary file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from services.delta_store import compose_child
from services.delta_store.compose_child import dense_lora_bytes, estimate_compose_bytes
from tests.api.helpers import refused
from tests.security.conftest import versions


def compose_events(api) -> list:
    return [e for e in api.registry.audit_events() if e.action == "delta.compose"]


def source_sizes(api, refs: list[str], folder: Path) -> tuple[list[int], list[int]]:
    """The sizes of the sources' delta files as the store holds them, and of their LoRA modules as dense ΔW
    (from the files' headers)."""
    from pelt_core.delta_format import read_manifest

    sizes, dense = [], []
    for index, ref in enumerate(refs):
        info = api.store.get_version(ref)
        downloaded = api.store.download(info.task, info.version, dest=folder / str(index))
        sizes.append((downloaded / "delta.safetensors").stat().st_size)
        dense.append(dense_lora_bytes(downloaded, read_manifest(downloaded)))
    return sizes, dense


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary folder of this process (tempfile's), empty: what a composition leaves there shows."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_a_composition_loads_no_source_tensor_in_the_api_process(client, api, loras, monkeypatch):
    from services.delta_store.values import DeltaRef

    expected = {  # the same compositions computed here, in this process, as a library call does
        op: api.store.compose(op, sources, into=f"here-{op}").stored.sha256
        for op, sources in (("merge", loras), ("multi_task", {"a": loras[0], "b": loras[1]}))
    }

    def no_loading(*args, **kwargs):
        raise AssertionError("the API's process loaded a source's tensors")

    for target in (
        "services.delta_store.reading.load_pulled",
        "pelt_core.pulled.load_pulled",
        "pelt_core.delta.load_delta",
        "safetensors.torch.load_file",
    ):
        monkeypatch.setattr(target, no_loading)
    merged = client.compose("merge", loras, "soup")
    bundle = client.compose("multi_task", {"a": loras[0], "b": loras[1]}, "pair")
    assert (merged.sha256, bundle.sha256) == (expected["merge"], expected["multi_task"])
    assert merged.provenance["op"] == "merge(linear)" and [
        i["name"] for i in merged.provenance["inputs"]
    ] == [
        "toy/1",
        "toy/2",
    ]
    assert api.store.get_version(DeltaRef("soup")).sha256 == merged.sha256
    assert [e.target for e in compose_events(api)] == ["pair version 1", "soup version 1"]


def test_a_composition_estimated_above_the_budget_is_413_before_anything_is_loaded(
    client, api, loras, monkeypatch, tmp_path
):
    sizes, dense = source_sizes(api, loras, tmp_path / "sizes")
    from_listing = estimate_compose_bytes("merge", {"how": "ties"}, sizes)  # before any download
    from_files = estimate_compose_bytes("merge", {"how": "ties"}, sizes, dense)  # + LoRA as dense ΔW
    assert from_files > from_listing

    def nothing_loaded(*args, **kwargs):
        raise AssertionError("a source was loaded or composed for a composition over its budget")

    monkeypatch.setattr(compose_child, "run_compose_child", nothing_loaded)
    monkeypatch.setattr("services.sandbox.run_in_child", nothing_loaded)
    monkeypatch.setattr(api.store, "pull", nothing_loaded)
    with monkeypatch.context() as patched:
        patched.setattr(api.store, "_download", nothing_loaded)
        api.settings.compose_memory_bytes = from_listing - 1
        error = refused(
            lambda: client.compose("merge", loras, "soup", how="ties"),
            413,
            "sources",
            "PELT_COMPOSE_MEMORY_BYTES",
        )
        assert f"{from_listing:,} bytes" in error.message and f"{sum(sizes):,} stored bytes" in error.message
    api.settings.compose_memory_bytes = from_files - 1  # the stored sizes fit; as dense ΔW they do not
    error = refused(lambda: client.compose("merge", loras, "soup", how="ties"), 413, "sources", "dense ΔW")
    assert f"{from_files:,} bytes" in error.message and f"{sum(dense):,} bytes" in error.message
    assert versions(api, "soup") == [] and compose_events(api) == []
    api.settings.compose_memory_bytes = from_files  # within the budget: it composes
    monkeypatch.undo()
    assert client.compose("merge", loras, "soup", how="ties").version == "1"


def test_a_composition_whose_process_runs_out_of_memory_is_413_and_leaves_nothing(
    client, api, loras, monkeypatch, private_tmp
):
    # the estimate passes, but the child's address space holds the budget alone: not even torch fits
    api.settings.compose_memory_bytes = 64 << 20
    monkeypatch.setattr(compose_child, "RUNTIME_HEADROOM_BYTES", 0)
    refused(lambda: client.compose("merge", loras, "soup"), 413, "sources", "ran out of memory")
    assert versions(api, "soup") == [] and compose_events(api) == []
    assert list(private_tmp.iterdir()) == []


def test_a_composition_that_runs_past_its_time_is_killed_and_leaves_nothing(client, api, loras, private_tmp):
    api.settings.sandbox_warm_seconds = 0  # a fresh interpreter: it cannot import torch in 10 ms
    api.settings.compose_timeout_seconds = 0.01
    refused(
        lambda: client.compose("merge", loras, "toy", aliases=["soup"]),
        422,
        "sources",
        "ran past PELT_COMPOSE_TIMEOUT_SECONDS",
    )
    assert versions(api, "toy") == ["1", "2"] and compose_events(api) == []
    assert list(private_tmp.iterdir()) == []


def test_a_source_the_child_refuses_is_a_422_naming_the_option(client, api, loras):
    refused(
        lambda: client.compose("merge", loras, "soup", how="ties", lora_rank=33),
        422,
        "options.lora_rank",
        "at most 32",
    )
    assert versions(api, "soup") == [] and compose_events(api) == []


def test_compositions_beyond_the_concurrency_are_503_with_retry_after(client, api, loras):
    slots = api.operations._compose_slots
    taken = 0
    try:
        for _ in range(api.settings.compose_concurrency):
            assert slots.acquire(blocking=False)
            taken += 1
        response = client.http.post("/v1/compose", json={"op": "merge", "sources": loras, "into": "soup"})
        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"] == "5"
        assert "PELT_COMPOSE_CONCURRENCY" in response.json()["error"]["message"]
        assert versions(api, "soup") == [] and compose_events(api) == []
        slots.release()
        taken -= 1
        assert client.compose("merge", loras, "soup").version == "1"
    finally:
        for _ in range(taken):
            slots.release()


def header_of(document: object) -> bytes:
    """A .safetensors file whose header is `document` (as JSON, or the bytes given) and holds no tensor."""
    raw = document if isinstance(document, bytes) else json.dumps(document).encode()
    return len(raw).to_bytes(8, "little") + raw


def stored_folder(api, ref: str) -> Path:
    """Where the store keeps a version's delta folder (a local artifact root)."""
    from urllib.parse import urlparse

    from services.delta_store.reading import _run_artifact

    run_id, path = _run_artifact(api.store.get_version(ref))
    return Path(urlparse(api.store.client.get_run(run_id).info.artifact_uri).path) / path


CORRUPTIONS = {  # what a stored delta may hold that the store's register takes (it checks the manifest's format)
    "a header that is not JSON": ("delta.safetensors", header_of(b"{not json")),
    "a header that is a JSON list": ("delta.safetensors", header_of([1, 2])),
    "a header with a negative size": ("delta.safetensors", header_of({"x.down.weight": {"shape": [-1, 2]}})),
    "a file shorter than its header": ("delta.safetensors", b"\x07"),
    "a manifest without its method": ("manifest.json", {"method": None}),
    "a manifest whose backbone has no name": ("manifest.json", {"backbone": "unnamed"}),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_malformed_stored_delta_is_a_422_naming_it_and_writes_nothing(
    client, api, loras, tmp_path, private_tmp, corruption
):
    info = api.store.get_version(loras[1])
    folder = api.store.download(info.task, info.version, dest=tmp_path / "broken")
    file, change = CORRUPTIONS[corruption]
    if file == "delta.safetensors":  # registered as it is: its sha256 is recorded, so it downloads
        (folder / file).write_bytes(change)
        broken = f"broken/{api.store.register('broken', folder).model_version}"
    else:  # a stored manifest changed in place (register refuses it; the sha256 covers the tensors only)
        broken = f"broken/{api.store.register('broken', folder).model_version}"
        stored = stored_folder(api, broken) / file
        manifest = json.loads(stored.read_text())
        if change.get("method", "") is None:
            del manifest["method"]
        else:
            del manifest["backbone"]["name"]
        stored.write_text(json.dumps(manifest))
    error = refused(
        lambda: client.compose("merge", [loras[0], broken], "soup", how="ties"),
        422,
        "sources",
        f"sources: {broken} (broken/1) is not a readable delta",
    )
    assert str(private_tmp) not in error.message and "pelt-compose-" not in error.message
    assert versions(api, "soup") == [] and compose_events(api) == []
    assert list(private_tmp.iterdir()) == []
