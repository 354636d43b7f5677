"""Dispatcher leadership: one leading dispatcher per Ray namespace, the others stand by.

`dispatcher_leaders` holds, per namespace, the dispatcher that leads it and until when; the leader renews
its row while it runs, a standby takes the row over once it has expired (`Registry.acquire_leadership`).

Downgrade drops the table (running dispatchers then all act as leaders, as before this revision).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dispatcher_leaders",
        sa.Column("namespace", sa.String(200), nullable=False),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("namespace", name="pk_dispatcher_leaders"),
    )


def downgrade() -> None:
    op.drop_table("dispatcher_leaders")
