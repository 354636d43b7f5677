"""A method search's report, as `pelt study` writes one: what the budget bought, what was varied, every trial
by rung, the answer with its interval, and the best dev score against the budget spent, as Markdown
(report.md) beside the search as the API returns it (report.json) and the plot (best-so-far.svg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.api.schemas import SearchOut, SearchTrialOut
from services.plots import settings_text

REPORT_FILES = ("report.md", "report.json", "best-so-far.svg")
ENDED = ("succeeded", "failed", "cancelled")


def answer_text(search: SearchOut) -> str:
    """The chosen configuration with its test mean, interval, seeds, dev mean and jobs; or why there is none."""
    chosen = search.chosen
    if search.status != "succeeded" or chosen is None:
        reason = f": {search.last_error}" if search.last_error else ""
        return (
            f"no answer: the search {'is running' if search.status == 'running' else search.status}{reason}"
        )
    interval = (
        "no interval"
        if chosen["ci_low"] is None
        else f"95% interval {chosen['ci_low']:.4f} to {chosen['ci_high']:.4f}"
    )
    failed = chosen.get("seeds_failed") or 0
    return (
        f"{chosen['method']} {settings_text(chosen['hyperparameters'])}".strip()
        + f" at {_epochs(chosen['epochs'])}: test {search.metric} {chosen['test_mean']:.4f} ({interval}, "
        + f"{chosen['seeds']} seeds{f', {failed} failed' if failed else ''}; dev {chosen['dev_mean']:.4f}); "
        + f"jobs {', '.join(str(j) for j in chosen['job_ids'])}; its leaderboard row {chosen['config_id']}"
    )


def best_first(search: SearchOut) -> list[SearchTrialOut]:
    """The trials, the last rung first, each rung's best dev score first (in the metric's direction)."""
    sign = -1.0 if search.metric_direction == "max" else 1.0
    return sorted(
        search.trials, key=lambda t: (-t.rung, t.dev is None, sign * (t.dev or 0.0), t.configuration, t.seed)
    )


def write_search_report(out_dir: Path, search: SearchOut, svg: str) -> list[Path]:
    """Write report.md, report.json and best-so-far.svg (the service's drawing, `svg`) into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in REPORT_FILES]
    paths[0].write_text(markdown(search))
    paths[1].write_text(search.model_dump_json(indent=2) + "\n")
    paths[2].write_text(svg)
    return paths


def markdown(search: SearchOut) -> str:
    better = "higher" if search.metric_direction == "max" else "lower"
    lines = [
        f"# Search {search.id} of {_text(search.task)}",
        "",
        f"- status: {search.status}" + (f" ({_text(search.last_error)})" if search.last_error else ""),
        f"- backbone {_text(search.backbone)}, K={search.k_shot} training rows, a dev split of {search.dev_rows} rows",
        f"- metric: {search.metric} ({better} is better); rungs rank by the dev split, the answer reports the test split "
        "(only the last rung's jobs evaluate it)",
        f"- methods: {', '.join(search.methods)}; fixed: {_text(settings_text(search.hyperparameters)) or 'nothing'}",
        f"- budget: {search.spent:.2f} of {search.budget:g} full-job equivalents spent "
        f"({search.planned_cost:.2f} planned), {search.configurations} configurations drawn",
        f"- started {search.created_at:%Y-%m-%d %H:%M} UTC"
        + (f", ended {search.finished_at:%Y-%m-%d %H:%M} UTC" if search.finished_at else ""),
        "",
        "## The answer",
        "",
        _text(answer_text(search)),
        "",
        "## What the budget bought",
        "",
        *_table(["rung", "configurations", "epochs", "seeds", "jobs", "ended", "spent"], _rungs(search)),
        "",
        "## What it varied",
        "",
        *(
            f"- {method}: {_text('; '.join(f'{name}: {what}' for name, what in space.items())) or 'nothing (all fixed)'}"
            for method, space in search.space.items()
        ),
        "",
        "## Trials (the last rung first, each rung's best dev score first)",
        "",
        *_table(
            ["rung", "configuration", "method", "settings", "epochs", "seed", "job", "status", "dev", "test"],
            [
                [
                    t.rung + 1,
                    t.configuration,
                    t.method,
                    settings_text(t.hyperparameters),
                    f"{t.epochs:.3g}",
                    t.seed,
                    t.job_id,
                    t.status,
                    _score(t.dev),
                    _score(t.test),
                ]
                for t in best_first(search)
            ],
        ),
        "",
        "## Best dev score against the budget spent",
        "",
        "![best dev score against the budget spent](best-so-far.svg)",
        "",
        *_table(
            ["budget spent", f"best dev {search.metric}"],
            [[f"{point['spent']:.2f}", f"{point['dev']:.4f}"] for point in _steps(search.best_so_far)],
        ),
        "",
    ]
    return "\n".join(lines)


def _rungs(search: SearchOut) -> list[list[Any]]:
    rows = []
    for index, rung in enumerate(search.schedule["rungs"]):
        trials = [t for t in search.trials if t.rung == index]
        ended = [t for t in trials if t.status in ENDED]
        rows.append(
            [
                index + 1,
                rung["configurations"],
                f"{rung['epochs']:.3g}",
                rung["seeds"],
                len(trials),
                len(ended),
                f"{sum(t.cost for t in trials if t.status in ('succeeded', 'failed')):.2f}",
            ]
        )
    return rows


def _steps(points: Sequence[Mapping[str, float]]) -> list[Mapping[str, float]]:
    """The points of `best_so_far` where the best dev score changed."""
    return [
        p
        for before, p in zip([None, *points], points, strict=False)
        if before is None or p["dev"] != before["dev"]
    ]


def _table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    if not rows:
        return ["(none yet)"]
    head = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return head + ["| " + " | ".join(_text(str(cell)) for cell in row) + " |" for row in rows]


def _epochs(epochs: float) -> str:
    return f"{epochs:.3g} epoch{'' if epochs == 1 else 's'}"


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _text(value: str) -> str:
    """A value as Markdown text on one line: table pipes escaped, line breaks and control characters gone."""
    flat = "".join(c if c.isprintable() else " " for c in value)
    return flat.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;")


__all__ = ["REPORT_FILES", "answer_text", "best_first", "write_search_report"]
