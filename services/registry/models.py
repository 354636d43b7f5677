"""ORM models of the registry (SQLAlchemy 2, typed). The migrations in `migrations/` create this schema.

Portable across SQLite and PostgreSQL: JSON columns, timestamps stored as UTC (timezone-aware in
Python, `timestamptz` on PostgreSQL, ISO text on SQLite), constraint names from a naming convention.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from pelt_core.vocabulary import DIRECTIONS, PROBLEM_TYPES

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class JobStatus(enum.StrEnum):
    """A job's state. queued → running → succeeded | failed | cancelled (running → queued on retry)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
SEARCH_STATUSES = ("running", "succeeded", "failed", "cancelled")  # running → one of the other three
SOURCE_KINDS = ("files", "datasets")
TOKEN_SCOPES = ("read", "predict", "write", "admin")  # each scope includes the ones before it
JOB_DEVICES = ("any", "cpu", "gpu")  # what a job needs to run on; `any`: either
DEFAULT_JOB_DEVICE = "any"


def _in(column: str, values: tuple[str, ...] | list[str]) -> str:
    return f"{column} IN ({', '.join(repr(str(v)) for v in values)})"


def idempotency_key_scopes(table: str) -> tuple[UniqueConstraint, Index]:
    """An idempotency key is unique per submitter: per (submitted_by, key) for what a token submitted, and
    per key among what was submitted without a token (a unique constraint never matches NULLs, so those
    rows get a partial unique index of their own)."""
    without_token = text("submitted_by IS NULL")
    return (
        UniqueConstraint("submitted_by", "idempotency_key"),
        Index(
            f"uq_{table}_idempotency_key_without_token",
            "idempotency_key",
            unique=True,
            sqlite_where=without_token,
            postgresql_where=without_token,
        ),
    )


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend (naive values are refused)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: registry timestamps must be timezone-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy reads this class attribute
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
    }


class Task(Base):
    """A dataset plus what to predict and how to score it."""

    __tablename__ = "tasks"
    __table_args__ = (
        CheckConstraint(_in("problem_type", PROBLEM_TYPES), name="problem_type"),
        CheckConstraint(_in("metric_direction", DIRECTIONS), name="metric_direction"),
        CheckConstraint(_in("source_kind", SOURCE_KINDS), name="source_kind"),
        CheckConstraint("max_length >= 1", name="max_length"),
        CheckConstraint("train_size >= 1", name="train_size"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    source_kind: Mapped[str] = mapped_column(String(16))
    source: Mapped[dict[str, Any]]  # files: {split: path}; datasets: {"path": folder}
    split_sizes: Mapped[dict[str, Any]]  # {split: rows}
    train_size: Mapped[int] = mapped_column(Integer)
    text_fields: Mapped[list[Any]]
    label_field: Mapped[str] = mapped_column(String(200))
    problem_type: Mapped[str] = mapped_column(String(40))
    metric: Mapped[str] = mapped_column(String(100))
    metric_direction: Mapped[str] = mapped_column(String(3))
    label_names: Mapped[list[Any] | None]
    max_length: Mapped[int] = mapped_column(Integer)
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime]


class Method(Base):
    """A PELT method preset. A user preset's row holds its spec; a built-in's holds its name only (the
    spec is read from pelt_core.methods at run time; the row exists for jobs to point at)."""

    __tablename__ = "methods"
    __table_args__ = (
        CheckConstraint(
            "(builtin AND spec IS NULL) OR (NOT builtin AND spec IS NOT NULL)", name="builtin_spec"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    spec: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))  # None for built-ins
    builtin: Mapped[bool] = mapped_column(Boolean, default=False)
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime]


class Backbone(Base):
    """A frozen pretrained model every job's delta is trained on top of. `source` is what workers load: a
    packaged alias or the model's resolved folder (never shown by the API); `facts` its shape from its
    config (hidden_size, num_layers, ...; None for rows registered before facts were kept)."""

    __tablename__ = "backbones"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    source: Mapped[str] = mapped_column(Text)
    content_hash: Mapped[str] = mapped_column(String(200))
    facts: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime]


class Sweep(Base):
    """One submit of methods × seeds × K values for one task and backbone, by `submitted_by` (the token
    whose jobs they all are). Its idempotency key is unique per submitter (`idempotency_key_scopes`)."""

    __tablename__ = "sweeps"
    __table_args__ = idempotency_key_scopes("sweeps")

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"), index=True)
    backbone_id: Mapped[int] = mapped_column(ForeignKey("backbones.id"))
    methods: Mapped[list[Any]]
    seeds: Mapped[list[Any]]
    k_values: Mapped[list[Any]]  # null entries mean the full training set
    hyperparameters: Mapped[dict[str, Any]]
    method_hyperparameters: Mapped[dict[str, Any]]
    priority: Mapped[int] = mapped_column(Integer, default=0)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))  # unique per submitter
    submitted_by: Mapped[str | None] = mapped_column(String(200))  # the API token's name (None: no token)
    created_at: Mapped[datetime]

    task: Mapped[Task] = relationship()
    backbone: Mapped[Backbone] = relationship()


class Job(Base):
    """One training run: the durable queue entry, its lease and its state. `device` is where it may run
    (JOB_DEVICES: `any`, `cpu`, `gpu`): placement, which workers may claim it, not part of what it is."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(_in("status", list(JobStatus)), name="status"),
        CheckConstraint("attempts >= 0", name="attempts"),
        CheckConstraint("max_attempts >= 1", name="max_attempts"),
        CheckConstraint("progress IS NULL OR (progress >= 0 AND progress <= 1)", name="progress"),
        CheckConstraint(_in("device", JOB_DEVICES), name="device"),
        # queue order first; `device` last, so a claim's device filter is checked in the index
        Index("ix_jobs_queue", "status", "priority", "created_at", "device"),
        Index("ix_jobs_lease", "status", "lease_expires_at"),
        Index("ix_jobs_task_k", "task_id", "k_shot"),
        Index("ix_jobs_submitted_by_status", "submitted_by", "status"),
        *idempotency_key_scopes("jobs"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"))
    method_id: Mapped[int] = mapped_column(ForeignKey("methods.id"))
    backbone_id: Mapped[int] = mapped_column(ForeignKey("backbones.id"))
    sweep_id: Mapped[int | None] = mapped_column(ForeignKey("sweeps.id"), index=True)
    hyperparameters: Mapped[dict[str, Any]]  # as submitted (training names canonical)
    train_config: Mapped[dict[str, Any]]  # the resolved pelt_core.TrainConfig
    method_spec: Mapped[dict[str, Any]]  # the resolved method spec, overrides applied
    method_fingerprint: Mapped[str] = mapped_column(String(16))  # the base preset's version (presets.py)
    seed: Mapped[int] = mapped_column(Integer)
    k_shot: Mapped[int | None] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    device: Mapped[str] = mapped_column(
        String(8), default=DEFAULT_JOB_DEVICE, server_default=DEFAULT_JOB_DEVICE
    )
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer)
    not_before: Mapped[datetime | None]
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    progress: Mapped[float | None] = mapped_column(Float)  # fraction done, in [0, 1]
    progress_detail: Mapped[dict[str, Any] | None]  # the worker's last report: step, total, loss, tokens/s
    # [[step, loss], ...] of the current attempt (at most 256): loaded only where read (the loss route, a
    # heartbeat adding points), so that job lists and records do not parse every job's curve
    loss_history: Mapped[list[Any] | None] = mapped_column(deferred=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    last_error: Mapped[str | None] = mapped_column(Text)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))  # unique per submitter
    submitted_by: Mapped[str | None] = mapped_column(
        String(200)
    )  # the API token's name (None: not via the API)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    task: Mapped[Task] = relationship()
    method: Mapped[Method] = relationship()
    backbone: Mapped[Backbone] = relationship()
    result: Mapped[Result | None] = relationship(back_populates="job", uselist=False)


class Result(Base):
    """What a succeeded job produced (at most one per job). `device`: where it trained, as the worker
    describes it ("cpu", "cuda:0 (NVIDIA H100 80GB HBM3)"); `job_memory_bytes`: the job's own parameters,
    gradients and optimizer state there (`peak_memory_bytes`: the process's or its pack's peak)."""

    __tablename__ = "results"
    __table_args__ = (CheckConstraint("trainable_params >= 0", name="trainable_params"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), unique=True)
    metrics: Mapped[dict[str, Any]]  # on the task's evaluation split (the protocol's test set)
    # None: the job left its test set out (`evaluate_test=false`: a search's early rung, ranked on dev)
    primary_metric: Mapped[float | None] = mapped_column(Float)
    # the study protocol's best dev evaluation (with its epoch and step); None for a plain job
    dev_metrics: Mapped[dict[str, Any] | None]
    dev_primary_metric: Mapped[float | None] = mapped_column(Float)
    trainable_params: Mapped[int] = mapped_column(BigInteger)
    total_params: Mapped[int | None] = mapped_column(BigInteger)
    trainable_percent: Mapped[float] = mapped_column(Float)
    train_seconds: Mapped[float] = mapped_column(Float)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    device: Mapped[str | None] = mapped_column(String(200))
    job_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    delta_uri: Mapped[str | None] = mapped_column(Text)
    delta_sha256: Mapped[str | None] = mapped_column(String(64))
    mlflow_run_id: Mapped[str | None] = mapped_column(String(100))
    mlflow_model_version: Mapped[str | None] = mapped_column(String(100))
    worker_id: Mapped[str | None] = mapped_column(String(200))
    attempt: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime]

    job: Mapped[Job] = relationship(back_populates="result")


class JobEvent(Base):
    """One status change of a job (or a cancel request), with its time and reason."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime]
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    worker_id: Mapped[str | None] = mapped_column(String(200))
    detail: Mapped[str | None] = mapped_column(
        Text
    )  # the full error behind `reason` (a traceback): admins only


class ApiToken(Base):
    """A bearer token of the HTTP API. Only its SHA-256 is stored; the secret is shown once, at creation."""

    __tablename__ = "api_tokens"
    __table_args__ = (CheckConstraint(_in("scope", TOKEN_SCOPES), name="scope"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    scope: Mapped[str] = mapped_column(String(16))  # read < predict < write < admin (TOKEN_SCOPES)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # the secret's first characters, to tell tokens apart
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]


class DispatcherLeader(Base):
    """Which dispatcher leads a Ray namespace: the one holding an unexpired row (renewed while it leads).
    Every other dispatcher of the namespace waits as a standby and takes over once the row expires."""

    __tablename__ = "dispatcher_leaders"

    namespace: Mapped[str] = mapped_column(String(200), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))  # "<host>:<pid>:<random>" of the leading dispatcher
    acquired_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    # the largest job budget of its workers, per kind ({"cpu": bytes, "gpu": bytes}); None: not known yet
    worker_memory: Mapped[dict[str, Any] | None]


class AuditEvent(Base):
    """Who did what: a submit, cancel, composition, registration or token change, written in the same
    transaction as the action (`actor`: the API token's name, `cli:<user>` for commands run next to the
    registry, None for direct library calls)."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(index=True)
    actor: Mapped[str | None] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(50))  # e.g. job.submit, token.revoke
    target: Mapped[str] = mapped_column(String(300))  # what it acted on: a name or an id
    detail: Mapped[dict[str, Any]]


class Search(Base):
    """A budget-aware method search on one task (services/registry/searches.py): the successive-halving
    schedule its budget bought, the configurations it draws, and, once it ended, what it chose. Its jobs
    and their rungs are its `SearchTrial` rows; its state is all here, so a restarted service resumes it."""

    __tablename__ = "searches"
    __table_args__ = (
        CheckConstraint(_in("status", SEARCH_STATUSES), name="status"),
        *idempotency_key_scopes("searches"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"), index=True)
    backbone_id: Mapped[int] = mapped_column(ForeignKey("backbones.id"))
    status: Mapped[str] = mapped_column(String(16), default="running", index=True)
    budget: Mapped[float] = mapped_column(Float)  # full-job equivalents
    k_shot: Mapped[int] = mapped_column(Integer)
    dev_rows: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(Integer)  # draws the configurations
    methods: Mapped[list[Any]]
    hyperparameters: Mapped[dict[str, Any]]  # fixed for every job, as given
    schedule: Mapped[dict[str, Any]]  # search_plan.Schedule.to_dict()
    space: Mapped[dict[str, Any]]  # method -> {hyperparameter: what it is drawn from}
    configurations: Mapped[list[Any]]  # [{index, method, hyperparameters}] drawn at the start
    fingerprints: Mapped[dict[str, Any]]  # method -> the preset version its jobs run (a changed one fails it)
    chosen: Mapped[dict[str, Any] | None]  # the answer, once it succeeded
    last_error: Mapped[str | None] = mapped_column(Text)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))  # unique per submitter
    submitted_by: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]

    task: Mapped[Task] = relationship()
    backbone: Mapped[Backbone] = relationship()


class SearchTrial(Base):
    """One job of a search: a configuration at a rung (the last rung: one row per seed)."""

    __tablename__ = "search_trials"
    __table_args__ = (UniqueConstraint("search_id", "configuration", "rung", "seed"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    search_id: Mapped[int] = mapped_column(ForeignKey("searches.id", ondelete="CASCADE"), index=True)
    configuration: Mapped[int] = mapped_column(Integer)  # its index in Search.configurations
    rung: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(Integer)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), unique=True)

    job: Mapped[Job] = relationship()


__all__ = [
    "DEFAULT_JOB_DEVICE",
    "JOB_DEVICES",
    "SEARCH_STATUSES",
    "SOURCE_KINDS",
    "TERMINAL_STATUSES",
    "TOKEN_SCOPES",
    "ApiToken",
    "AuditEvent",
    "Backbone",
    "Base",
    "DispatcherLeader",
    "Job",
    "JobEvent",
    "JobStatus",
    "Method",
    "Result",
    "Search",
    "SearchTrial",
    "Sweep",
    "Task",
    "UTCDateTime",
    "utcnow",
]
