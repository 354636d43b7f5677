"""A worker's own memory budget, and the check of each job it takes against it.

The registry refuses a job whose memory estimate is above PELT_WORKER_MEMORY_BYTES on the API host, but a
worker may run on another machine with less memory. So the worker that takes a job checks the same estimate
(`pelt_core.limits.check_job_memory`) against its own budget before it reads the job's data or maps its
backbone (with the backbone facts the registry kept, `JobSpec.backbone_facts`; without them, with the
backbone's own once it is mapped, before training), and fails the job (permanently, naming what to lower)
instead of running out of memory.

Its budget: PELT_WORKER_MEMORY_BYTES in the worker's own environment where set, else the memory of its
machine as its process sees it (`pelt_core.limits.machine_memory_bytes`: physical memory, cgroup limit,
RLIMIT_AS). Cheap: a job costs one estimate, nothing is read for it. And what a process's memory is now
(`process_memory`: what a worker reports).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pelt_core.config import TrainConfig
from pelt_core.limits import MemoryBudgetError, check_job_memory, fitted_max_length, machine_memory_bytes
from workers.job import JobSpec

BUDGET_VARIABLE = "PELT_WORKER_MEMORY_BYTES"


def worker_memory_budget() -> int:
    """This worker's memory for one job, in bytes: PELT_WORKER_MEMORY_BYTES where set in its environment
    (a whole number of bytes, at least 1 MiB, as the service's settings take it), else its machine's."""
    given = os.environ.get(BUDGET_VARIABLE, "").strip()
    if not given:
        return machine_memory_bytes()
    try:
        budget = int(given)
    except ValueError:
        raise ValueError(f"{BUDGET_VARIABLE} must be a whole number of bytes, got {given!r}") from None
    if budget < 1 << 20:
        raise ValueError(f"{BUDGET_VARIABLE} must be at least 1 MiB (1048576 bytes), got {budget}")
    return budget


class JobMemoryCheck:
    """Checks each job's memory estimate against one budget (bytes)."""

    def __init__(self, budget: int, worker_id: str) -> None:
        self.budget = budget
        self.worker_id = worker_id

    def check(self, job: JobSpec, config: TrainConfig, facts: Mapping[str, Any]) -> None:
        """Raise MemoryBudgetError (its field names what to lower) when the job's estimate on a backbone of
        these facts is above this worker's budget. `config`: the job's TrainConfig (defaults filled in)."""
        train_config = config.to_dict()
        train_config["max_length"] = fitted_max_length(config.max_length, facts)
        train_config["backbone_dtype"] = job.backbone_dtype or config.backbone_dtype
        try:
            check_job_memory(train_config, job.method_spec, facts, self.budget)
        except MemoryBudgetError as exc:
            reason = str(exc).removeprefix(f"{exc.field}: ")
            raise MemoryBudgetError(
                exc.field,
                f"{reason} (worker {self.worker_id} has {self.budget:,} bytes for a job: "
                f"{BUDGET_VARIABLE} in its environment, else its machine's memory)",
            ) from None


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """rss, pss and uss of a process in bytes, from /proc/<pid>/smaps_rollup (Linux), and `anonymous`: its
    heap and other private memory, without the shared memory it maps (a node's shared backbones: pages a
    process wrote there count in its uss until another process reads them)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) >= 3 and parts[0].endswith(":"):
                fields[parts[0][:-1]] = int(parts[1]) * 1024
    return {
        "rss": fields.get("Rss", 0),
        "pss": fields.get("Pss", 0),
        "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
        "anonymous": fields.get("Anonymous", 0),
    }


__all__ = ["BUDGET_VARIABLE", "JobMemoryCheck", "process_memory", "worker_memory_budget"]
