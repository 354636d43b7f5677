"""GPU workers: room on nodes with GPUs, what a GPU worker asks Ray for, and which jobs each kind of worker
takes (a job's `device`). No GPU needed: Ray's nodes and the worker actors are stood in for (tests/gpu/ runs
a real GPU worker where a GPU is visible)."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import ray

from services.dispatcher import Dispatcher, DispatcherConfig
from services.dispatcher.config import DEFAULT_GPU_PACK_SIZE
from services.dispatcher.placement import GPU_START_FAILURES, Nodes, start_worker
from services.dispatcher.slots import GPU_WORKER_PREFIX, WORKER_PREFIX, WorkerSlots, worker_kind
from services.registry import JobStatus, Registry
from tests.workers.conftest import BACKBONE, SHORT, TASK
from tests.workers.test_dispatcher import FakeActor, FakeActorClass, dispatcher_for

NODE = "ab" * 28  # a Ray node id: 28 bytes in hex


def nodes_with(monkeypatch, **resources: float) -> None:
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeID": NODE, "Resources": resources}])


@pytest.mark.parametrize(
    ("resources", "options", "gpu_workers", "cpu_workers"),
    [
        ({"CPU": 8.0, "GPU": 2.0}, {}, 2, 6),  # one worker per GPU, each reserving one CPU
        ({"CPU": 8.0, "GPU": 2.0}, {"gpus_per_worker": 0.5}, 4, 4),  # two workers share each GPU
        ({"CPU": 8.0, "GPU": 1.0}, {"gpus_per_worker": 1 / 3}, 3, 5),
        ({"CPU": 8.0, "GPU": 2.0}, {"gpus_per_worker": 0}, 0, 8),  # GPU workers off
        ({"CPU": 8.0, "GPU": 4.0}, {"cpus_per_gpu_worker": 4.0}, 2, 0),  # CPUs run out first
        ({"CPU": 8.0}, {}, 0, 8),
    ],
)
def test_a_node_has_room_for_a_gpu_worker_per_gpu_and_cpu_workers_on_the_cpus_left(
    monkeypatch, resources, options, gpu_workers, cpu_workers
):
    nodes_with(monkeypatch, **resources)
    nodes = Nodes(DispatcherConfig(**options))
    nodes.refresh()

    assert (nodes.gpu_capacity, nodes.capacity) == ({NODE: gpu_workers}, {NODE: cpu_workers})
    assert nodes.has_gpus == bool(gpu_workers)


def test_a_gpu_worker_asks_ray_for_its_gpus_and_is_told_to_pack_its_jobs_on_cuda(monkeypatch):
    """What the dispatcher asks Ray for and tells the worker (a fake actor: nothing trains here; training
    on a GPU is tests/gpu/test_gpu.py's)."""
    import workers.worker

    monkeypatch.setattr(workers.worker, "worker_actor_class", FakeActorClass)
    config = DispatcherConfig(gpus_per_worker=0.5, cpus_per_gpu_worker=2.0)
    worker = start_worker(NODE, config, heartbeat_seconds=1.0, lease_seconds=8.0, kind="gpu")

    assert worker.worker_id.startswith(GPU_WORKER_PREFIX) and worker_kind(worker.worker_id) == "gpu"
    assert (worker.device, worker.slots, worker.packed) == ("gpu", DEFAULT_GPU_PACK_SIZE, True)
    options = worker.actor.options
    assert (options["num_gpus"], options["num_cpus"]) == (0.5, 2.0)
    assert options["max_concurrency"] == DEFAULT_GPU_PACK_SIZE + 3
    _, worker_config = worker.actor.args
    assert (worker_config.device, worker_config.pack_size, worker_config.threads) == (
        "cuda",
        DEFAULT_GPU_PACK_SIZE,
        2,
    )


def test_a_cpu_worker_asks_ray_for_no_gpu_and_trains_on_the_cpu(monkeypatch):
    import workers.worker

    monkeypatch.setattr(workers.worker, "worker_actor_class", FakeActorClass)
    worker = start_worker(NODE, DispatcherConfig(), heartbeat_seconds=1.0, lease_seconds=8.0)

    assert worker.worker_id.startswith(WORKER_PREFIX) and worker_kind(worker.worker_id) == "cpu"
    assert worker.actor.options["num_gpus"] == 0
    assert worker.actor.args[1].device == "cpu"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gpus_per_worker": -1}, "--gpus-per-worker must be 0 (no GPU workers), a fraction of one GPU"),
        ({"gpus_per_worker": 1.5}, "--gpus-per-worker must be 0 (no GPU workers), a fraction of one GPU"),
        ({"gpu_pack_size": 0}, "--gpu-pack-size must be between 1 and 64"),
        ({"cpus_per_gpu_worker": 0}, "--cpus-per-gpu-worker must be above 0"),
    ],
)
def test_gpu_worker_options_out_of_range_are_refused_naming_the_option(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DispatcherConfig(**values)


def submit_for(registry: Registry, device: str, seed: int) -> int:
    values = {"max_steps": SHORT, "batch_size": 2}
    return registry.submit_job(TASK, "lora", BACKBONE, values, seed=seed, device=device).id


def ready_worker(dispatcher: Dispatcher, kind: str, places: int) -> WorkerSlots:
    """A ready, idle worker of a kind on NODE, and no room for more workers of that kind there."""
    prefix = GPU_WORKER_PREFIX if kind == "gpu" else WORKER_PREFIX
    worker = WorkerSlots(
        f"{prefix}fake", NODE, FakeActor(), slots=places, packed=True, ready=True, device=kind
    )
    dispatcher.workers[worker.worker_id] = worker
    (dispatcher.nodes.gpu_capacity if kind == "gpu" else dispatcher.nodes.capacity)[NODE] = 1
    return worker


def claimed_by(registry: Registry, worker: WorkerSlots) -> set[int]:
    return {
        job.job_id for job in worker.jobs.values() if registry.get_job(job.job_id).lease_owner == job.owner
    }


def test_gpu_workers_take_gpu_and_any_jobs_and_cpu_workers_only_cpu_jobs_where_a_node_has_gpus(
    registry, tmp_path
):
    gpu_job, any_job, cpu_job = (
        submit_for(registry, device, seed) for seed, device in enumerate(["gpu", "any", "cpu"])
    )
    dispatcher = dispatcher_for(registry, tmp_path, "t-gpu-workers")
    gpu_worker = ready_worker(dispatcher, "gpu", places=4)
    cpu_worker = ready_worker(dispatcher, "cpu", places=4)

    dispatcher._assign()

    assert claimed_by(registry, gpu_worker) == {gpu_job, any_job}
    assert claimed_by(registry, cpu_worker) == {cpu_job}


def test_without_gpus_cpu_workers_take_any_jobs_and_gpu_jobs_wait_with_a_warning(registry, tmp_path, caplog):
    gpu_job, any_job, cpu_job = (
        submit_for(registry, device, seed) for seed, device in enumerate(["gpu", "any", "cpu"])
    )
    dispatcher = dispatcher_for(registry, tmp_path, "t-gpu-workers")
    cpu_worker = ready_worker(dispatcher, "cpu", places=4)

    with caplog.at_level(logging.WARNING, logger="pelt.dispatcher"):
        dispatcher._assign()
        dispatcher._assign()

    assert claimed_by(registry, cpu_worker) == {any_job, cpu_job}
    assert registry.get_job(gpu_job).status == JobStatus.QUEUED
    warnings = [r.getMessage() for r in caplog.records if "need a GPU" in r.getMessage()]
    assert warnings == [
        "1 queued job(s) need a GPU, and no node of the cluster offers one to pelt (no GPU "
        "resource in Ray, or --gpus-per-worker 0): they wait until a GPU node joins (asked of Ray's autoscaler)"
    ]


@pytest.mark.parametrize("command", ["serve", "dispatcher"])
def test_pelt_serve_and_dispatcher_offer_the_gpu_worker_options(command: str) -> None:
    from click.testing import CliRunner

    from services.cli import main

    shown = CliRunner().invoke(main, [command, "--help"])
    text = " ".join(shown.output.split())

    assert shown.exit_code == 0
    for option in ("--gpus-per-worker", "--gpu-pack-size", "--cpus-per-gpu-worker"):
        assert option in text
    assert f"[default: {DEFAULT_GPU_PACK_SIZE}; 1<=x<=64]" in text


def test_workers_of_both_kinds_show_their_kind(registry, tmp_path):
    dispatcher = dispatcher_for(registry, tmp_path, "t-gpu-workers")
    ready_worker(dispatcher, "gpu", places=2)
    ready_worker(dispatcher, "cpu", places=1)

    described: list[dict[str, Any]] = dispatcher.describe()

    assert sorted(w["device"] for w in described) == ["cpu", "gpu"]


def test_a_node_whose_gpu_workers_keep_failing_to_start_gets_cpu_workers_only(monkeypatch, caplog):
    nodes_with(monkeypatch, CPU=8.0, GPU=2.0)
    nodes = Nodes(DispatcherConfig(node_cooldown_seconds=0.0))
    nodes.refresh()
    with caplog.at_level(logging.ERROR, logger="pelt.dispatcher"):
        for _ in range(GPU_START_FAILURES):
            assert nodes.has_gpus  # (a CPU build of torch on a GPU node: every GPU worker fails at start)
            nodes.gpu_worker_failed(NODE)
            nodes.refresh()

    assert (nodes.gpu_capacity, nodes.capacity) == ({NODE: 0}, {NODE: 8})
    assert not nodes.has_gpus  # `any` jobs go to CPU workers again
    assert any("its GPUs are left alone" in r.getMessage() for r in caplog.records)
