"""Errors of the delta store; each message says what exists or what to do."""

from __future__ import annotations

from collections.abc import Iterable


class DeltaStoreError(Exception):
    """Something about the MLflow delta store went wrong (`field`: the request field at fault, if any)."""

    def __init__(self, *args: object, field: str | None = None) -> None:
        super().__init__(*args)
        self.field = field


class StoreNotReadyError(DeltaStoreError):
    """MLflow's database is missing or behind the installed mlflow (run `pelt mlflow upgrade`)."""


class DeltaNotFoundError(DeltaStoreError, LookupError):
    """No delta matches the request: an unknown task, method, alias or version (the message lists what exists)."""

    def __init__(self, what: str, name: str, known: Iterable[str], where: str = "", hint: str = "") -> None:
        self.what, self.name, self.known = what, name, sorted({str(k) for k in known}, key=_natural)
        listing = ", ".join(self.known) if self.known else "none"
        plural = what + ("es" if what.endswith("s") else "s")
        place = f" {where}" if where else ""
        super().__init__(f"no {what} {name!r}{place}; known {plural}: {listing}{hint}")


class DeltaIntegrityError(DeltaStoreError):
    """A downloaded delta does not match its recorded sha256 (or its recorded hashes disagree)."""


class ComposeMemoryError(DeltaStoreError):
    """A composition needs more memory than PELT_COMPOSE_MEMORY_BYTES allows: estimated before anything is
    loaded, or its process ran out (a 413)."""


def _natural(text: str) -> tuple[int, int | str]:
    return (0, int(text)) if text.isdigit() else (1, text)


__all__ = [
    "ComposeMemoryError",
    "DeltaIntegrityError",
    "DeltaNotFoundError",
    "DeltaStoreError",
    "StoreNotReadyError",
]
