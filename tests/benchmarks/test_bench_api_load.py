"""benchmarks/bench_api_load.py end to end on a small registry: a seeded SQLite registry, the API in its
own process, polling clients, a submitter and a heartbeating worker; every route answered without error."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_api_load import ROUTES, run

pytestmark = pytest.mark.slow  # an API process and a seeded registry


def test_a_small_load_run_answers_every_route_and_every_heartbeat():
    args = Namespace(jobs=1000, results=20, clients=2, seconds=3.0, poll_seconds=0.2)
    result = run("sqlite", None, args)
    for route in ROUTES:
        numbers = result["routes"][route]
        assert numbers["errors"] == 0, numbers["first_error"]
        assert numbers["requests"] >= 1 and numbers["p99_ms"] >= numbers["p50_ms"] > 0
    assert result["heartbeats"] >= 4 and result["slowest_heartbeat_ms"] < 1000 * result["lease_seconds"]
