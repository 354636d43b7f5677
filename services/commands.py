"""The service's `pelt` commands: `serve`, and the client commands over the HTTP API (`task`, `submit`,
`sweep`, `jobs`, `watch`, `cancel`, `leaderboard`, `pull`, `compose`, `audit`), plus `token` (run next
to the registry: tokens are made and revoked there, never over the API; each has a scope: read, write
or admin).

The client commands talk to PELT_API_URL (default http://127.0.0.1:8000) with PELT_API_TOKEN, or with
the token `pelt serve` left in PELT_DATA_DIR/api_token.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import signal
import threading
from collections.abc import Callable
from typing import Any

import click

from services.api.schemas import DEFAULT_BACKBONE
from services.client import PeltAPIError, PeltClient


def _client_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """A refused request ends the command with the service's message (exit status 1)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except PeltAPIError as exc:
            raise click.ClickException(
                f"{exc.message} (HTTP {exc.status})" if exc.status else exc.message
            ) from None

    return wrapper


def _values(assignments: tuple[str, ...], *, compose: bool = False) -> dict[str, Any]:
    """`--set key=value` pairs. Numbers of known fields are read through the table of limits
    (pelt_core/limits.py: hyperparameters and method-spec fields, or `compose`'s options), so "inf", "nan"
    or a value out of range is refused here, naming the key; other values are read as JSON when they parse
    (true, [1, 2]; never NaN or Infinity), else kept as text."""
    from pelt_core.config import ConfigError, parse_assignments, parse_settings
    from pelt_core.limits import COMPOSE_RANGES, LimitError
    from pelt_core.spec import SpecError

    try:
        pairs = parse_assignments(assignments)
        if not compose:
            parsed = parse_settings(pairs)
            return {
                key: _json_or_text(raw) if parsed[key] is raw else parsed[key] for key, raw in pairs.items()
            }
        values: dict[str, Any] = {}
        for key, raw in pairs.items():
            if key == "weights":
                parts = raw.strip().strip("[]").split(",")
                values[key] = [
                    COMPOSE_RANGES["weights"].parse(part, f"weights[{i}]") for i, part in enumerate(parts)
                ]
            elif key in COMPOSE_RANGES:
                values[key] = COMPOSE_RANGES[key].parse(raw, key)
            else:
                values[key] = _json_or_text(raw)
        return values
    except (SpecError, ConfigError, LimitError) as exc:
        raise click.BadParameter(str(exc), param_hint="--set") from None


def _json_or_text(raw: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(constant)

    try:
        value = json.loads(raw, parse_constant=refuse)
    except ValueError:  # JSONDecodeError too
        return raw
    return (
        raw if isinstance(value, float) and not math.isfinite(value) else value
    )  # 1e400: text, refused later


def _ints(text: str | None, option: str, allow_full: bool = False) -> list[Any]:
    if not text:
        return []
    out: list[Any] = []
    for part in text.split(","):
        part = part.strip()
        if allow_full and part.lower() in ("full", "all", "none"):
            out.append(None)
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise click.BadParameter(f"{part!r} is not an integer", param_hint=option) from None
    return out


def _table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    if not rows:
        click.echo("(none)")
        return
    text = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in text)) for i, c in enumerate(columns)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in text:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


# --- pelt serve -----------------------------------------------------------------------------------


@click.command("serve")
@click.option("--host", default=None, help="listen address (default PELT_API_HOST, 127.0.0.1)")
@click.option("--port", type=int, default=None, help="port (default PELT_API_PORT, 8000)")
@click.option(
    "--dispatcher/--no-dispatcher",
    default=True,
    show_default=True,
    help="run the dispatcher here (else run `pelt dispatcher` elsewhere)",
)
@click.option("--num-cpus", type=int, default=None, help="CPUs of the local Ray (without PELT_RAY_ADDRESS)")
@click.option(
    "--upgrade/--no-upgrade",
    default=None,
    help="create/upgrade the registry schema at start (default: only for the embedded SQLite)",
)
@click.option(
    "--jobs-per-worker",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="job slots per worker process (more jobs share one runtime: less memory per job)",
)
@click.option("--drain", is_flag=True, help="on SIGTERM, let running jobs finish instead of requeueing them")
def serve_command(
    host: str | None,
    port: int | None,
    dispatcher: bool,
    num_cpus: int | None,
    upgrade: bool | None,
    jobs_per_worker: int,
    drain: bool,
) -> None:
    """Run the service: HTTP API + dispatcher + Ray + registry + MLflow store (embedded by default)."""
    from services.api.server import Service, token_path
    from services.dispatcher import DispatcherConfig
    from services.filemodes import private_files

    private_files()  # what the service and its local Ray write is for its user only (0600 / 0700)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    service = Service(
        host=host,
        port=port,
        dispatcher=dispatcher,
        num_cpus=num_cpus,
        upgrade=upgrade,
        dispatcher_config=DispatcherConfig(jobs_per_worker=jobs_per_worker),
        log_level="info",
    ).start()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    settings = service.settings
    docs = (
        f"{service.url}/docs"
        if settings.api_docs
        else "/openapi.json with a token; PELT_API_DOCS=true for /docs"
    )
    click.echo(f"pelt serving on {service.url} (OpenAPI: {docs})")
    click.echo(f"  registry:     {settings.database_url}")
    click.echo(f"  mlflow store: {settings.mlflow_tracking_uri}")
    click.echo(
        f"  ray:          {settings.ray_address or 'local (127.0.0.1)'}"
        f"{'' if dispatcher else ' (no dispatcher here)'}"
    )
    if service.token:
        click.echo(f"  API token:    in {token_path(settings)} (clients on this machine read it)")
    click.echo("stop with Ctrl-C", err=True)
    try:
        stop.wait()
    finally:
        summary = service.stop(drain=drain)
        click.echo(f"pelt stopped{'' if summary is None else f': {summary}'}")


# --- tasks ----------------------------------------------------------------------------------------


@click.group("task")
def task_group() -> None:
    """Register and inspect tasks (a dataset + what to predict + how to score it)."""


@task_group.command("add")
@click.argument("name")
@click.option("--train", type=click.Path(exists=True, dir_okay=False), help="JSON Lines, CSV/TSV or Parquet")
@click.option("--validation", type=click.Path(exists=True, dir_okay=False))
@click.option("--test", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--dataset", type=click.Path(exists=True, file_okay=False), help="a datasets save_to_disk folder"
)
@click.option("--text-field", "text_fields", multiple=True, required=True, help="text column (once or twice)")
@click.option("--label-field", default="label", show_default=True)
@click.option(
    "--problem-type",
    default="single_label_classification",
    show_default=True,
    type=click.Choice(["single_label_classification", "multi_label_classification", "regression"]),
)
@click.option(
    "--metric",
    default="accuracy",
    show_default=True,
    help="accuracy, f1, matthews_correlation, pearson, spearman, ...",
)
@click.option("--label-names", default=None, help="comma-separated class names, in label-index order")
@click.option("--max-length", default=128, show_default=True)
@click.option("--description", default="")
@_client_errors
def task_add(
    name: str,
    train: str | None,
    validation: str | None,
    test: str | None,
    dataset: str | None,
    text_fields: tuple[str, ...],
    label_field: str,
    problem_type: str,
    metric: str,
    label_names: str | None,
    max_length: int,
    description: str,
) -> None:
    """Upload a task's data and register it (fields and labels are checked against the data)."""
    with PeltClient() as client:
        task = client.register_task(
            name,
            train,
            validation,
            test,
            dataset=dataset,
            text_fields=list(text_fields),
            label_field=label_field,
            problem_type=problem_type,
            metric=metric,
            label_names=None if label_names is None else label_names.split(","),
            max_length=max_length,
            description=description,
        )
    click.echo(
        f"task {task.name}: {task.train_size} training rows, splits {task.split_sizes}, "
        f"labels {task.label_names}, metric {task.metric}"
    )


@task_group.command("list")
@_client_errors
def task_list() -> None:
    """Every task."""
    with PeltClient() as client:
        rows = [t.model_dump() for t in client.tasks()]
    _table(rows, ["name", "train_size", "problem_type", "metric", "label_names"])


@task_group.command("show")
@click.argument("name")
@_client_errors
def task_show(name: str) -> None:
    """One task, as JSON."""
    with PeltClient() as client:
        click.echo(client.task(name).model_dump_json(indent=2))


# --- jobs -----------------------------------------------------------------------------------------


@click.command("submit")
@click.argument("task")
@click.argument("method")
@click.option("--backbone", default=DEFAULT_BACKBONE, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--k-shot", type=int, default=None, help="K training examples (default: the full training set)")
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="KEY=VALUE",
    help="hyperparameter or method override: lr=1e-3, epochs=5, r=16, ...",
)
@click.option("--priority", default=0, show_default=True)
@click.option("--watch", is_flag=True, help="then show its progress until it ends")
@_client_errors
def submit_command(
    task: str,
    method: str,
    backbone: str,
    seed: int,
    k_shot: int | None,
    assignments: tuple[str, ...],
    priority: int,
    watch: bool,
) -> None:
    """Queue one job; prints its id."""
    with PeltClient() as client:
        job = client.submit(
            task,
            method,
            backbone=backbone,
            seed=seed,
            k_shot=k_shot,
            hyperparameters=_values(assignments),
            priority=priority,
        )
        click.echo(f"job {job.id} queued: {job.task} / {job.method} on {job.backbone}")
        if watch:
            _watch(client, [job.id])


@click.command("sweep")
@click.argument("task")
@click.option("--methods", required=True, help="comma-separated, e.g. lora,bitfit,prefix")
@click.option("--seeds", default="0", show_default=True, help="comma-separated")
@click.option(
    "--k", "k_values", default="full", show_default=True, help="comma-separated K values; 'full': all rows"
)
@click.option("--backbone", default=DEFAULT_BACKBONE, show_default=True)
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE", help="applies to every job")
@click.option("--priority", default=0, show_default=True)
@click.option("--watch", is_flag=True, help="then show the jobs' progress until they end")
@_client_errors
def sweep_command(
    task: str,
    methods: str,
    seeds: str,
    k_values: str,
    backbone: str,
    assignments: tuple[str, ...],
    priority: int,
    watch: bool,
) -> None:
    """Queue methods × seeds × K values for a task."""
    with PeltClient() as client:
        sweep = client.sweep(
            task,
            [m.strip() for m in methods.split(",") if m.strip()],
            backbone=backbone,
            seeds=_ints(seeds, "--seeds"),
            k_values=_ints(k_values, "--k", allow_full=True),
            hyperparameters=_values(assignments),
            priority=priority,
        )
        click.echo(
            f"sweep {sweep.id}: {len(sweep.job_ids)} jobs queued ({sweep.job_ids[0]}..{sweep.job_ids[-1]})"
        )
        if watch:
            _watch(client, sweep.job_ids)


@click.command("jobs")
@click.option("--task", default=None)
@click.option(
    "--status", multiple=True, type=click.Choice(["queued", "running", "succeeded", "failed", "cancelled"])
)
@click.option("--method", default=None)
@click.option("--sweep", "sweep_id", type=int, default=None)
@click.option("--limit", default=100, show_default=True)
@_client_errors
def jobs_command(
    task: str | None, status: tuple[str, ...], method: str | None, sweep_id: int | None, limit: int
) -> None:
    """List jobs (oldest first) with their status and progress."""
    with PeltClient() as client:
        jobs = client.jobs(
            task=task, status=list(status) or None, method=method, sweep_id=sweep_id, limit=limit
        )
    rows = [
        {
            **j.model_dump(),
            "progress": None if j.progress is None else f"{100 * j.progress:.0f}%",
            "error": (j.last_error or "")[:60] or None,
        }
        for j in jobs
    ]
    _table(rows, ["id", "task", "method", "seed", "k_shot", "status", "attempts", "progress", "error"])


@click.command("watch")
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--sweep", "sweep_id", type=int, default=None, help="every job of this sweep")
@_client_errors
def watch_command(job_ids: tuple[int, ...], sweep_id: int | None) -> None:
    """Live progress bars (step/total, loss, tokens/s) until the jobs end."""
    if not job_ids and sweep_id is None:
        raise click.UsageError("give job ids or --sweep")
    with PeltClient() as client:
        ids = list(job_ids)
        if sweep_id is not None:
            ids += [job.id for job in client.jobs(sweep_id=sweep_id, limit=10_000)]
        _watch(client, ids)


def _watch(client: PeltClient, ids: list[int]) -> None:
    ended = client.wait(ids)
    for job in ended:
        line = f"job {job.id} {job.method}: {job.status}"
        if job.status == "succeeded":
            result = client.result(job.id)
            line += f", {client.task(job.task).metric} {result.primary_metric:.4f}"
        elif job.last_error:
            line += f": {job.last_error.splitlines()[-1][:200]}"
        click.echo(line)
    if any(job.status != "succeeded" for job in ended):
        raise SystemExit(1)


@click.command("cancel")
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--sweep", "sweep_id", type=int, default=None, help="cancel every unfinished job of this sweep")
@_client_errors
def cancel_command(job_ids: tuple[int, ...], sweep_id: int | None) -> None:
    """Cancel jobs (a running one stops within seconds; a cancelled job is never retried)."""
    if not job_ids and sweep_id is None:
        raise click.UsageError("give job ids or --sweep")
    with PeltClient() as client:
        for job_id in job_ids:
            job = client.cancel(job_id)
            click.echo(f"job {job.id}: {job.status}{' (stopping)' if job.status == 'running' else ''}")
        if sweep_id is not None:
            click.echo(f"sweep {sweep_id}: {client.cancel_sweep(sweep_id)} job(s) cancelled")


# --- leaderboard, deltas ----------------------------------------------------------------------------


@click.command("leaderboard")
@click.argument("task")
@click.option("--k-shot", type=int, default=None, help="only runs with this K")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@_client_errors
def leaderboard_command(task: str, k_shot: int | None, as_json: bool) -> None:
    """The methods on a task, best first: best and mean ± std of its metric, trainable %, runs."""
    with PeltClient() as client:
        board = client.leaderboard_raw(task, k_shot)
    if as_json:
        click.echo(board.model_dump_json(indent=2))
        return
    click.echo(
        f"{task}: {board.metric} ({'higher' if board.metric_direction == 'max' else 'lower'} is better)"
        f"{'' if k_shot is None else f', K={k_shot}'}"
    )
    rows = [
        {
            **r.model_dump(),
            "mean ± std": f"{r.mean:.4f} ± {r.std:.4f}",
            "% params": f"{r.trainable_percent:.3f}",
            "train s": f"{r.median_train_seconds:.1f}",
        }
        for r in board.rows
    ]
    _table(rows, ["rank", "method", "best", "mean ± std", "runs", "% params", "train s", "best_job_id"])


@click.command("pull")
@click.argument("task")
@click.option(
    "-o", "--out", required=True, type=click.Path(file_okay=False), help="folder to write the delta to"
)
@click.option("--version", default=None, help="a version number (default: the task's best)")
@click.option("--alias", default=None, help="an alias, e.g. best-lora")
@click.option("--method", default=None, help="the best version of this method")
@_client_errors
def pull_command(task: str, out: str, version: str | None, alias: str | None, method: str | None) -> None:
    """Download a task's delta by task name (its best by default), checked against its sha256."""
    with PeltClient() as client:
        info = client.download(task, out, version=version, alias=alias, method=method)
    value = "" if info.metric_value is None else f", {info.metric} {info.metric_value:.4f}"
    click.echo(
        f"{info.task} version {info.version} ({info.kind}, {info.method}{value}) -> {out}  "
        f"sha256 {info.sha256}"
    )


@click.command("compose")
@click.argument("op", type=click.Choice(["merge", "average", "merge_lora_svd", "multi_task"]))
@click.argument("sources", nargs=-1, required=True)
@click.option("--into", required=True, help="the task whose new version the result becomes")
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="KEY=VALUE",
    help="options: how=ties, density=0.5, weights=[0.7,0.3], rank=8, ...",
)
@click.option("--alias", "aliases", multiple=True, help="alias for the new version")
@_client_errors
def compose_command(
    op: str, sources: tuple[str, ...], into: str, assignments: tuple[str, ...], aliases: tuple[str, ...]
) -> None:
    """Compose stored deltas: SOURCES are "task" (its best), "task@alias" or "task/VERSION"; for
    multi_task, "route=ref"."""
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
            **_values(assignments, compose=True),
        )
    click.echo(
        f"{composed.task} version {composed.version}: {op} of {', '.join(sources)} (sha256 {composed.sha256})"
    )


# --- tokens (next to the registry) ------------------------------------------------------------------


@click.group("token")
def token_group() -> None:
    """API tokens, made and revoked in the registry (PELT_DATABASE_URL); only their SHA-256 is stored."""


def _cli_actor() -> str:
    """Who the audit trail names for a `pelt token` command: the operating-system user."""
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli"


@token_group.command("create")
@click.argument("name")
@click.option(
    "--scope",
    type=click.Choice(["read", "write", "admin"]),
    default="write",
    show_default=True,
    help="read: every GET; write: read + submit, cancel, register tasks and methods, compose; "
    "admin: write + register backbones, full job errors, the audit trail",
)
def token_create(name: str, scope: str) -> None:
    """Create a token and print its secret (shown once)."""
    from services.registry import Registry, RegistryValidationError, acting_as

    with Registry() as registry, acting_as(_cli_actor()):
        try:
            record, secret = registry.create_api_token(name, scope=scope)
        except RegistryValidationError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"token {record.name} ({record.scope}) created; its secret (shown only now):", err=True)
    click.echo(secret)


@token_group.command("list")
def token_list() -> None:
    """Every token: name, scope, prefix, created, last used, revoked."""
    from services.registry import Registry

    with Registry() as registry:
        rows = [
            {
                "name": t.name,
                "scope": t.scope,
                "prefix": t.prefix + "…",
                "created": t.created_at.isoformat(timespec="seconds"),
                "last used": t.last_used_at and t.last_used_at.isoformat(timespec="seconds"),
                "revoked": t.revoked_at and t.revoked_at.isoformat(timespec="seconds"),
            }
            for t in registry.list_api_tokens()
        ]
    _table(rows, ["name", "scope", "prefix", "created", "last used", "revoked"])


@token_group.command("revoke")
@click.argument("name")
def token_revoke(name: str) -> None:
    """Revoke a token: every request with it is refused from now on."""
    from services.registry import Registry, RegistryValidationError, acting_as

    with Registry() as registry, acting_as(_cli_actor()):
        try:
            registry.revoke_api_token(name)
        except RegistryValidationError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"token {name} revoked")


# --- audit ----------------------------------------------------------------------------------------


@click.command("audit")
@click.option("--limit", default=50, show_default=True)
@click.option("--offset", default=0, show_default=True)
@_client_errors
def audit_command(limit: int, offset: int) -> None:
    """Who registered, submitted, cancelled, composed, created or revoked what, newest first (an admin token)."""
    with PeltClient() as client:
        events = client.audit(limit=limit, offset=offset)
    rows = [
        {
            "at": e.at.isoformat(timespec="seconds"),
            "actor": e.actor,
            "action": e.action,
            "target": e.target,
            "detail": json.dumps(e.detail, sort_keys=True)[:80] if e.detail else None,
        }
        for e in events
    ]
    _table(rows, ["at", "actor", "action", "target", "detail"])


SERVICE_COMMANDS = [
    serve_command,
    task_group,
    submit_command,
    sweep_command,
    jobs_command,
    watch_command,
    cancel_command,
    leaderboard_command,
    pull_command,
    compose_command,
    token_group,
    audit_command,
]
