"""`pelt demo --fast`: the README's demo on the same code path (embedded service, real MiniLM backbone, real
Rotten Tomatoes data, five methods through the HTTP client, the best then predicting through the service), with fewer rows and steps. A second run finds
its sweep by idempotency key and trains nothing again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def run_demo(data_dir: Path) -> str:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PELT_")}
    environment["PELT_DATA_DIR"] = str(data_dir)
    done = subprocess.run(
        [sys.executable, "-c", "from services.cli import main; main()", "demo", "--fast"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_demo_runs_the_whole_service_and_a_rerun_trains_nothing_twice(tmp_path):
    first = run_demo(tmp_path / "pelt")
    board = first.split("leaderboard:")[1].split("pulled")[0]
    ranked = [line.split() for line in board.strip().splitlines() if line.split()[0].isdigit()]
    assert sorted(cells[1] for cells in ranked) == sorted(["bitfit", "pfeiffer", "prefix", "lora", "unipelt"])
    assert "pulled rotten_tomatoes-dev64's best delta by task name" in first
    predictions = first.split("sha256")[1].splitlines()[1:5]
    assert all(line.split()[0] in ("positive", "negative") for line in predictions), predictions
    assert "prediction endpoint (POST /v1/tasks/rotten_tomatoes-dev64/predict, Ray Serve)" in first
    assert "the same labels as the pulled delta" in first  # served as the pulled delta predicts alone
    assert (tmp_path / "pelt" / "api_token").stat().st_mode & 0o777 == 0o600

    second = run_demo(tmp_path / "pelt")
    assert second.split("leaderboard:")[1].split("pulled")[0] == board  # the same five results, not new ones
