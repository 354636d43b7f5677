"""One dispatcher leads a Ray namespace; others started against the same registry and namespace stand by.

The leader holds its namespace's row in the registry (`Registry.acquire_leadership`) and renews it every
third of `leader_seconds`; it acts (claims jobs, starts, adopts and stops workers) only while its last
renewal is that recent. A standby asks for the row every few seconds and takes it once it has expired: the
leader died, lost its database, or stalled longer than `leader_seconds`. The new leader adopts the running
workers and their jobs (`services.dispatcher.adoption`), so nothing runs twice and no worker is fought
over; a leader that finds its row taken steps down to standby without touching the workers.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

from services.registry import Registry

log = logging.getLogger("pelt.dispatcher")

# Without a successful renewal for this share of the lease, a leader stops acting even if its row may still
# be alive: the registry is unreachable, and a standby may take over when the row expires.
ACT_WITHOUT_RENEWAL = 0.8


class LeaderLock:
    """This dispatcher's hold on leading its namespace (see the module docstring)."""

    def __init__(self, registry: Registry, namespace: str, leader_seconds: float) -> None:
        self.registry = registry
        self.namespace = namespace
        self.leader_seconds = leader_seconds
        self.holder = f"{socket.gethostname()[:120]}:{os.getpid()}:{secrets.token_hex(4)}"
        self.leading = False
        self._renewed_at = 0.0  # when the last successful renewal (or acquisition) was sent
        self._told_standby = False
        self.asked = 0  # times it asked to lead
        # the largest job budget of its workers per kind, recorded with each renewal (what submits check
        # jobs' memory against: Registry.renew_leadership); None: nothing to report
        self.worker_memory: Callable[[], dict[str, int]] | None = None

    def try_acquire(self) -> bool:
        """Lead now if the namespace is free (or its leader's row expired); False: stand by."""
        self.asked += 1
        sent = time.monotonic()
        try:
            self.leading = self.registry.acquire_leadership(self.namespace, self.holder, self.leader_seconds)
        except Exception as exc:  # the registry is unreachable for now: stay a standby, ask again later
            log.warning("cannot ask the registry who leads namespace %s: %s", self.namespace, exc)
            self.leading = False
        if self.leading:
            self._renewed_at = sent
            self._told_standby = False
            log.info("dispatcher %s leads namespace %s", self.holder, self.namespace)
        elif not self._told_standby:
            self._told_standby = True
            leader = self._current_leader()
            log.info(
                "dispatcher %s stands by: namespace %s is led by %s; it takes over if that one stops",
                self.holder,
                self.namespace,
                leader or "another dispatcher",
            )
        return self.leading

    def may_act(self) -> bool:
        """Whether this leader may still claim a job, start a worker or stop one: its last renewal was sent
        less than ACT_WITHOUT_RENEWAL of the lease ago (its row cannot have expired in the registry yet).
        Checked before each such action, so a leader that stalled mid-round stops before a standby can
        take over."""
        return (
            self.leading and time.monotonic() - self._renewed_at < self.leader_seconds * ACT_WITHOUT_RENEWAL
        )

    def still_leading(self, force: bool = False) -> bool:
        """Whether this dispatcher leads now: it renews its row when a third of the lease has passed (or at
        once with `force`: before stopping workers); False once the row is someone else's, or no renewal got
        through for most of the lease."""
        if not self.leading:
            return False
        if not force and time.monotonic() - self._renewed_at < self.leader_seconds / 3:
            return True
        sent = time.monotonic()
        try:
            memory = self.worker_memory() if self.worker_memory is not None else None
            renewed = self.registry.renew_leadership(
                self.namespace, self.holder, self.leader_seconds, worker_memory=memory or None
            )
        except Exception as exc:
            log.warning(
                "cannot renew the leadership of namespace %s (%.0f s since the last): %s",
                self.namespace,
                time.monotonic() - self._renewed_at,
                exc,
            )
            if not self.may_act():
                self.leading = False
            return self.leading
        if renewed:
            self._renewed_at = sent
            return True
        self.leading = False
        log.error(
            "dispatcher %s lost namespace %s to %s; it stands by and leaves the workers to the leader",
            self.holder,
            self.namespace,
            self._current_leader() or "another dispatcher",
        )
        return False

    def release(self) -> None:
        """Give the namespace up now, so that a standby takes over at once."""
        if not self.leading:
            return
        self.leading = False
        try:
            self.registry.release_leadership(self.namespace, self.holder)
        except Exception as exc:  # it expires by itself
            log.warning(
                "could not release namespace %s (a standby takes over when it expires): %s",
                self.namespace,
                exc,
            )

    def _current_leader(self) -> str | None:
        try:
            leader = self.registry.leader(self.namespace)
        except Exception:
            return None
        return None if leader is None else leader.holder


__all__ = ["ACT_WITHOUT_RENEWAL", "LeaderLock"]
