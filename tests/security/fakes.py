"""Fakes the security tests share."""

from __future__ import annotations

from typing import Any


class Lease:
    """A worker's lease that records how the attempt ended (fail: its error and whether it may be retried)."""

    def __init__(self, job_id: int) -> None:
        self.job_id, self.worker_id = job_id, "w1"
        self.ends: list[tuple[str, Any]] = []

    def heartbeat(self, progress: dict[str, Any] | None = None) -> bool:
        return False

    def complete(self, result: dict[str, Any]) -> None:
        self.ends.append(("complete", result))

    def fail(self, error: str, retryable: bool) -> None:
        self.ends.append(("fail", (error, retryable)))

    def cancelled(self) -> None:
        self.ends.append(("cancelled", None))

    def release(self, reason: str) -> None:
        self.ends.append(("release", reason))
