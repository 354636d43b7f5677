"""Method presets as the registry sees them.

Built-in presets have one home, `pelt_core.methods`: the registry reads them at run time, so a preset
edited there reaches the next job with no migration. Their rows in `methods` hold a name only (no spec):
a row per built-in name exists so that jobs can point at it, made on first use (`builtin_row`). User
presets are rows with their spec. A user preset may not take a built-in's name; should a later pelt_core
add a preset under the name of an existing user preset, the user's row keeps that name.

A job stores the spec it ran (`jobs.method_spec`, overrides applied) and the `fingerprint` of the base
preset it came from, so results of an older version of a preset can be told from the current one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pelt_core import methods as pelt_methods
from services.registry.errors import RegistryValidationError, UnknownMethodError
from services.registry.models import Method
from services.registry.rows import get_or_create

FINGERPRINT_LENGTH = 16
# AdapterFusion's jobs point at a built-in row of this name; each job's spec is built from its sources
# (`PeltOperations.submit_fusion`), so no preset of the name exists and no user preset may take it
FUSION = "fusion"
FUSION_HOW = (
    "'fusion' is AdapterFusion over stored adapters: submit it with `pelt fuse TASK --from TASK ...` "
    "(client.fuse, POST /v1/fusions), which names its sources"
)


def fingerprint(spec: Mapping[str, Any]) -> str:
    """A preset version's short name: the first 16 hex digits of the SHA-256 of its canonical JSON (keys
    sorted, no spaces). Migration 0008 computed it the same way for older jobs: never change it."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:FINGERPRINT_LENGTH]


def builtin_names() -> list[str]:
    """The built-in presets pelt_core has now, in its order."""
    return pelt_methods.list_methods()


def builtin_spec(name: str) -> dict[str, Any] | None:
    """A built-in preset's spec as pelt_core has it now (None: not a built-in)."""
    if name not in pelt_methods.BUILTIN_METHODS:
        return None
    return pelt_methods.get_method(name).to_dict()


def builtin_row(name: str, now: datetime) -> Method:
    """A new row for a built-in preset: its name only (pelt_core holds the spec)."""
    return Method(name=name, spec=None, builtin=True, description="", created_at=now)


def rows_named(session: Session, names: Iterable[str]) -> dict[str, Method]:
    """The method rows of these names that exist, by name."""
    return {row.name: row for row in session.scalars(select(Method).where(Method.name.in_(list(names))))}


@dataclass(frozen=True)
class JobMethod:
    """The method a new job runs: its row (what the job points at), its base spec before the job's
    overrides, and that spec's fingerprint."""

    row: Method
    spec: dict[str, Any]
    fingerprint: str


def job_method(session: Session, name: str, now: datetime) -> JobMethod:
    """The method jobs named `name` run now: a user preset's stored spec, or a built-in's spec as
    pelt_core has it (its row made now if none exists yet). UnknownMethodError lists the known ones."""
    row = session.scalar(select(Method).where(Method.name == name))
    if row is not None and not row.builtin:
        return JobMethod(row, dict(row.spec), fingerprint(row.spec))
    if name == FUSION:
        raise RegistryValidationError("method", FUSION_HOW)
    spec = builtin_spec(name)
    if spec is None:
        raise unknown_method(session, name)
    if row is None:
        row, _ = get_or_create(session, Method, name, lambda: builtin_row(name, now))
    return JobMethod(row, spec, fingerprint(spec))


def fusion_method(session: Session, spec: Mapping[str, Any], now: datetime) -> JobMethod:
    """The method a fusion job runs: the built-in `fusion` row (made on first use) and the spec its
    sources made (`pelt_core.methods.fusion.fusion_method`)."""
    row, _ = get_or_create(session, Method, FUSION, lambda: builtin_row(FUSION, now))
    return JobMethod(row, dict(spec), fingerprint(spec))


def user_method_row(session: Session, name: str) -> Method:
    """The user preset of that name (UnknownMethodError lists the known methods)."""
    row = session.scalar(select(Method).where(Method.name == name, Method.builtin.is_(False)))
    if row is None:
        raise unknown_method(session, name)
    return row


def check_known(session: Session, name: str) -> None:
    """UnknownMethodError unless some job could name this method: a built-in, a user preset or a former
    built-in that older jobs ran."""
    if name == FUSION:
        return
    if builtin_spec(name) is None and session.scalar(select(Method.id).where(Method.name == name)) is None:
        raise unknown_method(session, name)


def unknown_method(session: Session, name: str) -> UnknownMethodError:
    """The error for an unknown method, listing the built-ins, then the user presets."""
    users = session.scalars(select(Method.name).where(Method.builtin.is_(False)).order_by(Method.id))
    builtins = builtin_names()
    return UnknownMethodError("method", name, [*builtins, *(user for user in users if user not in builtins)])


__all__ = [
    "FINGERPRINT_LENGTH",
    "FUSION",
    "FUSION_HOW",
    "JobMethod",
    "builtin_names",
    "builtin_row",
    "builtin_spec",
    "check_known",
    "fingerprint",
    "fusion_method",
    "job_method",
    "rows_named",
    "unknown_method",
    "user_method_row",
]
