"""Scaling from the queue on a Ray cluster that has an autoscaler and no worker node: Ray's fake multi-node
provider, whose nodes are raylets on this machine that its autoscaler starts and stops as a cloud provider's
would be (loopback only, token auth on). The head has no CPUs; the cluster may grow by one CPU node and one
GPU node. `pelt dispatcher` runs against it as a deployment runs it.

A CPU job queued makes the dispatcher ask Ray for a CPU worker: a CPU node appears and the job runs there (the
head cannot run it). Once the queue is empty the idle worker is stopped (--idle-worker-seconds) and the
autoscaler removes the node (idle_timeout_minutes). A GPU job makes a GPU node appear (the fake node's GPU is
a resource only: the job cannot train on it, and is cancelled). Each node appearing is the autoscaler
answering the dispatcher's request: the cluster's minimum is zero nodes of each kind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from services.dispatcher import loopback_only, require_token_auth
from services.registry import Registry
from tests.workers.conftest import BACKBONE, TASK, submit, wait_for
from tests.workers.test_cluster import dispatcher_environment, ensure_ray_token

pytestmark = pytest.mark.slow  # a Ray cluster with an autoscaler and `pelt dispatcher` (tests/tiers.py)
NODE_TYPES = {
    "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
    "cpu": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 1},
    "gpu": {"resources": {"CPU": 1, "GPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 1},
}
IDLE_MINUTES = 0.05  # the autoscaler removes a node idle for 3 s


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def autoscaling_config(port: int) -> dict:
    """Ray's fake multi-node cluster config (its provider starts nodes as raylets on this machine)."""
    return {
        "cluster_name": "pelt-autoscaling-test",
        "max_workers": 2,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": f"127.0.0.1:{port}",
        },
        "available_node_types": NODE_TYPES,
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_MINUTES,
        "docker": {},
        **{key: [] for key in ("initialization_commands", "setup_commands", "head_setup_commands")},
        **{
            key: []
            for key in ("worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
        },
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


def stop_session(session: int) -> None:
    """Kill every process of the session the head was started in (its nodes, their workers), nothing else."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session:
                members.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    for process in members:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue
    psutil.wait_procs(members, timeout=30)


@pytest.fixture
def autoscaling_head(tmp_path: Path) -> Iterator[str]:
    """The head of a fake autoscaling cluster (no CPUs; nodes of NODE_TYPES on demand); its address."""
    loopback_only()
    require_token_auth()
    ensure_ray_token()
    port = free_port()
    config = tmp_path / "autoscaling.json"
    config.write_text(json.dumps(autoscaling_config(port)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PELT_")}
    env.update({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_USAGE_STATS_ENABLED": "0"})
    log = tmp_path / "head.log"
    with open(log, "w") as output:
        head = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("ray")),
                "start",
                "--head",
                f"--port={port}",
                "--num-cpus=0",
                "--node-ip-address=127.0.0.1",
                "--include-dashboard=false",
                f"--temp-dir={tempfile.mkdtemp(prefix='ray-as-', dir='/tmp')}",
                f"--autoscaling-config={config}",
            ],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        assert head.wait(timeout=180) == 0, log.read_text()
        yield f"127.0.0.1:{port}"
    finally:
        stop_session(head.pid)


PROBE = (
    "import json, sys, ray; ray.init(address=sys.argv[1], namespace='probe', log_to_driver=False); "
    "print(json.dumps([n['Resources'] for n in ray.nodes() if n['Alive']]))"
)


def alive_nodes(address: str) -> list[dict[str, float]]:
    """The resources of the cluster's alive nodes, read by a driver of its own (this process may hold a Ray)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, address], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_dispatcher(address: str, registry_url: str, tmp_path: Path) -> subprocess.Popen:
    env = dispatcher_environment(address, registry_url, tmp_path, LEASE_SECONDS="20")
    log = open(tmp_path / "dispatcher.log", "w")  # noqa: SIM115 - the process writes it until it ends
    return subprocess.Popen(
        [
            str(Path(sys.executable).with_name("pelt")),
            "dispatcher",
            "--namespace",
            "autoscaling-test",
            "--scaling-seconds",
            "1",
            "--idle-worker-seconds",
            "3",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_queued_jobs_bring_the_nodes_they_need_and_idle_nodes_go(autoscaling_head, registry_url, tmp_path):
    assert not any(node.get("CPU") for node in alive_nodes(autoscaling_head))  # the head alone: no CPUs
    dispatcher = start_dispatcher(autoscaling_head, registry_url, tmp_path)
    log = tmp_path / "dispatcher.log"
    try:
        with Registry(registry_url) as registry:
            (job_id,) = submit(registry, 1, steps=4)
            wait_for(
                lambda: registry.get_job(job_id).status in ("succeeded", "failed", "cancelled"),
                240,
                f"job {job_id} to end on a node the autoscaler started (dispatcher log: {log})",
            )
            assert registry.get_job(job_id).status == "succeeded", registry.get_job(job_id).last_error
            assert "asking Ray for room for 0 GPU and 1 CPU worker(s)" in log.read_text()

            wait_for(lambda: "stopping 1 worker(s) idle" in log.read_text(), 60, "the idle worker to stop")
            wait_for(
                lambda: not any(node.get("CPU") for node in alive_nodes(autoscaling_head)),
                120,
                "the autoscaler to remove the idle CPU node",
                interval=2,
            )

            gpu_job = registry.submit_job(TASK, "lora", BACKBONE, {"max_steps": 4}, device="gpu").id
            wait_for(
                lambda: any(node.get("GPU") for node in alive_nodes(autoscaling_head)),
                120,
                "a GPU node for the queued GPU job",
                interval=2,
            )
            assert "asking Ray for room for 1 GPU and 0 CPU worker(s)" in log.read_text()
            registry.cancel_job(gpu_job)
    finally:
        dispatcher.send_signal(signal.SIGTERM)
        try:
            dispatcher.wait(60)
        except subprocess.TimeoutExpired:
            dispatcher.kill()
            dispatcher.wait(30)
