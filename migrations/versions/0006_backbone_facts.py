"""Backbone facts: `backbones.facts` holds the shape of a registered backbone as JSON
({hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size, max_positions,
vocab_size, num_parameters, model_type}), read from its config when it is registered, so hyperparameters
can be checked against it (a LoRA rank at most the hidden size) without loading the model.

Existing rows keep NULL: filling them would load every model inside the migration. A NULL means "not
known"; checks that need the facts skip such a backbone.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("backbones", sa.Column("facts", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("backbones", "facts")  # SQLite >= 3.35 drops columns natively
