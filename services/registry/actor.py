"""Who is acting: the name the registry records as a job's submitter and in the audit trail.

The HTTP API sets it for each request to the name of the request's token (`acting_as(token.name)`),
the `pelt token` commands to `cli:<user>`; the registry reads it where it writes (`current_actor()`).
It is a context variable, so it follows a request into the thread that runs its route and never
reaches another request. Outside any `acting_as` (a direct library call) it is None.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_actor: ContextVar[str | None] = ContextVar("pelt_actor", default=None)


@contextmanager
def acting_as(name: str | None) -> Iterator[None]:
    """Within the block, the registry records `name` as the one who acts."""
    token = _actor.set(name)
    try:
        yield
    finally:
        _actor.reset(token)


def current_actor() -> str | None:
    """The name set by the innermost `acting_as`, or None."""
    return _actor.get()


__all__ = ["acting_as", "current_actor"]
