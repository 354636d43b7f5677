"""The Registry's dispatcher leadership: at most one dispatcher leads each Ray namespace at a time.

A dispatcher leads while it holds its namespace's row in `dispatcher_leaders` and the row has not
expired; it renews the row well within `ttl_seconds`. Any other dispatcher of the namespace is a standby:
`acquire_leadership` returns False until the row has expired (the leader died or stalled), then the first
standby to ask takes it over. A leader whose renewal fails has lost the namespace and must stop acting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from services.registry.core import RegistryCore
from services.registry.errors import RegistryValidationError
from services.registry.models import DispatcherLeader

MAX_NAME_LENGTH = 200  # of a Ray namespace and of a holder


@dataclass(frozen=True)
class LeaderRecord:
    """Who leads a namespace, since when and until when (unless renewed)."""

    namespace: str
    holder: str
    acquired_at: datetime
    expires_at: datetime


class Leadership(RegistryCore):
    """Dispatcher leadership per Ray namespace: one part of `Registry`."""

    def acquire_leadership(self, namespace: str, holder: str, ttl_seconds: float) -> bool:
        """Lead `namespace` for `ttl_seconds` from now: True if `holder` now leads it (it was free, had
        expired, or `holder` already led it: then this renews), False while another holder's row is alive."""
        self._check_leadership(namespace, holder, ttl_seconds)
        try:
            with self._writing() as session:
                now = self._now()
                row = session.get(DispatcherLeader, namespace, with_for_update=True)
                if row is None:
                    session.add(
                        DispatcherLeader(
                            namespace=namespace,
                            holder=holder,
                            acquired_at=now,
                            expires_at=now + timedelta(seconds=ttl_seconds),
                        )
                    )
                    return True
                if row.holder != holder and row.expires_at > now:
                    return False
                if row.holder != holder:
                    row.holder, row.acquired_at = holder, now
                row.expires_at = now + timedelta(seconds=ttl_seconds)
                return True
        except IntegrityError:  # another standby inserted the namespace's first row at the same moment
            return False

    def renew_leadership(
        self,
        namespace: str,
        holder: str,
        ttl_seconds: float,
        worker_memory: Mapping[str, int] | None = None,
    ) -> bool:
        """Extend `holder`'s leadership by `ttl_seconds` from now; False if it no longer leads (another
        dispatcher took the namespace over after its row expired, or the row is gone). `worker_memory`: the
        largest job budget of its workers per kind ("cpu", "gpu"), what submits check jobs against."""
        self._check_leadership(namespace, holder, ttl_seconds)
        memory = None if worker_memory is None else _worker_memory(worker_memory)
        with self._writing() as session:
            row = session.get(DispatcherLeader, namespace, with_for_update=True)
            if row is None or row.holder != holder:
                return False
            row.expires_at = self._now() + timedelta(seconds=ttl_seconds)
            if memory is not None and memory != row.worker_memory:
                row.worker_memory = memory
            return True

    def largest_workers(self) -> dict[str, int]:
        """The largest job budget of the workers of each kind ("cpu", "gpu") that the leading dispatchers
        run now, over every namespace ({} before any leader has reported one)."""
        with self._reading() as session:
            largest: dict[str, int] = {}
            now = self._now()
            for row in session.scalars(select(DispatcherLeader).where(DispatcherLeader.expires_at > now)):
                for kind, memory in (row.worker_memory or {}).items():
                    largest[kind] = max(largest.get(kind, 0), int(memory))
            return largest

    def release_leadership(self, namespace: str, holder: str) -> bool:
        """Give the namespace up (a standby takes over at once instead of after the expiry); True if
        `holder` led it."""
        self._check_leadership(namespace, holder)
        with self._writing() as session:
            gone = session.execute(
                delete(DispatcherLeader).where(
                    DispatcherLeader.namespace == namespace, DispatcherLeader.holder == holder
                )
            )
            return bool(gone.rowcount)

    def leader(self, namespace: str) -> LeaderRecord | None:
        """Who leads `namespace` now (None: nobody, or the last leader's row has expired)."""
        self._check_leadership(namespace, "reader")
        with self._reading() as session:
            row = session.scalars(
                select(DispatcherLeader).where(DispatcherLeader.namespace == namespace)
            ).first()
            if row is None or row.expires_at <= self._now():
                return None
            return LeaderRecord(row.namespace, row.holder, row.acquired_at, row.expires_at)

    @staticmethod
    def _check_leadership(namespace: str, holder: str, ttl_seconds: float | None = None) -> None:
        for field, value in (("namespace", namespace), ("holder", holder)):
            if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_LENGTH:
                raise RegistryValidationError(field, f"must be 1 to {MAX_NAME_LENGTH} characters")
        if ttl_seconds is not None and not 0 < ttl_seconds <= 3600:
            raise RegistryValidationError("ttl_seconds", f"must be in (0, 3600], got {ttl_seconds}")


def _worker_memory(worker_memory: Mapping[str, int]) -> dict[str, int]:
    checked = {}
    for kind, memory in worker_memory.items():
        if (
            kind not in ("cpu", "gpu")
            or isinstance(memory, bool)
            or not isinstance(memory, int)
            or memory <= 0
        ):
            raise RegistryValidationError(
                "worker_memory", f"expected cpu/gpu -> bytes, got {kind!r}: {memory!r}"
            )
        checked[kind] = memory
    return checked


__all__ = ["LeaderRecord", "Leadership"]
