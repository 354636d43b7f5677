"""A dispatcher's start-up: adopt the live workers of its Ray namespace (workers are detached named
actors, so they outlive a dispatcher) and settle the jobs the registry says are running.

A job running on a live worker is adopted (it goes on); a job claimed for a live worker that is not
running it (claimed, never started) is given back to the queue; a job whose worker is gone is left to
lease expiry (the registry takes it back). One dispatcher per namespace.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from services.dispatcher.slots import (
    WORKER_PREFIX,
    SlotJob,
    WorkerSlots,
    owner_worker,
    running_jobs,
    worker_kind,
)
from services.registry import JobStateError, LeaseLostError, Registry

log = logging.getLogger("pelt.dispatcher")


def live_workers(registry: Registry, namespace: str) -> dict[str, WorkerSlots]:
    """The namespace's worker actors that answer, by name, each with the jobs it says it runs and the
    registry names of the backbones it keeps warm."""
    import ray

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith(WORKER_PREFIX)
    ]
    infos: dict[str, tuple[Any, dict[str, Any]]] = {}
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=namespace)
            infos[name] = (actor, ray.get(actor.info.remote(), timeout=30))
        except Exception as exc:  # gone meanwhile, or hung: not adopted
            log.warning("not adopting worker %s: %s", name, exc)
    sources = _source_names(registry)
    workers = {}
    for name, (actor, info) in infos.items():
        packed = int(info.get("pack_size", 1)) > 1
        slots = int(info.get("slots", 1))
        worker = WorkerSlots(
            name, info["node_id"], actor, slots=slots, ready=True, packed=packed, device=worker_kind(name)
        )
        worker.backbones = {sources[src] for src, _ in info["backbones"] if src in sources}
        for entry in running_jobs(info, name):  # busy slots, whatever the registry says, until freed
            _, slot = owner_worker(entry.get("owner") or "")
            if slot is None or slot in worker.jobs or slot >= worker.slots:
                slot = (worker.free_slots() or [len(worker.jobs)])[0]
            owner = entry.get("owner") or worker.owner(slot)
            worker.jobs[slot] = SlotJob(entry["job_id"], owner, backbone=entry.get("backbone"))
        if worker.jobs:
            worker.poll_ref = actor.info.remote()
        workers[name] = worker
    return workers


def settle_running_jobs(registry: Registry, workers: dict[str, WorkerSlots]) -> dict[str, list[int]]:
    """Settle every job the registry says a worker of this kind runs: the job ids adopted (running on a
    live worker), released (claimed for a live worker that is not running them) and left to lease expiry
    (their worker is gone)."""
    settled: dict[str, list[int]] = {"adopted": [], "released": [], "left_to_lease_expiry": []}
    for record in registry.list_jobs(status="running", limit=100_000):
        owner = record.lease_owner or ""
        if not owner.startswith(WORKER_PREFIX):
            continue
        worker = workers.get(owner_worker(owner)[0])
        job = (
            None
            if worker is None
            else next((j for j in worker.jobs.values() if j.job_id == record.id and j.owner == owner), None)
        )
        if job is not None:
            job.backbone, job.task = record.backbone, record.task
            settled["adopted"].append(record.id)
        elif worker is not None:
            with contextlib.suppress(LeaseLostError, JobStateError):
                registry.release_job(record.id, owner, "claimed for a worker that never started it")
                settled["released"].append(record.id)
        else:
            settled["left_to_lease_expiry"].append(record.id)
            log.warning(
                "job %s: its worker %s is gone; it comes back when its lease expires at %s",
                record.id,
                owner,
                record.lease_expires_at,
            )
    return settled


def _source_names(registry: Registry) -> dict[str, str]:
    """Canonical backbone source -> registry name."""
    from pelt_core.backbones import BackboneError, resolve_backbone

    names = {}
    for record in registry.list_backbones():
        with contextlib.suppress(BackboneError):
            names[resolve_backbone(record.source)[0]] = record.name
    return names
