"""Jobs say which device they need; results say where they trained.

- `jobs.device`: `any` (default; every job before this revision), `cpu` or `gpu`. A worker claims only
  the jobs its devices can run (`Registry.claim_jobs(..., devices=...)`). A CHECK keeps it to the three.
  The queue index `ix_jobs_queue` gets `device` as its last column: the claim query still walks it in
  queue order, and a device filter is checked in the index without reading the rows it skips.
- `results.device`: where the job trained, as the worker describes it ("cpu",
  "cuda:0 (NVIDIA H100 80GB HBM3)"); NULL for older results.
- `results.job_memory_bytes`: the job's own parameters, gradients and optimizer state on that device
  (`peak_memory_bytes` stays the process's, or its pack's, peak); NULL for older results.

Downgrade drops the three columns (a job's device is lost: every job becomes runnable anywhere again).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUEUE_COLUMNS = ["status", "priority", "created_at"]


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # SQLite: the CHECK needs the table rebuilt
        batch.add_column(sa.Column("device", sa.String(8), nullable=False, server_default="any"))
        batch.create_check_constraint("ck_jobs_device", "device IN ('any', 'cpu', 'gpu')")
    op.drop_index("ix_jobs_queue", table_name="jobs")
    op.create_index("ix_jobs_queue", "jobs", [*QUEUE_COLUMNS, "device"])
    op.add_column("results", sa.Column("device", sa.String(200), nullable=True))
    op.add_column("results", sa.Column("job_memory_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("results", "job_memory_bytes")  # SQLite >= 3.35 drops columns natively
    op.drop_column("results", "device")
    op.drop_index("ix_jobs_queue", table_name="jobs")
    op.create_index("ix_jobs_queue", "jobs", QUEUE_COLUMNS)
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("ck_jobs_device", type_="check")
        batch.drop_column("device")
