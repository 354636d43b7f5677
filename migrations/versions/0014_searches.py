"""Method searches: `searches` (one budget-aware search of a task: its schedule, the configurations it drew,
its status and what it chose) and `search_trials` (each job of a search: a configuration at a rung, and
a seed on the last rung). The search's whole state is in these rows, so a restarted service resumes it.

Downgrade drops both tables (the searches' jobs stay, as plain jobs).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATUSES = ("running", "succeeded", "failed", "cancelled")
WITHOUT_TOKEN = "submitted_by IS NULL"


def upgrade() -> None:
    when = {"timezone": True}
    op.create_table(
        "searches",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("backbone_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("budget", sa.Float(), nullable=False),
        sa.Column("k_shot", sa.Integer(), nullable=False),
        sa.Column("dev_rows", sa.Integer(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("methods", sa.JSON(), nullable=False),
        sa.Column("hyperparameters", sa.JSON(), nullable=False),
        sa.Column("schedule", sa.JSON(), nullable=False),
        sa.Column("space", sa.JSON(), nullable=False),
        sa.Column("configurations", sa.JSON(), nullable=False),
        sa.Column("fingerprints", sa.JSON(), nullable=False),
        sa.Column("chosen", sa.JSON(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("idempotency_key", sa.String(200), nullable=True),
        sa.Column("submitted_by", sa.String(200), nullable=True),
        sa.Column("created_at", sa.DateTime(**when), nullable=False),
        sa.Column("updated_at", sa.DateTime(**when), nullable=False),
        sa.Column("finished_at", sa.DateTime(**when), nullable=True),
        sa.CheckConstraint(f"status IN ({', '.join(repr(s) for s in STATUSES)})", name="ck_searches_status"),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], name="fk_searches_task_id_tasks"),
        sa.ForeignKeyConstraint(["backbone_id"], ["backbones.id"], name="fk_searches_backbone_id_backbones"),
        sa.PrimaryKeyConstraint("id", name="pk_searches"),
        sa.UniqueConstraint(
            "submitted_by", "idempotency_key", name="uq_searches_submitted_by_idempotency_key"
        ),
    )
    op.create_index("ix_searches_task_id", "searches", ["task_id"])
    op.create_index("ix_searches_status", "searches", ["status"])
    op.create_index(
        "uq_searches_idempotency_key_without_token",
        "searches",
        ["idempotency_key"],
        unique=True,
        sqlite_where=sa.text(WITHOUT_TOKEN),
        postgresql_where=sa.text(WITHOUT_TOKEN),
    )
    op.create_table(
        "search_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("search_id", sa.Integer(), nullable=False),
        sa.Column("configuration", sa.Integer(), nullable=False),
        sa.Column("rung", sa.Integer(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["search_id"], ["searches.id"], name="fk_search_trials_search_id_searches", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_search_trials_job_id_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_search_trials"),
        sa.UniqueConstraint(
            "search_id",
            "configuration",
            "rung",
            "seed",
            name="uq_search_trials_search_id_configuration_rung_seed",
        ),
        sa.UniqueConstraint("job_id", name="uq_search_trials_job_id"),
    )
    op.create_index("ix_search_trials_search_id", "search_trials", ["search_id"])


def downgrade() -> None:
    op.drop_table("search_trials")
    op.drop_table("searches")
