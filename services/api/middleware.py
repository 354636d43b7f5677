"""The API's ASGI middleware, outermost first: `InternalErrorMiddleware` (an unexpected error becomes a
JSON 500), `TokenAuthMiddleware` (no token, no route: 401 before any of the body is read) and
`BodySizeLimitMiddleware` (413 for a body above its bound).

Both checks run before the app reads any of a request's body, so nobody without a token can make the
service read an upload, and nobody with one can make it read more than the bound.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import anyio
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api.dependencies import UNAUTHORIZED
from services.api.error_handlers import internal_error
from services.errors import ErrorView
from services.registry import ApiTokenRecord, acting_as

log = logging.getLogger("pelt.api")


class InternalErrorMiddleware:
    """An unexpected error becomes a JSON 500 on a connection that stays open for the client's next
    request; the traceback goes to the service log. (Once the answer has started, the only way to end
    it is to close the connection, so the error is passed on.)"""

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
        except Exception as exc:
            if started:
                raise
            log.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=exc)
            await JSONResponse(internal_error(exc).body(), status_code=500)(scope, receive, send)


class TokenAuthMiddleware:
    """Refuse a /v1 request, and one for the OpenAPI schema at `schema_path` (None: the schema is
    public), without a valid token: a 401 before the app reads any of its body. `authenticate` turns a
    bearer secret into its token record (None: unknown or revoked); it runs in a worker thread.

    The request then runs `acting_as` its token's name, which the registry records, with the token in
    the scope's state, where the routes' `authenticated` dependency reads it. (The routes check the token
    again, and its scope, as dependencies that the OpenAPI schema shows.)"""

    def __init__(
        self,
        app: ASGIApp,
        authenticate: Callable[[str], ApiTokenRecord | None],
        schema_path: str | None = None,
    ) -> None:
        self.app, self.authenticate, self.schema_path = app, authenticate, schema_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = None
        if scope["path"].startswith("/v1/") or scope["path"] == self.schema_path:
            token = await self._token(dict(scope.get("headers") or []).get(b"authorization"))
            if token is None:
                view = ErrorView(401, "ServiceError", UNAUTHORIZED, "Authorization")
                await JSONResponse(view.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send
                )
                return
            scope.setdefault("state", {})["token"] = token
        with acting_as(None if token is None else token.name):
            await self.app(scope, receive, send)

    async def _token(self, header: bytes | None) -> ApiTokenRecord | None:
        scheme, _, secret = (header or b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            return None
        return await anyio.to_thread.run_sync(self.authenticate, secret.strip())


class BodySizeLimitMiddleware:
    """Refuse a request body above its bound (413): by Content-Length when sent, else by counting the
    streamed bytes, before the app reads past the bound. A path in `upload_paths` (dataset uploads) gets
    `upload_limit`, every other path `limit`."""

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
        seen, exceeded, answered = 0, False, False

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
            nonlocal answered
            if not exceeded:
                await send(message)
            elif not answered:
                answered = True
                await _too_large(limit)(scope, receive, send)

        await self.app(scope, bounded, guarded_send)


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse(
        ErrorView(413, "TooLargeError", f"request body larger than {limit} bytes", "body").body(),
        status_code=413,
    )


__all__ = ["BodySizeLimitMiddleware", "InternalErrorMiddleware", "TokenAuthMiddleware"]
