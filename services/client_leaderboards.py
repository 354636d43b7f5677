"""`PeltClient`'s leaderboards (services/client.py): a task's leaderboard as a DataFrame or as the service
sent it, one per K, and the service's plots of them (`_draw`, which the search plots use too)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.api.schemas import LeaderboardOut, LeaderboardRowOut


class LeaderboardsClient:
    """The leaderboard calls of `PeltClient` (which gives them `_get` and `_request`)."""

    _get: Callable[..., Any]
    _request: Callable[..., Any]

    def leaderboard(
        self,
        task: str,
        k_shot: int | str | None = None,
        backbone: str | None = None,
        split: str = "test",
        order_by: str = "mean",
    ) -> Any:
        """The task's leaderboard as a pandas DataFrame: one row per method and configuration (K and the
        settings in `config`; `k_shot="full"`: only the runs on the full training set), seeds pooled,
        ranked by the mean over seeds (`order_by="best"`: by the best run), with the 95% interval
        (`ci_low`, `ci_high`) and `tied_with_top` (not separable from rank 1). The metric's name and
        what the interval and tie test are: `frame.attrs`. `split="dev"`: by the protocol's dev split."""
        import pandas as pd

        board = self.leaderboard_raw(task, k_shot, backbone, split, order_by)
        frame = pd.DataFrame(
            [row.model_dump() for row in board.rows], columns=list(LeaderboardRowOut.model_fields)
        )
        frame.attrs.update(
            task=board.task,
            metric=board.metric,
            metric_direction=board.metric_direction,
            split=board.split,
            order_by=board.order_by,
            interval=board.interval,
            tie_test=board.tie_test,
        )
        return frame

    def leaderboard_raw(
        self,
        task: str,
        k_shot: int | str | None = None,
        backbone: str | None = None,
        split: str = "test",
        order_by: str = "mean",
    ) -> LeaderboardOut:
        return LeaderboardOut.model_validate(
            self._get(
                f"/v1/tasks/{task}/leaderboard",
                k_shot=k_shot,
                backbone=backbone,
                split=split,
                order_by=order_by,
            )
        )

    def leaderboard_by_k(
        self, task: str, backbone: str | None = None, split: str = "test", order_by: str = "mean"
    ) -> list[LeaderboardOut]:
        """The task's leaderboard for each K its jobs used, K ascending (k_shot None: the full training
        set, last); [] while no job has succeeded. `split="dev"` ranks by the protocol's dev split."""
        found = self._get(
            f"/v1/tasks/{task}/leaderboard/by-k", backbone=backbone, split=split, order_by=order_by
        )
        return [LeaderboardOut.model_validate(board) for board in found]

    def plot_leaderboard(
        self,
        task: str,
        path: str | Path | None = None,
        view: str = "pareto",
        k_shot: int | str | None = None,
        backbone: str | None = None,
        *,
        format: str | None = None,
    ) -> str | bytes:
        """The task's leaderboard drawn by the service: view "pareto" (the metric against trainable
        parameters, the Pareto frontier marked; only K = k_shot when given) or "metric-vs-k" (every K).
        Returns the SVG text or the PNG bytes, and writes them to `path` when given; the format is the
        path's suffix (.svg or .png), else `format` ("svg" by default). Nothing is written on an error."""
        from services.plots import check_view

        check_view(view, k_shot)
        params = {k: v for k, v in {"k_shot": k_shot, "backbone": backbone}.items() if v is not None}
        return self._draw(f"/v1/tasks/{task}/plots/{view}", path, format, params)

    def _draw(
        self, route: str, path: str | Path | None, format: str | None, params: dict[str, Any] | None = None
    ) -> str | bytes:
        """GET `route`.svg or .png (the path's suffix, else `format`, "svg" by default): the SVG text or the
        PNG bytes, written to `path` when given (nothing is written on an error)."""
        from services.plots import MEDIA_TYPES, format_of

        fmt = format_of(path) if path is not None else (format or "svg")
        if fmt not in MEDIA_TYPES or (format is not None and format != fmt):
            raise ValueError(f"format {format!r} does not fit: a plot is svg or png (the path's suffix)")
        response = self._request("GET", f"{route}.{fmt}", params=params or {})
        if path is not None:
            Path(path).write_bytes(response.content)
        return response.text if fmt == "svg" else response.content


__all__ = ["LeaderboardsClient"]
