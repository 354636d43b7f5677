"""/v1/backbones: the frozen backbones jobs train on (registering one needs an admin token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import ADMIN, READ, Name, Operations
from services.api.schemas import BackboneIn, BackboneOut

router = APIRouter(tags=["backbones"], route_class=BoundedJsonRoute)  # JSON nests at most MAX_JSON_DEPTH deep


@router.get("/backbones", response_model=list[BackboneOut], dependencies=[READ])
def list_backbones(operations: Operations) -> Any:
    return operations.list_backbones()


@router.post("/backbones", response_model=BackboneOut, status_code=201, dependencies=[ADMIN])
def register_backbone(operations: Operations, body: BackboneIn) -> Any:
    """Register a packaged backbone alias or a model folder inside one of the service's backbone folders
    (PELT_BACKBONE_DIRS; never its data directory). It is loaded once, in a child process with memory
    and time limits, for its content hash and facts; a config beyond the size limits is refused."""
    return operations.register_backbone(body.name, body.source)


@router.get("/backbones/{name}", response_model=BackboneOut, dependencies=[READ])
def get_backbone(operations: Operations, name: Name) -> Any:
    return operations.get_backbone(name)
