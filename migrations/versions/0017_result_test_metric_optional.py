"""A result without a test metric: `results.primary_metric` may be null.

Under the study protocol a job may leave its test set out (`evaluate_test=false`): a method search's early
rungs are ranked on their dev split, and evaluating the test set in each of them cost as much as their
training. Such a result keeps its dev metrics (`dev_primary_metric`) and has no test metric: it takes part
in dev leaderboards and in its search, never in the test leaderboard, the `best` aliases or a pull by task
name.

Downgrade makes the column required again; it refuses while results without a test metric exist (it would
have to invent their value), naming how many.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("results") as batch:
        batch.alter_column("primary_metric", existing_type=sa.Float(), nullable=True)


def downgrade() -> None:
    untested = op.get_bind().scalar(sa.text("SELECT count(*) FROM results WHERE primary_metric IS NULL"))
    if untested:
        raise RuntimeError(
            f"{untested} result(s) have no test metric (jobs run with evaluate_test=false, e.g. a method "
            "search's early rungs): revision 0016 requires one; delete those jobs' results first"
        )
    with op.batch_alter_table("results") as batch:
        batch.alter_column("primary_metric", existing_type=sa.Float(), nullable=False)
