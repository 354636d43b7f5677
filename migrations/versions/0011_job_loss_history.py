"""Jobs keep their loss curve: `jobs.loss_history`, the [step, loss] points of the current attempt.

`Registry.heartbeat` appends a report's (step, loss) when the step advanced and the loss is a finite
number; at most 256 points (when full, every other point is kept, then the new one appended: the whole
curve at half the resolution). A claim starts the new attempt with an empty history. NULL: no point yet
(every job before this revision).

Downgrade drops the column (the curves are lost; the last progress report stays in `progress_detail`).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("loss_history", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "loss_history")  # SQLite >= 3.35 drops columns natively
