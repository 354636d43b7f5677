"""/v1/audit: who did what to the registry and the delta store (admin tokens only)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import ADMIN, Limit, Offset, Operations
from services.api.schemas import AuditEventOut

router = APIRouter(tags=["audit"], route_class=BoundedJsonRoute)


@router.get("/audit", response_model=list[AuditEventOut], dependencies=[ADMIN])
def audit(operations: Operations, limit: Limit = 100, offset: Offset = 0) -> Any:
    """Who registered, submitted, cancelled, composed, created or revoked what, newest first."""
    return operations.audit_events(limit=limit, offset=offset)
