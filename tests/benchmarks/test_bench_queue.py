"""benchmarks/bench_queue.py still runs against today's registry: its task and its 1,000-job sweep (every
method, K up to the whole training set) pass the submit-time validation a user's would."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_queue

from services.registry.testing import sqlite_url


def test_the_benchmarks_sweep_of_1000_jobs_is_accepted_and_timed(tmp_path: Path):
    url = sqlite_url(tmp_path / "bench.db")
    bench_queue.prepare(url, tmp_path)
    timings = bench_queue.bench_submit(url, sweeps=1)
    assert 0 < timings["min_ms"] <= timings["median_ms"] <= timings["max_ms"]
    assert timings["repeat_ms"] > 0
