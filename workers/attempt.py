"""One running job inside a worker (`Attempt`: its stop flag and reason, its last progress and loss curve)
and the thread that keeps its lease (`Heartbeat`: renews it, reports progress, turns a cancel request or a
lost lease into the attempt's stop flag, and rides out a registry that is away for a while)."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, ClassVar

from pelt_core.train import Progress
from workers.job import JobLease, LeaseLost
from workers.loss_curve import LossCurve

log = logging.getLogger("pelt.workers")

OUTAGE_LEASES = 2  # leases a worker trains on while the registry's database does not answer (`_gave_up`)


def finite(value: float) -> float | None:
    """The number, or None for NaN/inf (JSON columns refuse them)."""
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


class Attempt:
    """One running job: its stop flag and reason, and the trainer's last progress report."""

    PRIORITY: ClassVar[dict[str, int]] = {"release": 0, "cancel": 1, "lease_lost": 2}

    def __init__(self, job_id: int, owner: str, backbone: str | None = None) -> None:
        self.job_id = job_id
        self.backbone = backbone  # the registry's name of its backbone (for a restarted dispatcher)
        self.owner = owner  # the lease owner, unique per running job (the dispatcher's "<worker>#<slot>")
        self.stopping = threading.Event()
        self.reason: str | None = None
        self.detail = ""
        self.progress: dict[str, Any] | None = None
        self.curve = LossCurve()
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def stop(self, reason: str, detail: str = "") -> None:
        """Raise the stop flag; a stronger reason (lease_lost > cancel > release) overrides a weaker one."""
        with self._lock:
            if self.reason is None or self.PRIORITY[reason] > self.PRIORITY[self.reason]:
                self.reason, self.detail = reason, detail
            self.stopping.set()

    def report(self, progress: Progress) -> None:
        """The trainer's report after each step: the last one kept, its loss added to the curve."""
        self.progress = {
            "step": progress.step,
            "total": progress.total_steps,
            "loss": finite(progress.loss),
            "tokens_per_second": round(progress.tokens_per_second, 1),
            "epoch": round(progress.epoch, 4),
            "learning_rate": progress.learning_rate,
        }
        self.curve.add(progress.step, progress.total_steps, progress.loss)

    def beat_report(self) -> dict[str, Any] | None:
        """What the next heartbeat sends: the last report, with the curve's points since the last beat."""
        progress = self.progress
        if progress is None:
            return None
        points = self.curve.take()
        ahead = [point for point in points if point[0] > progress["step"]]  # a step reported meanwhile
        if ahead:
            self.curve.restore(ahead)  # they go with the report of their step
            points = points[: len(points) - len(ahead)]
        return {**progress, "losses": points} if points else dict(progress)

    def final_report(self, steps: int, stopped_early: bool) -> dict[str, Any] | None:
        """The report of a job that trained to its end (`steps` taken): step N of N with the last loss (N
        the steps it took when it stopped early), and the rest of its curve."""
        if self.progress is None:
            return None
        total = steps if stopped_early else max(self.progress["total"], steps)
        report = {**self.progress, "step": min(steps, total), "total": total}
        points = [point for point in self.curve.flush() if point[0] <= report["step"]]
        return {**report, "losses": points} if points else report


class Heartbeat(threading.Thread):
    """Renews the lease every `interval` seconds (at once on start), and every `progress_interval` once
    the trainer has reported a step (while it trains, evaluates, stores), until stopped; turns a cancel request or a lost lease into the attempt's stop
    flag."""

    def __init__(
        self,
        lease: JobLease,
        attempt: Attempt,
        interval: float,
        give_up_after: float,
        progress_interval: float | None = None,
    ) -> None:
        super().__init__(name=f"heartbeat-{attempt.job_id}", daemon=True)
        self.lease, self.attempt = lease, attempt
        self.interval, self.give_up_after = interval, give_up_after
        self.progress_interval = min(interval, progress_interval or interval)
        self.halt = threading.Event()
        self.beats = 0

    def run(self) -> None:
        last_ok = time.monotonic()
        last_beat = -math.inf
        while not self.halt.is_set():
            now = time.monotonic()
            training = self.attempt.progress is not None  # (its evaluations too: no steps, still stoppable)
            if now - last_beat < self.interval and (not training or now - last_beat < self.progress_interval):
                self.halt.wait(min(self.progress_interval, self.interval - (now - last_beat)))
                continue
            last_beat = now
            report = self.attempt.beat_report()
            try:
                if self.lease.heartbeat(report):
                    self.attempt.stop("cancel", "cancellation requested")
                last_ok = time.monotonic()
                self.beats += 1
            except LeaseLost as exc:
                self.attempt.stop("lease_lost", str(exc))
                return
            except ValueError as exc:  # the registry refused the report: its loss points go, and the
                if (report or {}).get("losses"):  # lease is renewed at once without them
                    log.error("job %s: the registry refused its loss points (%s)", self.attempt.job_id, exc)
                    last_beat = -math.inf
                elif self._gave_up(exc, report, last_ok):
                    return
            except Exception as exc:  # the registry is unreachable for now: keep trying while the lease lasts
                if self._gave_up(exc, report, last_ok):
                    return

    def _gave_up(self, exc: Exception, report: dict[str, Any] | None, last_ok: float) -> bool:
        """A heartbeat did not get through: its loss points wait for the next one; past the lease, the
        attempt stops as lease_lost (True). While the registry's database is away (a ConnectionError: the
        service's RegistryUnavailableError is one) it goes on for OUTAGE_LEASES leases: nobody can take the
        job back meanwhile (the registry holds expired leases a grace after an outage), and a restart that
        outlasts a lease then costs no attempt; where only this worker is cut off, the registry says
        LeaseLost at its next heartbeat, or keeps one result if it completes first."""
        self.attempt.curve.restore((report or {}).get("losses") or [])
        silent = time.monotonic() - last_ok
        log.warning(
            "job %s: heartbeat failed (%s); %.0f s since the last one", self.attempt.job_id, exc, silent
        )
        if silent > self.give_up_after * (OUTAGE_LEASES if isinstance(exc, ConnectionError) else 1):
            self.attempt.stop("lease_lost", f"no heartbeat got through for {silent:.0f} s: {exc}")
            return True
        return False

    def finish(self) -> None:
        self.halt.set()
        self.join()


__all__ = ["OUTAGE_LEASES", "Attempt", "Heartbeat", "finite"]
