"""/v1/searches: a budget-aware method search of one task (successive halving through the queue), read
with its evidence, listed, cancelled."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from fastapi import Path as PathParam

from pelt_core.limits import INT32_MAX
from services import plots
from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import READ, WRITE, Caller, Operations
from services.api.routes.plots import IMAGE, Format, image
from services.api.schemas import SearchIn, SearchOut

router = APIRouter(tags=["searches"], route_class=BoundedJsonRoute)

SearchId = Annotated[int, PathParam(ge=1, le=INT32_MAX, description="a search id")]


@router.post("/searches", response_model=SearchOut, status_code=201, dependencies=[WRITE])
def create_search(operations: Operations, body: SearchIn) -> Any:
    """Plan a search within the budget and queue its first rung (all its jobs or none): 201. A budget too
    small for one rung, an unknown method, a K or dev split the task cannot supply, or nothing to
    search is refused naming the field, and nothing is queued. The dispatcher advances it from then on."""
    values = body.model_dump()
    return operations.create_search(values.pop("task"), values.pop("budget"), **values)


@router.get("/searches", response_model=list[SearchOut], dependencies=[READ])
def list_searches(
    operations: Operations,
    task: Annotated[str | None, Query(max_length=100)] = None,
    status: Annotated[Literal["running", "succeeded", "failed", "cancelled"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0,
) -> Any:
    """Searches, newest first."""
    return operations.list_searches(task=task, status=status, limit=limit, offset=offset)


@router.get("/searches/{search_id}", response_model=SearchOut, dependencies=[READ])
def get_search(operations: Operations, search_id: SearchId) -> Any:
    """The search: its schedule, every trial (configuration, rung, job, dev and test score, cost), the
    best dev score against the budget spent, and what it chose once it succeeded."""
    return operations.get_search(search_id)


@router.get("/searches/{search_id}/plot.{fmt}", response_class=Response, responses=IMAGE, dependencies=[READ])
def search_plot(operations: Operations, search_id: SearchId, fmt: Format) -> Response:
    """The search's best dev score against the budget it spent: every ended job a point, the best so far a
    step line (SVG or PNG)."""
    return image(plots.search_figure(operations.get_search(search_id)), fmt)


@router.post("/searches/{search_id}/cancel", response_model=SearchOut, dependencies=[WRITE])
def cancel_search(operations: Operations, search_id: SearchId, caller: Caller) -> Any:
    """Stop the search and cancel its unfinished jobs. Another token's search needs the admin scope."""
    return operations.cancel_search(search_id, own_only=not caller.allows("admin"))
