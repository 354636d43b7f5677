"""How the API answers an error: JSON {"error": {status, type, field, message}}, its message without
server paths or store URIs (`services.redaction`).

Expected errors (`services.errors.expected_errors`) and request validation errors are answered here;
any other exception by `services.api.middleware.InternalErrorMiddleware`, as a 500.
"""

from __future__ import annotations

import dataclasses
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.errors import ErrorView, ServiceError, classify, expected_errors
from services.redaction import redact

log = logging.getLogger("pelt.api")


def validation_error(exc: ValidationError | RequestValidationError, prefix: str = "") -> ServiceError:
    """A 422 naming the first invalid field (under `prefix`, for a field that holds JSON itself)."""
    first = exc.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    field = ".".join([prefix, *location] if prefix else location) or prefix or None
    message = first.get("msg", "invalid")
    return ServiceError(f"{field}: {message}" if field else message, status=422, field=field)


def internal_error(exc: BaseException) -> ErrorView:
    """The answer to an unexpected error: a 500 naming only the exception's class."""
    return ErrorView(500, "InternalError", f"internal error ({type(exc).__name__}); see the service log")


def _respond(view: ErrorView) -> JSONResponse:
    headers = {**({"WWW-Authenticate": "Bearer"} if view.status == 401 else {}), **(view.headers or {})}
    view = dataclasses.replace(view, message=redact(view.message))  # no server path or store URI, ever
    return JSONResponse(view.body(), status_code=view.status, headers=headers)


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    error = validation_error(exc)
    return _respond(ErrorView(422, "RequestValidationError", str(error), error.field))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _respond(ErrorView(exc.status_code, "HTTPError", str(exc.detail)))


async def _expected(request: Request, exc: Exception) -> JSONResponse:
    view = classify(exc)
    if view is None:  # a subclass classify does not know: a bug, not the caller's fault
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        view = internal_error(exc)
    return _respond(view)


def install_error_handlers(app: FastAPI) -> None:
    """Answer request validation errors, HTTP errors and the service's expected errors as JSON."""
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for error_class in expected_errors():
        app.add_exception_handler(error_class, _expected)
    # Any other exception is answered by InternalErrorMiddleware: an `Exception` handler here would run in
    # Starlette's ServerErrorMiddleware, which re-raises after answering, and uvicorn then drops the
    # connection.


__all__ = ["install_error_handlers", "internal_error", "validation_error"]
