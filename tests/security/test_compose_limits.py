"""Limits of compositions (issue #11, findings 1 and 7): a rank is bounded by the matrices it factors and is
checked before anything is allocated; every option's type and range, the sources and the aliases are checked
before anything is pulled or written; a failure after the new version was written leaves no version."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pelt_core import limits
from tests.api.helpers import refused
from tests.security.conftest import versions

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("op", "options", "field", "words"),
    [
        ("merge", {"lora_rank": 1_000_000}, "options.lora_rank", "in [1, 16384]"),
        ("merge", {"lora_rank": 16_384}, "options.lora_rank", "at most 32"),
        ("merge", {"how": "ties", "density": 0.5, "lora_rank": 33}, "options.lora_rank", "at most 32"),
        ("average", {"lora_rank": 1_000_000}, "options.lora_rank", "in [1, 16384]"),
        ("average", {"lora_rank": 33}, "options.lora_rank", "at most 32"),
        ("merge_lora_svd", {"rank": 1_000_000}, "options.rank", "in [1, 16384]"),
        ("merge_lora_svd", {"rank": 33}, "options.rank", "at most 32"),
    ],
)
def test_a_rank_above_what_the_matrices_hold_is_422_and_writes_no_version(
    client, api, loras, op, options, field, words
):
    before = versions(api, "toy")
    refused(lambda: client.compose(op, loras, "soup", **options), 422, field, words)
    assert versions(api, "toy") == before and versions(api, "soup") == []


def test_ranks_up_to_the_matrices_or_the_sources_summed_rank_compose(client, api, loras):
    assert client.compose("merge", loras, "soup", lora_rank=32).version == "1"  # min(d_in, d_out) = 32
    assert client.compose("merge_lora_svd", loras, "soup", rank=4).version == "2"  # 2 + 2


@pytest.mark.parametrize(
    ("op", "options", "field"),
    [
        ("merge", {"weights": [1.0]}, "options.weights"),
        ("merge", {"weights": [1.0, math.nan]}, "options.weights[1]"),
        ("merge", {"weights": [1.0, 1e300]}, "options.weights[1]"),
        ("merge", {"weights": "1,1"}, "options.weights"),
        ("merge", {"how": "ties", "density": 0}, "options.density"),
        ("merge", {"how": "dare", "density": 2}, "options.density"),
        ("merge", {"how": "dare", "seed": 2**40}, "options.seed"),
        ("merge", {"how": "dare", "seed": 1.5}, "options.seed"),
        ("merge", {"scale": math.inf}, "options.scale"),
        ("merge", {"how": "magic"}, "options.how"),
        ("merge", {"lora_rank": "8"}, "options.lora_rank"),
        ("merge_lora_svd", {"rank": True}, "options.rank"),
    ],
)
def test_compose_options_of_the_wrong_type_or_range_are_422_before_anything_is_pulled(
    client, api, loras, monkeypatch, op, options, field
):
    def no_pull(*args, **kwargs):
        raise AssertionError("pulled a delta for a request that was bad from the start")

    monkeypatch.setattr(api.store, "pull", no_pull)
    body = json.dumps({"op": op, "sources": loras, "into": "soup", "options": options})  # NaN, Infinity as is
    response = client.http.post("/v1/compose", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field
    assert versions(api, "soup") == []


def test_too_many_sources_are_422(client, api, loras):
    sources = [loras[0]] * (limits.MAX_COMPOSE_SOURCES + 1)
    refused(lambda: client.compose("merge", sources, "soup"), 422, "sources")
    assert versions(api, "soup") == []


@pytest.mark.parametrize("alias", ["bad alias!", "v1", "V12", "latest", "x" * 300, "", "best", "best-lora"])
def test_a_bad_alias_is_422_and_writes_no_version(client, api, loras, alias):
    before = versions(api, "toy")
    refused(lambda: client.compose("merge", loras, "toy", aliases=["soup", alias]), 422, "aliases[1]")
    assert versions(api, "toy") == before


def test_a_failure_after_the_version_is_written_leaves_no_version(api, loras, monkeypatch):
    before = versions(api, "toy")

    def broken(*args, **kwargs):
        raise RuntimeError("the tracking server went away")

    monkeypatch.setattr(api.store.client, "set_registered_model_alias", broken)
    with pytest.raises(RuntimeError, match="went away"):
        api.store.compose("merge", loras, into="toy", aliases=["soup"])
    assert versions(api, "toy") == before
    with pytest.raises(RuntimeError, match="went away"):
        api.store.compose("merge", loras, into="fresh", aliases=["soup"])
    assert versions(api, "fresh") == []


def test_a_composition_whose_audit_fails_is_503_and_leaves_no_version(client, api, loras, monkeypatch):
    from services.registry.errors import RegistryBusyError

    def busy(*args, **kwargs):
        raise RegistryBusyError("another writer holds the database")

    monkeypatch.setattr(api.registry, "record_audit", busy)
    before = versions(api, "toy")
    refused(lambda: client.compose("merge", loras, "toy", aliases=["soup"]), 503, words="busy")
    assert versions(api, "toy") == before
    refused(lambda: client.compose("merge", loras, "fresh"), 503, words="busy")
    assert versions(api, "fresh") == [] and "delta.compose" not in {
        e.action for e in api.registry.audit_events()
    }
    monkeypatch.undo()
    composed = client.compose("merge", loras, "fresh")
    assert api.registry.audit_events()[0].target == f"fresh version {composed.version}"


ATTACK = textwrap.dedent("""
    import resource, sys, torch
    from pelt_core.compose import CompositionError, merge, merge_lora_svd
    from pelt_core.methods import get_method
    from pelt_core.model import JobDelta
    from pelt_core.testing import tiny_bert

    backbone = tiny_bert("unused")
    deltas = [JobDelta(get_method("lora", {"r": 2}), backbone, num_labels=2) for _ in range(2)]
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    budget = mapped + (1 << 30)  # what the process maps now, plus 1 GiB
    resource.setrlimit(resource.RLIMIT_AS, (budget, budget))
    for attack in (lambda: merge(deltas, lora_rank=1_000_000), lambda: merge_lora_svd(deltas, None, 1_000_000),
                   lambda: merge(deltas, lora_rank=16_384), lambda: merge_lora_svd(deltas, None, 16_384)):
        try:
            attack()
        except CompositionError as exc:
            print("refused:", exc)
        except MemoryError:
            print("out of memory")
            sys.exit(3)
        else:
            sys.exit(4)
""")


def test_a_huge_rank_is_refused_before_anything_is_allocated_under_a_memory_limit():
    done = subprocess.run(
        [sys.executable, "-c", ATTACK], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused: lora_rank: must be in [1, 16384]"), lines
    assert lines[1].startswith("refused: rank: must be in [1, 16384]"), lines
    assert lines[2].startswith("refused: lora_rank: must be at most 32"), lines
    assert lines[3].startswith("refused: rank: must be at most 32"), lines


def test_the_service_applies_pelt_cores_compose_options_which_the_table_bounds(client, api, loras):
    from pelt_core.compose import OPTIONS

    refused(
        lambda: client.compose("average", loras, "soup", how="ties"),
        422,
        "options.how",
        "not an option of average; its options: lora_rank",
    )
    assert versions(api, "soup") == []
    for name in ("backbone", "into", "aliases", "description", "on_written"):  # the store's own parameters
        body = {"op": "merge", "sources": loras, "into": "soup", "options": {name: "x"}}
        response = client.http.post("/v1/compose", json=body)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["field"] == f"options.{name}", response.text
    assert versions(api, "soup") == []
    numeric = {name for names in OPTIONS.values() for name in names} - {"how", "combine"}
    assert numeric == set(limits.COMPOSE_RANGES)
