"""The Registry's API tokens (only a secret's SHA-256 is stored) and the audit trail of who did what."""

from __future__ import annotations

import contextlib
import hashlib
import re
import secrets
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from sqlalchemy import select

from services.registry.core import RegistryCore
from services.registry.errors import (
    AlreadyExistsError,
    NotFoundError,
    RegistryBusyError,
    RegistryValidationError,
)
from services.registry.models import TOKEN_SCOPES, ApiToken, AuditEvent
from services.registry.records import ApiTokenRecord, AuditEventRecord
from services.registry.rows import audit, retry_once_on_conflict
from services.registry.validation import check_int, check_name

TOKEN_PREFIX = "pelt_"
# A secret chosen outside pelt (a deployment's first token) is as long as the ones pelt makes:
# `pelt_` + secrets.token_urlsafe(32), 43 URL-safe characters (256 bits); `authenticate` reads up to 200.
_GIVEN_SECRET_BODY = re.compile(r"[A-Za-z0-9_-]{43,195}")


class TokensAndAudit(RegistryCore):
    """API tokens and the audit trail: one part of `Registry`."""

    def create_api_token(
        self, name: str, scope: str = "write", secret: str | None = None
    ) -> tuple[ApiTokenRecord, str]:
        """A new bearer token for the HTTP API: (its record, the secret). Only the secret's SHA-256 is
        stored, so the secret cannot be shown again. Names are unique, also among revoked tokens.

        scope: `read` (every GET), `write` (read + submit, cancel, register tasks and methods, compose)
        or `admin` (write + register backbones, full job errors, the audit trail). secret: one chosen
        outside pelt (a deployment's first token, from its secret store; `check_given_secret`), else a
        new random one."""
        check_name(name, "name")
        if scope not in TOKEN_SCOPES:
            raise RegistryValidationError("scope", f"must be one of {', '.join(TOKEN_SCOPES)}, got {scope!r}")
        if secret is None:
            secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        else:
            check_given_secret(secret)

        def write() -> ApiTokenRecord:
            with self._writing() as session:
                if session.scalar(select(ApiToken.id).where(ApiToken.name == name)) is not None:
                    raise AlreadyExistsError("name", f"a token named {name!r} already exists")
                if session.scalar(select(ApiToken.id).where(ApiToken.token_hash == token_hash(secret))):
                    raise AlreadyExistsError("secret", "another token has this secret already")
                row = ApiToken(
                    name=name,
                    scope=scope,
                    token_hash=token_hash(secret),
                    prefix=secret[: len(TOKEN_PREFIX) + 6],
                    created_at=self._now(),
                )
                session.add(row)
                session.flush()
                audit(session, row.created_at, "token.create", name, {"scope": scope})
                return ApiTokenRecord.of(row)

        return retry_once_on_conflict(write), secret  # a name inserted at the same moment: AlreadyExistsError

    def authenticate(self, secret: str) -> ApiTokenRecord | None:
        """The active token whose secret this is, or None (unknown or revoked). Marks it used at most
        once a minute (a write per request would serialise readers on SQLite)."""
        if not isinstance(secret, str) or not secret.startswith(TOKEN_PREFIX) or len(secret) > 200:
            return None
        with self._reading() as session:
            row = session.scalar(select(ApiToken).where(ApiToken.token_hash == token_hash(secret)))
            if row is None or row.revoked_at is not None:
                return None
            record = ApiTokenRecord.of(row)
        now = self._now()
        if record.last_used_at is None or now - record.last_used_at > timedelta(minutes=1):
            with (
                contextlib.suppress(RegistryBusyError),
                self._writing() as session,
            ):  # a busy registry: next time
                session.execute(
                    ApiToken.__table__.update().where(ApiToken.id == record.id).values(last_used_at=now)
                )
        return record

    def revoke_api_token(self, name: str) -> ApiTokenRecord:
        """Revoke a token by name (revoking twice is harmless); NotFoundError lists the known names."""
        with self._writing() as session:
            row = session.scalar(select(ApiToken).where(ApiToken.name == name))
            if row is None:
                known = session.scalars(select(ApiToken.name).order_by(ApiToken.name))
                raise NotFoundError("name", name, known)
            if row.revoked_at is None:
                row.revoked_at = self._now()
                audit(session, row.revoked_at, "token.revoke", name)
            session.flush()
            return ApiTokenRecord.of(row)

    def list_api_tokens(self) -> list[ApiTokenRecord]:
        """Every token (active and revoked), by name; no secrets."""
        with self._reading() as session:
            return [
                ApiTokenRecord.of(row) for row in session.scalars(select(ApiToken).order_by(ApiToken.name))
            ]

    # --- audit trail -----------------------------------------------------------------------------

    def record_audit(
        self, action: str, target: str, detail: Mapping[str, Any] | None = None
    ) -> AuditEventRecord:
        """Record an action done outside the registry (e.g. a composition in the delta store) by the
        current actor. The registry's own writes record theirs in the same transaction."""
        with self._writing() as session:
            row = audit(session, self._now(), action, target, detail)
            session.flush()
            return AuditEventRecord.of(row)

    def audit_events(self, *, limit: int = 100, offset: int = 0) -> list[AuditEventRecord]:
        """The audit trail, newest first."""
        check_int(limit, "limit", minimum=1, maximum=10_000)
        check_int(offset, "offset", minimum=0)
        query = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit).offset(offset)
        with self._reading() as session:
            return [AuditEventRecord.of(row) for row in session.scalars(query)]


def check_given_secret(secret: object) -> None:
    """Refuse a secret chosen outside pelt unless it is `pelt_` and 43 to 195 URL-safe characters
    (A-Z a-z 0-9 _ -), as long as the ones pelt makes; the message never repeats the secret."""
    body = (
        secret[len(TOKEN_PREFIX) :] if isinstance(secret, str) and secret.startswith(TOKEN_PREFIX) else None
    )
    if body is None or not _GIVEN_SECRET_BODY.fullmatch(body):
        raise RegistryValidationError(
            "secret",
            f"must be {TOKEN_PREFIX!r} followed by 43 to 195 of A-Z a-z 0-9 _ - (make one with: python3 -c "
            f"\"import secrets; print('{TOKEN_PREFIX}' + secrets.token_urlsafe(32))\")",
        )


def token_hash(secret: str) -> str:
    """Tokens are 256-bit random strings, so a plain SHA-256 (no salt, no stretching) is enough."""
    return hashlib.sha256(secret.encode()).hexdigest()


__all__ = ["TOKEN_PREFIX", "TokensAndAudit", "check_given_secret", "token_hash"]
