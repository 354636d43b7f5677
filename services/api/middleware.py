"""The API's ASGI middleware, outermost first: `InternalErrorMiddleware` (an unexpected error becomes a
JSON 500), `TokenAuthMiddleware` (no token, no route: 401; a token without the route's scope: 403),
`BodySizeLimitMiddleware` (413 for a body above its bound) and `UploadSlotMiddleware` (a dataset upload
holds one of PELT_DATASET_PROBE_CONCURRENCY slots; none free: 503).

Every check runs from the request's headers, before the app reads any of its body: nobody without a
token, or without the scope, can make the service read an upload (FastAPI would parse a whole multipart
body into temporary files before a route's dependencies run), and nobody with one can make it read more
than the bound. A refusal says `Connection: close`, and uvicorn closes the connection after it: the body
it announced is never read.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api.connections import CONNECTION_STATE_KEY
from services.api.dependencies import SCOPE_DEPENDENCIES, UNAUTHORIZED
from services.api.error_handlers import internal_error
from services.errors import ErrorView, ServiceError, classify
from services.registry import ApiTokenRecord, acting_as

log = logging.getLogger("pelt.api")

SCOPE_CHECKS = tuple(d.dependency for d in SCOPE_DEPENDENCIES.values())  # how routes declare their scope


def refusal(view: ErrorView) -> JSONResponse:
    """The answer to a request refused from its headers: the error as JSON, with `Connection: close` so
    that the connection is closed after it and the body it announced is never read."""
    headers = {**(view.headers or {}), "Connection": "close"}
    if view.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(view.body(), status_code=view.status, headers=headers)


@dataclass(frozen=True)
class DeclaredScope:
    """A route's path pattern and methods, with the scope checks (READ, PREDICT, WRITE, ADMIN) among its
    dependencies: the ones FastAPI runs, and the OpenAPI schema shows, once the body is parsed."""

    pattern: re.Pattern[str]
    methods: frozenset[str]
    checks: tuple[Callable[..., Any], ...]

    def matches(self, method: str, path: str) -> bool:
        return method in self.methods and self.pattern.match(path) is not None


def declared_scopes(routers: Iterable[APIRouter], prefix: str) -> list[DeclaredScope]:
    """The scope each route of `routers`, included under `prefix`, declares, in the routers' order (the
    order in which the app matches them)."""
    declared = []
    for router in routers:
        for route in router.routes:
            if not isinstance(route, APIRoute):
                continue
            checks, pending = [], [route.dependant]
            while pending:
                current = pending.pop()
                if current.call in SCOPE_CHECKS:
                    checks.append(current.call)
                pending.extend(current.dependencies)
            pattern = compile_path(prefix + route.path)[0]
            declared.append(DeclaredScope(pattern, frozenset(route.methods), tuple(checks)))
    return declared


class InternalErrorMiddleware:
    """An unexpected error becomes a JSON 500 on a connection that stays open for the client's next
    request; the traceback goes to the service log. (Once the answer has started, the only way to end
    it is to close the connection, so the error is passed on.) A connection closed while the app read
    its body is no error: one line in the log, no answer (there is nobody to answer)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except ClientDisconnect:  # the connection closed (by the client, or a deadline) before the body came
            log.info(
                "%s %s: the connection closed before its body arrived", scope.get("method"), scope.get("path")
            )
        except Exception as exc:
            if started:
                raise
            log.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=exc)
            await JSONResponse(internal_error(exc).body(), status_code=500)(scope, receive, send)


class TokenAuthMiddleware:
    """Refuse a /v1 request, and one for the OpenAPI schema at `schema_path` (None: the schema is
    public), without a valid token (401), or whose token lacks the scope its route declares (403, the
    route's own message; `declared`: `declared_scopes` of the app's routers): both from the headers,
    before the app reads any of the body, and the connection closed after. `authenticate` turns a bearer secret into its token record (None: unknown or
    revoked); it runs in a worker thread. A valid token takes its connection out of the unauthenticated
    share of the cap (`services.api.connections`).

    The request then runs `acting_as` its token's name, which the registry records, with the token in
    the scope's state, where the routes' `authenticated` dependency reads it. (The routes check the token
    again, and its scope, as dependencies that the OpenAPI schema shows.)"""

    def __init__(
        self,
        app: ASGIApp,
        authenticate: Callable[[str], ApiTokenRecord | None],
        schema_path: str | None = None,
        declared: Sequence[DeclaredScope] = (),
    ) -> None:
        self.app, self.authenticate, self.schema_path = app, authenticate, schema_path
        self.declared = declared

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = None
        if scope["path"].startswith("/v1/") or scope["path"] == self.schema_path:
            token = await self._token(dict(scope.get("headers") or []).get(b"authorization"))
            if token is None:
                unauthorized = refusal(ErrorView(401, "ServiceError", UNAUTHORIZED, "Authorization"))
                await unauthorized(scope, receive, send)
                return
            state = scope.setdefault("state", {})
            state["token"] = token
            connection = state.get(CONNECTION_STATE_KEY)
            if connection is not None:
                connection.mark_authenticated()
            refused = await self._scope_refusal(scope, token)
            if refused is not None:
                await refusal(refused)(scope, receive, send)
                return
        with acting_as(None if token is None else token.name):
            await self.app(scope, receive, send)

    async def _token(self, header: bytes | None) -> ApiTokenRecord | None:
        scheme, _, secret = (header or b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            return None
        return await anyio.to_thread.run_sync(self.authenticate, secret.strip())

    async def _scope_refusal(self, scope: Scope, token: ApiTokenRecord) -> ErrorView | None:
        """The 403 of the route this request goes to, when its token lacks the scope the route declares."""
        route = next((r for r in self.declared if r.matches(scope["method"], scope["path"])), None)
        for check in route.checks if route is not None else ():  # no route: a 404 or 405, body unread
            try:
                await check(token)
            except ServiceError as exc:
                return classify(exc) or internal_error(exc)
        return None


class BodySizeLimitMiddleware:
    """Refuse a request body above its bound (413): by Content-Length when sent (from the headers, the
    connection closed after), else by counting the streamed bytes (a chunked body), before the app reads
    past the bound. A path in `upload_paths` (dataset uploads) gets `upload_limit`, every other path
    `limit`."""

    def __init__(self, app: ASGIApp, limit: int, upload_limit: int, upload_paths: Collection[str]) -> None:
        self.app, self.limit, self.upload_limit, self.upload_paths = app, limit, upload_limit, upload_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_limit if scope["path"] in self.upload_paths else self.limit
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _too_large(limit)(scope, receive, send)
            return
        seen, exceeded, started, answered = 0, False, False, False

        async def bounded() -> Message:
            nonlocal seen, exceeded
            if exceeded:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    exceeded = True
                    return {"type": "http.disconnect"}  # the app stops reading; its answer is replaced below
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started, answered
            if not exceeded:
                started = started or message["type"] == "http.response.start"
                await send(message)
            elif not started and not answered:
                answered = True
                await _too_large(limit)(scope, receive, send)

        try:
            await self.app(scope, bounded, guarded_send)
        except Exception:
            if not exceeded or started:
                raise
            # the app failed on the body cut at the bound (a client disconnect, to it): the answer is the 413
        if exceeded and not started and not answered:
            await _too_large(limit)(scope, receive, send)


def _too_large(limit: int) -> JSONResponse:
    return refusal(ErrorView(413, "TooLargeError", f"request body larger than {limit} bytes", "body"))


class UploadSlotMiddleware:
    """Give a dataset upload (a POST to a path in `upload_paths`) a slot from `slot` (a context manager:
    `TaskUploads.probe_slot`), from its headers and until its answer is sent; when none is free, its
    refusal (a 503 with Retry-After) before any of the body is read, and the connection closed."""

    def __init__(
        self,
        app: ASGIApp,
        slot: Callable[[], contextlib.AbstractContextManager[None]],
        upload_paths: Collection[str],
    ) -> None:
        self.app, self.slot, self.upload_paths = app, slot, upload_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.upload_paths:
            await self.app(scope, receive, send)
            return
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self.slot())
            except ServiceError as exc:
                await refusal(classify(exc) or internal_error(exc))(scope, receive, send)
                return
            await self.app(scope, receive, send)


__all__ = [
    "BodySizeLimitMiddleware",
    "DeclaredScope",
    "InternalErrorMiddleware",
    "TokenAuthMiddleware",
    "UploadSlotMiddleware",
    "declared_scopes",
    "refusal",
]
