"""Built-in presets `mam` and `scaled_parallel_adapter`: default learning rate 1e-4.

With their scale-4 FFN adapter both stayed at chance on SST-2 and RTE (all-MiniLM-L6-v2, K=500) at the
old defaults (1e-3 and 5e-4); at 1e-4 SST-2 reached 78-79%. Only `defaults.learning_rate` of the two
built-in rows changes; the values are literal, downgrade restores the old ones.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# name -> (learning rate before, learning rate after)
LEARNING_RATES: dict[str, tuple[float, float]] = {
    "mam": (0.001, 0.0001),
    "scaled_parallel_adapter": (0.0005, 0.0001),
}

methods = sa.table(
    "methods",
    sa.column("name", sa.String),
    sa.column("spec", sa.JSON),
    sa.column("builtin", sa.Boolean),
)


def _set_learning_rates(which: int) -> None:
    bind = op.get_bind()
    for name, rates in LEARNING_RATES.items():
        row = bind.execute(
            sa.select(methods.c.spec).where(methods.c.name == name, methods.c.builtin.is_(True))
        ).first()
        if row is None:  # a database without the seeded row: nothing to update
            continue
        spec = dict(row.spec)
        spec["defaults"] = {**(spec.get("defaults") or {}), "learning_rate": rates[which]}
        bind.execute(
            methods.update().where(methods.c.name == name, methods.c.builtin.is_(True)).values(spec=spec)
        )


def upgrade() -> None:
    _set_learning_rates(1)


def downgrade() -> None:
    _set_learning_rates(0)
