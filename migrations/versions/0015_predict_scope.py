"""The `predict` token scope: read < predict < write < admin.

Predicting spends the service's compute, reading does not, so a read token (a dashboard's) cannot
predict; an application that only predicts gets a `predict` token, which can also read but can submit,
cancel or register nothing. Write and admin tokens include it.

Downgrading turns every `predict` token into a `read` one (narrower: it loses prediction, which the
older revision does not have).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_constraint("ck_api_tokens_scope", type_="check")
        batch.create_check_constraint("ck_api_tokens_scope", "scope IN ('read', 'predict', 'write', 'admin')")


def downgrade() -> None:
    tokens = sa.table("api_tokens", sa.column("scope", sa.String(16)))
    op.execute(tokens.update().where(tokens.c.scope == "predict").values(scope="read"))
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_constraint("ck_api_tokens_scope", type_="check")
        batch.create_check_constraint("ck_api_tokens_scope", "scope IN ('read', 'write', 'admin')")
