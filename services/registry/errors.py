"""Errors of the registry: bad input names its field; a missing thing lists what exists."""

from __future__ import annotations

from collections.abc import Iterable


class RegistryError(Exception):
    """Base class of every error the registry raises on purpose."""


class RegistryValidationError(RegistryError, ValueError):
    """Bad input; nothing was written. `field` names the offending field (as the caller spelled it)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        text = message if message.startswith(f"{field}:") else f"{field}: {message}"
        super().__init__(text)


class NotFoundError(RegistryValidationError, LookupError):
    """A named task, method, backbone, job or sweep does not exist; the message lists what does."""

    kind = "object"

    def __init__(
        self, field: str, name: object, existing: Iterable[object] = (), *, listing: bool = True
    ) -> None:
        self.name = name
        self.existing = [str(item) for item in existing]
        message = f"unknown {self.kind} {name!r}"
        if listing:
            message += f"; known {self.kind}s: {_short_list(self.existing)}"
        super().__init__(field, message)


class UnknownTaskError(NotFoundError):
    kind = "task"


class UnknownMethodError(NotFoundError):
    kind = "method"


class UnknownBackboneError(NotFoundError):
    kind = "backbone"


class UnknownJobError(NotFoundError):
    kind = "job"

    def __init__(self, job_id: object) -> None:
        super().__init__("job_id", job_id, listing=False)


class UnknownSweepError(NotFoundError):
    kind = "sweep"

    def __init__(self, sweep_id: object) -> None:
        super().__init__("sweep_id", sweep_id, listing=False)


class AlreadyExistsError(RegistryValidationError):
    """A different definition is already registered under this name."""


class IdempotencyConflictError(RegistryValidationError):
    """An idempotency key was reused for a different request."""

    def __init__(self, key: str, what: str) -> None:
        self.key = key
        super().__init__("idempotency_key", f"{key!r} was already used for a different {what}")


class QuotaExceededError(RegistryValidationError):
    """A submit would take its token past the cap on queued jobs (PELT_MAX_QUEUED_JOBS_PER_TOKEN); nothing
    was written."""


class NotOwnerError(RegistryError):
    """The current actor may not act on a job or sweep another token submitted (cancelling one needs the
    `admin` scope); nothing was changed. `owner`: who submitted it (None: submitted without a token)."""

    def __init__(self, what: str, owner: str | None, actor: str | None) -> None:
        self.owner = owner
        self.field = "Authorization"
        whose = f"token {owner!r}" if owner is not None else "no token (from the registry's own machine)"
        who = f"token {actor!r}" if actor is not None else "a caller without a token"
        super().__init__(
            f"{what} was submitted by {whose}: {who} may cancel only what it submitted; cancelling "
            "another token's job or sweep needs a token with the 'admin' scope"
        )


class JobStateError(RegistryError):
    """The job is not in a state that allows this operation (e.g. completing a cancelled job)."""

    def __init__(self, job_id: int, message: str) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id}: {message}")


class LeaseLostError(JobStateError):
    """The caller no longer holds the job's lease (it expired and was taken back, or the job ended)."""


class RegistryBusyError(RegistryError, TimeoutError):
    """No write turn within the busy timeout (PELT_DB_BUSY_TIMEOUT_SECONDS): other writers held the database
    (SQLite's one writer at a time). Nothing was written; the same call may be tried again after
    `retry_after` seconds (the API answers 503 with a Retry-After header)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        self.retry_after = retry_after
        super().__init__(f"the registry is busy: {message}; try again in {retry_after:g} s")


class RegistryUnavailableError(RegistryError, ConnectionError):
    """The registry's database did not answer (restarting, unreachable, or it dropped the connection).

    `maybe_written` is False when the transaction never reached its commit: nothing was written and the
    same call may be tried again after `retry_after` seconds (the API answers 503 with Retry-After). It is
    True when the connection broke during the commit: the write may have landed, so only a call that
    does nothing twice (a completion, a submission with an idempotency key) may be repeated."""

    def __init__(self, message: str, *, maybe_written: bool = False, retry_after: float = 5.0) -> None:
        self.maybe_written, self.retry_after = maybe_written, retry_after
        outcome = "it may have been written" if maybe_written else "nothing was written"
        super().__init__(f"the registry's database did not answer ({message}); {outcome}")


class SchemaOutOfDateError(RegistryError, RuntimeError):
    """The database's schema revision is not the one this code needs."""


def _short_list(names: list[str], limit: int = 25) -> str:
    if not names:
        return "(none)"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, … and {len(names) - limit} more"


__all__ = [
    "AlreadyExistsError",
    "IdempotencyConflictError",
    "JobStateError",
    "LeaseLostError",
    "NotFoundError",
    "NotOwnerError",
    "QuotaExceededError",
    "RegistryBusyError",
    "RegistryError",
    "RegistryUnavailableError",
    "RegistryValidationError",
    "SchemaOutOfDateError",
    "UnknownBackboneError",
    "UnknownJobError",
    "UnknownMethodError",
    "UnknownSweepError",
    "UnknownTaskError",
]
