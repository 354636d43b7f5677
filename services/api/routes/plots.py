"""/v1/tasks/{name}/plots/…: the leaderboard's two views (`services.plots`), drawn on the server as SVG or
PNG. The SVG answers carry a Content-Security-Policy that lets nothing run or load, so that one opened
on its own is as inert as one the page puts inline."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Response

from services import plots
from services.api.bodies import BoundedJsonRoute
from services.api.dependencies import READ, Name, Operations
from services.api.routes.leaderboard import Backbone, KShot, board, boards_by_k

router = APIRouter(tags=["plots"], route_class=BoundedJsonRoute)

Format = Literal["svg", "png"]
SVG_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
}
IMAGE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the plot: SVG (.svg) or PNG (.png)",
        "content": {
            "image/svg+xml": {"schema": {"type": "string"}},
            "image/png": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.get("/tasks/{name}/plots/pareto.{fmt}", response_class=Response, responses=IMAGE, dependencies=[READ])
def pareto_plot(
    operations: Operations, name: Name, fmt: Format, k_shot: KShot = None, backbone: Backbone = None
) -> Response:
    """The metric against trainable parameters, one point per method, the Pareto frontier marked (only
    K = k_shot when given)."""
    return image(plots.pareto_figure(board(operations, name, k_shot, backbone), backbone), fmt)


@router.get(
    "/tasks/{name}/plots/metric-vs-k.{fmt}", response_class=Response, responses=IMAGE, dependencies=[READ]
)
def metric_vs_k_plot(operations: Operations, name: Name, fmt: Format, backbone: Backbone = None) -> Response:
    """The metric against K, one line per method (mean ± std over seeds; the full training set last)."""
    boards = boards_by_k(operations, name, backbone) or [board(operations, name, None, backbone)]
    return image(plots.metric_vs_k_figure(boards, backbone), fmt)


def image(figure: plots.Figure, fmt: str) -> Response:
    """The figure drawn as an answer: SVG (inert: its Content-Security-Policy lets nothing run) or PNG."""
    headers = SVG_HEADERS if fmt == "svg" else {"X-Content-Type-Options": "nosniff"}
    return Response(plots.render(figure, fmt), media_type=plots.MEDIA_TYPES[fmt], headers=headers)
