"""Results keep the study protocol's dev evaluation: `results.dev_metrics` (the best evaluation on the
job's held-out dev split, with its epoch and step: the checkpoint kept) and `results.dev_primary_metric`
(the task's metric in it), so a leaderboard can rank by the dev split or by the test split (`metrics`).
NULL for every plain job, and for every result before this revision.

Downgrade drops both columns (the dev evaluations are lost; `metrics` and the MLflow runs stay).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("results", sa.Column("dev_metrics", sa.JSON(), nullable=True))
    op.add_column("results", sa.Column("dev_primary_metric", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("results", "dev_primary_metric")
    op.drop_column("results", "dev_metrics")
