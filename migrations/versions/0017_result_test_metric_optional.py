"""A result without a test metric: `results.primary_metric` may be null.

Under the study protocol a job may leave its test set out (`evaluate_test=false`): a method search's early
rungs are ranked on their dev split, and evaluating the test set in each of them cost as much as their
training. Such a result keeps its dev metrics (`dev_primary_metric`) and has no test metric: it takes part
in dev leaderboards and in its search, never in the test leaderboard, the `best` aliases or a pull by task
name.

Downgrade makes the column required again; it refuses while results without a test metric exist (it would
have to invent their value), naming their jobs. It also takes `evaluate_test` out of the jobs' settings
(`train_config`, `hyperparameters`), where every job since this revision has it: code of revision 0016
knows no such setting, and would refuse those jobs.

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
    untested = op.get_bind().scalars(sa.text("SELECT job_id FROM results WHERE primary_metric IS NULL")).all()
    if untested:
        shown = ", ".join(str(job_id) for job_id in sorted(untested)[:20]) + (
            ", ..." if len(untested) > 20 else ""
        )
        raise RuntimeError(
            f"{len(untested)} result(s) have no test metric: jobs {shown} ran with evaluate_test=false (a "
            "method search's early rungs), and revision 0016 requires a test metric. Nothing was changed. "
            "To go back all the same, delete those results by hand (DELETE FROM results WHERE primary_metric "
            "IS NULL): their jobs then stay succeeded without a result, on no leaderboard"
        )
    jobs = sa.table(
        "jobs",
        sa.column("id", sa.Integer),
        sa.column("train_config", sa.JSON),
        sa.column("hyperparameters", sa.JSON),
    )
    bind = op.get_bind()
    for job_id, config, given in bind.execute(
        sa.select(jobs.c.id, jobs.c.train_config, jobs.c.hyperparameters)
    ):
        if "evaluate_test" in (config or {}) or "evaluate_test" in (given or {}):
            bind.execute(
                jobs.update()
                .where(jobs.c.id == job_id)
                .values(
                    train_config={k: v for k, v in config.items() if k != "evaluate_test"},
                    hyperparameters={k: v for k, v in (given or {}).items() if k != "evaluate_test"},
                )
            )
    with op.batch_alter_table("results") as batch:
        batch.alter_column("primary_metric", existing_type=sa.Float(), nullable=False)
