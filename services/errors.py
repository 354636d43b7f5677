"""Errors of the service layer and how each kind of error becomes an HTTP status.

Every error the API returns is JSON: {"error": {"status", "type", "field", "message"}}; `field` names
the offending input when there is one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.registry.errors import RegistryValidationError


class ServiceError(Exception):
    """An error the service raises on purpose, with its HTTP status."""

    def __init__(
        self, message: str, *, status: int = 400, field: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.retry_after = retry_after  # seconds: sent as Retry-After (a 503 for a resource that is busy now)


class TooLargeError(RegistryValidationError):
    """An upload or request body above its bound (PELT_MAX_UPLOAD_BYTES, PELT_MAX_REQUEST_BYTES)."""


@dataclass(frozen=True)
class ErrorView:
    status: int
    type: str
    message: str
    field: str | None = None
    headers: dict[str, str] | None = None  # e.g. Retry-After on a 503

    def body(self) -> dict:
        return {
            "error": {"status": self.status, "type": self.type, "field": self.field, "message": self.message}
        }


def expected_errors() -> tuple[type[Exception], ...]:
    """The error classes the service raises on purpose: the API answers them with `classify`'s view
    (from modules that import no torch: an API that never composes or predicts never loads it)."""
    from pelt_core.compose_options import CompositionError
    from pelt_core.config import ConfigError
    from pelt_core.delta_format import DeltaError
    from pelt_core.errors import BackboneError, DataError
    from pelt_core.spec import SpecError
    from services.delta_store.errors import DeltaStoreError
    from services.registry.errors import RegistryError

    return (
        ServiceError,
        RegistryError,
        DeltaStoreError,
        CompositionError,
        DeltaError,
        BackboneError,
        ConfigError,
        SpecError,
        DataError,
    )


def classify(exc: BaseException) -> ErrorView | None:
    """The HTTP view of an expected error (None: unexpected, a 500)."""
    from services.delta_store.errors import (
        ComposeMemoryError,
        DeltaIntegrityError,
        DeltaNotFoundError,
        StoreNotReadyError,
    )
    from services.registry.errors import (
        AlreadyExistsError,
        IdempotencyConflictError,
        JobStateError,
        NotFoundError,
        NotOwnerError,
        QuotaExceededError,
        RegistryBusyError,
        RegistryError,
        RegistryUnavailableError,
    )

    kind = type(exc).__name__
    if isinstance(exc, ServiceError):
        retry = (
            {"Retry-After": str(max(1, math.ceil(exc.retry_after)))} if exc.retry_after is not None else None
        )
        return ErrorView(exc.status, kind, str(exc), exc.field, headers=retry)
    if isinstance(exc, TooLargeError):
        return ErrorView(413, kind, str(exc), exc.field)
    if isinstance(exc, NotFoundError):
        return ErrorView(404, kind, str(exc), exc.field)
    if isinstance(exc, AlreadyExistsError | IdempotencyConflictError):
        return ErrorView(409, kind, str(exc), exc.field)
    if isinstance(exc, QuotaExceededError):
        return ErrorView(429, kind, str(exc), exc.field)
    if isinstance(exc, RegistryValidationError):
        return ErrorView(422, kind, str(exc), exc.field)
    if isinstance(exc, JobStateError):
        return ErrorView(409, kind, str(exc), "job_id")
    if isinstance(exc, NotOwnerError):  # another token's job or sweep: the admin scope's
        return ErrorView(403, kind, str(exc), exc.field)
    if isinstance(exc, RegistryBusyError):  # other writers held the database: nothing was written, try again
        return ErrorView(
            503, kind, str(exc), headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
        )
    if isinstance(exc, RegistryUnavailableError):  # restarting or unreachable: try again (see its docstring)
        if exc.maybe_written:  # no Retry-After: only a request that does nothing twice may be sent again
            return ErrorView(503, kind, str(exc))
        return ErrorView(
            503, kind, str(exc), headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
        )
    if isinstance(exc, ComposeMemoryError):  # a composition above PELT_COMPOSE_MEMORY_BYTES
        return ErrorView(413, kind, str(exc), exc.field)
    if isinstance(exc, DeltaNotFoundError):
        return ErrorView(404, kind, str(exc), getattr(exc, "field", None))
    if isinstance(exc, StoreNotReadyError):  # its message names the store's URI: for the operator's log only
        return ErrorView(503, kind, "the delta store is not ready: an operator runs `pelt mlflow upgrade`")
    if isinstance(exc, DeltaIntegrityError):
        return ErrorView(500, kind, str(exc))
    if isinstance(exc, expected_errors()) and not isinstance(
        exc, RegistryError
    ):  # pelt_core/store: bad input
        return ErrorView(422, kind, str(exc), getattr(exc, "field", None))
    return None


__all__ = ["ErrorView", "ServiceError", "TooLargeError", "classify", "expected_errors"]
