"""The dispatcher's view of its worker actors and their job slots (a pack worker's places), and the
lease-owner names that tie a job's lease in the registry to the slot that runs it
("<worker's actor name>#<slot>")."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

WORKER_PREFIX = "pelt-worker."  # actor names of the workers (and so of their jobs' lease owners)
GPU_WORKER_PREFIX = f"{WORKER_PREFIX}gpu."  # a GPU worker's name says so (a restarted dispatcher reads it)


@dataclass
class SlotJob:
    """A job running in one slot of a worker, as the dispatcher sees it."""

    job_id: int
    owner: str  # its lease owner: "<worker id>#<slot>"
    backbone: str | None = None  # registry name of its backbone
    task: str | None = None
    run_ref: Any = None  # the run() call this dispatcher made (None for a job adopted on restart)
    cancel_pushed: bool = False


@dataclass
class WorkerSlots:
    """The dispatcher's view of one worker actor and its job slots."""

    worker_id: str
    node_id: str
    actor: Any
    slots: int = 1
    ready: bool = False
    started_at: float = field(default_factory=time.monotonic)
    jobs: dict[int, SlotJob] = field(default_factory=dict)  # slot -> the job running there
    poll_ref: Any = None  # a pending info() call (startup, or watching adopted jobs)
    backbones: set[str] = field(default_factory=set)  # registry backbone names it keeps warm
    packed: bool = False  # trains its jobs as one pack (its slots are the pack's places)
    device: str = "cpu"  # the kind of worker: "cpu", or "gpu" (holds its backbones on a GPU)
    memory_bytes: int | None = None  # its budget for one job, as it measured it where it runs (info())

    def free_slots(self) -> list[int]:
        return [slot for slot in range(self.slots) if slot not in self.jobs]

    def claim_backbones(self) -> list[str] | None:
        """The backbones a free slot may claim a job on now: for a pack with running jobs, theirs (a
        pack never mixes backbones; none while one of them is not known); else the warm ones first;
        None: any backbone."""
        if self.packed and self.jobs:
            running = {job.backbone for job in self.jobs.values()}
            return [] if None in running else sorted(running)
        return sorted(self.backbones) if self.backbones else None

    def owner(self, slot: int) -> str:
        return slot_owner(self.worker_id, slot, self.slots)


def largest_worker_memory(workers: Iterable[WorkerSlots]) -> dict[str, int]:
    """The largest job budget among the started workers of each kind ("cpu", "gpu")."""
    largest: dict[str, int] = {}
    for worker in workers:
        if worker.ready and worker.memory_bytes:
            largest[worker.device] = max(largest.get(worker.device, 0), int(worker.memory_bytes))
    return largest


def worker_kind(worker_id: str) -> str:
    """ "gpu" for a GPU worker's actor name (or a lease owner of one), else "cpu"."""
    return "gpu" if worker_id.startswith(GPU_WORKER_PREFIX) else "cpu"


def slot_owner(worker_id: str, slot: int, slots: int) -> str:
    """The lease owner of a worker's job slot: "<worker id>#<slot>", or the worker id itself when the
    worker has a single slot (as before job slots existed)."""
    return worker_id if slots == 1 else f"{worker_id}#{slot}"


def running_jobs(info: dict[str, Any], worker_id: str) -> list[dict[str, Any]]:
    """The jobs a worker's info() says it runs ([{job_id, owner}]); a worker from before job slots
    reports a single `job_id`, owned by the worker itself."""
    if info.get("jobs") is not None:
        return info["jobs"]
    return [] if info.get("job_id") is None else [{"job_id": info["job_id"], "owner": worker_id}]


def owner_worker(owner: str) -> tuple[str, int | None]:
    """(worker id, slot) of a lease owner ("<worker id>#<slot>"; a bare worker id: slot None)."""
    worker_id, _, slot = owner.partition("#")
    return worker_id, int(slot) if slot.isdigit() else None


def streams(worker: WorkerSlots) -> int:
    """The worker's compute streams: one for a pack (it steps its places together), else one per slot."""
    return 1 if worker.packed else worker.slots


def idle_streams(worker: WorkerSlots) -> int:
    """Its compute streams with no job: a pack with no job has one; a worker of job slots, its free slots."""
    if worker.packed:
        return 0 if worker.jobs else 1
    return len(worker.free_slots())
