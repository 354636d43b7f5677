"""A worker's packs on one warm backbone: one thread steps them; each job's own thread waits for its result.

`PackRunner.train` has the signature and the outcome of `pelt_core.train.train` (a result, or the job's own
TrainingError / TrainingCancelled / ConfigError ...), so the worker keeps one code path per job (lease,
heartbeat, cancel, store) whether jobs train alone or packed. Jobs join between steps; a job that cannot
start fails alone; jobs wanting another precision (bf16 or not) form a second pack, stepped in turn.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from pelt_core.backbones import Backbone
from pelt_core.pack import Pack, PackMember, wants_bf16
from pelt_core.train import TrainResult

log = logging.getLogger("pelt.workers")


@dataclass
class _Entry:
    """A job handed to the runner: what `Pack.join` takes, and how it ended."""

    arguments: dict[str, Any]
    ended: threading.Event = field(default_factory=threading.Event)
    result: TrainResult | None = None
    error: BaseException | None = None

    def end(self, result: TrainResult | None = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.ended.set()


class PackRunner:
    """Trains every job handed to `train` on `backbone` in packs, from one thread that lives while there
    are jobs."""

    def __init__(self, backbone: Backbone, name: str = "pack") -> None:
        self.backbone = backbone
        self.name = name
        self._lock = threading.Lock()
        self._pending: list[_Entry] = []
        self._thread: threading.Thread | None = None
        self.steps = 0  # pack steps taken, all packs together
        self.job_steps = 0  # steps of its jobs, counted per job (above `steps`: jobs shared passes)
        self.jobs = 0  # jobs in its packs now

    def train(
        self,
        method,
        train_data,
        eval_data=None,
        config=None,
        task=None,
        progress=None,
        should_stop=None,
        metric=None,
        sources=None,
    ):
        """Train one job in this runner's pack and wait for it: `pelt_core.train.train`'s contract."""
        entry = _Entry(
            {
                "method": method,
                "train_data": train_data,
                "eval_data": eval_data,
                "config": config,
                "task": task,
                "progress": progress,
                "should_stop": should_stop,
                "metric": metric,
                "sources": sources,
            }
        )
        with self._lock:
            self._pending.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self.name}-steps", daemon=True)
                self._thread.start()
        entry.ended.wait()
        if entry.error is not None:
            raise entry.error
        return entry.result

    def describe(self) -> dict[str, Any]:
        """What the runner does: jobs in its packs now, pack steps taken, and its jobs' steps."""
        return {
            "backbone": self.backbone.name,
            "jobs": self.jobs,
            "steps": self.steps,
            "job_steps": self.job_steps,
        }

    @property
    def active(self) -> bool:
        with self._lock:
            return self._thread is not None

    def _run(self) -> None:
        packs: dict[bool, Pack] = {}
        entries: dict[int, _Entry] = {}  # id(member) -> its entry
        try:
            self._step_until_empty(packs, entries)  # leaves `_thread` None (under the lock) when done
        except BaseException:  # the thread dies: no job may wait for it
            with self._lock:
                waiting, self._pending = [*entries.values(), *self._pending], []
                self._thread = None
            for entry in waiting:
                if not entry.ended.is_set():
                    entry.end(error=RuntimeError(f"{self.name}: the pack's thread stopped"))
            raise

    def _step_until_empty(self, packs: dict[bool, Pack], entries: dict[int, _Entry]) -> None:
        while True:
            with self._lock:
                joining, self._pending = self._pending, []
                if not joining and not any(len(pack) for pack in packs.values()):
                    self._thread = None
                    return
            for entry in joining:
                self._join(packs, entries, entry)
            self.jobs = sum(len(pack) for pack in packs.values())
            for pack in [p for p in packs.values() if len(p)]:
                counted = pack.steps, pack.job_steps
                try:
                    ended = pack.step()
                except Exception as exc:  # not any one job's fault (each job's own errors end only that job)
                    log.exception("%s: a pack step failed; its %d job(s) fail with it", self.name, len(pack))
                    ended = list(pack.members)
                    for member in ended:
                        if not member.done:
                            member.error = exc
                        pack.leave(member)
                self.steps += pack.steps - counted[0]
                self.job_steps += pack.job_steps - counted[1]
                for member in ended:
                    entries.pop(id(member)).end(member.result, member.error)

    def _join(self, packs: dict[bool, Pack], entries: dict[int, _Entry], entry: _Entry) -> None:
        try:
            config = entry.arguments["config"]
            key = wants_bf16(config, self.backbone)
            pack = packs.setdefault(key, Pack(self.backbone))
            member: PackMember = pack.join(**entry.arguments)
        except Exception as exc:  # this job cannot start (its data, config, spec): it alone fails
            entry.end(error=exc)
            return
        entries[id(member)] = entry
