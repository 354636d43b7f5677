"""/v1/tasks/{name}/leaderboard: the task's methods and configurations ranked by their mean over seeds (or
their best run), with intervals and ties with the top marked, for one K or each K."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import Field

from pelt_core.limits import INT32_MAX
from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import READ, Name, Operations
from services.api.schemas import LeaderboardOut, LeaderboardRowOut
from services.operations import PeltOperations
from services.redaction import public_uri
from services.registry import LeaderboardRow, TaskRecord

router = APIRouter(tags=["leaderboard"], route_class=BoundedJsonRoute)

KShot = Annotated[
    Annotated[int, Field(ge=1, le=INT32_MAX)] | Literal["full"] | None,
    Query(description="only the runs with this K, or 'full': only the runs on the full training set"),
]
Backbone = Annotated[str | None, Query(max_length=100)]
RankSplit = Annotated[
    Literal["test", "dev"],
    Query(description="rank by the metric on the task's evaluation split (test) or the protocol's dev split"),
]
RankOrder = Annotated[
    Literal["mean", "best"],
    Query(description="rank by the mean over seeds (mean) or by each row's best run (best)"),
]


@router.get("/tasks/{name}/leaderboard", response_model=LeaderboardOut, dependencies=[READ])
def leaderboard(
    operations: Operations,
    name: Name,
    k_shot: KShot = None,
    backbone: Backbone = None,
    split: RankSplit = "test",
    order_by: RankOrder = "mean",
) -> Any:
    """One row per method and configuration over the task's succeeded jobs, seeds pooled, the top first
    (only K = k_shot when given; otherwise every K, each its own rows)."""
    return board(operations, name, k_shot, backbone, split, order_by)


@router.get("/tasks/{name}/leaderboard/by-k", response_model=list[LeaderboardOut], dependencies=[READ])
def leaderboard_by_k(
    operations: Operations,
    name: Name,
    backbone: Backbone = None,
    split: RankSplit = "test",
    order_by: RankOrder = "mean",
) -> Any:
    """The leaderboard of each K the task's succeeded jobs used, K ascending; `k_shot` null here is the
    runs on the full training set (last). An empty list while no job has succeeded with a score on `split`
    (on the test split: jobs that left their test set out, a search's early rungs, are not ranked)."""
    return boards_by_k(operations, name, backbone, split, order_by)


def board(
    operations: PeltOperations,
    name: str,
    k_shot: int | str | None,
    backbone: str | None,
    split: str = "test",
    order_by: str = "mean",
) -> LeaderboardOut:
    """The task's leaderboard (only K = k_shot when given) as the API shows it."""
    task = operations.get_task(name)
    rows = operations.leaderboard(name, k_shot, backbone, split, order_by)
    return _board_out(task, k_shot, rows, split, order_by)


def boards_by_k(
    operations: PeltOperations, name: str, backbone: str | None, split: str = "test", order_by: str = "mean"
) -> list[LeaderboardOut]:
    """One leaderboard per K (None: the full training set, last) as the API shows them."""
    task = operations.get_task(name)
    by_k = operations.leaderboard_by_k(name, backbone, split, order_by)
    return [_board_out(task, k_shot, rows, split, order_by) for k_shot, rows in by_k.items()]


def _board_out(
    task: TaskRecord, k_shot: int | str | None, rows: Sequence[LeaderboardRow], split: str, order_by: str
) -> LeaderboardOut:
    return LeaderboardOut(
        task=task.name,
        metric=task.metric,
        metric_direction=task.metric_direction,
        k_shot=k_shot,
        split=split,
        order_by=order_by,
        rows=[
            LeaderboardRowOut.model_validate(
                dataclasses.replace(row, best_delta_uri=public_uri(row.best_delta_uri))
            )
            for row in rows
        ],
    )
