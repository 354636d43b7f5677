"""What the registry hands out: plain frozen dataclasses, detached from any database session."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from services.registry import models
from services.registry.presets import fingerprint


@dataclass(frozen=True)
class TaskRecord:
    """A registered task. `label_names` are the class names in index order (None for regression):
    given at registration, else a `datasets` ClassLabel's names, else the distinct label values as
    strings, sorted (integer labels 0..n-1 give "0".."n-1")."""

    id: int
    name: str
    source_kind: str  # "files" or "datasets"
    source: dict[str, str]  # files: {split: path}; datasets: {"path": folder}
    split_sizes: dict[str, int]
    train_size: int
    text_fields: list[str]
    label_field: str
    problem_type: str
    metric: str
    metric_direction: str  # "max" or "min"
    label_names: list[str] | None
    max_length: int
    description: str
    created_at: datetime

    @classmethod
    def of(cls, row: models.Task) -> TaskRecord:
        return cls(
            id=row.id,
            name=row.name,
            source_kind=row.source_kind,
            source=dict(row.source),
            split_sizes=dict(row.split_sizes),
            train_size=row.train_size,
            text_fields=list(row.text_fields),
            label_field=row.label_field,
            problem_type=row.problem_type,
            metric=row.metric,
            metric_direction=row.metric_direction,
            label_names=None if row.label_names is None else list(row.label_names),
            max_length=row.max_length,
            description=row.description,
            created_at=row.created_at,
        )


@dataclass(frozen=True)
class MethodRecord:
    """A method preset; `spec` is its pelt_core spec dict (`pelt_core.get_method(record.spec)`), a
    built-in's as pelt_core has it now. `fingerprint` names this version of the spec (see
    `presets.fingerprint`); a job records the fingerprint of the version it ran."""

    id: int
    name: str
    spec: dict[str, Any]
    builtin: bool
    description: str
    created_at: datetime
    fingerprint: str

    @classmethod
    def of(cls, row: models.Method, spec: dict[str, Any] | None = None) -> MethodRecord:
        """The record of a method row; a built-in's row holds no spec: pass pelt_core's."""
        spec = dict(row.spec if spec is None else spec)
        description = spec.get("description", "")
        return cls(row.id, row.name, spec, row.builtin, description, row.created_at, fingerprint(spec))


@dataclass(frozen=True)
class BackboneRecord:
    """A registered backbone: where it comes from, the hash of its content and its shape.

    `source`: what workers load (a packaged alias or the model's folder on the service's machine; the
    API shows a user-visible form instead). `facts`: {hidden_size, num_layers, num_heads, num_kv_heads,
    head_dim, intermediate_size, max_positions, vocab_size, num_parameters, model_type}, or None for a
    backbone registered before facts were kept."""

    id: int
    name: str
    source: str
    content_hash: str
    created_at: datetime
    facts: dict[str, Any] | None = None

    @classmethod
    def of(cls, row: models.Backbone) -> BackboneRecord:
        return cls(
            row.id,
            row.name,
            row.source,
            row.content_hash,
            row.created_at,
            None if row.facts is None else dict(row.facts),
        )


@dataclass(frozen=True)
class JobRecord:
    """One job. `attempts` counts the times it was started (claimed); the worker runs
    `method_spec` (overrides applied) with `train_config` (a resolved pelt_core.TrainConfig dict).
    `method_fingerprint`: the version of the method's preset it came from (before overrides).
    `device`: where it may run, `any`, `cpu` or `gpu` (which workers may claim it)."""

    id: int
    task: str
    method: str
    backbone: str
    sweep_id: int | None
    hyperparameters: dict[str, Any]
    train_config: dict[str, Any]
    method_spec: dict[str, Any]
    method_fingerprint: str
    seed: int
    k_shot: int | None
    priority: int
    device: str  # any, cpu or gpu (models.JOB_DEVICES)
    status: models.JobStatus
    attempts: int
    max_attempts: int
    not_before: datetime | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    heartbeat_at: datetime | None
    progress: float | None
    progress_detail: dict[str, Any] | None  # step, total, loss, tokens_per_second (the worker's last report)
    cancel_requested: bool
    last_error: str | None
    idempotency_key: str | None
    submitted_by: str | None  # the API token's name (None: not submitted through the API)
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @property
    def sources(self) -> list[dict[str, Any]] | None:
        """An AdapterFusion job's source deltas as its spec records them (task, version, sha256, method);
        None for any other job."""
        fusion = self.method_spec.get("fusion")
        if not fusion:
            return None
        return [{k: s.get(k) for k in ("task", "version", "sha256", "method")} for s in fusion["sources"]]

    @classmethod
    def of(cls, row: models.Job, names: tuple[str, str, str] | None = None) -> JobRecord:
        """The record of a job row; `names` (task, method, backbone) saves loading them."""
        task, method, backbone = names or (row.task.name, row.method.name, row.backbone.name)
        return cls(
            id=row.id,
            task=task,
            method=method,
            backbone=backbone,
            sweep_id=row.sweep_id,
            hyperparameters=dict(row.hyperparameters),
            train_config=dict(row.train_config),
            method_spec=dict(row.method_spec),
            method_fingerprint=row.method_fingerprint,
            seed=row.seed,
            k_shot=row.k_shot,
            priority=row.priority,
            device=row.device,
            status=models.JobStatus(row.status),
            attempts=row.attempts,
            max_attempts=row.max_attempts,
            not_before=row.not_before,
            lease_owner=row.lease_owner,
            lease_expires_at=row.lease_expires_at,
            heartbeat_at=row.heartbeat_at,
            progress=row.progress,
            progress_detail=None if row.progress_detail is None else dict(row.progress_detail),
            cancel_requested=row.cancel_requested,
            last_error=row.last_error,
            idempotency_key=row.idempotency_key,
            submitted_by=row.submitted_by,
            created_at=row.created_at,
            updated_at=row.updated_at,
            started_at=row.started_at,
            finished_at=row.finished_at,
        )


@dataclass(frozen=True)
class SweepRecord:
    """One submitted sweep and its jobs (ids in submission order: method, then seed, then K)."""

    id: int
    task: str
    backbone: str
    methods: list[str]
    seeds: list[int]
    k_values: list[int | None]
    hyperparameters: dict[str, Any]
    method_hyperparameters: dict[str, dict[str, Any]]
    priority: int
    idempotency_key: str | None
    created_at: datetime
    job_ids: list[int]
    already_submitted: bool = False  # the answer to a submit: this sweep existed, nothing was queued now
    submitted_by: str | None = None  # the API token's name (None: not submitted through the API)

    @classmethod
    def of(cls, row: models.Sweep, job_ids: list[int], already_submitted: bool = False) -> SweepRecord:
        return cls(
            id=row.id,
            task=row.task.name,
            backbone=row.backbone.name,
            methods=list(row.methods),
            seeds=list(row.seeds),
            k_values=list(row.k_values),
            hyperparameters=dict(row.hyperparameters),
            method_hyperparameters=dict(row.method_hyperparameters),
            priority=row.priority,
            idempotency_key=row.idempotency_key,
            created_at=row.created_at,
            job_ids=job_ids,
            already_submitted=already_submitted,
            submitted_by=row.submitted_by,
        )


@dataclass(frozen=True)
class ResultRecord:
    """What a succeeded job produced. `device`: where it trained ("cpu", "cuda:0 (NVIDIA H100 80GB
    HBM3)"; None when the worker did not say); `job_memory_bytes`: the job's own parameters, gradients
    and optimizer state there; `peak_memory_bytes`: the peak of its process (on a GPU, of its pack)."""

    id: int
    job_id: int
    metrics: dict[str, Any]
    primary_metric: float | None  # None: the job left its test set out (evaluate_test=false)
    trainable_params: int
    total_params: int | None
    trainable_percent: float
    train_seconds: float
    peak_memory_bytes: int | None
    job_memory_bytes: int | None
    device: str | None
    delta_uri: str | None
    delta_sha256: str | None
    mlflow_run_id: str | None
    mlflow_model_version: str | None
    worker_id: str | None
    attempt: int
    created_at: datetime
    # the study protocol's best dev evaluation (with "epoch" and "step") and its value of the task's
    # metric; None for a plain job (whose `metrics` are its only evaluation)
    dev_metrics: dict[str, Any] | None = None
    dev_primary_metric: float | None = None

    @classmethod
    def of(cls, row: models.Result) -> ResultRecord:
        return cls(
            id=row.id,
            job_id=row.job_id,
            metrics=dict(row.metrics),
            primary_metric=row.primary_metric,
            dev_metrics=None if row.dev_metrics is None else dict(row.dev_metrics),
            dev_primary_metric=row.dev_primary_metric,
            trainable_params=row.trainable_params,
            total_params=row.total_params,
            trainable_percent=row.trainable_percent,
            train_seconds=row.train_seconds,
            peak_memory_bytes=row.peak_memory_bytes,
            job_memory_bytes=row.job_memory_bytes,
            device=row.device,
            delta_uri=row.delta_uri,
            delta_sha256=row.delta_sha256,
            mlflow_run_id=row.mlflow_run_id,
            mlflow_model_version=row.mlflow_model_version,
            worker_id=row.worker_id,
            attempt=row.attempt,
            created_at=row.created_at,
        )


@dataclass(frozen=True)
class LossHistoryRecord:
    """A job's loss curve: the [step, loss] points its current attempt (`attempt`, 0 before the first
    claim) reported, steps increasing, at most `queue.LOSS_HISTORY_POINTS` (thinned evenly when full)."""

    job_id: int
    attempt: int
    points: list[tuple[int, float]]

    @classmethod
    def of(cls, row: models.Job) -> LossHistoryRecord:
        points = [(int(step), float(loss)) for step, loss in row.loss_history or []]
        return cls(job_id=row.id, attempt=row.attempts, points=points)


@dataclass(frozen=True)
class JobEventRecord:
    """One status change of a job (from_status None: the submit), or a cancel request. `reason` is one
    line without server paths; `detail` the full error behind it (a traceback), for admins only."""

    id: int
    job_id: int
    at: datetime
    from_status: str | None
    to_status: str
    reason: str
    worker_id: str | None
    detail: str | None

    @classmethod
    def of(cls, row: models.JobEvent) -> JobEventRecord:
        return cls(
            row.id, row.job_id, row.at, row.from_status, row.to_status, row.reason, row.worker_id, row.detail
        )


@dataclass(frozen=True)
class AuditEventRecord:
    """Who did what, when (see models.AuditEvent)."""

    id: int
    at: datetime
    actor: str | None
    action: str
    target: str
    detail: dict[str, Any]

    @classmethod
    def of(cls, row: models.AuditEvent) -> AuditEventRecord:
        return cls(row.id, row.at, row.actor, row.action, row.target, dict(row.detail))


__all__ = [
    "ApiTokenRecord",
    "AuditEventRecord",
    "BackboneRecord",
    "JobEventRecord",
    "JobRecord",
    "LossHistoryRecord",
    "MethodRecord",
    "ResultRecord",
    "SweepRecord",
    "TaskRecord",
]


@dataclass(frozen=True)
class ApiTokenRecord:
    """An API token, without its secret (only its hash is stored; `prefix` tells tokens apart)."""

    id: int
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None
    scope: str  # read < predict < write < admin (models.TOKEN_SCOPES)

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def allows(self, scope: str) -> bool:
        """Whether this token's scope includes `scope` (admin includes write, write includes read)."""
        return models.TOKEN_SCOPES.index(self.scope) >= models.TOKEN_SCOPES.index(scope)

    @classmethod
    def of(cls, row: models.ApiToken) -> ApiTokenRecord:
        return cls(
            id=row.id,
            name=row.name,
            prefix=row.prefix,
            created_at=row.created_at,
            revoked_at=row.revoked_at,
            last_used_at=row.last_used_at,
            scope=row.scope,
        )
