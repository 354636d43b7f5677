"""The study's report: the paper's Table 1 layout per K (mean ± std over seeds per task, the average over
the tasks) with the paper's BERT-base numbers beside ours, a plain answer to the paper's claim (UniPELT
matches or beats the best single method on the average at each K), the metric-against-K plot of the
averages (`services.plots`), and the same data as JSON."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services import plots
from services.registry.leaderboard import seed_statistics
from services.study.paper import MIXTURES, PAPER_METHODS, SINGLE_METHODS, paper_value
from services.study.plan import StudyPlan, StudyRun

REPORT_FILES = ("report.md", "report.json", "metric-vs-k.svg")


def _stats(cell: Sequence[StudyRun]) -> dict[str, float | int | None]:
    """A cell's test score ×100 pooled over seeds as the leaderboard pools a row (a seed run twice counts
    once): mean, std and the 95% Student-t interval over seeds (None with one seed)."""
    by_seed: dict[int, list[float]] = {}
    for run in cell:
        by_seed.setdefault(run.seed, []).append(100 * run.test)
    summary = seed_statistics(by_seed)
    return {
        "mean": summary.mean,
        "std": summary.std,
        "ci_low": summary.ci_low,
        "ci_high": summary.ci_high,
        "seeds": summary.seeds,
        "runs": len(cell),
    }


def summarize(
    plan: StudyPlan, runs: Sequence[StudyRun], metrics: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Per K and method: each task's test score (×100) as mean ± std over seeds, the paper's number, the
    average over the tasks (its std: over the seeds that every task has), the dev score, where the kept
    checkpoint was and the cost; and per K the answer to the paper's claim. `metrics`: each task's primary
    metric (task name → metric name, as the registry has it), named in the report."""
    by_cell: dict[tuple[int, str, str], list[StudyRun]] = {}
    for run in runs:
        by_cell.setdefault((run.k, run.method, run.task), []).append(run)
    table: dict[str, Any] = {}
    for k in plan.k_values:
        rows: dict[str, Any] = {}
        for method in plan.methods:
            tasks = {}
            for task in plan.tasks:
                cell = sorted(by_cell.get((k, method, task), []), key=lambda r: r.seed)
                tasks[task] = {
                    **(_stats(cell) if cell else {"mean": None, "std": None, "seeds": 0, "runs": 0}),
                    "dev": statistics.fmean(100 * r.dev for r in cell if r.dev is not None)
                    if any(r.dev is not None for r in cell)
                    else None,
                    "best_epoch_median": statistics.median(
                        r.best_epoch for r in cell if r.best_epoch is not None
                    )
                    if any(r.best_epoch is not None for r in cell)
                    else None,
                    "median_train_seconds": statistics.median(r.train_seconds for r in cell)
                    if cell
                    else None,
                    "paper": paper_value(method, k, task),
                    "job_ids": [r.job_id for r in cell],
                }
            complete = all(tasks[t]["runs"] for t in plan.tasks)
            seeds_everywhere = sorted(
                set.intersection(*({r.seed for r in by_cell.get((k, method, t), [])} for t in plan.tasks))
            )
            per_seed = [
                statistics.fmean(
                    100 * r.test for t in plan.tasks for r in by_cell[(k, method, t)] if r.seed == s
                )
                for s in seeds_everywhere
            ]
            average = statistics.fmean(tasks[t]["mean"] for t in plan.tasks) if complete else None
            rows[method] = {
                "tasks": tasks,
                "average": average,
                "average_std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0 if complete else None,
                "paper_average": paper_value(method, k),
                "trainable_percent": next((r.trainable_percent for r in runs if r.method == method), None),
            }
        table[str(k)] = {"methods": rows, "claim": _claim(rows)}
    devices = sorted({run.device for run in runs if run.device})
    return {
        "plan": plan.to_dict(),
        "runs": len(runs),
        "devices": devices,
        "metrics": {task: (metrics or {}).get(task) for task in plan.tasks},
        "by_k": table,
    }


def metrics_sentence(metrics: Mapping[str, str | None]) -> str:
    """The tasks' primary metrics in words: "pearson for stsb; accuracy for sst2, rte" (one name when
    all share it; "each task's primary metric" when none is known)."""
    by_metric: dict[str, list[str]] = {}
    for task, metric in metrics.items():
        by_metric.setdefault(metric or "its primary metric", []).append(task)
    if not by_metric:
        return "each task's primary metric"
    if len(by_metric) == 1:
        metric = next(iter(by_metric))
        return "each task's primary metric" if metric == "its primary metric" else metric
    return "; ".join(f"{metric} for {', '.join(tasks)}" for metric, tasks in by_metric.items())


def _claim(rows: dict[str, Any]) -> dict[str, Any] | None:
    """Does UniPELT (APL) match or beat the best single method on the average? (None without both.)"""
    singles = {m: rows[m]["average"] for m in SINGLE_METHODS if m in rows and rows[m]["average"] is not None}
    mixture = next(
        (m for m in ("unipelt", "unipelt_apl") if m in rows and rows[m]["average"] is not None), None
    )
    if not singles or mixture is None:
        return None
    best = max(singles, key=lambda m: singles[m])
    difference = rows[mixture]["average"] - singles[best]
    noise = max(rows[mixture]["average_std"] or 0.0, rows[best]["average_std"] or 0.0)
    verdict = (
        "beats"
        if difference > 0
        else "matches (within one std over seeds)"
        if -difference <= noise
        else "falls short of"
    )
    return {
        "mixture": mixture,
        "best_single": best,
        "difference": difference,
        "noise": noise,
        "verdict": verdict,
    }


def _cell(stats: dict[str, Any], digits: int = 1) -> str:
    if stats.get("mean") is None:
        return "—"
    spread = "(1 seed)" if stats.get("std") is None else f"± {stats['std']:.{digits}f}"
    text = f"{stats['mean']:.{digits}f} {spread}"
    return text + (f" ({stats['paper']:.1f})" if stats.get("paper") is not None else "")


def markdown(summary: dict[str, Any], command: str) -> str:
    """The report as Markdown: how it was run, one table per K, the claim, the costs."""
    plan = summary["plan"]
    tasks = plan["tasks"]
    lines = [
        "# UniPELT's low-resource study on pelt",
        "",
        f"Generated by `pelt study` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from {summary['runs']} succeeded "
        f"runs, trained on {', '.join(summary['devices']) or 'no device yet'}. Command:",
        "",
        f"```\n{command}\n```",
        "",
        f"Backbone `{plan['backbone']}`; tasks {', '.join(tasks)}; K = {', '.join(map(str, plan['k_values']))}; "
        f"seeds {', '.join(map(str, plan['seeds']))}. Every job: the training rows shuffled by seed, the first K "
        f"for training, the next {plan['dev_rows']} as the dev split (evaluated every epoch, best checkpoint "
        f"kept{', early stopping after ' + str(plan['patience']) + ' evaluations without improvement' if plan['patience'] else ''}), "
        "the task's GLUE validation split as the test set reported here. Hyperparameters by K, the same for "
        f"every task: `{json.dumps(plan['hyperparameters'], sort_keys=True)}` (learning rates: each method's "
        "preset unless set).",
        "",
        f"Cells: test score ×100, mean ± std over seeds ({metrics_sentence(summary.get('metrics') or {})}), "
        "the paper's BERT-base number "
        "in brackets where the paper gives one per task (K=100). *Avg (paper)* is the paper's average over its "
        "GLUE tasks, not over these three: compare the ordering of the methods, not the level.",
        "",
    ]
    for k, block in summary["by_k"].items():
        lines += [f"## K = {k}", ""]
        lines.append(
            "| Method | " + " | ".join(tasks) + " | Avg (ours) | Avg (paper) | dev Avg | trainable % |"
        )
        lines.append("|---|" + "---:|" * (len(tasks) + 4))
        for method, row in block["methods"].items():
            dev = [row["tasks"][t]["dev"] for t in tasks]
            dev_avg = statistics.fmean(dev) if all(d is not None for d in dev) else None
            cells = [_cell(row["tasks"][t]) for t in tasks]
            average = "—" if row["average"] is None else f"{row['average']:.1f} ± {row['average_std']:.1f}"
            paper = "—" if row["paper_average"] is None else f"{row['paper_average']:.2f}"
            percent = "—" if row["trainable_percent"] is None else f"{row['trainable_percent']:.2f}"
            name = PAPER_METHODS.get(method, method)
            lines.append(
                f"| {name} (`{method}`) | " + " | ".join(cells) + f" | **{average}** | {paper} | "
                f"{'—' if dev_avg is None else f'{dev_avg:.1f}'} | {percent} |"
            )
        claim = block["claim"]
        lines.append("")
        if claim is None:
            lines.append("The claim cannot be judged at this K: UniPELT or every single method lacks runs.")
        else:
            lines.append(
                f"**Claim at K={k}:** {PAPER_METHODS.get(claim['mixture'], claim['mixture'])} "
                f"{claim['verdict']} the best single method, {PAPER_METHODS[claim['best_single']]}, on the "
                f"average: {claim['difference']:+.2f} points (std over seeds up to {claim['noise']:.2f})."
            )
        lines.append("")
    lines += [
        "## Where the kept checkpoint was, and the cost",
        "",
        "| K | Method | "
        + " | ".join(f"{t}: best epoch (median)" for t in tasks)
        + " | median train s (per task) |",
        "|---|---|" + "---:|" * (len(tasks) + 1),
    ]
    for k, block in summary["by_k"].items():
        for method, row in block["methods"].items():
            epochs = [row["tasks"][t]["best_epoch_median"] for t in tasks]
            seconds = [row["tasks"][t]["median_train_seconds"] for t in tasks]
            lines.append(
                f"| {k} | `{method}` | "
                + " | ".join("—" if e is None else f"{e:g}" for e in epochs)
                + " | "
                + " / ".join("—" if s is None else f"{s:.0f}" for s in seconds)
                + " |"
            )
    lines += ["", "![the average test score against K per method](metric-vs-k.svg)", ""]
    return "\n".join(lines)


def average_figure(summary: dict[str, Any]) -> plots.Figure:
    """The average over the study's tasks against K, one line per method (mean ± std over seeds)."""
    values: dict[str, dict[int | None, tuple[float, float, int]]] = {}
    for k, block in summary["by_k"].items():
        for method, row in block["methods"].items():
            if row["average"] is not None:
                runs = min(row["tasks"][t]["runs"] for t in row["tasks"])
                values.setdefault(method, {})[int(k)] = (row["average"], row["average_std"], runs)
    tasks = ", ".join(summary["plan"]["tasks"])
    return plots.metric_vs_k_from_values(
        tasks,
        "average test score ×100",
        "max",
        values,
        backbone=summary["plan"]["backbone"],
        title=f"Average over {tasks} against K",
    )


def write_report(
    out_dir: str | Path,
    plan: StudyPlan,
    runs: Sequence[StudyRun],
    command: str,
    metrics: Mapping[str, str] | None = None,
) -> list[Path]:
    """report.md, report.json (the summary and every run) and metric-vs-k.svg in `out_dir`; `metrics`:
    each task's primary metric, named in the report."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(plan, runs, metrics)
    written = [out / name for name in REPORT_FILES]
    written[0].write_text(markdown(summary, command))
    data = {**summary, "command": command, "run_list": [run.__dict__ for run in runs]}
    written[1].write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    if any(
        row["average"] is not None for block in summary["by_k"].values() for row in block["methods"].values()
    ):
        written[2].write_text(plots.render_svg(average_figure(summary)))
    else:
        written.pop()
    return written


__all__ = [
    "MIXTURES",
    "REPORT_FILES",
    "average_figure",
    "markdown",
    "metrics_sentence",
    "summarize",
    "write_report",
]
