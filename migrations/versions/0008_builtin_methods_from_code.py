"""Built-in method presets come from pelt_core at run time; jobs record which preset version they ran.

- `methods.spec` of built-in rows becomes NULL (and their `description` empty): the registry reads a
  built-in's spec from `pelt_core.methods` when it lists it or submits a job, so a preset edited there
  needs no migration. The rows stay, a name each, for jobs to point at; a new preset gets its row on
  first use. A CHECK keeps built-in rows without a spec and user rows with one.
- `jobs.method_fingerprint`: the first 16 hex digits of the SHA-256 of the canonical JSON (keys sorted, no
  spaces) of the base preset a job ran, before its overrides (`services.registry.presets.fingerprint`).
  Older jobs get the fingerprint of the spec their method's row holds at this upgrade.

Downgrade restores the specs 0002 seeded, with 0005's learning rates. A built-in row made after this
revision (a preset pelt_core added later) gets the spec its newest job ran, or is deleted if no job ran it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BUILTIN_SPEC_CHECK = "(builtin AND spec IS NULL) OR (NOT builtin AND spec IS NOT NULL)"

methods = sa.table(
    "methods",
    sa.column("id", sa.Integer),
    sa.column("name", sa.String),
    sa.column("spec", sa.JSON(none_as_null=True)),
    sa.column("builtin", sa.Boolean),
    sa.column("description", sa.Text),
)
jobs = sa.table(
    "jobs",
    sa.column("id", sa.Integer),
    sa.column("method_id", sa.Integer),
    sa.column("method_spec", sa.JSON),
    sa.column("method_fingerprint", sa.String),
)


def fingerprint(spec: Mapping[str, Any]) -> str:
    """Frozen copy of services.registry.presets.fingerprint (a migration must not change with the code)."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def upgrade() -> None:
    bind = op.get_bind()
    op.add_column("jobs", sa.Column("method_fingerprint", sa.String(16), nullable=True))
    for method_id, spec in bind.execute(sa.select(methods.c.id, methods.c.spec)).all():
        bind.execute(
            jobs.update().where(jobs.c.method_id == method_id).values(method_fingerprint=fingerprint(spec))
        )
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("method_fingerprint", existing_type=sa.String(16), nullable=False)
    with op.batch_alter_table("methods") as batch:
        batch.alter_column("spec", existing_type=sa.JSON(), nullable=True)
    bind.execute(methods.update().where(methods.c.builtin.is_(True)).values(spec=sa.null(), description=""))
    with op.batch_alter_table("methods") as batch:
        batch.create_check_constraint("ck_methods_builtin_spec", BUILTIN_SPEC_CHECK)


def downgrade() -> None:
    with op.batch_alter_table("methods") as batch:
        batch.drop_constraint("ck_methods_builtin_spec", type_="check")
    restore_builtin_specs()
    with op.batch_alter_table("methods") as batch:
        batch.alter_column("spec", existing_type=sa.JSON(), nullable=False)
    op.drop_column("jobs", "method_fingerprint")  # SQLite >= 3.35 drops columns natively


def seeded_specs() -> dict[str, dict[str, Any]]:
    """The built-in rows as 0002 seeded them and 0005 changed them (both revisions' own literal data)."""
    seeded = importlib.import_module("migrations.versions.0002_builtin_methods").BUILTIN_METHODS
    rates = importlib.import_module("migrations.versions.0005_scaled_adapter_learning_rates").LEARNING_RATES
    specs = {name: dict(spec) for name, spec in seeded.items()}
    for name, (_, after) in rates.items():
        specs[name]["defaults"] = {**(specs[name].get("defaults") or {}), "learning_rate": after}
    return specs


def restore_builtin_specs() -> None:
    """Give every built-in row a spec again: the seeded one, else its newest job's; else delete it."""
    bind = op.get_bind()
    seeded = seeded_specs()
    builtins = bind.execute(sa.select(methods.c.id, methods.c.name).where(methods.c.builtin.is_(True))).all()
    for method_id, name in builtins:
        spec = seeded.get(name)
        if spec is None:
            newest = (
                sa.select(jobs.c.method_spec).where(jobs.c.method_id == method_id).order_by(jobs.c.id.desc())
            )
            spec = bind.execute(newest.limit(1)).scalar()
        if spec is None:
            bind.execute(methods.delete().where(methods.c.id == method_id))
        else:
            values = {"spec": spec, "description": spec.get("description", "")}
            bind.execute(methods.update().where(methods.c.id == method_id).values(**values))
