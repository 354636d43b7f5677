"""What a request may hold beyond its size: how deep its JSON nests, which form fields it sends.

Python's JSON parser recurses once per level (40,000 nested brackets end in a RecursionError), and so
does every consumer after it; real requests nest 3-4 levels. A JSON body or form field nested deeper
than `limits.MAX_JSON_DEPTH` is a 422 naming it, before anything parses it. A multipart upload may only
send the fields its route declares, each once (FastAPI would silently ignore the others).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Coroutine
from typing import Any

from fastapi import Request, params
from fastapi.routing import APIRoute
from starlette.responses import Response

from pelt_core.json_nesting import json_depth
from pelt_core.limits import MAX_JSON_DEPTH
from services.errors import ServiceError

_FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")


def check_json_depth(text: str | bytes, field: str, limit: int = MAX_JSON_DEPTH) -> None:
    """A 422 naming `field` when the JSON text nests deeper than `limit`."""
    if json_depth(text, stop_above=limit) > limit:
        raise ServiceError(f"{field}: JSON nested more than {limit} levels deep", status=422, field=field)


class BoundedJsonRoute(APIRoute):
    """A route whose JSON body may nest at most MAX_JSON_DEPTH levels (checked on the raw bytes, which
    the size bound already limits, before FastAPI parses them)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        fields = self.dependant.body_params
        if not fields or any(isinstance(field.field_info, params.Form) for field in fields):
            return handler  # no JSON body (a form route never reads its body as JSON)

        async def bounded(request: Request) -> Response:
            if not request.headers.get("content-type", "").lower().startswith(_FORMS):
                check_json_depth(await request.body(), "body")
            return await handler(request)

        return bounded


def known_form_fields(allowed: Collection[str]) -> Callable[[Request], Coroutine[Any, Any, None]]:
    """A dependency refusing a form field the route does not take, or one sent twice (422 naming it)."""

    async def check(request: Request) -> None:
        form = await request.form()  # parsed once: FastAPI has read it for the route's own fields
        seen: set[str] = set()
        for key, _ in form.multi_items():
            if key not in allowed:
                raise ServiceError(
                    f"{key}: unknown form field; this route takes {', '.join(allowed)}", status=422, field=key
                )
            if key in seen:
                raise ServiceError(f"{key}: sent twice; send each form field once", status=422, field=key)
            seen.add(key)

    return check


__all__ = ["BoundedJsonRoute", "check_json_depth", "json_depth", "known_form_fields"]
