"""The queue across real OS processes (multiprocessing 'spawn'): concurrent claimers never share a
job, and a claimer killed with SIGKILL loses its job only to the lease, not forever."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from services.registry import JobStatus, Registry
from services.registry.testing import EXAMPLE_RESULT, FakeClock, claim_and_hold, claim_until_empty

SPAWN = multiprocessing.get_context("spawn")


def aware(moment: datetime | None) -> datetime:
    """A timestamp read back from the database, as a UTC-aware datetime."""
    assert moment is not None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> bool:
    """Poll `predicate` until it holds, failing (never timing anything) after a generous deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
    return True


@pytest.fixture
def processes() -> Iterator[list]:
    """Processes the test starts; any still alive at the end are killed and reaped."""
    started: list = []
    yield started
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(timeout=30)


@pytest.fixture
def queue_db(migrated_url: str, sst2_file: Path) -> str:
    with Registry(migrated_url) as registry:
        registry.register_task("sst2", sst2_file, text_fields="sentence")
        registry.register_backbone("tiny-bert", "hf:tiny", "sha256:ab")
    return migrated_url


def test_two_processes_claiming_500_jobs_at_once_take_each_exactly_once(
    queue_db: str, processes: list
) -> None:
    with Registry(queue_db) as registry:
        methods = [m.name for m in registry.list_methods()][:5]
        sweep = registry.submit_sweep("sst2", methods, list(range(10)), list(range(1, 11)), "tiny-bert")
    assert len(sweep.job_ids) == 500

    start, out = SPAWN.Barrier(2), SPAWN.Queue()
    for worker in ("claimer-a", "claimer-b"):
        process = SPAWN.Process(target=claim_until_empty, args=(queue_db, worker, start, out), daemon=True)
        process.start()
        processes.append(process)
    reports = {worker: claimed for worker, claimed, *_ in (out.get(timeout=180) for _ in processes)}
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0

    a, b = reports["claimer-a"], reports["claimer-b"]
    assert a and b, f"both processes should have claimed jobs (a: {len(a)}, b: {len(b)})"
    assert not set(a) & set(b)
    assert sorted(a + b) == sorted(sweep.job_ids)
    assert len(a) + len(b) == 500

    with Registry(queue_db) as registry:
        jobs = registry.list_jobs(sweep_id=sweep.id, limit=1000)
        holder = {job_id: worker for worker, claimed in reports.items() for job_id in claimed}
        assert all(job.status == JobStatus.RUNNING and job.attempts == 1 for job in jobs)
        assert all(job.lease_owner == holder[job.id] for job in jobs)
        assert registry.job_counts(sweep_id=sweep.id)["running"] == 500


def test_a_claimer_killed_while_holding_a_lease_loses_the_job_to_the_lease_and_it_ends_with_one_result(
    queue_db: str, processes: list
) -> None:
    # The victim's lease and heartbeats run on real time; here, time moves only when the test says so.
    clock = FakeClock(datetime.now(UTC))
    with Registry(queue_db, retry_backoff_seconds=0, clock=clock) as registry:
        job_id = registry.submit_job("sst2", "lora", "tiny-bert").id
        out = SPAWN.Queue()
        victim = SPAWN.Process(target=claim_and_hold, args=(queue_db, "victim", 1.5, 0.1, out), daemon=True)
        victim.start()
        processes.append(victim)
        worker, claimed, pid = out.get(timeout=120)
        assert (worker, claimed) == ("victim", job_id)

        first = registry.get_job(job_id)
        first_expiry = aware(first.lease_expires_at)
        # a heartbeat (every 0.1 s) renews the 1.5 s lease: at the moment the claim's lease ran out, it holds
        renewed = wait_until(
            lambda: aware(registry.get_job(job_id).heartbeat_at) > aware(first.heartbeat_at),
            "a heartbeat from the victim",
        )
        assert renewed
        clock.now = first_expiry + timedelta(milliseconds=1)
        assert registry.requeue_expired_leases() == []
        assert registry.get_job(job_id).lease_owner == "victim"

        os.kill(pid, signal.SIGKILL)
        victim.join(timeout=30)
        assert victim.exitcode == -signal.SIGKILL
        assert registry.get_job(job_id).status == JobStatus.RUNNING  # nothing knows yet

        assert registry.claim_job("rescuer") is None  # its last lease has not run out yet
        clock.now = aware(registry.get_job(job_id).lease_expires_at) + timedelta(seconds=1)
        rescued = registry.claim_job("rescuer")  # the claim takes back the expired lease, then the job
        assert rescued is not None and rescued.id == job_id
        assert rescued.attempts == 2
        registry.complete_job(job_id, "rescuer", EXAMPLE_RESULT)

        job = registry.get_job(job_id)
        assert job.status == JobStatus.SUCCEEDED
        result = registry.get_result(job_id)
        assert result is not None and (result.worker_id, result.attempt) == ("rescuer", 2)
        history = [(e.from_status, e.to_status, e.worker_id) for e in registry.job_events(job_id)]
        assert history == [
            (None, "queued", None),
            ("queued", "running", "victim"),
            ("running", "queued", "victim"),
            ("queued", "running", "rescuer"),
            ("running", "succeeded", "rescuer"),
        ]
        assert "lease of worker victim expired" in registry.job_events(job_id)[2].reason
