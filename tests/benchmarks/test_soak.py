"""The short chaos soak of `make test` (benchmarks/soak.py): pelt as deployed on hosts that are network
namespaces (PostgreSQL and the MLflow server, the API and two dispatchers, a Ray head, two Ray worker hosts;
the services as uid 10001), a small sweep over two tasks, and one fault of every kind while it runs: a
SIGKILLed worker, a SIGKILLed leading dispatcher, a worker host cut off for longer than a lease, a worker
host killed and started again, the Ray head killed and started again (its GCS state in Redis), PostgreSQL,
the MLflow server and the API restarted, the database host cut off from the others. Every job ends exactly
once with one result, one MLflow version and one run, the aliases follow the leaderboard, and every pulled
delta matches its sha256.

It needs root (network namespaces), as CI has; elsewhere it skips, unless PELT_REQUIRE_ROOT=1 (.ci/run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a whole deployment as processes
SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_a_short_soak_through_every_fault_kind_loses_no_job_and_does_none_twice(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        why = "the soak makes network namespaces: it needs root"
        if os.environ.get("PELT_REQUIRE_ROOT") == "1":
            pytest.fail(f"{why} (PELT_REQUIRE_ROOT=1 is set)")
        pytest.skip(why)
    report_file = tmp_path / "soak.json"
    argv = [sys.executable, str(SOAK), "--jobs", "20", "--tasks", "2", "--faults-per-kind", "1"]
    argv += ["--json", str(report_file), "--max-minutes", "12"]
    soak = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = soak.communicate(timeout=20 * 60)
    except subprocess.TimeoutExpired:  # SIGTERM: the soak stops its services and removes its hosts
        soak.terminate()
        output, _ = soak.communicate(timeout=180)
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    assert soak.returncode == 0, (output[-8000:], report.get("problems"))
    assert report["problems"] == [] and report["lost"] == 0 and report["duplicated"] == 0
    assert report["faults"] == {kind: 1 for kind in report["faults"]} and len(report["faults"]) == 9
    assert (
        report["statuses"].get("succeeded", 0) + report["statuses"].get("failed", 0) == report["jobs"] == 20
    )
    assert report["stubborn_services"] == []  # no process of any service was left running
