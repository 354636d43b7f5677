"""Idempotency keys belong to the token that submitted under them; sweeps record who submitted them.

- `jobs.idempotency_key` and `sweeps.idempotency_key` were unique across every token, so one token could
  take a key another would use (a study's predictable keys) and make that one's submits fail with a 409.
  They are now unique per submitter: per (`submitted_by`, key) for what a token submitted (the unique
  constraints `uq_jobs_submitted_by_idempotency_key`, `uq_sweeps_submitted_by_idempotency_key`), and per
  key among what was submitted without a token (`submitted_by` NULL: a partial unique index,
  `uq_<table>_idempotency_key_without_token`, as a unique constraint never matches NULLs). Every existing
  key was unique on its own, so it still names the same job or sweep, now for the token that made it.
- `sweeps.submitted_by`: the name of the token that submitted the sweep (NULL: without a token), filled
  for existing sweeps from their jobs (a sweep's jobs are all submitted with it, by the same token). A
  token without the admin scope may cancel only its own jobs and sweeps.

Downgrade goes back to keys unique across tokens: where tokens used the same key, the oldest row keeps it
and the later ones lose theirs (set to NULL: a retry under that key no longer finds them); then it drops
`sweeps.submitted_by` (who submitted a sweep is still on its jobs).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("jobs", "sweeps")
WITHOUT_TOKEN = "submitted_by IS NULL"


def upgrade() -> None:
    op.add_column("sweeps", sa.Column("submitted_by", sa.String(200), nullable=True))
    op.execute(
        "UPDATE sweeps SET submitted_by = "
        "(SELECT jobs.submitted_by FROM jobs WHERE jobs.sweep_id = sweeps.id ORDER BY jobs.id LIMIT 1)"
    )
    for table in TABLES:
        with op.batch_alter_table(table) as batch:  # SQLite: a constraint change rebuilds the table
            batch.drop_constraint(f"uq_{table}_idempotency_key", type_="unique")
            batch.create_unique_constraint(
                f"uq_{table}_submitted_by_idempotency_key", ["submitted_by", "idempotency_key"]
            )
        op.create_index(
            f"uq_{table}_idempotency_key_without_token",
            table,
            ["idempotency_key"],
            unique=True,
            sqlite_where=sa.text(WITHOUT_TOKEN),
            postgresql_where=sa.text(WITHOUT_TOKEN),
        )


def downgrade() -> None:
    for table in TABLES:
        op.drop_index(f"uq_{table}_idempotency_key_without_token", table_name=table)
        op.execute(  # keys several tokens used: the oldest row keeps its key (see the doc)
            f"UPDATE {table} SET idempotency_key = NULL WHERE idempotency_key IS NOT NULL AND id > "
            f"(SELECT min(same.id) FROM {table} AS same WHERE same.idempotency_key = {table}.idempotency_key)"
        )
        with op.batch_alter_table(table) as batch:
            batch.drop_constraint(f"uq_{table}_submitted_by_idempotency_key", type_="unique")
            batch.create_unique_constraint(f"uq_{table}_idempotency_key", ["idempotency_key"])
            if table == "sweeps":
                batch.drop_column("submitted_by")
