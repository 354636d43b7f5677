"""benchmarks/bench_workers.py and bench_sweep.py: a run at exactly one class's share of the dev set is
reported as one that failed to learn, on the service's side and on the peers'."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_workers


@pytest.fixture
def sst2_and_rte_dev(monkeypatch):
    """SST-2's dev set: 872 rows (428 and 444 of each class); RTE's: 277 rows (131 and 146)."""
    shares = {"sst2": (872, [428 / 872, 444 / 872]), "rte": (277, [131 / 277, 146 / 277])}
    monkeypatch.setattr(bench_workers, "dev_class_shares", lambda task: shares[task])


def test_runs_at_one_classs_share_of_dev_are_counted_as_failed_to_learn(sst2_and_rte_dev):
    assert bench_workers.failed_to_learn("sst2", [444 / 872, 0.81, 428 / 872, 0.79]) == 2
    assert bench_workers.failed_to_learn("sst2", [445 / 872, 0.5]) == 0
    assert bench_workers.failed_to_learn("rte", [146 / 277]) == 1


def test_the_note_names_each_task_and_how_many_of_its_runs_failed(sst2_and_rte_dev):
    assert bench_workers.learning_note({"sst2": [0.8, 0.81], "rte": [0.6]}) == ""
    note = bench_workers.learning_note({"sst2": [0.8, 444 / 872], "rte": [131 / 277, 146 / 277, 0.6]})
    assert "FAILED TO LEARN: sst2 1 of 2 runs, rte 2 of 3 runs" in note
