"""/v1/methods: the built-in PELT presets and users' own method specs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import READ, WRITE, Name, Operations
from services.api.schemas import MethodIn, MethodOut

router = APIRouter(tags=["methods"], route_class=BoundedJsonRoute)  # JSON nests at most MAX_JSON_DEPTH deep


@router.get("/methods", response_model=list[MethodOut], dependencies=[READ])
def list_methods(operations: Operations, builtin: bool | None = None) -> Any:
    return operations.list_methods(builtin)


@router.post("/methods", response_model=MethodOut, status_code=201, dependencies=[WRITE])
def register_method(operations: Operations, body: MethodIn) -> Any:
    """A user preset: a method spec as data (see `pelt methods`)."""
    return operations.register_method(body.spec, body.replace)


@router.get("/methods/{name}", response_model=MethodOut, dependencies=[READ])
def get_method(operations: Operations, name: Name) -> Any:
    return operations.get_method(name)
