"""The registry: the service's memory and its durable job queue (SQLAlchemy; SQLite or PostgreSQL).

    from services.registry import Registry
    registry = Registry()                      # PELT_DATABASE_URL, or SQLite under PELT_DATA_DIR
    registry.register_task("sst2", "data/sst2/train.jsonl", text_fields=["sentence"])
    registry.submit_sweep("sst2", ["lora", "bitfit"], seeds=[0, 1, 2], k_values=[16, None], backbone="minilm")
    job = registry.claim_job("worker-1")

Only this package speaks SQL; everything else calls `Registry`.
"""

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
    "RegistryValidationError",
    "ResultRecord",
    "SchemaOutOfDateError",
    "SweepRecord",
    "TaskRecord",
    "UnknownBackboneError",
    "UnknownJobError",
    "UnknownMethodError",
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
