"""Holding a job in its Ray worker until the test lets it go (test-only; the worker imports this module).

`Hold(folder)` gives a `HeldSink` to the dispatcher in place of its delta sink. Each attempt then stops at
its store step, trained but not yet recorded (the job is `running` in the registry, its lease renewed by
the worker's heartbeat, its worker busy), writes a marker the test can wait for, and goes on only once the
test has released its job. So a test acts on a job that is certainly still running, whatever the machine's
speed, instead of sizing jobs to outrun its checks.

The worker runs in another process: the hold and its release are files in a folder the test owns.
A hold not released within `HeldSink.timeout` fails the store (a retryable failure), so a test that
forgets to release fails instead of hanging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.job import DeltaSink, JobSpec, StoredDelta

ALL = "all"  # release every job, held now or later


@dataclass(frozen=True)
class HeldSink:
    """A DeltaSink that holds each attempt before storing through `inner` until the test releases the job."""

    inner: DeltaSink
    folder: str
    timeout: float = 600.0
    poll_seconds: float = 0.05

    def __getattr__(self, name: str) -> Any:
        """What the inner sink offers beyond `store` (MlflowDeltaStore's `finalize_job`), as the inner's."""
        if name.startswith("__") or name == "inner":  # unpickling asks before `inner` is set
            raise AttributeError(name)
        return getattr(self.inner, name)

    def store(
        self, job: JobSpec, delta_dir: Path, result: dict[str, Any], history: list[dict[str, Any]]
    ) -> StoredDelta:
        folder = Path(self.folder)
        (folder / f"held-{job.job_id}-{job.attempt}").touch()
        deadline = time.monotonic() + self.timeout
        while not ((folder / f"release-{job.job_id}").exists() or (folder / f"release-{ALL}").exists()):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job.job_id} was held for {self.timeout:.0f} s: the test never let it go"
                )
            time.sleep(self.poll_seconds)
        return self.inner.store(job, delta_dir, result, history)


class Hold:
    """The test's side: a sink that holds jobs, whether a job's attempt is held, and its release."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def sink(self, inner: DeltaSink) -> HeldSink:
        return HeldSink(inner, str(self.folder))

    def holds(self, job_ids: list[int], attempt: int = 1) -> bool:
        """True when each job's `attempt` has reached its hold (trained; it stays running until released)."""
        return all((self.folder / f"held-{job_id}-{attempt}").exists() for job_id in job_ids)

    def release(self, *job_ids: int) -> None:
        """Let these jobs (every job, now and later, when none is named) store their deltas and end."""
        for name in job_ids or (ALL,):
            (self.folder / f"release-{name}").touch()


def hold_dispatcher_deltas(folder: str) -> None:
    """Make every dispatcher started later in this process (by `pelt dispatcher` or `pelt serve`, run as a
    deployment runs them) hold each attempt in `folder` before storing it through the sink it was given
    (local or MLflow); for a test that runs the real command in a subprocess, where it cannot hand the
    dispatcher a sink."""
    from services.dispatcher.dispatcher import Dispatcher

    unheld = Dispatcher.__init__

    def held(self: Dispatcher, *args: Any, **kwargs: Any) -> None:
        unheld(self, *args, **kwargs)
        if not isinstance(self.sink, HeldSink):  # a second call of this function holds once, not twice
            self.sink = HeldSink(self.sink, folder)

    Dispatcher.__init__ = held  # type: ignore[method-assign]
