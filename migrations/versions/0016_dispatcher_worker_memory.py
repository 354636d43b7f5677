"""The memory of the workers a leading dispatcher runs: `dispatcher_leaders.worker_memory`.

A leader records, with each renewal, the largest job budget of its CPU workers and of its GPU workers
({"cpu": bytes, "gpu": bytes}: what each worker measured where it runs, its cgroup limit included). A submit
checks a job's memory estimate against the largest worker that could run it, instead of against
PELT_WORKER_MEMORY_BYTES of the API's host, so a job no worker can hold is refused at once, naming that
worker. Null: not known yet (the check falls back to PELT_WORKER_MEMORY_BYTES).

Downgrade drops the column.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("dispatcher_leaders") as batch:
        batch.add_column(sa.Column("worker_memory", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("dispatcher_leaders") as batch:
        batch.drop_column("worker_memory")
