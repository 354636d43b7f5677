"""A real 2-node Ray cluster on this machine (ray.cluster_utils.Cluster, loopback only, token auth on),
driven by the `pelt dispatcher` command in separate processes, as a deployment runs it
(PELT_RAY_ADDRESS set): jobs run on both nodes; the non-head node is killed mid-job and its jobs run
again, and finish, on the head node; the dispatcher is killed (SIGKILL) while jobs train and a new
one, a standby until the dead one's leadership expires, adopts them; every job ends with one result and one
delta.

Each node has 4 logical CPUs (4 worker slots) and 4 jobs are queued, so the dispatcher puts 2 on each
node and the head keeps 2 free slots for the jobs of the lost node. Every attempt is held in its worker
(`tests.workers.hold`: trained, not yet recorded) until the test lets it go, so each job is certainly
still running when its node is lost and when the second dispatcher takes over (it must adopt them all,
not restart them), whatever the machine's speed.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from ray.cluster_utils import Cluster

from services.dispatcher import loopback_only, require_token_auth
from services.dispatcher.ray_cluster import private_ray_token
from services.registry import JobStatus, Registry
from tests.ray_start import start_with_retries
from tests.workers.conftest import ended, submit, wait_for
from tests.workers.hold import Hold

pytestmark = pytest.mark.slow  # a two-node Ray cluster (tests/tiers.py)
SLOTS = 4  # logical CPUs (= worker slots) per node


@pytest.fixture
def cluster() -> Iterator[object]:
    """Head + one more node, 4 CPUs each; a lost node is declared dead within ~2 s."""
    loopback_only()
    require_token_auth()
    ensure_ray_token()
    fast_failure_detection = {
        "health_check_initial_delay_ms": 0,
        "health_check_period_ms": 500,
        "health_check_failure_threshold": 3,
    }
    cluster = start_with_retries(  # a node that never comes up is started again (tests/ray_start.py)
        lambda: Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": SLOTS,
                "include_dashboard": False,
                "_system_config": fast_failure_detection,
            },
        ),
        clean_up=lambda: None,  # the timed-out node's processes are killed already
    )
    try:
        start_with_retries(lambda: cluster.add_node(num_cpus=SLOTS), clean_up=lambda: None)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def ensure_ray_token() -> None:
    """A token for the cluster's processes, as `ray.init` would make for a new local Ray (`Cluster` makes
    none: on a machine where no Ray ran before, its GCS stops at once for want of a token)."""
    subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "get-auth-token", "--generate"],
        check=True,
        stdout=subprocess.DEVNULL,  # the token itself
        stderr=subprocess.PIPE,
    )
    private_ray_token()


# `pelt dispatcher`, its deltas held in the folder given first (see tests.workers.hold.hold_dispatcher_deltas)
HELD_DISPATCHER = (
    "import sys; from tests.workers.hold import hold_dispatcher_deltas; hold_dispatcher_deltas(sys.argv.pop(1)); "
    "from services.cli import main; main()"
)


def held_now(registry: Registry, hold: Hold, job_ids: list[int]) -> dict[int, int] | None:
    """{job: its attempt} once every job is held in its current attempt, else None."""
    attempts = {job_id: registry.get_job(job_id).attempts for job_id in job_ids}
    if all(attempt >= 1 and hold.holds([job_id], attempt=attempt) for job_id, attempt in attempts.items()):
        return attempts
    return None


def dispatcher_environment(
    address: str, registry_url: str, tmp_path: Path, **settings: str
) -> dict[str, str]:
    """The environment of a `pelt dispatcher` joining the cluster at `address` (none of this process's
    PELT_* settings): short heartbeats and backoffs, plus `settings` (PELT_<name>)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PELT_")}
    env.pop("RAY_AUTH_MODE", None)  # `pelt dispatcher` turns token auth on by itself when joining by address
    env.update(
        {
            "PELT_RAY_ADDRESS": address,
            "PELT_DATABASE_URL": registry_url,
            "PELT_DATA_DIR": str(tmp_path / "data"),
            "PELT_HEARTBEAT_SECONDS": "1",
            "PELT_RETRY_BACKOFF_SECONDS": "0.2",
            "PELT_RETRY_BACKOFF_MAX_SECONDS": "1",
            **{f"PELT_{name}": value for name, value in settings.items()},
        }
    )
    return env


def start_dispatcher(
    address: str, registry_url: str, tmp_path: Path, name: str, hold: Hold
) -> subprocess.Popen:
    # a lease lost to a slow start, then the lost node: attempts to spare
    env = dispatcher_environment(address, registry_url, tmp_path, LEASE_SECONDS="10", MAX_ATTEMPTS="6")
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - the process writes it until it ends
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            HELD_DISPATCHER,
            str(hold.folder),
            "dispatcher",
            "--namespace",
            "cluster-test",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def node_of(worker_id: str | None, nodes: dict[str, str]) -> str | None:
    return next((name for name, node_id in nodes.items() if worker_id and node_id[:12] in worker_id), None)


def reconciled(log_text: str) -> tuple[int, dict[str, list[int]]] | None:
    """(workers adopted, jobs settled) from a dispatcher's "reconciled: ..." log line."""
    found = re.search(r"reconciled: (\d+) worker\(s\) adopted, jobs (\{.*\})", log_text)
    return None if found is None else (int(found[1]), ast.literal_eval(found[2]))


def test_jobs_survive_a_dispatcher_restart_and_the_loss_of_a_node(cluster, registry_url, tmp_path):
    head, other = cluster.head_node, cluster.list_all_nodes()[1]
    nodes = {"head": head.node_id, "other": other.node_id}
    ray_processes = {p.pid for p in psutil.Process().children(recursive=True)}
    assert {
        c.laddr.ip
        for c in psutil.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.pid in ray_processes
    } <= {"127.0.0.1", "::ffff:127.0.0.1"}

    registry = Registry(registry_url)
    job_ids = submit(registry, 4)
    hold = Hold(tmp_path / "hold")
    dispatchers = [start_dispatcher(cluster.address, registry_url, tmp_path, "dispatcher-1", hold)]
    try:
        # held mid-attempt: its current attempt (a worker slow to start on a loaded machine lets a lease
        # expire before the job runs, and the job is held on its second attempt instead)
        attempts = wait_for(
            lambda: held_now(registry, hold, job_ids), 150, "every job to be held mid-attempt"
        )
        owners = {job_id: registry.get_job(job_id).lease_owner for job_id in job_ids}
        on_head = {j: owner for j, owner in owners.items() if node_of(owner, nodes) == "head"}
        on_other = {j: owner for j, owner in owners.items() if node_of(owner, nodes) == "other"}
        assert len(on_head) == len(on_other) == 2, owners

        cluster.remove_node(other, allow_graceful=False)  # the non-head node dies mid-job
        wait_for(
            lambda: all(hold.holds([j], attempt=attempts[j] + 1) for j in on_other),
            120,
            "the lost node's jobs to run again",
        )
        retried = {j: registry.get_job(j).lease_owner for j in on_other}
        assert {node_of(worker, nodes) for worker in retried.values()} == {"head"}

        dispatchers[0].send_signal(signal.SIGKILL)  # the dispatcher dies mid-job; its detached workers go on
        dispatchers[0].wait(10)
        dispatchers.append(start_dispatcher(cluster.address, registry_url, tmp_path, "dispatcher-2", hold))
        wait_for(  # a standby first, while the dead one's leadership lasts (15 s); then it leads and adopts
            lambda: reconciled((tmp_path / "dispatcher-2.log").read_text()),
            120,
            "the second dispatcher to take over and adopt the running jobs",
        )
        hold.release()
        wait_for(lambda: ended(registry, job_ids), 150, "every job to finish")
    finally:
        for process in dispatchers:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # graceful: stops the workers it runs
                process.wait(60)

    jobs = {job_id: registry.get_job(job_id) for job_id in job_ids}
    assert all(job.status == JobStatus.SUCCEEDED for job in jobs.values()), {
        j: (v.status, v.last_error) for j, v in jobs.items()
    }
    results = {job_id: registry.get_result(job_id) for job_id in job_ids}
    events = {job_id: registry.job_events(job_id) for job_id in job_ids}

    def transitions(job_id: int) -> list[tuple[str | None, str]]:
        return [(e.from_status, e.to_status) for e in events[job_id]]

    def before_hold(job_id: int) -> list[tuple[str | None, str]]:
        """A job's transitions up to its held attempt's start (a lease lost to a slow start adds a round)."""
        return [(None, "queued")] + [("queued", "running"), ("running", "queued")] * (attempts[job_id] - 1)

    for job_id, worker in on_head.items():  # neither the lost node nor the restart touched them
        assert (jobs[job_id].attempts, results[job_id].worker_id) == (attempts[job_id], worker)
        assert transitions(job_id) == [*before_hold(job_id), ("queued", "running"), ("running", "succeeded")]
    for job_id, worker in retried.items():  # retried once for the lost node, finished where it was retried
        again = attempts[job_id] + 1
        assert (jobs[job_id].attempts, results[job_id].attempt, results[job_id].worker_id) == (
            again,
            again,
            worker,
        )
        assert transitions(job_id) == [
            *before_hold(job_id),
            ("queued", "running"),
            ("running", "queued"),
            ("queued", "running"),
            ("running", "succeeded"),
        ]
        lost = events[job_id][len(before_hold(job_id)) + 1]  # the dispatcher saw the worker die with its node
        assert lost.worker_id == on_other[job_id] and "died" in lost.reason, lost
    ran_on = {node_of(e.worker_id, nodes) for j in job_ids for e in events[j] if e.to_status == "running"}
    assert ran_on == {"head", "other"}
    assert sorted(p.name for p in (tmp_path / "data" / "deltas" / "toy").iterdir()) == sorted(
        f"job-{job_id}" for job_id in job_ids
    )  # one stored delta per job: the one its result names
    for job_id, result in results.items():
        delta = Path(result.delta_uri.removeprefix("file://")) / "delta.safetensors"
        assert delta.parent.name == f"job-{job_id}"
        assert hashlib.sha256(delta.read_bytes()).hexdigest() == result.delta_sha256
    second_log = (tmp_path / "dispatcher-2.log").read_text()
    adopted_workers, settled = reconciled(second_log)
    # the head node's workers, warm, kept; none of the lost node's (more when a slow start cost a lease and
    # the dispatcher started other workers meanwhile)
    assert adopted_workers == 4 if set(attempts.values()) == {1} else adopted_workers >= 4
    assert sorted(settled["adopted"]) == sorted(
        job_ids
    )  # all held mid-job at the restart: adopted, not restarted
    assert not settled["released"] and not settled["left_to_lease_expiry"]
    assert "dispatcher stopped" in second_log
    registry.close()
