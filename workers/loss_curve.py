"""A job's loss curve as a worker sends it to the registry: every step's loss, thinned evenly."""

from __future__ import annotations

import math
import threading

from workers.job import LOSS_POINTS


class LossCurve:
    """A job's per-step losses, thinned evenly for the registry: the mean loss of every `stride` steps
    (stride = ceil(total steps / LOSS_POINTS)), as [step, loss] points that each heartbeat takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[list[float]] = []
        self._sum, self._count, self._step = 0.0, 0, 0

    def add(self, step: int, total: int, loss: float) -> None:
        """A step's loss (a non-finite one is left out); a point when its stride is complete or it is the last."""
        if not math.isfinite(loss):
            return
        stride = max(1, math.ceil(total / LOSS_POINTS))
        with self._lock:
            self._sum, self._count, self._step = self._sum + float(loss), self._count + 1, step
            if step % stride == 0 or step >= total:
                self._close()

    def _close(self) -> None:
        self._pending.append([self._step, self._sum / self._count])
        self._sum, self._count = 0.0, 0

    def take(self) -> list[list[float]]:
        """The points not sent yet (the caller sends them; `restore` them if it could not)."""
        with self._lock:
            points, self._pending = self._pending, []
        return points

    def restore(self, points: list[list[float]]) -> None:
        """Points `take` gave that did not reach the registry: sent with the next beat."""
        with self._lock:
            self._pending = points + self._pending

    def flush(self) -> list[list[float]]:
        """Every point not sent yet, the last steps' mean included (training ended)."""
        with self._lock:
            if self._count:
                self._close()
        return self.take()


__all__ = ["LossCurve"]
