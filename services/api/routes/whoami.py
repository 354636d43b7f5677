"""/v1/whoami: the name and scope of the token a request carries (the page hides what its scope forbids)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from services.api.dependencies import READ, Caller

router = APIRouter(tags=["tokens"])


class WhoAmIOut(BaseModel):
    name: str = Field(description="the token's name")
    scope: str = Field(description="read, predict, write or admin (read < predict < write < admin)")


@router.get("/whoami", response_model=WhoAmIOut, dependencies=[READ])
def whoami(caller: Caller) -> Any:
    """The calling token's name and scope (never its secret)."""
    return WhoAmIOut(name=caller.name, scope=caller.scope)
