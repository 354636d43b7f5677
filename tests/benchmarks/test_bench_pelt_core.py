"""benchmarks/bench_pelt_core.py's verdicts: a side that failed to learn gets no accuracy verdict."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_pelt_core
import bench_workers


@pytest.fixture
def sst2_dev(monkeypatch):
    """SST-2's dev set: 872 rows, 428 of class 0 and 444 of class 1."""
    monkeypatch.setattr(bench_workers, "dev_class_shares", lambda task: (872, [428 / 872, 444 / 872]))


def test_a_run_at_exactly_one_classs_share_of_dev_failed_to_learn(sst2_dev):
    assert bench_pelt_core.failed_to_learn("sst2", {"accuracy": 444 / 872})
    assert bench_pelt_core.failed_to_learn("sst2", {"accuracy": 428 / 872})
    assert not bench_pelt_core.failed_to_learn("sst2", {"accuracy": 445 / 872})
    assert not bench_pelt_core.failed_to_learn("sst2", {"accuracy": 0.79})
    assert not bench_pelt_core.failed_to_learn("sst2", None)


def test_one_constant_seed_among_several_fails_the_side(sst2_dev):
    side = {"accuracy": (0.78 + 0.77 + 444 / 872) / 3, "accuracies": [0.78, 0.77, 444 / 872]}
    assert bench_pelt_core.failed_to_learn("sst2", side)


def test_the_table_gives_no_accuracy_verdict_against_a_side_that_failed_to_learn(sst2_dev, capsys):
    side = {"tokens": 1000, "train_seconds": 1.0, "examples": 100}
    rows = [
        {
            "task": "sst2",
            "method": "prefix",
            "peer_name": "peft prefix",
            "n_nonembedding": 1,
            "pelt": side | {"accuracy": 0.769},
            "peer": side | {"accuracy": 444 / 872},
        },
        {
            "task": "sst2",
            "method": "lora",
            "peer_name": "peft LoRA",
            "n_nonembedding": 1,
            "pelt": side | {"accuracy": 0.70},
            "peer": side | {"accuracy": 0.741},
        },
    ]
    peak = {"gflops": 100.0, "per_size": {}, "threads": 1}
    args = type("Args", (), {"flops": "4n", "peer_bf16": False, "adapters_padding": "max_length"})()
    bench_pelt_core.print_table(rows, peak, None, args)
    printed = capsys.readouterr().out
    assert rows[0]["accuracy_pass"] is None and rows[0]["failed_to_learn"] == ["peer"]
    assert "peer failed to learn" in printed
    assert rows[1]["accuracy_pass"] is False and rows[1]["failed_to_learn"] == []
