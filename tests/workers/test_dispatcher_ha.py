"""Two dispatchers against one registry and one Ray cluster: one leads, the other stands by and takes over when
the leader dies; no job runs twice and no worker is fought over."""

from __future__ import annotations

from datetime import timedelta

from services.registry import JobStatus, Registry
from services.registry.models import DispatcherLeader
from tests.workers.conftest import ended, submit, wait_for
from tests.workers.test_dispatcher import delta_folders, dispatcher_for


def pairs(jobs: list[int]) -> list[list[int]]:
    return [[a, b] for i, a in enumerate(jobs) for b in jobs[i + 1 :]]


# a standby takes over 10 s after the leader stopped; a leader renews every 3.3 s and acts up to 8 s after a
# renewal was sent, so a slow round on a loaded machine does not hand the namespace over by itself
FAST_TAKEOVER = {"leader_seconds": 10.0, "standby_poll_seconds": 0.3, "max_workers_per_node": 2}


def test_a_standby_takes_over_a_dead_leaders_workers_and_every_job_ends_once(
    local_ray, registry: Registry, tmp_path, namespace, hold
):
    jobs = submit(registry, 3)  # held at their store step: two run, one waits for a free worker
    leader = dispatcher_for(registry, tmp_path, namespace, hold, **FAST_TAKEOVER).start()
    standby = dispatcher_for(registry, tmp_path, namespace, hold, **FAST_TAKEOVER).start()
    try:
        assert (leader.role, standby.role) == ("leader", "standby")
        running = wait_for(
            lambda: next((p for p in pairs(jobs) if hold.holds(p)), None), 120, "two held jobs"
        )
        owners = {job_id: registry.get_job(job_id).lease_owner for job_id in running}
        assert standby.workers == {} and standby.stats["dispatched"] == 0  # a standby touches nothing

        leader._stop_loop()  # the leader dies: no shutdown, no release; its row expires after 10 s
        wait_for(
            lambda: standby.stats["workers_adopted"], 60, "the standby to take over and adopt the workers"
        )
        assert standby.role == "leader"
        assert sorted(j.job_id for w in standby.workers.values() for j in w.jobs.values()) == sorted(running)
        hold.release()
        wait_for(lambda: ended(registry, jobs), 300, "every job to finish")
    finally:
        standby.shutdown()
        leader.registry.close()

    records = [registry.get_job(job_id) for job_id in jobs]
    assert [job.status for job in records] == [JobStatus.SUCCEEDED] * 3
    assert [job.attempts for job in records] == [1, 1, 1]  # adopted, never started again
    for job_id, owner in owners.items():
        assert registry.get_result(job_id).worker_id == owner  # finished on the worker that started it
    assert len(delta_folders(tmp_path)) == 3


def take_over(registry: Registry, namespace: str, holder: str) -> None:
    """Give the namespace's row to `holder` in one transaction (as a standby does once the row expired)."""
    with registry._writing() as session:
        row = session.get(DispatcherLeader, namespace)
        row.holder, row.expires_at = holder, registry._now() + timedelta(seconds=60)


def test_a_leader_whose_hold_was_taken_stands_by_and_leaves_the_workers_alone(
    local_ray, registry: Registry, tmp_path, namespace
):
    stalled = dispatcher_for(registry, tmp_path, namespace, **FAST_TAKEOVER).start()
    try:
        assert stalled.role == "leader"
        take_over(
            registry, namespace, "another-dispatcher"
        )  # as if it had stalled past its lease and lost it
        wait_for(lambda: stalled.role == "standby", 30, "the old leader to step down")
        (job,) = submit(registry, 1)
        asked = stalled.lock.asked
        wait_for(lambda: stalled.lock.asked >= asked + 3, 30, "three rounds as a standby")

        assert stalled.stats["leadership_lost"] == 1
        assert registry.get_job(job).status == JobStatus.QUEUED  # it claims nothing any more
        assert stalled.workers == {}
    finally:
        summary = stalled.shutdown()
    assert summary["role"] == "standby"
    assert registry.leader(namespace).holder == "another-dispatcher"  # a standby's shutdown releases nothing


def test_pelt_dispatcher_offers_handing_over_on_sigterm() -> None:
    from click.testing import CliRunner

    from services.cli import main

    shown = CliRunner().invoke(main, ["dispatcher", "--help"])

    assert shown.exit_code == 0
    assert "--handover" in shown.output and "stands by and takes over" in " ".join(shown.output.split())
