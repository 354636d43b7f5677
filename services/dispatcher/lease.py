"""The lease a worker holds on one job, backed by the registry (`RegistryLease`).

The dispatcher claims a job for a worker's slot and hands the worker this small picklable object; inside
the worker process it opens a `Registry` on the database URL, so heartbeats, progress and the attempt's
end go from the worker straight to the registry, even while no dispatcher is alive. The attempt's end rides
out a database that restarts: it is tried again for up to a lease while the registry is unavailable
(a heartbeat is not: the next one goes out anyway).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from services.registry import JobStateError, LeaseLostError, Registry
from services.registry.db import call_through_outage
from workers.job import LeaseLost


@functools.lru_cache(maxsize=8)
def _worker_registry(url: str, lease_seconds: float, backoff: float, backoff_max: float) -> Registry:
    """One Registry per worker process and configuration (engines are thread-safe)."""
    return Registry(
        url, lease_seconds=lease_seconds, retry_backoff_seconds=backoff, retry_backoff_max_seconds=backoff_max
    )


@contextlib.contextmanager
def _lease_errors() -> Iterator[None]:
    """The registry's "you no longer hold it" errors, as the worker's LeaseLost."""
    try:
        yield
    except (LeaseLostError, JobStateError) as exc:
        raise LeaseLost(str(exc)) from exc


@dataclass(frozen=True)
class RegistryLease:
    """A worker's lease on one job, backed by the registry (implements workers.job.JobLease).

    Picklable: it travels to the worker with the job and opens the registry there from the URL (which
    carries the database password, if any; it stays inside the authenticated Ray cluster).
    """

    database_url: str
    job_id: int
    worker_id: str
    lease_seconds: float
    retry_backoff_seconds: float
    retry_backoff_max_seconds: float

    def _registry(self) -> Registry:
        return _worker_registry(
            self.database_url, self.lease_seconds, self.retry_backoff_seconds, self.retry_backoff_max_seconds
        )

    def heartbeat(self, progress: dict[str, Any] | None = None) -> bool:
        """Renew the lease, record progress; True when cancellation was requested."""
        with _lease_errors():
            return self._registry().heartbeat(self.job_id, self.worker_id, progress, self.lease_seconds)

    def _end(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """An attempt's last call, tried again for up to a lease while the registry is unavailable: each
        is safe to repeat (a completion returns the stored result; a repeated failure, cancel or release
        finds the job no longer held, which is LeaseLost)."""
        with _lease_errors():  # the registry is opened inside: its first connection may meet the outage too
            return call_through_outage(
                lambda: getattr(self._registry(), method)(self.job_id, self.worker_id, *args, **kwargs),
                self.lease_seconds,
                f"job {self.job_id}: {what}",
            )

    def complete(self, result: dict[str, Any]) -> None:
        """Record the result; the job succeeds (once, ever)."""
        self._end("completing", "complete_job", result)

    def fail(self, error: str, retryable: bool) -> None:
        """End the attempt with an error (retried after the backoff while attempts remain, if retryable)."""
        self._end("recording its failure", "fail_job", error, retryable=retryable)

    def cancelled(self) -> None:
        """The worker stopped on a cancel request: the job ends cancelled."""
        self._end("confirming its cancel", "confirm_cancelled")

    def release(self, reason: str) -> None:
        """Give the job back to the queue without counting the attempt."""
        self._end("releasing it", "release_job", reason)
