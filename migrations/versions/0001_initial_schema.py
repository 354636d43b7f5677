"""Initial schema: tasks, methods, backbones, sweeps, jobs, results, job events.

Revision ID: 0001
Revises:
Create Date: 2025-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATUSES = "'queued', 'running', 'succeeded', 'failed', 'cancelled'"
PROBLEM_TYPES = "'single_label_classification', 'multi_label_classification', 'regression'"


def _timestamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tasks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("source_kind", sa.String(16), nullable=False),
        sa.Column("source", sa.JSON(), nullable=False),
        sa.Column("split_sizes", sa.JSON(), nullable=False),
        sa.Column("train_size", sa.Integer(), nullable=False),
        sa.Column("text_fields", sa.JSON(), nullable=False),
        sa.Column("label_field", sa.String(200), nullable=False),
        sa.Column("problem_type", sa.String(40), nullable=False),
        sa.Column("metric", sa.String(100), nullable=False),
        sa.Column("metric_direction", sa.String(3), nullable=False),
        sa.Column("label_names", sa.JSON(), nullable=True),
        sa.Column("max_length", sa.Integer(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_tasks"),
        sa.UniqueConstraint("name", name="uq_tasks_name"),
        sa.CheckConstraint(f"problem_type IN ({PROBLEM_TYPES})", name="ck_tasks_problem_type"),
        sa.CheckConstraint("metric_direction IN ('max', 'min')", name="ck_tasks_metric_direction"),
        sa.CheckConstraint("source_kind IN ('files', 'datasets')", name="ck_tasks_source_kind"),
        sa.CheckConstraint("max_length >= 1", name="ck_tasks_max_length"),
        sa.CheckConstraint("train_size >= 1", name="ck_tasks_train_size"),
    )
    op.create_table(
        "methods",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("builtin", sa.Boolean(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_methods"),
        sa.UniqueConstraint("name", name="uq_methods_name"),
    )
    op.create_table(
        "backbones",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("content_hash", sa.String(200), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_backbones"),
        sa.UniqueConstraint("name", name="uq_backbones_name"),
    )
    op.create_table(
        "sweeps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("backbone_id", sa.Integer(), nullable=False),
        sa.Column("methods", sa.JSON(), nullable=False),
        sa.Column("seeds", sa.JSON(), nullable=False),
        sa.Column("k_values", sa.JSON(), nullable=False),
        sa.Column("hyperparameters", sa.JSON(), nullable=False),
        sa.Column("method_hyperparameters", sa.JSON(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(200), nullable=True),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_sweeps"),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], name="fk_sweeps_task_id_tasks"),
        sa.ForeignKeyConstraint(["backbone_id"], ["backbones.id"], name="fk_sweeps_backbone_id_backbones"),
        sa.UniqueConstraint("idempotency_key", name="uq_sweeps_idempotency_key"),
    )
    op.create_index("ix_sweeps_task_id", "sweeps", ["task_id"])
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("method_id", sa.Integer(), nullable=False),
        sa.Column("backbone_id", sa.Integer(), nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=True),
        sa.Column("hyperparameters", sa.JSON(), nullable=False),
        sa.Column("train_config", sa.JSON(), nullable=False),
        sa.Column("method_spec", sa.JSON(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("k_shot", sa.Integer(), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        _timestamp("not_before", nullable=True),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        _timestamp("lease_expires_at", nullable=True),
        _timestamp("heartbeat_at", nullable=True),
        sa.Column("progress", sa.Float(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("idempotency_key", sa.String(200), nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        _timestamp("started_at", nullable=True),
        _timestamp("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], name="fk_jobs_task_id_tasks"),
        sa.ForeignKeyConstraint(["method_id"], ["methods.id"], name="fk_jobs_method_id_methods"),
        sa.ForeignKeyConstraint(["backbone_id"], ["backbones.id"], name="fk_jobs_backbone_id_backbones"),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"], name="fk_jobs_sweep_id_sweeps"),
        sa.UniqueConstraint("idempotency_key", name="uq_jobs_idempotency_key"),
        sa.CheckConstraint(f"status IN ({STATUSES})", name="ck_jobs_status"),
        sa.CheckConstraint("attempts >= 0", name="ck_jobs_attempts"),
        sa.CheckConstraint("max_attempts >= 1", name="ck_jobs_max_attempts"),
        sa.CheckConstraint("progress IS NULL OR (progress >= 0 AND progress <= 1)", name="ck_jobs_progress"),
    )
    op.create_index("ix_jobs_queue", "jobs", ["status", "priority", "created_at"])
    op.create_index("ix_jobs_lease", "jobs", ["status", "lease_expires_at"])
    op.create_index("ix_jobs_task_k", "jobs", ["task_id", "k_shot"])
    op.create_index("ix_jobs_sweep_id", "jobs", ["sweep_id"])
    op.create_table(
        "results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("primary_metric", sa.Float(), nullable=False),
        sa.Column("trainable_params", sa.BigInteger(), nullable=False),
        sa.Column("total_params", sa.BigInteger(), nullable=True),
        sa.Column("trainable_percent", sa.Float(), nullable=False),
        sa.Column("train_seconds", sa.Float(), nullable=False),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("delta_uri", sa.Text(), nullable=True),
        sa.Column("delta_sha256", sa.String(64), nullable=True),
        sa.Column("mlflow_run_id", sa.String(100), nullable=True),
        sa.Column("mlflow_model_version", sa.String(100), nullable=True),
        sa.Column("worker_id", sa.String(200), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_results"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_results_job_id_jobs", ondelete="CASCADE"),
        sa.UniqueConstraint("job_id", name="uq_results_job_id"),
        sa.CheckConstraint("trainable_params >= 0", name="ck_results_trainable_params"),
    )
    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        _timestamp("at"),
        sa.Column("from_status", sa.String(16), nullable=True),
        sa.Column("to_status", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("worker_id", sa.String(200), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_job_events"),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name="fk_job_events_job_id_jobs", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_job_events_job_id", "job_events", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_job_events_job_id", table_name="job_events")
    op.drop_table("job_events")
    op.drop_table("results")
    for index in ("ix_jobs_sweep_id", "ix_jobs_task_k", "ix_jobs_lease", "ix_jobs_queue"):
        op.drop_index(index, table_name="jobs")
    op.drop_table("jobs")
    op.drop_index("ix_sweeps_task_id", table_name="sweeps")
    op.drop_table("sweeps")
    op.drop_table("backbones")
    op.drop_table("methods")
    op.drop_table("tasks")
