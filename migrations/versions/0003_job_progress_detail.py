"""Structured job progress: `jobs.progress_detail` holds the worker's last report
({step, total, loss, tokens_per_second, ...}); `jobs.progress` stays the fraction done in [0, 1].

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("progress_detail", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "progress_detail")  # SQLite >= 3.35 drops columns natively
