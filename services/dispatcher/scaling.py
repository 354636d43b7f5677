"""Scaling from the queue: the dispatcher asks Ray's autoscaler for the nodes its queued jobs need, and lets
workers that stay idle go so that idle nodes can be removed.

Every `scaling_seconds` the dispatcher reads the queue by device and backbone and counts, for each kind of
worker (gpu, cpu), the jobs that the free places of its workers (started or starting) cannot take: a pack
that is training jobs of one backbone takes only more of that backbone (a pack never mixes backbones), an
idle pack takes jobs of one backbone, a worker of job slots one job of any backbone per free slot; the jobs
left need `ceil(left / places)` new workers per backbone. It then asks Ray
(`ray.autoscaler.sdk.request_resources`) for one bundle per worker it keeps and one per worker those jobs
need, each shaped as that worker reserves (a GPU worker: `gpus_per_worker` GPUs and `cpus_per_gpu_worker`
CPUs; a CPU worker: `cpus_per_actor` CPUs), at most `max_requested_workers` more than it has of each kind per
request (the next request asks for more once those have started). Ray's autoscaler
reads that as the capacity to have, whatever runs now (a node with room counts toward it, and is kept
while the request holds it): a GPU group at zero nodes gets one when a GPU job queues (KubeRay, or any Ray cluster with an autoscaler; without one the request does nothing). The request
is sent when it changes.

Scaling down: with `idle_worker_seconds`, a worker that has had no job that long, while no job its kind
could run waits, is stopped, and with the last one on its node the node's backbone host (whose shared
copies would keep the node busy: Ray does not remove a node that holds objects); the node, idle then, is
removed by the autoscaler after its own idle timeout (KubeRay's `idleTimeoutSeconds`). Without it (the default) workers stay warm, their backbones loaded.

A GPU job waiting with no GPU in the cluster is said once in the log while it lasts (the request goes out
all the same: a node may come).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from services.dispatcher.config import DispatcherConfig
from services.dispatcher.slots import WorkerSlots
from services.registry.models import JOB_DEVICES

log = logging.getLogger("pelt.dispatcher")
KINDS = ("gpu", "cpu")


def request_resources(bundles: list[dict[str, float]]) -> None:
    """Ray's autoscaler SDK call (a standing request, replaced by the next one)."""
    from ray.autoscaler.sdk import request_resources as ray_request

    ray_request(bundles=bundles)


def queued_per_device(by_backbone: Mapping[tuple[str, str], int]) -> dict[str, int]:
    """{"any": n, "cpu": n, "gpu": n} (zeros included) from the queued jobs per (device, backbone)."""
    counts = dict.fromkeys(JOB_DEVICES, 0)
    for (device, _), count in by_backbone.items():
        counts[device] = counts.get(device, 0) + count
    return counts


class NodeRequests:
    """What the dispatcher asks Ray's autoscaler for, and which of its workers it lets go (module docstring)."""

    def __init__(
        self, config: DispatcherConfig, request: Callable[[list[dict[str, float]]], None] = request_resources
    ) -> None:
        self.config = config
        self.request = request
        self.sent: list[dict[str, float]] | None = None  # the standing request (None: none sent yet)
        self._at = float("-inf")
        self._idle_since: dict[str, float] = {}  # worker id -> when it was first seen without a job
        self._warned_no_gpu = False
        self._failed = False

    def due(self, now: float | None = None) -> bool:
        """Whether the queue should be read for scaling now."""
        if self.config.scaling_seconds <= 0:
            return False
        return (time.monotonic() if now is None else now) - self._at >= self.config.scaling_seconds

    def waiting(self, queued: Mapping[str, int], has_gpus: bool) -> dict[str, int]:
        """Queued jobs per kind of worker that may run them: gpu jobs (and `any` ones where a node has a
        GPU) on GPU workers, the rest on CPU workers."""
        any_jobs = queued.get("any", 0)
        return {
            "gpu": queued.get("gpu", 0) + (any_jobs if has_gpus else 0),
            "cpu": queued.get("cpu", 0) + (0 if has_gpus else any_jobs),
        }

    def update(
        self,
        queued: Mapping[str, int],
        workers: Iterable[WorkerSlots],
        has_gpus: bool,
        queued_backbones: Mapping[tuple[str, str], int] | None = None,
        now: float | None = None,
    ) -> list[WorkerSlots]:
        """Ask for the workers the queue needs (when the request changes) and return the workers to stop:
        idle for `idle_worker_seconds` with nothing of their kind waiting. `queued_backbones`: the queued
        jobs per (device, backbone name) (the registry's `queued_by_device_and_backbone`); without it every
        free place counts as able to take any queued job."""
        now = time.monotonic() if now is None else now
        self._at = now
        workers = list(workers)
        waiting = self.waiting(queued, has_gpus)
        self._warn_if_no_gpu(queued.get("gpu", 0), has_gpus)
        bundles: list[dict[str, float]] = []
        for kind in KINDS:
            mine = [w for w in workers if w.device == kind]
            if queued_backbones is None:
                by_backbone: Mapping[str | None, int] = {None: waiting[kind]}
            else:
                by_backbone = self._waiting_by_backbone(kind, queued_backbones, has_gpus)
            extra = self.workers_needed(kind, by_backbone, mine)
            wanted = len(mine) + min(extra, self.config.max_requested_workers)
            if kind == "gpu" and self.config.gpus_per_worker <= 0:
                wanted = 0  # no GPU workers at all (--gpus-per-worker 0)
            bundles += [self._shape(kind)] * wanted
        if bundles != self.sent:
            self._send(bundles)
        return self._idle(workers, waiting, now)

    def _waiting_by_backbone(
        self, kind: str, queued_backbones: Mapping[tuple[str, str], int], has_gpus: bool
    ) -> Counter[str | None]:
        """The queued jobs a worker of this kind may run, per backbone (as `waiting` splits the devices)."""
        devices = {
            "gpu": ("gpu", "any") if has_gpus else ("gpu",),
            "cpu": ("cpu",) if has_gpus else ("cpu", "any"),
        }
        counts: Counter[str | None] = Counter()
        for (device, backbone), count in queued_backbones.items():
            if device in devices[kind]:
                counts[backbone] += count
        return counts

    def workers_needed(
        self, kind: str, waiting: Mapping[str | None, int], workers: Iterable[WorkerSlots]
    ) -> int:
        """New workers of a kind for the jobs waiting per backbone (None: backbone not known) that the free
        places of `workers` cannot take (the module docstring's rule)."""
        left = Counter({backbone: count for backbone, count in waiting.items() if count > 0})
        idle_packs, any_slots = [], 0
        for worker in workers:
            free = len(worker.free_slots())
            if not free:
                continue
            if not worker.packed:
                any_slots += free
            elif not worker.jobs or None in left:
                idle_packs.append(free)  # its backbone is not fixed yet (or the queue's is not known)
            else:
                for backbone in worker.claim_backbones() or ():
                    taken = min(free, left[backbone])
                    left[backbone] -= taken
                    free -= taken
        for free in sorted(idle_packs, reverse=True):  # each takes jobs of one backbone, the most waiting
            if left:
                backbone, count = left.most_common(1)[0]
                left[backbone] = count - min(free, count)
            left = +left  # drop the backbones with nothing left
        while any_slots and left:  # a free slot takes one job of any backbone
            backbone, count = left.most_common(1)[0]
            taken = min(any_slots, count)
            left[backbone] -= taken
            any_slots -= taken
            left = +left
        places = self.config.places(kind)
        if self.config.pack_size_of(kind) == 1:  # workers of job slots: a new one takes any backbone
            return math.ceil(sum(left.values()) / places)
        return sum(math.ceil(count / places) for count in left.values())  # a new pack: one backbone

    def _shape(self, kind: str) -> dict[str, float]:
        """What one worker of a kind reserves; whole numbers as ints (Ray before 2.60 took ints only)."""
        if kind == "gpu":
            shape = {"GPU": self.config.gpus_per_worker, "CPU": self.config.cpus_per_gpu_worker}
        else:
            shape = {"CPU": self.config.cpus_per_actor}
        return {
            key: int(value) if float(value).is_integer() else float(value) for key, value in shape.items()
        }

    def withdraw(self) -> None:
        """Ask for nothing any more (the dispatcher stopped its workers): the autoscaler may shrink."""
        if self.sent:
            self._send([])

    def _send(self, bundles: list[dict[str, float]]) -> None:
        try:
            self.request(bundles)
        except Exception as exc:  # no autoscaler state to write to (e.g. an old cluster): say it once
            if not self._failed:
                log.warning("could not ask Ray's autoscaler for nodes (%s); the cluster keeps its size", exc)
            self._failed = True
            return
        self._failed = False
        if bundles:
            counts = {
                kind: sum(1 for b in bundles if (b.get("GPU", 0) > 0) == (kind == "gpu")) for kind in KINDS
            }
            log.info("asking Ray for room for %d GPU and %d CPU worker(s)", counts["gpu"], counts["cpu"])
        elif self.sent:
            log.info("asking Ray for no more room: the queue is empty")
        self.sent = bundles

    def _idle(self, workers: list[WorkerSlots], waiting: Mapping[str, int], now: float) -> list[WorkerSlots]:
        alive = {w.worker_id for w in workers}
        for worker_id in set(self._idle_since) - alive:
            del self._idle_since[worker_id]
        retired = []
        for worker in workers:
            if worker.jobs or not worker.ready:
                self._idle_since.pop(worker.worker_id, None)
                continue
            since = self._idle_since.setdefault(worker.worker_id, now)
            limit = self.config.idle_worker_seconds
            if limit is not None and now - since >= limit and not waiting.get(worker.device, 0):
                retired.append(worker)
                del self._idle_since[worker.worker_id]
        if retired:
            log.info(
                "stopping %d worker(s) idle for %g s or more", len(retired), self.config.idle_worker_seconds
            )
        return retired

    def _warn_if_no_gpu(self, stuck: int, has_gpus: bool) -> None:
        """Say (once while it lasts) that jobs wait for a GPU the cluster does not offer."""
        stuck = stuck if not has_gpus else 0
        if stuck and not self._warned_no_gpu:
            log.warning(
                "%d queued job(s) need a GPU, and no node of the cluster offers one to pelt (no GPU resource "
                "in Ray, or --gpus-per-worker 0): they wait until a GPU node joins (asked of Ray's autoscaler)",
                stuck,
            )
        self._warned_no_gpu = bool(stuck)

    def describe(self) -> dict[str, Any]:
        """The standing request, per kind of worker."""
        sent = self.sent or []
        return {
            "gpu_workers": sum(1 for b in sent if b.get("GPU", 0) > 0),
            "cpu_workers": sum(1 for b in sent if not b.get("GPU", 0)),
        }
