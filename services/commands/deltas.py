"""`pelt leaderboard|pull|compose`: a task's results, its stored deltas and their composition."""

from __future__ import annotations

from pathlib import Path

import click

from pelt_core.vocabulary import COMPOSE_OPERATIONS
from services.api.schemas import LeaderboardOut
from services.client import PeltClient
from services.commands.common import KShot, client_errors, parse_set_options, print_table
from services.plots import VIEWS, check_view, format_of
from services.registry.leaderboard import FULL_SET


@click.command("leaderboard")
@click.argument("task")
@click.option(
    "--k-shot",
    type=KShot(FULL_SET),
    default=None,
    help="only runs with this K ('full': on the full training set)",
)
@click.option(
    "--split",
    type=click.Choice(["test", "dev"]),
    default="test",
    show_default=True,
    help="rank by the metric on the task's evaluation split, or on the study protocol's dev split",
)
@click.option(
    "--order-by",
    type=click.Choice(["mean", "best"]),
    default="mean",
    show_default=True,
    help="rank by the mean over seeds, or by each row's best run",
)
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="draw the leaderboard into this file instead (.svg or .png)",
)
@click.option(
    "--view",
    type=click.Choice(VIEWS),
    default=None,
    help="with --plot: pareto (metric against trainable %, the default) or metric-vs-k (every K)",
)
@client_errors
def leaderboard_command(
    task: str,
    k_shot: int | str | None,
    split: str,
    order_by: str,
    as_json: bool,
    plot: str | None,
    view: str | None,
) -> None:
    """The methods on a task, one row per method and configuration (K and the settings that differ),
    seeds pooled: the mean with its 95% interval, whether it is separable from the top, the best run,
    trainable %; with --plot, drawn into an SVG or PNG file instead."""
    if plot is not None:
        if split != "test" or order_by != "mean":
            raise click.UsageError(
                "--plot draws the test split's leaderboard: leave out --split and --order-by"
            )
        _plot(task, plot, view or "pareto", k_shot, as_json)
        return
    if view is not None:
        raise click.UsageError("--view draws a plot: add --plot FILE (.svg or .png)")
    with PeltClient() as client:
        board = client.leaderboard_raw(task, k_shot, split=split, order_by=order_by)
    if as_json:
        click.echo(board.model_dump_json(indent=2))
        return
    echo_board(board)


def echo_board(board: LeaderboardOut, title: str | None = None) -> None:
    """A leaderboard as a table with a header that says how it ranks and what its columns mean."""
    direction = "higher" if board.metric_direction == "max" else "lower"
    where = "" if board.k_shot is None else f", K={board.k_shot}"
    split = ", on the dev split" if board.split == "dev" else ""
    ranked = "the mean over seeds" if board.order_by == "mean" else "the best run"
    click.echo(
        f"{title or board.task}: {board.metric} ({direction} is better){where}{split}; ranked by {ranked}"
    )
    rows = [
        {
            **row.model_dump(),
            "K": "full" if row.k_shot is None else row.k_shot,
            "config": config_text(row.config),
            "95% interval": "1 seed" if row.ci_low is None else f"{row.ci_low:.4f} to {row.ci_high:.4f}",
            "vs top": tie_text(row.tied_with_top, row.rank),
            "% params": f"{row.trainable_percent:.3f}",
            "train s": f"{row.median_train_seconds:.1f}",
        }
        for row in board.rows
    ]
    columns = ["rank", "method", "K", "config", "mean", "95% interval", "seeds", "vs top", "best"]
    print_table(rows, [*columns, "% params", "train s", "best_job_id"])
    if board.rows:
        click.echo(
            "95% interval: Student-t over seeds. vs top: tied = not separable from rank 1 "
            "(Welch's t-test, p >= 0.05); '?' = a side has one seed"
        )


def config_text(config: dict[str, object]) -> str:
    """A row's distinguishing settings as `name=value` pairs ("" when the method has one configuration)."""
    return " ".join(f"{name}={_setting(value)}" for name, value in config.items())


def _setting(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ",".join(str(item) for item in value)
    return str(value)


def tie_text(tied_with_top: bool | None, rank: int) -> str:
    if rank == 1:
        return "top"
    return {True: "tied", False: "separable", None: "?"}[tied_with_top]


def _plot(task: str, path: str, view: str, k_shot: int | str | None, as_json: bool) -> None:
    """`--plot`: the view drawn by the service into `path`; bad options are refused before any request."""
    if as_json:
        raise click.UsageError("--plot and --json do not go together")
    for check, option in ((lambda: format_of(path), "--plot"), (lambda: check_view(view, k_shot), "--view")):
        try:
            check()
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint=option) from None
    with PeltClient() as client:
        client.plot_leaderboard(task, path, view=view, k_shot=k_shot)
    click.echo(f"{task}: {view}{'' if k_shot is None else f', K={k_shot}'} -> {path}")


@click.command("pull")
@click.argument("task")
@click.option(
    "-o", "--out", required=True, type=click.Path(file_okay=False), help="folder to write the delta to"
)
@click.option("--version", default=None, help="a version number (default: the task's best)")
@click.option("--alias", default=None, help="an alias, e.g. best-lora")
@click.option("--method", default=None, help="the best version of this method")
@click.option(
    "--peft",
    "as_peft",
    is_flag=True,
    help="also write a LoRA delta as a PEFT adapter in OUT/peft (loads its backbone here)",
)
@client_errors
def pull_command(
    task: str, out: str, version: str | None, alias: str | None, method: str | None, as_peft: bool
) -> None:
    """Download a task's delta by task name (its best by default), checked against its sha256."""
    with PeltClient() as client:
        info = client.download(task, out, version=version, alias=alias, method=method)
        value = "" if info.metric_value is None else f", {info.metric} {info.metric_value:.4f}"
        click.echo(
            f"{info.task} version {info.version} ({info.kind}, {info.method}{value}) -> {out}  "
            f"sha256 {info.sha256}"
        )
        if as_peft:
            click.echo(f"PEFT adapter -> {export_pulled_peft(client, info, Path(out))}")


def export_pulled_peft(client: PeltClient, info, folder: Path) -> Path:
    """The pulled LoRA delta written as a PEFT adapter folder (`folder/peft`, loaded by
    `peft.PeftModel.from_pretrained` over the base model; its head beside it); a delta PEFT cannot load (not
    plain LoRA, or a multi-task bundle) is a click error naming why. `folder` holds the version as `pull`
    downloaded it (sha256-checked): it is loaded from there, not downloaded again."""
    from pelt_core.delta import DeltaError, export_peft_lora
    from pelt_core.pulled import load_pulled

    try:
        pulled = load_pulled(info, folder, lambda manifest: client._backbone(manifest, None, "cpu"))
        return export_peft_lora(pulled.delta, pulled.backbone, folder / "peft")
    except DeltaError as exc:
        raise click.ClickException(
            f"--peft: {info.task} version {info.version} ({info.method}): {exc}"
        ) from None


@click.command("compose")
@click.argument("op", type=click.Choice(COMPOSE_OPERATIONS))
@click.argument("sources", nargs=-1, required=True)
@click.option(
    "--into",
    required=True,
    help="a new name for the composition (pulled by that name), or a registered task among the sources",
)
@click.option(
    "--into-existing",
    "into_existing",
    is_flag=True,
    help="allow --into a registered task that none of the sources comes from",
)
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="KEY=VALUE",
    help="options: how=ties, density=0.5, weights=[0.7,0.3], rank=8, ...",
)
@click.option("--alias", "aliases", multiple=True, help="alias for the new version")
@client_errors
def compose_command(
    op: str,
    sources: tuple[str, ...],
    into: str,
    into_existing: bool,
    assignments: tuple[str, ...],
    aliases: tuple[str, ...],
) -> None:
    """Compose stored deltas: SOURCES are "task" (its best), "task@alias" or "task/VERSION"; for
    multi_task, "route=ref". --into a registered task is refused unless it is among the sources or
    --into-existing is given."""
    named = (
        dict(s.split("=", 1) for s in sources)
        if op == "multi_task" and all("=" in s for s in sources)
        else None
    )
    with PeltClient() as client:
        composed = client.compose(
            op,
            named if named is not None else list(sources),
            into,
            aliases=aliases,
            allow_existing=into_existing,
            **parse_set_options(assignments, compose=True),
        )
    click.echo(
        f"{composed.task} version {composed.version}: {op} of {', '.join(sources)} (sha256 {composed.sha256})"
    )


@click.group("versions")
def versions_group() -> None:
    """A task's stored delta versions: list them, archive one."""


@versions_group.command("list")
@click.argument("task")
@client_errors
def versions_list_command(task: str) -> None:
    """Every stored version of TASK with its kind, method, aliases and whether it is archived."""
    with PeltClient() as client:
        versions = client.versions(task)
    rows = [
        {
            "version": v.version,
            "kind": v.kind,
            "method": v.method,
            "aliases": ",".join(v.aliases) or None,
            "archived": "yes" if v.archived else "no",
            "created": v.created_at.strftime("%Y-%m-%d %H:%M"),
        }
        for v in versions
    ]
    print_table(rows, ["version", "kind", "method", "aliases", "archived", "created"])


@versions_group.command("archive")
@click.argument("task")
@click.argument("version", type=click.IntRange(min=1))
@client_errors
def versions_archive_command(task: str, version: int) -> None:
    """Archive VERSION of TASK (an admin token; audited): its aliases go, and no pull by name or alias
    answers with it again; `pelt pull TASK --version VERSION` still does."""
    with PeltClient() as client:
        info = client.archive_version(task, version)
    click.echo(
        f"{info.task} version {info.version} archived ({info.kind}, {info.method}); "
        f"pulled only by --version {info.version} from now on"
    )


__all__ = ["compose_command", "leaderboard_command", "pull_command", "versions_group"]
