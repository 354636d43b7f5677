"""The worker's pack runner: each job's thread waits for its own end; a broken step ends its pack's jobs,
never leaves one waiting, and the next job starts a fresh pack."""

from __future__ import annotations

import threading

import datasets
import pytest

from pelt_core import TrainConfig, get_method
from pelt_core.pack import Pack
from pelt_core.testing import tiny_bert
from workers.pack_runner import PackRunner

ROWS = [{"sentence": w, "label": i % 2} for i, w in enumerate(["good", "bad", "great", "awful"] * 4)]


def train_in(runner: PackRunner, seed: int, outcomes: dict, steps: int = 6) -> threading.Thread:
    data = datasets.Dataset.from_list(ROWS)
    config = TrainConfig(max_steps=steps, batch_size=4, seed=seed, bf16="false")

    def run() -> None:
        try:
            outcomes[seed] = runner.train(get_method("lora"), data, data, config)
        except Exception as exc:  # the job's own outcome
            outcomes[seed] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_jobs_handed_to_a_runner_train_and_each_gets_its_own_result(tmp_path):
    runner = PackRunner(tiny_bert(str(tmp_path)))
    outcomes: dict = {}
    threads = [train_in(runner, seed, outcomes) for seed in (0, 1, 2)]
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive()
    assert all(outcomes[seed].steps == 6 for seed in (0, 1, 2))
    assert runner.job_steps >= 18 and not runner.active


def test_a_broken_step_ends_every_job_of_its_pack_and_the_runner_recovers(tmp_path, monkeypatch):
    runner = PackRunner(tiny_bert(str(tmp_path)))
    real_step = Pack.step

    def broken_step(self):
        raise RuntimeError("the backbone's memory is gone")

    monkeypatch.setattr(Pack, "step", broken_step)
    outcomes: dict = {}
    for thread in [train_in(runner, seed, outcomes) for seed in (0, 1)]:
        thread.join(120)
        assert not thread.is_alive(), "a job was left waiting"
    assert all("memory is gone" in str(outcomes[seed]) for seed in (0, 1))
    monkeypatch.setattr(Pack, "step", real_step)
    train_in(runner, 2, outcomes).join(120)
    assert outcomes[2].steps == 6


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the test
def test_a_runner_whose_thread_dies_ends_its_waiting_jobs(tmp_path, monkeypatch):
    runner = PackRunner(tiny_bert(str(tmp_path)))
    pack_threads: list[threading.Thread] = []

    def dying(self, packs, entries):
        pack_threads.append(threading.current_thread())
        for entry in self._pending:  # joined, then the thread dies
            entries[id(entry)] = entry
        self._pending = []
        raise SystemExit("thread killed")

    monkeypatch.setattr(PackRunner, "_step_until_empty", dying)
    outcomes: dict = {}
    thread = train_in(runner, 0, outcomes)
    thread.join(60)
    assert not thread.is_alive() and "pack's thread stopped" in str(outcomes[0])
    assert not runner.active
    for pack_thread in pack_threads:  # its death is reported in this test, not in whichever runs next
        pack_thread.join(60)
        assert not pack_thread.is_alive()
