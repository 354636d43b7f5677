"""Leaderboard plots: figure data from leaderboard rows (`LeaderboardOut`, as the API returns them) and two
renderers of the same `Figure`: SVG written here (no dependency; every text escaped; no script, style or
external reference: safe inline in a page) and PNG through matplotlib (imported on first use).

`pareto_figure(board)`: the metric (mean over seeds, the 95% interval as an error bar) against trainable
parameters (% of the backbone, log axis), one point per leaderboard row (a method in one configuration; a
method's points share its color), the Pareto frontier (the best mean for at most that many parameters, in
the metric's direction) a step line over its highlighted points. `metric_vs_k_figure(boards)`: the metric
against K (log axis, the full training set last), a line per method through its top row at each K with the
interval as a band; `metric_vs_k_from_values` draws it from plain numbers (the study report's averages
across tasks, ± their std over seeds). `search_figure(search)`: a method search's best dev score against
the budget it spent (linear axis), every ended job a point, the best so far a step line.
"""

from __future__ import annotations

import io
import math
import re
import threading
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from services.errors import ServiceError

VIEWS = ("pareto", "metric-vs-k")  # a task's leaderboard; a search's figure is "search"
MEDIA_TYPES = {"svg": "image/svg+xml", "png": "image/png"}
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")
PALETTE += ("#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 72, 540, 64, 356  # the plot area in viewBox units
MIN_PERCENT = 1e-4  # a method training no parameter sits here on the log axis
NO_RESULTS = "no results yet: no job of this task has succeeded"
NO_SEARCH_RESULTS = "no results yet: no job of this search has ended with a dev score"
FRONTIER_STROKE = {"stroke": "#222222", "stroke_width": 1.5, "stroke_dasharray": "6 3"}
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
_MATPLOTLIB = threading.Lock()  # matplotlib's font and text caches are not thread-safe
# PNG requests rendering or waiting at once; more get a 503 with Retry-After instead of a server thread each
_PNG_SLOTS = threading.BoundedSemaphore(2)
PNG_LEGEND_ENTRIES = 16  # methods named in a PNG's legend (the SVG's legend stops where its height ends)


@dataclass(frozen=True)
class Point:
    """One mark: `x` is the trainable % (Pareto) or K (metric vs K); `error` the half-width of its error
    bar or band (0: none; the figure's y label says what it is); `detail` is its hover text."""

    method: str
    x: float
    mean: float
    error: float
    detail: str
    on_frontier: bool = False
    full_data: bool = False  # metric vs K: the runs on the full training set


@dataclass(frozen=True)
class Series:
    method: str
    points: tuple[Point, ...]  # x ascending


@dataclass(frozen=True)
class Figure:
    """What both renderers draw; no series: a "no results yet" figure."""

    view: str  # "pareto" or "metric-vs-k"
    title: str
    subtitle: str
    x_label: str
    y_label: str
    series: tuple[Series, ...]
    x_ticks: tuple[tuple[float, str], ...] = ()  # () : decades of the log axis, as percentages
    log_x: bool = True  # False: a linear x axis from 0 (the search's budget)
    frontier_label: str = "Pareto frontier"  # what the step line through the highlighted points is
    empty: str = NO_RESULTS  # what a figure without series says

    @property
    def frontier(self) -> list[Point]:
        return sorted((p for s in self.series for p in s.points if p.on_frontier), key=lambda p: p.x)


# --- figure data ---------------------------------------------------------------------------------


def pareto_figure(board: Any, backbone: str | None = None) -> Figure:
    """The metric against trainable parameters, one point per row of `board` (a LeaderboardOut)."""
    scope = {None: "all K", "full": "the full training set"}.get(board.k_shot, f"K={board.k_shot}")
    points = []
    for row in board.rows:
        _check_finite(row.method, row.mean, _half_width(row), row.trainable_percent)
        detail = (
            f"{_row_name(row)}\n{board.metric} {_mean_text(row)} (best {row.best:.4f}, "
            f"{_count(row.runs, 'run')})\ntrainable {row.trainable_percent:.4g}% ({row.trainable_params:,} parameters)"
        )
        x = max(row.trainable_percent, MIN_PERCENT)
        points.append((row.config_id, Point(row.method, x, row.mean, _half_width(row), detail)))
    on_frontier = pareto_frontier([(key, p.x, p.mean) for key, p in points], board.metric_direction)
    frontier_note = "\non the Pareto frontier"
    marked = [
        replace(p, on_frontier=True, detail=p.detail + frontier_note) if key in on_frontier else p
        for key, p in points
    ]
    by_method: dict[str, list[Point]] = {}
    for point in marked:
        by_method.setdefault(point.method, []).append(point)
    return Figure(
        "pareto",
        f"{board.task}: {board.metric} against trainable parameters",
        _subtitle(scope, board.metric_direction, backbone),
        "trainable parameters (% of the backbone, log scale)",
        f"{board.metric} (mean over seeds, 95% interval)",
        tuple(
            Series(method, tuple(sorted(by_method[method], key=lambda p: (p.x, p.mean))))
            for method in sorted(by_method)
        ),
    )


def _row_name(row: Any) -> str:
    """A leaderboard row as a reader tells it apart: method, K and the settings that differ."""
    k = "the full training set" if row.k_shot is None else f"K={row.k_shot}"
    settings = ", ".join(f"{name}={value}" for name, value in row.config.items())
    return f"{row.method} ({k}{', ' + settings if settings else ''})"


def _mean_text(row: Any) -> str:
    if row.ci_low is None:
        return f"{row.mean:.4f} (1 seed: no interval)"
    return f"mean {row.mean:.4f}, 95% interval {row.ci_low:.4f} to {row.ci_high:.4f} ({row.seeds} seeds)"


def _half_width(row: Any) -> float:
    """The row's interval as an error bar's half-width (0 with one seed: no bar)."""
    return 0.0 if row.ci_high is None else row.ci_high - row.mean


def pareto_frontier(points: Iterable[tuple[str, float, float]], direction: str) -> set[str]:
    """The names among (name, cost, value) that no other point beats: none with at most that cost has a
    better value, and none with a lower cost an equal one. Equal points are all on it."""
    if direction not in ("max", "min"):
        raise ValueError(f"direction must be 'max' or 'min', got {direction!r}")
    sign = 1.0 if direction == "max" else -1.0
    by_cost: dict[float, list[tuple[str, float]]] = {}
    for name, cost, value in points:
        by_cost.setdefault(cost, []).append((name, sign * value))
    frontier: set[str] = set()
    best_so_far = -math.inf
    for cost in sorted(by_cost):
        top = max(value for _, value in by_cost[cost])
        if top > best_so_far:
            frontier.update(name for name, value in by_cost[cost] if value == top)
            best_so_far = top
    return frontier


def metric_vs_k_figure(boards: Sequence[Any], backbone: str | None = None) -> Figure:
    """The metric against K, one line per method through its top row at each K (mean over seeds, the
    95% interval as a band), from one board per K (`GET .../leaderboard/by-k`; k_shot None: the full
    training set). A task without results: pass its (empty) leaderboard."""
    if not boards:
        raise ValueError("no leaderboard to plot: pass at least the task's (empty) leaderboard")
    values: dict[str, dict[int | None, tuple[float, float, int]]] = {}
    for board in boards:
        for row in board.rows:  # best first: a method's first row is its top configuration at this K
            values.setdefault(row.method, {}).setdefault(
                board.k_shot, (row.mean, _half_width(row), row.seeds)
            )
    first = boards[0]
    return metric_vs_k_from_values(
        first.task,
        first.metric,
        first.metric_direction,
        values,
        backbone=backbone,
        spread="each method's top configuration per K: mean over seeds, 95% interval",
        count="seed",
    )


def metric_vs_k_from_values(
    task: str,
    metric: str,
    direction: str,
    values: Mapping[str, Mapping[int | None, tuple[float, float, int]]],
    *,
    backbone: str | None = None,
    title: str | None = None,
    spread: str = "mean ± std over seeds",
    count: str = "run",
) -> Figure:
    """The metric-vs-K view from {method: {K: (mean, half-width of the band, count)}} (K None: the full
    training set); `spread` says what the band is, `count` what was counted."""
    ks = sorted({k for cells in values.values() for k in cells if k is not None})
    full_x = ks[-1] * 4.0 if ks else 1.0
    ticks = tuple((float(k), str(k)) for k in ks)
    if any(None in cells for cells in values.values()):
        ticks += ((full_x, "full"),)
    series = []
    for method in sorted(values):
        points = []
        for k, (mean, error, number) in sorted(
            values[method].items(), key=lambda kv: (kv[0] is None, kv[0] or 0)
        ):
            _check_finite(method, mean, error)
            where = "the full training set" if k is None else f"K={k}"
            detail = f"{method} at {where}\n{metric} {mean:.4f} ± {error:.4f} ({_count(number, count)})"
            points.append(
                Point(method, full_x if k is None else float(k), mean, error, detail, full_data=k is None)
            )
        series.append(Series(method, tuple(points)))
    return Figure(
        "metric-vs-k",
        title or f"{task}: {metric} against K",
        _subtitle(spread, direction, backbone),
        "K, training rows (log scale)",
        metric,
        tuple(series),
        ticks,
    )


def search_figure(search: Any) -> Figure:
    """A method search (`SearchOut`, as the API returns it): every job that ended with a dev score is a
    point at the budget spent when it ended (the search's `best_so_far`: full-job equivalents, the jobs in
    the order they ended, a failed job's cost counted too), at its dev score, in its method's color; the
    jobs that raised the best dev score are highlighted and the best so far is a step line through them."""
    trials = {trial.job_id: trial for trial in search.trials}
    best, by_method = None, {}
    for step in search.best_so_far:  # the registry's account of the spending, one point per ended job
        trial, spent = trials[int(step["job_id"])], step["spent"]
        if trial.dev is None:
            continue
        _check_finite(trial.method, trial.dev, where=f"search {search.id}")
        better = step["dev"] != best
        best = step["dev"]
        detail = (
            f"job {trial.job_id}: {trial.method} {settings_text(trial.hyperparameters)}".rstrip()
            + f"\nrung {trial.rung + 1}, {trial.epochs:g} epochs, seed {trial.seed}"
            + f"\ndev {search.metric} {trial.dev:.4f} after {spent:.2f} spent"
            + ("\na new best" if better else "")
        )
        point = Point(trial.method, spent, trial.dev, 0.0, detail, on_frontier=better)
        by_method.setdefault(trial.method, []).append(point)
    series = tuple(Series(method, tuple(points)) for method, points in sorted(by_method.items()))
    return Figure(
        "search",
        f"search {search.id} of {search.task}: best dev {search.metric} against budget",
        _subtitle(
            f"{search.spent:.1f} of {search.budget:g} full-job equivalents spent, {search.status}",
            search.metric_direction,
            search.backbone,
        ),
        "budget spent (full-job equivalents)",
        f"dev {search.metric}",
        series,
        log_x=False,
        frontier_label="best so far",
        empty=NO_SEARCH_RESULTS,
    )


def settings_text(values: Mapping[str, Any]) -> str:
    """Hyperparameters as `name=value` words (floats in their shortest form)."""
    return " ".join(
        f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
        for name, value in values.items()
    )


def _subtitle(scope: str, direction: str, backbone: str | None) -> str:
    parts = [scope, "higher is better" if direction == "max" else "lower is better"]
    return " · ".join(parts + ([f"backbone {backbone}"] if backbone else []))


def _check_finite(method: str, *numbers: float, where: str = "the leaderboard") -> None:
    if not all(math.isfinite(n) for n in numbers):
        raise ValueError(f"method {method!r}: {where} holds a number that is not finite: {numbers}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# --- layout both renderers share -----------------------------------------------------------------


@dataclass(frozen=True)
class _Axes:
    x_range: tuple[float, float]  # data units, log axis
    y_range: tuple[float, float]
    x_ticks: tuple[tuple[float, str], ...]
    y_ticks: tuple[tuple[float, str], ...]


def _axes(figure: Figure) -> _Axes:
    points = [p for s in figure.series for p in s.points]
    xs = [p.x for p in points] or [1.0]
    lows, highs = [p.mean - p.error for p in points] or [0.0], [p.mean + p.error for p in points] or [1.0]
    if figure.log_x:
        pad = 2.0 if figure.view == "pareto" else 1.6
        x_range = (min(xs) / pad, max(xs) * pad)
    else:
        x_range = (0.0, max(xs) * 1.05 if max(xs) > 0 else 1.0)
    y_lo, y_hi = min(lows), max(highs)
    margin = (y_hi - y_lo) * 0.08 if y_hi - y_lo > 1e-12 else max(abs(y_hi) * 0.05, 0.01)
    y_range = (y_lo - margin, y_hi + margin)
    x_ticks = figure.x_ticks or (_log_ticks(*x_range) if figure.log_x else _linear_ticks(*x_range))
    return _Axes(x_range, y_range, x_ticks, _linear_ticks(*y_range))


def _log_ticks(lo: float, hi: float) -> tuple[tuple[float, str], ...]:
    """Decades in [lo, hi] labelled as percentages; 2 and 5 times them as well when few decades show."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    steps = (1,) if last - first > 3 else (1, 2, 5)
    values = [m * 10.0**e for e in range(first, last + 1) for m in steps]
    return tuple((v, f"{v:g}%") for v in values if lo <= v <= hi)


def _linear_ticks(lo: float, hi: float, count: int = 5) -> tuple[tuple[float, str], ...]:
    raw = (hi - lo) / count
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    decimals = max(0, -math.floor(math.log10(step)) + (1 if step / magnitude == 2.5 else 0))
    start = math.ceil(lo / step)
    values = [i * step for i in range(start, math.floor(hi / step) + 1)]
    return tuple((v, f"{v:.{decimals}f}") for v in values)


def _colors(figure: Figure) -> dict[str, str]:
    """A color per method, the same in every figure where it can be (a hash of the name), distinct
    within a figure of at most 10 methods."""
    colors: dict[str, str] = {}
    for series in figure.series:
        start = zlib.crc32(series.method.encode())
        free = [PALETTE[(start + i) % len(PALETTE)] for i in range(len(PALETTE))]
        taken = set(colors.values())
        colors[series.method] = next((c for c in free if c not in taken), free[0])
    return colors


# --- SVG ---------------------------------------------------------------------------------------


def render_svg(figure: Figure) -> str:
    """The figure as a standalone SVG document (sizes in its viewBox; hover: each point's <title>)."""
    axes = _axes(figure)
    scale = math.log10 if figure.log_x else float
    (x_lo, x_hi), (y_lo, y_hi) = (scale(v) for v in axes.x_range), axes.y_range

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            LEFT + (scale(x) - x_lo) / (x_hi - x_lo) * (RIGHT - LEFT),
            BOTTOM - (y - y_lo) / (y_hi - y_lo) * (BOTTOM - TOP),
        )

    ident = f"pelt-{figure.view}"
    out = [
        _el("title", _text(figure.title), id=f"{ident}-title"),
        _el("desc", _text(_description(figure)), id=f"{ident}-desc"),
        _el("rect", width=WIDTH, height=HEIGHT, fill="#ffffff"),
        _el("text", _text(_short(figure.title, 72)), x=LEFT, y=26, font_size=16, font_weight="bold"),
        _el("text", _text(figure.subtitle), x=LEFT, y=46, fill="#555555"),
        _el("rect", x=LEFT, y=TOP, width=RIGHT - LEFT, height=BOTTOM - TOP, fill="none", stroke="#999999"),
    ]
    middle = ((LEFT + RIGHT) / 2, (TOP + BOTTOM) / 2)
    if not figure.series:
        centre = {"x": middle[0], "y": middle[1], "text_anchor": "middle", "fill": "#555555"}
        out.append(_el("text", _text(figure.empty), class_="empty", font_size=14, **centre))
    else:
        out += _svg_axes(figure, axes, at, middle)
        out += _svg_series(figure, at)
        out += _svg_legend(figure)
    return _el(
        "svg",
        "\n".join(out),
        xmlns="http://www.w3.org/2000/svg",
        viewBox=f"0 0 {WIDTH} {HEIGHT}",
        role="img",
        aria_labelledby=f"{ident}-title {ident}-desc",
        class_=f"pelt-plot {ident}",
        font_family="sans-serif",
        font_size=12,
    )


def _svg_axes(figure: Figure, axes: _Axes, at: Any, middle: tuple[float, float]) -> list[str]:
    out = []
    for value, label in axes.y_ticks:
        y = at(axes.x_range[0], value)[1]
        out.append(_el("line", x1=LEFT, x2=RIGHT, y1=y, y2=y, stroke="#eeeeee"))
        out.append(_el("text", _text(label), x=LEFT - 6, y=y + 4, text_anchor="end"))
    for value, label in axes.x_ticks:
        x = at(value, axes.y_range[0])[0]
        out.append(_el("line", x1=x, x2=x, y1=TOP, y2=BOTTOM, stroke="#eeeeee"))
        out.append(_el("text", _text(label), x=x, y=BOTTOM + 18, text_anchor="middle"))
    out.append(_el("text", _text(figure.x_label), x=middle[0], y=BOTTOM + 40, text_anchor="middle"))
    turned = f"translate(18 {middle[1]}) rotate(-90)"
    out.append(_el("text", _text(figure.y_label), transform=turned, text_anchor="middle"))
    return [_el("g", "".join(out), class_="axes", fill="#333333")]


def _svg_series(figure: Figure, at: Any) -> list[str]:
    out, colors, frontier = [], _colors(figure), figure.frontier
    if frontier:
        corners = [at(p.x, p.mean) for p in frontier]
        steps = "".join(f" H{x:.1f} V{y:.1f}" for x, y in corners[1:])
        path = f"M{corners[0][0]:.1f} {corners[0][1]:.1f}{steps} H{RIGHT}"
        out.append(_el("path", class_="frontier-line", d=path, fill="none", **FRONTIER_STROKE))
    for series in figure.series:
        color, points, inner = colors[series.method], series.points, []
        if figure.view == "metric-vs-k":
            band = [at(p.x, p.mean + p.error) for p in points] + [
                at(p.x, p.mean - p.error) for p in points[::-1]
            ]
            inner.append(_el("polygon", points=_coords(band), fill=color, fill_opacity=0.15))
            measured = [p for p in points if not p.full_data]
            to_full = measured[-1:] + [p for p in points if p.full_data]  # dashed: not a K of its own
            for part, dashes in ((measured, None), (to_full, "3 3")):
                if len(part) > 1:
                    line = _coords(at(p.x, p.mean) for p in part)
                    style = {"stroke": color, "stroke_width": 2, "stroke_dasharray": dashes}
                    inner.append(_el("polyline", points=line, fill="none", **style))
        for p in points:
            (x, y), top, bottom = at(p.x, p.mean), at(p.x, p.mean + p.error)[1], at(p.x, p.mean - p.error)[1]
            if figure.view != "metric-vs-k" and p.error > 0:
                bar = (
                    f"M{x:.1f} {top:.1f} V{bottom:.1f} M{x - 4:.1f} {top:.1f} h8 M{x - 4:.1f} {bottom:.1f} h8"
                )
                inner.append(_el("path", d=bar, stroke=color, stroke_width=1.5, fill="none"))
            mark = {"class_": "point frontier", "r": 7, "stroke": "#222222", "stroke_width": 2.5}
            if not p.on_frontier:
                mark = {"class_": "point", "r": 5, "stroke": "#ffffff"}
            title = _el("title", _text(p.detail))
            inner.append(_el("circle", title, data_method=p.method, cx=x, cy=y, fill=color, **mark))
        out.append(_el("g", "".join(inner), class_="series", data_method=series.method))
    return out


def _svg_legend(figure: Figure) -> list[str]:
    colors, out = _colors(figure), []
    rows = (BOTTOM - TOP) // 20 - 2  # rows kept for "… and N more" and the frontier
    shown = figure.series[:rows]
    for i, series in enumerate(shown):
        y, name = TOP + 10 + 20 * i, series.method
        out.append(_el("circle", cx=RIGHT + 24, cy=y, r=5, fill=colors[name]))
        out.append(_el("text", _el("title", _text(name)) + _text(_short(name, 18)), x=RIGHT + 36, y=y + 4))
    y = TOP + 10 + 20 * len(shown)
    if len(shown) < len(figure.series):
        out.append(_el("text", f"… and {len(figure.series) - len(shown)} more", x=RIGHT + 36, y=y + 4))
        y += 20
    if figure.frontier:
        out.append(_el("path", d=f"M{RIGHT + 14} {y} h20", **FRONTIER_STROKE))
        out.append(_el("text", _text(figure.frontier_label), x=RIGHT + 36, y=y + 4))
    return [_el("g", "".join(out), class_="legend")]


def _description(figure: Figure) -> str:
    if not figure.series:
        return f"{figure.title} ({figure.subtitle}): {figure.empty}."
    points = "; ".join(p.detail.replace("\n", ", ") for s in figure.series for p in s.points)
    return f"{figure.title} ({figure.subtitle}); x: {figure.x_label}; y: {figure.y_label}. {points}."


def _el(tag: str, inner: str | None = None, /, **attributes: object) -> str:
    """One SVG element. `inner` is markup already made safe (`_text`, other elements); every attribute
    value is escaped here (names: `_` becomes `-`, `class_` is class); None leaves an attribute out."""
    pairs = "".join(
        f' {name.rstrip("_").replace("_", "-")}="{_text(_number(value))}"'
        for name, value in attributes.items()
        if value is not None
    )
    return f"<{tag}{pairs}/>" if inner is None else f"<{tag}{pairs}>{inner}</{tag}>"


def _short(text: str, length: int) -> str:
    return text if len(text) <= length else text[: length - 1] + "…"


def _number(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _text(value: str) -> str:
    """Text and attribute values for the SVG: markup characters escaped, characters XML forbids dropped."""
    return escape(_NOT_XML.sub("", value), {'"': "&quot;", "'": "&#39;"})


def _coords(points: Iterable[tuple[float, float]]) -> str:
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in points)


# --- PNG ---------------------------------------------------------------------------------------


def render_png(figure: Figure) -> bytes:
    """The same figure as a PNG, drawn by matplotlib (Agg; no pyplot state)."""
    from matplotlib.figure import Figure as MatplotlibFigure

    axes = _axes(figure)
    if not _PNG_SLOTS.acquire(blocking=False):
        raise ServiceError(
            "PNG plots are being drawn for other requests; try again shortly (or ask for .svg)",
            status=503,
            retry_after=2,
        )
    try:
        return _render_png(figure, axes, MatplotlibFigure)
    finally:
        _PNG_SLOTS.release()


def _render_png(figure: Figure, axes: _Axes, MatplotlibFigure: Any) -> bytes:
    with _MATPLOTLIB:
        canvas = MatplotlibFigure(figsize=(WIDTH / 100, HEIGHT / 100), dpi=100, layout="constrained")
        ax = canvas.add_subplot()
        ax.set_title(_plain(f"{figure.title}\n{figure.subtitle}"), loc="left", fontsize=11)
        if not figure.series:
            ax.text(0.5, 0.5, _plain(figure.empty), ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
        else:
            _draw_png(ax, figure, axes)
        buffer = io.BytesIO()
        canvas.savefig(buffer, format="png")
    return buffer.getvalue()


def _draw_png(ax: Any, figure: Figure, axes: _Axes) -> None:
    colors = _colors(figure)
    for series in figure.series:
        color, pts = colors[series.method], series.points
        xs, means, errors = [p.x for p in pts], [p.mean for p in pts], [p.error for p in pts]
        label = _plain(series.method)
        if figure.view != "metric-vs-k":
            ax.errorbar(xs, means, yerr=errors, fmt="o", color=color, capsize=3, markersize=7, label=label)
        else:
            measured = [p for p in pts if not p.full_data]
            ax.plot([p.x for p in measured], [p.mean for p in measured], "-o", color=color, label=label)
            if measured and len(measured) < len(pts):
                ax.plot([measured[-1].x, pts[-1].x], [measured[-1].mean, pts[-1].mean], ":o", color=color)
            lows, highs = [p.mean - p.error for p in pts], [p.mean + p.error for p in pts]
            ax.fill_between(xs, lows, highs, color=color, alpha=0.15, linewidth=0)
    frontier = figure.frontier
    if frontier:
        xs, ys = [p.x for p in frontier] + [axes.x_range[1]], [p.mean for p in frontier] + [frontier[-1].mean]
        ax.step(
            xs,
            ys,
            where="post",
            color="#222222",
            linestyle="--",
            linewidth=1.5,
            label=_plain(figure.frontier_label),
        )
        ax.scatter(xs[:-1], ys[:-1], s=140, facecolors="none", edgecolors="#222222", linewidths=2, zorder=3)
    if figure.log_x:
        ax.set_xscale("log")
    ax.set_xlim(*axes.x_range)
    ax.set_ylim(*axes.y_range)
    ax.set_xticks([v for v, _ in axes.x_ticks], [_plain(label) for _, label in axes.x_ticks])
    ax.set_xticks([], minor=True)
    ax.set_yticks([v for v, _ in axes.y_ticks], [label for _, label in axes.y_ticks])
    ax.set_xlabel(_plain(figure.x_label))
    ax.set_ylabel(_plain(figure.y_label))
    ax.grid(color="#eeeeee")
    handles, labels = ax.get_legend_handles_labels()
    if len(handles) > PNG_LEGEND_ENTRIES:  # a legend of hundreds of methods would take seconds to lay out
        more = len(handles) - PNG_LEGEND_ENTRIES
        handles, labels = handles[:PNG_LEGEND_ENTRIES], labels[:PNG_LEGEND_ENTRIES]
        ax.set_title(f"{ax.get_title(loc='left')} (legend: {more} more not named)", loc="left", fontsize=11)
    ax.legend(handles, labels, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small", frameon=False)


def _plain(text: str) -> str:
    """Text matplotlib draws as written: no math mode ($), no legend-hiding leading underscore."""
    return _NOT_XML.sub("", text).replace("$", r"\$").lstrip("_") or "?"


# --- choosing ---------------------------------------------------------------------------------


def render(figure: Figure, fmt: str) -> str | bytes:
    """The figure as "svg" (text) or "png" (bytes)."""
    if fmt not in MEDIA_TYPES:
        raise ValueError(f"format must be one of {', '.join(MEDIA_TYPES)}, got {fmt!r}")
    return render_svg(figure) if fmt == "svg" else render_png(figure)


def format_of(path: str | Path) -> str:
    """ "svg" or "png" from a file name's suffix (ValueError naming the path otherwise)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in MEDIA_TYPES:
        raise ValueError(
            f"{str(path)!r}: a plot is written as .svg or .png, not {('.' + suffix) if suffix else 'no suffix'}"
        )
    return suffix


def check_view(view: str, k_shot: int | str | None = None) -> str:
    """The view, checked: "pareto" (one K or all) or "metric-vs-k" (every K; k_shot must be None)."""
    if view not in VIEWS:
        raise ValueError(f"view must be one of {', '.join(VIEWS)}, got {view!r}")
    if view == "metric-vs-k" and k_shot is not None:
        raise ValueError("the metric-vs-k view shows every K: leave k_shot out")
    return view


__all__ = [
    "MEDIA_TYPES",
    "VIEWS",
    "Figure",
    "Point",
    "Series",
    "check_view",
    "format_of",
    "metric_vs_k_figure",
    "metric_vs_k_from_values",
    "pareto_figure",
    "pareto_frontier",
    "render",
    "render_png",
    "render_svg",
    "search_figure",
    "settings_text",
]
