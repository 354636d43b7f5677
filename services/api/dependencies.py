"""What the routes depend on: the service layer, the caller's token and the scope a route needs, and the
path and query parameters several resources share.

Each route declares the scope it needs with one of READ, WRITE, ADMIN (`requires`): read < write <
admin; a token without it gets a 403 naming the scope. The token itself is checked before the route
runs, by `services.api.middleware.TokenAuthMiddleware`; `authenticated` hands it to the route.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from pelt_core.limits import INT32_MAX, MAX_PAGE_LIMIT
from services.errors import ServiceError
from services.operations import PeltOperations
from services.registry import ApiTokenRecord
from services.registry.models import TOKEN_SCOPES

UNAUTHORIZED = (
    "missing, unknown or revoked token: send 'Authorization: Bearer <token>' (create one with "
    "`pelt token create`)"
)
bearer = HTTPBearer(auto_error=False, description="a token from `pelt token create`")


async def operations(request: Request) -> PeltOperations:
    """The service layer the app was made over (`create_app`)."""
    return request.app.state.operations


async def authenticated(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> ApiTokenRecord:
    """The route's caller: the token `TokenAuthMiddleware` already checked for this request; 401 without
    one. (The bearer scheme is declared here so that the OpenAPI schema shows it.)"""
    token = request.scope.get("state", {}).get("token")
    if token is None:
        raise ServiceError(UNAUTHORIZED, status=401, field="Authorization")
    return token


def requires(scope: str) -> Any:
    """The dependency by which a route declares the scope it needs (read < predict < write < admin): a token
    without it gets a 403 naming the scope."""

    async def check(token: Annotated[ApiTokenRecord, Depends(authenticated)]) -> ApiTokenRecord:
        if not token.allows(scope):
            raise ServiceError(
                f"this needs a token with the {scope!r} scope; token {token.name!r} has the "
                f"{token.scope!r} scope (an admin creates tokens: `pelt token create NAME "
                f"--scope {scope}`)",
                status=403,
                field="Authorization",
            )
        return token

    return Depends(check)


SCOPE_DEPENDENCIES = {scope: requires(scope) for scope in TOKEN_SCOPES}  # one per scope, in order
READ, PREDICT, WRITE, ADMIN = (SCOPE_DEPENDENCIES[scope] for scope in ("read", "predict", "write", "admin"))
Caller = Annotated[ApiTokenRecord, Depends(authenticated)]
Operations = Annotated[PeltOperations, Depends(operations)]

Name = Annotated[str, PathParam(min_length=1, max_length=200)]
Limit = Annotated[
    int,
    Query(
        ge=1,
        le=MAX_PAGE_LIMIT,
        description=f"rows of one page, at most {MAX_PAGE_LIMIT:,}: page on with `offset` for more",
    ),
]
Offset = Annotated[int, Query(ge=0, le=INT32_MAX)]

__all__ = [
    "ADMIN",
    "READ",
    "UNAUTHORIZED",
    "WRITE",
    "Caller",
    "Limit",
    "Name",
    "Offset",
    "Operations",
    "authenticated",
    "bearer",
    "operations",
    "requires",
]
