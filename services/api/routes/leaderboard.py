"""/v1/tasks/{name}/leaderboard: the task's methods ranked by their best result."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Query

from pelt_core.limits import INT32_MAX
from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import READ, Name, Operations
from services.api.schemas import LeaderboardOut, LeaderboardRowOut
from services.redaction import public_uri

router = APIRouter(tags=["leaderboard"], route_class=BoundedJsonRoute)


@router.get("/tasks/{name}/leaderboard", response_model=LeaderboardOut, dependencies=[READ])
def leaderboard(
    operations: Operations,
    name: Name,
    k_shot: Annotated[int | None, Query(ge=1, le=INT32_MAX)] = None,
    backbone: Annotated[str | None, Query(max_length=100)] = None,
) -> Any:
    """One row per method over the task's succeeded jobs, best first (only K = k_shot when given)."""
    task = operations.get_task(name)
    rows = operations.leaderboard(name, k_shot, backbone)
    return LeaderboardOut(
        task=name,
        metric=task.metric,
        metric_direction=task.metric_direction,
        k_shot=k_shot,
        rows=[
            LeaderboardRowOut.model_validate(
                dataclasses.replace(row, best_delta_uri=public_uri(row.best_delta_uri))
            )
            for row in rows
        ],
    )
