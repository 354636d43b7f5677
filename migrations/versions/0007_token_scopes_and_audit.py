"""Token scopes and the audit trail.

- `api_tokens.scope`: read < write < admin. Tokens made before scopes existed could do everything, so
  they become `admin` (today's behaviour kept; `pelt token create NAME --scope write` makes narrower ones).
- `jobs.submitted_by`: the name of the API token that submitted the job (NULL for older jobs and for
  jobs submitted without the API); a per-token cap on queued jobs counts by it.
- `job_events.detail`: the full error behind an event's reason (a traceback), shown to admin tokens only.
- `audit_events`: who submitted, cancelled, composed, registered, created or revoked what, and when.

Downgrading below this revision revokes every token whose scope is not `admin` (sets `revoked_at`):
before scopes every active token could do everything, so a read or write token kept by the downgrade
would come back as a full-power one. Admin tokens keep working; make the others again after upgrading.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("scope", sa.String(16), nullable=False, server_default="admin"))
    with op.batch_alter_table("api_tokens") as batch:  # new tokens name their scope: no default
        batch.alter_column("scope", existing_type=sa.String(16), existing_nullable=False, server_default=None)
        batch.create_check_constraint("ck_api_tokens_scope", "scope IN ('read', 'write', 'admin')")
    op.add_column("jobs", sa.Column("submitted_by", sa.String(200), nullable=True))
    op.create_index("ix_jobs_submitted_by_status", "jobs", ["submitted_by", "status"])
    op.add_column("job_events", sa.Column("detail", sa.Text(), nullable=True))
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(200), nullable=True),
        sa.Column("action", sa.String(50), nullable=False),
        sa.Column("target", sa.String(300), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_audit_events"),
    )
    op.create_index("ix_audit_events_at", "audit_events", ["at"])


def downgrade() -> None:
    revoke_narrow_tokens()
    op.drop_index("ix_audit_events_at", table_name="audit_events")
    op.drop_table("audit_events")
    op.drop_column("job_events", "detail")  # SQLite >= 3.35 drops columns natively
    op.drop_index("ix_jobs_submitted_by_status", table_name="jobs")
    op.drop_column("jobs", "submitted_by")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_constraint("ck_api_tokens_scope", type_="check")
        batch.drop_column("scope")


def revoke_narrow_tokens() -> None:
    """Revoke every active token that is not admin: without the scope column it would be (see the doc)."""
    tokens = sa.table(
        "api_tokens", sa.column("scope", sa.String(16)), sa.column("revoked_at", sa.DateTime(timezone=True))
    )
    now = datetime.now(UTC)
    if op.get_bind().dialect.name == "sqlite":  # the registry keeps naive UTC there (models.UTCDateTime)
        now = now.replace(tzinfo=None)
    op.execute(
        tokens.update().where(tokens.c.scope != "admin", tokens.c.revoked_at.is_(None)).values(revoked_at=now)
    )
