"""The tests' patient Ray node lookup (tests/ray_start.py): it waits for a node that registers late, and
still gives up, with Ray's own error, on one that never does."""

from __future__ import annotations

import pytest

from tests import ray_start
from tests.ray_start import patient_node_lookup, patiently


def test_a_lookup_that_fails_until_the_node_registers_returns_the_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ray_start, "POLL_SECONDS", 0.0)
    calls = []

    def lookup(gcs_address: str, node_id: str) -> dict:
        calls.append(node_id)
        if len(calls) < 5:
            raise RuntimeError(f"node {node_id} not found")
        return {"node_id": node_id}

    assert patiently(lookup, seconds=60)("127.0.0.1:1", "abc") == {"node_id": "abc"}
    assert len(calls) == 5


def test_a_node_that_never_registers_still_fails_with_rays_error_once_the_deadline_passes() -> None:
    def lookup(gcs_address: str, node_id: str) -> dict:
        raise RuntimeError("node not found")

    with pytest.raises(RuntimeError, match="node not found"):
        patiently(lookup, seconds=0.0)("127.0.0.1:1", "abc")


def test_the_tests_patch_rays_node_lookup_and_put_it_back() -> None:
    import ray._private.services as ray_services

    original = ray_services.get_node
    with patient_node_lookup(seconds=1):
        assert ray_services.get_node is not original
    assert ray_services.get_node is original
