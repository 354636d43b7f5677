"""`pelt search TASK --budget N`: a budget-aware method search through the service (successive halving over
the queue), and `pelt search show|report|list|cancel`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from services.api.schemas import DEFAULT_BACKBONE, SearchOut
from services.client import PeltClient
from services.commands.common import client_errors, parse_set_options, print_table, printable
from services.plots import format_of, settings_text
from services.search_report import answer_text, best_first, write_search_report

STATUSES = ("running", "succeeded", "failed", "cancelled")


class _SearchGroup(click.Group):
    """`pelt search TASK ...` starts a search (`pelt search start TASK ...`); the other words are commands."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["start", *args]
        return super().parse_args(ctx, args)


@click.group("search", cls=_SearchGroup)
def search_group() -> None:
    """Let pelt choose a method and its settings for a task within a budget: `pelt search TASK --budget N`
    (successive halving: many configurations train briefly, the best third trains longer, the last rung
    runs its survivors with several seeds). Also: show, report, list, cancel (a task named like one of these:
    `pelt search start TASK ...`)."""


@search_group.command("start")
@click.argument("task")
@click.option(
    "--budget",
    type=click.FloatRange(0, 10_000, min_open=True),
    required=True,
    help="full-job equivalents: one job at the full epochs (3, or --set epochs=N) on K rows",
)
@click.option(
    "--methods", default=None, help="comma-separated (default: bitfit,lora,pfeiffer,prefix,unipelt)"
)
@click.option("--backbone", default=DEFAULT_BACKBONE, show_default=True)
@click.option(
    "--k-shot", type=int, default=None, help="training rows per job (default: min(500, half the rows))"
)
@click.option(
    "--dev-rows", type=int, default=None, help="the dev split rungs rank by (default: min(500, rows left))"
)
@click.option("--seeds", default=3, show_default=True, help="seeds of each survivor of the last rung")
@click.option("--seed", default=0, show_default=True, help="draws the configurations")
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="KEY=VALUE",
    help="fixed for every job, left out of the search (e.g. batch_size=16, epochs=5 for the full epochs)",
)
@click.option("--watch", is_flag=True, help="then follow it rung by rung to its answer")
@client_errors
def search_start(
    task: str,
    budget: float,
    methods: str | None,
    backbone: str,
    k_shot: int | None,
    dev_rows: int | None,
    seeds: int,
    seed: int,
    assignments: tuple[str, ...],
    watch: bool,
) -> None:
    """Start a search of TASK within --budget; prints its plan (and, with --watch, its answer)."""
    with PeltClient() as client:
        search = client.search(
            task,
            budget,
            methods=None if methods is None else [m.strip() for m in methods.split(",") if m.strip()],
            backbone=backbone,
            k_shot=k_shot,
            dev_rows=dev_rows,
            hyperparameters=parse_set_options(assignments),
            seeds=seeds,
            seed=seed,
        )
        echo_plan(search)
        if watch:
            ended = client.wait_search(search, on_change=echo_progress)
            echo_answer(ended)
            if ended.status != "succeeded":
                raise SystemExit(1)


@search_group.command("show")
@click.argument("search_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="print JSON (every trial)")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="also draw its best dev score against the budget spent into this file (.svg or .png)",
)
@client_errors
def search_show(search_id: int, as_json: bool, plot: str | None) -> None:
    """A search: its plan, its trials by rung (best dev score first), and its answer."""
    if plot is not None:
        try:
            format_of(plot)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--plot") from None
    with PeltClient() as client:
        search = client.get_search(search_id)
        if plot is not None:
            client.plot_search(search_id, plot)
    if as_json:
        click.echo(search.model_dump_json(indent=2))
        return
    echo_plan(search)
    print_table(
        [
            {
                **trial.model_dump(),
                "settings": settings_text(trial.hyperparameters),
                "epochs": f"{trial.epochs:g}",
            }
            for trial in best_first(search)
        ],
        ["rung", "configuration", "method", "settings", "epochs", "seed", "job_id", "status", "dev", "test"],
    )
    echo_answer(search)
    if plot is not None:
        click.echo(f"best dev score against budget -> {plot}")


@search_group.command("report")
@click.argument("search_id", type=int)
@click.option(
    "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="where the report goes"
)
@client_errors
def search_report(search_id: int, out_dir: str) -> None:
    """Write a search's report into a folder: report.md (what the budget bought, what was varied, every
    trial by rung, the answer with its interval, the best dev score against the budget spent),
    report.json (the search with every trial) and best-so-far.svg."""
    with PeltClient() as client:
        search = client.get_search(search_id)
        svg = client.plot_search(search_id)
    for path in write_search_report(Path(out_dir), search, svg):
        click.echo(f"wrote {path}")


@search_group.command("list")
@click.option("--task", default=None)
@click.option("--status", type=click.Choice(STATUSES), default=None)
@client_errors
def search_list(task: str | None, status: str | None) -> None:
    """Searches, newest first."""
    with PeltClient() as client:
        found = client.searches(task=task, status=status)
    print_table(
        [
            {
                **s.model_dump(),
                "budget": f"{s.spent:.1f} of {s.budget:g}",
                "chosen": "" if s.chosen is None else _chosen_name(s.chosen),
            }
            for s in found
        ],
        ["id", "task", "status", "rung", "configurations", "budget", "chosen"],
    )


@search_group.command("cancel")
@click.argument("search_id", type=int)
@client_errors
def search_cancel(search_id: int) -> None:
    """Stop a search and cancel its unfinished jobs (your own; any, with an admin token)."""
    with PeltClient() as client:
        search = client.cancel_search(search_id)
    click.echo(f"search {search.id}: {search.status}")


def echo_plan(search: SearchOut) -> None:
    """What the budget bought: the rungs, the methods and what each varies."""
    rungs = search.schedule["rungs"]
    parts = [
        f"{r['configurations']} × {r['epochs']:.3g} epochs"
        + (f" × {r['seeds']} seeds" if r["seeds"] > 1 else "")
        for r in rungs
    ]
    click.echo(
        f"search {search.id} of {search.task} ({search.status}): {search.configurations} configurations of "
        f"{', '.join(search.methods)} on {search.backbone}, K={search.k_shot}, dev split {search.dev_rows} rows"
    )
    click.echo(
        f"rungs: {'; '.join(parts)}; {search.planned_cost:.1f} of {search.budget:g} full-job equivalents "
        f"planned, {search.spent:.1f} spent"
    )
    for method, space in search.space.items():
        varied = "; ".join(f"{name}: {what}" for name, what in space.items()) or "nothing (all fixed)"
        click.echo(f"  {method}: {printable(varied)}")


def echo_progress(search: SearchOut) -> None:
    rungs = len(search.schedule["rungs"])
    done = sum(
        1 for t in search.trials if t.rung == search.rung and t.status in ("succeeded", "failed", "cancelled")
    )
    total = sum(1 for t in search.trials if t.rung == search.rung)
    click.echo(
        f"search {search.id}: {search.status}, rung {search.rung + 1} of {rungs} ({done}/{total} jobs ended), "
        f"{search.spent:.1f} of {search.budget:g} spent"
    )


def echo_answer(search: SearchOut) -> None:
    if search.status == "succeeded" and search.chosen is not None:
        click.echo(f"chosen: {printable(answer_text(search))}")
    elif search.status in ("failed", "cancelled"):
        click.echo(
            f"search {search.id} {search.status}"
            + (f": {printable(search.last_error)}" if search.last_error else "")
        )


def _chosen_name(chosen: dict[str, Any]) -> str:
    return f"{chosen['method']} {settings_text(chosen['hyperparameters'])}".strip()


__all__ = ["search_group"]
