"""The registry: the service's memory and its durable job queue (SQLAlchemy; SQLite or PostgreSQL).

    from services.registry import Registry
    registry = Registry()                      # PELT_DATABASE_URL, or SQLite under PELT_DATA_DIR
    registry.register_task("sst2", "data/sst2/train.jsonl", text_fields=["sentence"])
    registry.submit_sweep("sst2", ["lora", "bitfit"], seeds=[0, 1, 2], k_values=[16, None], backbone="minilm")
    job = registry.claim_job("worker-1")

Only this package speaks SQL; everything else calls `Registry`.

Its names are imported on first use (PEP 562): a process that needs one module of the package (the dataset
probe's sandboxed child reads files, it speaks no SQL) does not pay for SQLAlchemy and Alembic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.registry.actor import acting_as, current_actor
    from services.registry.db import check_schema_current, downgrade, head_revision, make_engine, upgrade
    from services.registry.errors import (
        AlreadyExistsError,
        IdempotencyConflictError,
        JobStateError,
        LeaseLostError,
        NotFoundError,
        NotOwnerError,
        QuotaExceededError,
        RegistryBusyError,
        RegistryError,
        RegistryUnavailableError,
        RegistryValidationError,
        SchemaOutOfDateError,
        UnknownBackboneError,
        UnknownJobError,
        UnknownMethodError,
        UnknownSweepError,
        UnknownTaskError,
    )
    from services.registry.leaderboard import LeaderboardRow
    from services.registry.models import JobStatus
    from services.registry.records import (
        ApiTokenRecord,
        AuditEventRecord,
        BackboneRecord,
        JobEventRecord,
        JobRecord,
        LossHistoryRecord,
        MethodRecord,
        ResultRecord,
        SweepRecord,
        TaskRecord,
    )
    from services.registry.registry import Registry
    from services.registry.search_rows import SearchRecord, SearchTrialRecord, UnknownSearchError

_HOMES = {
    "AlreadyExistsError": "services.registry.errors",
    "ApiTokenRecord": "services.registry.records",
    "AuditEventRecord": "services.registry.records",
    "BackboneRecord": "services.registry.records",
    "IdempotencyConflictError": "services.registry.errors",
    "JobEventRecord": "services.registry.records",
    "JobRecord": "services.registry.records",
    "JobStateError": "services.registry.errors",
    "JobStatus": "services.registry.models",
    "LeaderboardRow": "services.registry.leaderboard",
    "LeaseLostError": "services.registry.errors",
    "LossHistoryRecord": "services.registry.records",
    "MethodRecord": "services.registry.records",
    "NotFoundError": "services.registry.errors",
    "NotOwnerError": "services.registry.errors",
    "QuotaExceededError": "services.registry.errors",
    "Registry": "services.registry.registry",
    "RegistryBusyError": "services.registry.errors",
    "RegistryError": "services.registry.errors",
    "RegistryUnavailableError": "services.registry.errors",
    "RegistryValidationError": "services.registry.errors",
    "ResultRecord": "services.registry.records",
    "SchemaOutOfDateError": "services.registry.errors",
    "SearchRecord": "services.registry.search_rows",
    "SearchTrialRecord": "services.registry.search_rows",
    "SweepRecord": "services.registry.records",
    "TaskRecord": "services.registry.records",
    "UnknownBackboneError": "services.registry.errors",
    "UnknownJobError": "services.registry.errors",
    "UnknownMethodError": "services.registry.errors",
    "UnknownSearchError": "services.registry.search_rows",
    "UnknownSweepError": "services.registry.errors",
    "UnknownTaskError": "services.registry.errors",
    "acting_as": "services.registry.actor",
    "check_schema_current": "services.registry.db",
    "current_actor": "services.registry.actor",
    "downgrade": "services.registry.db",
    "head_revision": "services.registry.db",
    "make_engine": "services.registry.db",
    "upgrade": "services.registry.db",
}

__all__ = [
    "AlreadyExistsError",
    "ApiTokenRecord",
    "AuditEventRecord",
    "BackboneRecord",
    "IdempotencyConflictError",
    "JobEventRecord",
    "JobRecord",
    "JobStateError",
    "JobStatus",
    "LeaderboardRow",
    "LeaseLostError",
    "LossHistoryRecord",
    "MethodRecord",
    "NotFoundError",
    "NotOwnerError",
    "QuotaExceededError",
    "Registry",
    "RegistryBusyError",
    "RegistryError",
    "RegistryUnavailableError",
    "RegistryValidationError",
    "ResultRecord",
    "SchemaOutOfDateError",
    "SearchRecord",
    "SearchTrialRecord",
    "SweepRecord",
    "TaskRecord",
    "UnknownBackboneError",
    "UnknownJobError",
    "UnknownMethodError",
    "UnknownSearchError",
    "UnknownSweepError",
    "UnknownTaskError",
    "acting_as",
    "check_schema_current",
    "current_actor",
    "downgrade",
    "head_revision",
    "make_engine",
    "upgrade",
]


def __getattr__(name: str) -> Any:
    """A name of the package, imported from its module on first use."""
    try:
        module = _HOMES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
