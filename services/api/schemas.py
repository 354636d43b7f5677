"""Request and response bodies of the HTTP API (pydantic). Requests refuse unknown fields, so a typo is
a 422 naming it rather than a setting silently ignored. Responses mirror the registry's records."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pelt_core.limits import (
    INT32_MAX,
    MAX_COMPOSE_ALIASES,
    MAX_COMPOSE_SOURCES,
    MAX_PREDICT_ROWS,
    MAX_PREDICT_TEXT_CHARS,
    SEED,
    SWEEP_LIST_LENGTH,
    TRAIN_RANGES,
)
from pelt_core.vocabulary import (
    COMPOSE_OPERATIONS,
    DEFAULT_METRIC_HELP,
    DIRECTIONS,
    METRIC_HELP,
    PROBLEM_TYPES,
)
from services.registry.leaderboard import INTERVAL, TIE_TEST

ID = Field(ge=1, le=INT32_MAX)
NAME = Field(min_length=1, max_length=100)
DEFAULT_BACKBONE = "all-minilm-l6-v2"
# simple bounds from the table of limits (pelt_core/limits.py); the registry applies the whole table
Seed = Annotated[int, Field(ge=SEED.low, le=SEED.high)]
KShot = Annotated[int, Field(ge=TRAIN_RANGES["k_shot"].low, le=TRAIN_RANGES["k_shot"].high)]
MAX_LENGTH = TRAIN_RANGES["max_length"]
# where a job may run; services.registry.models.JOB_DEVICES (kept here too, so that the client does not
# import SQLAlchemy; tests/api/test_api.py keeps the two equal)
JOB_DEVICES = ("any", "cpu", "gpu")
JobDevice = Literal[JOB_DEVICES]  # a Literal of each name in the tuple
DEVICE_HELP = "where the job may run: any (default: a GPU worker where the cluster has GPUs, else a CPU worker), cpu or gpu"


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Response(BaseModel):
    model_config = ConfigDict(from_attributes=True)


# --- requests -------------------------------------------------------------------------------------


class TaskDefinition(Request):
    """The part of a task registration that is not data (sent as the `definition` form field, JSON)."""

    text_fields: list[str] | str | None = Field(
        default=None,
        description="column(s) holding the text, one or two (default: GLUE-style names detected in the data)",
    )
    label_field: str = "label"
    problem_type: Literal[PROBLEM_TYPES] | None = Field(  # a Literal of each name in the tuple
        default=None,
        description="default: told by the labels (lists: multi-label; numbers with a fractional part: "
        "regression; anything else: single-label classification)",
    )
    metric: str | None = Field(
        default=None,
        description=f"the primary metric, by name or alias (default: {DEFAULT_METRIC_HELP}; it must apply "
        f"to the problem type): {METRIC_HELP}",
    )
    metric_direction: Literal[DIRECTIONS] | None = Field(
        default=None, description="optional: checked against the metric's own direction"
    )
    label_names: list[str] | None = None
    max_length: int = Field(
        default=128,
        ge=MAX_LENGTH.low,
        le=MAX_LENGTH.high,
        description="tokens kept per example, the jobs' default (cut to a backbone's positions)",
    )
    description: str = Field(default="", max_length=10_000)


class MethodIn(Request):
    spec: dict[str, Any] = Field(
        description="a method spec: {name, modules: [...], ...} (see `pelt methods`)"
    )
    replace: bool = False


class BackboneIn(Request):
    name: str = NAME
    source: str | None = Field(
        default=None,
        max_length=1000,
        description="a packaged alias, or a model folder inside one of the service's backbone "
        "folders (PELT_BACKBONE_DIRS), relative to it or absolute; default: name",
    )


class JobIn(Request):
    task: str = NAME
    method: str = NAME
    backbone: str = Field(default=DEFAULT_BACKBONE, min_length=1, max_length=100)
    hyperparameters: dict[str, Any] = Field(
        default_factory=dict, description="training settings and method overrides, e.g. lr, epochs, r"
    )
    seed: Seed = 0
    k_shot: KShot | None = None
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    max_attempts: int | None = Field(default=None, ge=1, le=100)
    idempotency_key: str | None = Field(
        default=None,
        max_length=200,
        description="the same key returns the job it made (whatever its device: placement, not identity)",
    )
    device: JobDevice = Field(default="any", description=DEVICE_HELP)


class FusionIn(Request):
    task: str = Field(min_length=1, max_length=100, description="the target task")
    sources: list[str] = Field(
        min_length=1,
        max_length=16,
        description="stored adapter deltas to fuse, as pulled: 'sst2' (its best), 'sst2@best-pfeiffer', 'sst2/3'",
    )
    own_adapter: bool = Field(
        default=False, description="train the target's own adapter alongside the fusion"
    )
    backbone: str | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        description="default: the backbone the sources were trained on",
    )
    hyperparameters: dict[str, Any] = Field(
        default_factory=dict, description="training settings, e.g. lr (default 5e-5, the paper's), epochs"
    )
    seed: Seed = 0
    k_shot: KShot | None = None
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    max_attempts: int | None = Field(default=None, ge=1, le=100)
    idempotency_key: str | None = Field(default=None, max_length=200)
    device: JobDevice = Field(default="any", description=DEVICE_HELP)


class SweepIn(Request):
    task: str = NAME
    methods: list[str] = Field(min_length=1, max_length=SWEEP_LIST_LENGTH)
    backbone: str = Field(default=DEFAULT_BACKBONE, min_length=1, max_length=100)
    seeds: list[Seed] = Field(default_factory=lambda: [0], min_length=1, max_length=SWEEP_LIST_LENGTH)
    k_values: list[KShot | None] = Field(
        default_factory=lambda: [None], min_length=1, max_length=SWEEP_LIST_LENGTH
    )
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    method_hyperparameters: dict[str, dict[str, Any]] = Field(default_factory=dict)
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    max_attempts: int | None = Field(default=None, ge=1, le=100)
    idempotency_key: str | None = Field(default=None, max_length=200)
    device: JobDevice = Field(default="any", description=f"{DEVICE_HELP}; applies to every job")
    again: bool = Field(
        default=False,
        description="queue new runs even when the same sweep was already submitted (else that sweep is "
        "the answer, with already_submitted true); not with an idempotency_key",
    )


class SearchIn(Request):
    task: str = NAME
    budget: float = Field(
        gt=0, le=10_000, description="full-job equivalents: one job at the search's full epochs on K rows"
    )
    methods: list[str] | None = Field(
        default=None,
        min_length=1,
        max_length=SWEEP_LIST_LENGTH,
        description="the methods to search over (default: bitfit, lora, pfeiffer, prefix, unipelt)",
    )
    backbone: str = Field(default=DEFAULT_BACKBONE, min_length=1, max_length=100)
    k_shot: KShot | None = Field(default=None, description="default: min(500, half the training rows)")
    dev_rows: int | None = Field(
        default=None,
        ge=1,
        le=INT32_MAX,
        description="the dev split rungs rank by; default: min(500, rows left)",
    )
    hyperparameters: dict[str, Any] = Field(
        default_factory=dict,
        description="fixed for every job and left out of the search space (epochs: the full epochs)",
    )
    seeds: int = Field(default=3, ge=2, le=10, description="seeds of each survivor of the last rung")
    seed: int = Field(default=0, ge=0, le=INT32_MAX, description="draws the configurations")
    idempotency_key: str | None = Field(default=None, max_length=200)


class SearchTrialOut(Response):
    configuration: int
    method: str
    hyperparameters: dict[str, Any]
    rung: int
    epochs: float
    seed: int
    job_id: int
    status: str
    dev: float | None = Field(description="the dev split's primary metric: what the rungs rank by")
    test: float | None = Field(
        description="the evaluation split's primary metric; null for the rungs before the last (their jobs "
        "leave the test set out)"
    )
    cost: float = Field(description="full-job equivalents")
    finished_at: datetime | None


class SearchOut(Response):
    id: int
    task: str
    metric: str
    metric_direction: str
    backbone: str
    status: Literal["running", "succeeded", "failed", "cancelled"]
    budget: float
    k_shot: int
    dev_rows: int
    methods: list[str]
    hyperparameters: dict[str, Any]
    schedule: dict[str, Any] = Field(description="the rungs: configurations, seeds and epochs of each")
    space: dict[str, Any] = Field(description="per method: each hyperparameter and what it is drawn from")
    configurations: int
    rung: int
    planned_cost: float
    spent: float
    chosen: dict[str, Any] | None = Field(
        description="once succeeded: the configuration with the best mean dev score over the last rung's "
        "seeds, its test mean and 95% interval, its jobs and its leaderboard row (config_id)"
    )
    last_error: str | None
    submitted_by: str | None
    created_at: datetime
    finished_at: datetime | None
    trials: list[SearchTrialOut]
    best_so_far: list[dict[str, float | int]] = Field(
        description="the best dev score against the budget spent: one point per job as the jobs ended "
        "({spent, dev: the best so far, job_id: the job that ended there})"
    )


TextPair = Annotated[list[str], Field(min_length=2, max_length=2, description="[text, text_pair]")]


class PredictIn(Request):
    texts: list[str | TextPair] = Field(
        description=f"the rows: texts, or [text, text_pair] pairs for a task trained on pairs; at most "
        f"{MAX_PREDICT_ROWS} (413 beyond), each text at most {MAX_PREDICT_TEXT_CHARS:,} characters"
    )
    version: str | None = Field(
        default=None,
        max_length=100,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="which version answers: an alias (best, best-lora, one you set) or a version number; "
        "default best",
    )


class PredictOut(Response):
    task: str
    version: str = Field(description="the version that answered")
    method: str | None = Field(description="the method it was trained with")
    kind: str = Field(description="job, composed or imported")
    backbone: str
    sha256: str = Field(description="of the delta file that answered, as the store recorded it")
    predictions: list[dict[str, Any]] = Field(
        description="one per row, in order: {label, score} (single-label), {labels, scores} (multi-label) "
        "or {value} (regression)"
    )


class ComposeIn(Request):
    op: Literal[COMPOSE_OPERATIONS]
    sources: list[str] | dict[str, str] = Field(
        min_length=1,
        max_length=MAX_COMPOSE_SOURCES,
        description='delta references: "task" (its best), "task@alias", "task/3"; multi_task: {route: ref}',
    )
    into: str = Field(
        min_length=1, max_length=100, description="the task whose new version the result becomes"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="merge: weights, how (linear|ties|dare), density, seed, ..."
    )
    aliases: list[str] = Field(default_factory=list, max_length=MAX_COMPOSE_ALIASES)
    description: str = Field(default="", max_length=10_000)
    allow_existing: bool = Field(
        default=False,
        description="allow `into` a registered task that none of the sources comes from (refused otherwise)",
    )


# --- responses ------------------------------------------------------------------------------------


class TaskOut(Response):
    id: int
    name: str
    source_kind: str
    split_sizes: dict[str, int]
    train_size: int
    text_fields: list[str]
    label_field: str
    problem_type: str
    metric: str
    metric_direction: str
    label_names: list[str] | None
    max_length: int
    description: str
    created_at: datetime


class MethodOut(Response):
    id: int
    name: str
    spec: dict[str, Any]
    builtin: bool
    description: str
    created_at: datetime
    fingerprint: str = Field(
        description="names this version of the spec (a built-in: as this server's pelt_core has it); "
        "a job records the fingerprint of the version it ran"
    )


class BackboneOut(Response):
    id: int
    name: str
    source: str = Field(description="the packaged alias, or the model folder relative to its backbone folder")
    content_hash: str
    created_at: datetime
    facts: dict[str, Any] | None = Field(
        default=None,
        description="its shape: hidden_size, num_layers, num_heads, num_kv_heads, head_dim, "
        "intermediate_size, max_positions, vocab_size, num_parameters, model_type (null: registered before facts "
        "were kept; its first job reads them from its config)",
    )


class JobOut(Response):
    id: int
    task: str
    method: str
    backbone: str
    sweep_id: int | None
    method_fingerprint: str = Field(description="the version of the method's preset the job ran")
    hyperparameters: dict[str, Any]
    train_config: dict[str, Any]
    sources: list[dict[str, Any]] | None = Field(
        default=None, description="an AdapterFusion job's source deltas: task, version, sha256, method"
    )
    seed: int
    k_shot: int | None
    priority: int
    device: str = Field(default="any", description="where the job may run: any, cpu or gpu")
    status: str
    attempts: int
    max_attempts: int
    lease_owner: str | None
    progress: float | None
    progress_detail: dict[str, Any] | None
    cancel_requested: bool
    last_error: str | None = Field(description="the last attempt's error: one line, no server paths")
    submitted_by: str | None = Field(default=None, description="the name of the token that submitted the job")
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class ProgressOut(Response):
    id: int
    status: str
    progress: float | None
    progress_detail: dict[str, Any] | None
    attempts: int
    last_error: str | None


# [step, loss]: two numbers (not tuple[int, float], whose OpenAPI 3.1 form, prefixItems, some schema readers refuse)
LossPoint = Annotated[tuple[int | float, ...], Field(min_length=2, max_length=2)]


class LossHistoryOut(Response):
    """A job's loss curve: the [step, loss] points of its current attempt, steps increasing (at most
    256; a long run's curve is thinned evenly)."""

    job_id: int
    attempt: int
    points: list[LossPoint]


class SweepOut(Response):
    id: int
    task: str
    backbone: str
    methods: list[str]
    seeds: list[int]
    k_values: list[int | None]
    hyperparameters: dict[str, Any]
    method_hyperparameters: dict[str, dict[str, Any]]
    priority: int
    created_at: datetime
    job_ids: list[int]
    already_submitted: bool = Field(
        default=False,
        description="true when the same sweep was submitted before: these are its jobs, nothing was queued now",
    )
    submitted_by: str | None = Field(
        default=None, description="the name of the token that submitted the sweep (and so its jobs)"
    )


class SweepCheckOut(Response):
    task: str
    jobs: int = Field(description="how many jobs the sweep holds (none is queued by a check)")


class SweepCancelOut(Response):
    sweep_id: int
    cancelled: int


class ResultOut(Response):
    job_id: int
    metrics: dict[str, Any] = Field(
        description="on the task's evaluation split; under the study protocol (dev_rows), its test set "
        "(empty when the job left it out: evaluate_test=false, a method search's early rungs)"
    )
    primary_metric: float | None = Field(
        description="the task's metric in `metrics`; null when the job left its test set out"
    )
    dev_metrics: dict[str, Any] | None = Field(
        default=None,
        description="the study protocol's best evaluation on its held-out dev split (with its epoch and "
        "step), the checkpoint kept; null for a plain job",
    )
    dev_primary_metric: float | None = None
    trainable_params: int
    total_params: int | None
    trainable_percent: float
    train_seconds: float
    peak_memory_bytes: int | None = Field(
        description="the peak memory of the job's process on its device (on a GPU: of its pack of jobs)"
    )
    job_memory_bytes: int | None = Field(
        default=None, description="the job's own parameters, gradients and optimizer state on its device"
    )
    device: str | None = Field(
        default=None, description='where it trained, e.g. "cpu" or "cuda:0 (NVIDIA H100 80GB HBM3)"'
    )
    delta_uri: str | None
    delta_sha256: str | None
    mlflow_run_id: str | None
    mlflow_model_version: str | None
    worker_id: str | None
    attempt: int
    created_at: datetime


class EventOut(Response):
    at: datetime
    from_status: str | None
    to_status: str
    reason: str
    worker_id: str | None
    detail: str | None = Field(
        default=None,
        description="the full error behind reason (a traceback); admin tokens only, null for the others",
    )


class AuditEventOut(Response):
    id: int
    at: datetime
    actor: str | None = Field(description="the token's name (cli:<user> for `pelt token` commands)")
    action: str = Field(
        description="task.register, method.register, backbone.register, job.submit, sweep.submit, "
        "job.cancel, sweep.cancel, delta.compose, token.create, token.revoke"
    )
    target: str
    detail: dict[str, Any]


class LeaderboardRowOut(Response):
    rank: int
    method: str
    config_id: str = Field(description="12 hex digits naming the method and configuration of the row")
    k_shot: int | None = Field(description="the configuration's K (null: the full training set)")
    backbone: str | None
    config: dict[str, Any] = Field(
        description="the settings in which this row differs from the same method's other rows (empty: "
        "the method has one configuration on this board)"
    )
    mean: float = Field(description="the mean over seeds (a seed run twice counts once, at its mean)")
    std: float | None = Field(description="the sample standard deviation over seeds; null with one seed")
    ci_low: float | None = Field(description="the 95% Student-t interval of the mean; null with one seed")
    ci_high: float | None
    tied_with_top: bool | None = Field(
        description="not separable from rank 1 by Welch's t-test at p >= 0.05 (rank 1 itself: true); "
        "null when this row or rank 1 has one seed"
    )
    best: float
    runs: int
    seeds: int
    seed_values: list[float] = Field(description="each seed's value, seeds ascending")
    trainable_params: int
    trainable_percent: float
    median_train_seconds: float
    best_job_id: int
    best_delta_uri: str | None
    best_delta_sha256: str | None
    k_values: list[int | None] = Field(description="[k_shot], for readers of one-row-per-method boards")
    best_method_fingerprint: str | None = Field(description="the preset version of the best run")
    method_fingerprints: list[str] = Field(description="the preset versions among the runs, oldest job first")


class LeaderboardOut(Response):
    task: str
    metric: str
    metric_direction: str
    k_shot: int | Literal["full"] | None = Field(
        description="the K the rows were filtered to ('full': the full training set); null: every K "
        "(in /leaderboard/by-k, null is the board of the full training set)"
    )
    split: Literal["test", "dev"] = Field(
        default="test",
        description="what the rows rank by: the metric on the task's evaluation split (test; under the "
        "study protocol its test set) or on the protocol's held-out dev split (dev: only jobs that had one)",
    )
    order_by: Literal["mean", "best"] = Field(
        default="mean", description="rows ranked by their mean over seeds or by their best run"
    )
    interval: str = Field(default=INTERVAL, description="what ci_low and ci_high are")
    tie_test: str = Field(default=TIE_TEST, description="what tied_with_top means")
    rows: list[LeaderboardRowOut]


class VersionOut(Response):
    task: str
    model_name: str
    version: str
    kind: str
    sha256: str | None
    run_id: str | None
    job_id: int | None
    method: str | None
    metric: str | None
    metric_value: float | None
    aliases: list[str]
    tags: dict[str, str]
    created_at: datetime
    uri: str
    archived: bool = Field(
        default=False, description="archived by an admin: pulled only by its version number"
    )


class ComposeOut(Response):
    task: str
    version: str
    sha256: str
    provenance: dict[str, Any]


class HealthOut(Response):
    status: str
    version: str
    registry: str
    delta_store: str | None
    dispatcher: dict[str, Any] | None


class ReadyOut(Response):
    status: str  # "ready", "degraded" (the delta store did not answer) or "not ready" (the database did not)
    registry: str | None  # "ok" or "did not answer"
    delta_store: str | None  # the same; None when the service runs without one


class ErrorBody(BaseModel):
    status: int
    type: str
    field: str | None
    message: str


class ErrorOut(BaseModel):
    error: ErrorBody
