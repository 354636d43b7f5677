"""`pelt submit|sweep|jobs|watch|cancel|result|events`: queue jobs and sweeps, list and follow them, cancel
them, read what a job ended with and what happened to it."""

from __future__ import annotations

from typing import Any

import click

from services.api.schemas import DEFAULT_BACKBONE, JOB_DEVICES
from services.client import PeltClient
from services.commands.common import (
    KShot,
    client_errors,
    parse_ints,
    parse_set_options,
    print_table,
    printable,
)

MAX_WATCH_ERROR_CHARS = 200  # of a failed job's error, on its line of `pelt watch`

device_option = click.option(
    "--device",
    type=click.Choice(JOB_DEVICES),
    default="any",
    show_default=True,
    help="where the job may run: any (a GPU worker where the cluster has GPUs, else a CPU worker), cpu or gpu",
)


@click.command("submit")
@click.argument("task")
@click.argument("method")
@click.option("--backbone", default=DEFAULT_BACKBONE, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--k-shot",
    type=KShot(),
    default=None,
    help="K training examples (default, or 'full': the full training set)",
)
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="KEY=VALUE",
    help="hyperparameter or method override: lr=1e-3, epochs=5, r=16, ...",
)
@click.option("--priority", default=0, show_default=True)
@device_option
@click.option("--watch", is_flag=True, help="then show its progress until it ends")
@client_errors
def submit_command(
    task: str,
    method: str,
    backbone: str,
    seed: int,
    k_shot: int | None,
    assignments: tuple[str, ...],
    priority: int,
    device: str,
    watch: bool,
) -> None:
    """Queue one job; prints its id."""
    with PeltClient() as client:
        say_if_first_use(client, backbone)
        job = client.submit(
            task,
            method,
            backbone=backbone,
            seed=seed,
            k_shot=k_shot,
            hyperparameters=parse_set_options(assignments),
            priority=priority,
            device=device,
        )
        where = "" if job.device == "any" else f" ({job.device} only)"
        click.echo(f"job {job.id} queued: {job.task} / {job.method} on {job.backbone}{where}")
        if watch:
            _watch(client, [job.id])


@click.command("fuse")
@click.argument("task")
@click.option(
    "--from",
    "sources",
    multiple=True,
    required=True,
    metavar="TASK[@ALIAS|/VERSION]",
    help="a stored adapter delta to fuse (repeat it): sst2 (its best), sst2@best-pfeiffer, sst2/3",
)
@click.option("--own-adapter", is_flag=True, help="train the task's own adapter alongside the fusion")
@click.option("--backbone", default=None, help="default: the backbone the sources were trained on")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--k-shot", type=KShot(), default=None, help="K training examples (default, or 'full': all rows)"
)
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE", help="lr=5e-5, epochs=10, ...")
@click.option("--priority", default=0, show_default=True)
@device_option
@click.option("--watch", is_flag=True, help="then show its progress until it ends")
@client_errors
def fuse_command(
    task: str,
    sources: tuple[str, ...],
    own_adapter: bool,
    backbone: str | None,
    seed: int,
    k_shot: int | None,
    assignments: tuple[str, ...],
    priority: int,
    device: str,
    watch: bool,
) -> None:
    """Queue an AdapterFusion job: TASK learns how to combine the stored adapters of other tasks (frozen);
    prints its id. Its delta is pulled and served by TASK's name like any other."""
    with PeltClient() as client:
        job = client.fuse(
            task,
            sources,
            own_adapter=own_adapter,
            backbone=backbone,
            seed=seed,
            k_shot=k_shot,
            hyperparameters=parse_set_options(assignments),
            priority=priority,
            device=device,
        )
        names = ", ".join(f"{s['task']} v{s['version']}" for s in job.sources or [])
        click.echo(f"job {job.id} queued: {job.task} / fusion of {names} on {job.backbone}")
        if watch:
            _watch(client, [job.id])


def say_if_first_use(client: PeltClient, backbone: str) -> None:
    """Before a submit that may wait: say so when the backbone is not registered yet (the service registers
    a packaged one on first use, loading and hashing its weights, which can take a minute)."""
    if backbone not in {known.name for known in client.backbones()}:
        click.echo(
            f"backbone {backbone} is not registered yet: registering it on first use (hashing its weights; "
            "this can take a minute)…",
            err=True,
        )


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
@device_option
@click.option(
    "--again",
    is_flag=True,
    help="queue new runs even if the same sweep was already submitted (else that sweep's jobs are shown)",
)
@click.option("--watch", is_flag=True, help="then show the jobs' progress until they end")
@click.option("--check", is_flag=True, help="check the sweep as submitting it would, and queue nothing")
@client_errors
def sweep_command(
    task: str,
    methods: str,
    seeds: str,
    k_values: str,
    backbone: str,
    assignments: tuple[str, ...],
    priority: int,
    device: str,
    again: bool,
    watch: bool,
    check: bool,
) -> None:
    """Queue methods × seeds × K values for a task; the same sweep again queues nothing (it shows the
    jobs already submitted) unless --again. --check: only check it (the names, each K against the task's
    rows, the ranges)."""
    sweep_of: dict[str, Any] = {
        "task": task,
        "methods": [m.strip() for m in methods.split(",") if m.strip()],
        "backbone": backbone,
        "seeds": parse_ints(seeds, "--seeds"),
        "k_values": parse_ints(k_values, "--k", allow_full=True),
        "hyperparameters": parse_set_options(assignments),
        "device": device,
    }
    given = click.get_current_context().get_parameter_source
    if check and (again or watch or given("priority") != click.core.ParameterSource.DEFAULT):
        raise click.UsageError("--check queues nothing: it takes no --again, --watch or --priority")
    with PeltClient() as client:
        say_if_first_use(client, backbone)
        if check:
            jobs = client.check_sweep(**sweep_of)
            click.echo(f"the sweep checks out: it holds {jobs} jobs (nothing queued)")
            return
        sweep = client.sweep(**sweep_of, priority=priority, again=again)
        span = f"({sweep.job_ids[0]}..{sweep.job_ids[-1]})"
        if sweep.already_submitted:
            click.echo(
                f"sweep {sweep.id}: already submitted: its {len(sweep.job_ids)} jobs {span} are queued, "
                "running or done; nothing queued now (--again queues new runs)"
            )
        else:
            click.echo(f"sweep {sweep.id}: {len(sweep.job_ids)} jobs queued {span}")
        if watch:
            _watch(client, sweep.job_ids)


@click.command("jobs")
@click.option("--task", default=None)
@click.option(
    "--status", multiple=True, type=click.Choice(["queued", "running", "succeeded", "failed", "cancelled"])
)
@click.option("--method", default=None)
@click.option("--sweep", "sweep_id", type=int, default=None)
@click.option(
    "--limit", default=100, show_default=True, help="jobs to list (fetched 1,000 a request: any number works)"
)
@client_errors
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
    print_table(
        rows, ["id", "task", "method", "seed", "k_shot", "device", "status", "attempts", "progress", "error"]
    )


@click.command("watch")
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--sweep", "sweep_id", type=int, default=None, help="every job of this sweep")
@client_errors
def watch_command(job_ids: tuple[int, ...], sweep_id: int | None) -> None:
    """Live progress bars (step/total, loss, tokens/s) until the jobs end."""
    if not job_ids and sweep_id is None:
        raise click.UsageError("give job ids or --sweep")
    with PeltClient() as client:
        ids = list(job_ids)
        if sweep_id is not None:
            ids += [job.id for job in client.jobs(sweep_id=sweep_id, limit=None)]
        _watch(client, ids)


def _watch(client: PeltClient, ids: list[int]) -> None:
    ended = client.wait(ids)
    for job in ended:
        line = f"job {job.id} {job.method}: {job.status}"
        if job.status == "succeeded":
            result = client.result(job.id)
            metric = client.task(job.task).metric
            if result.primary_metric is not None:
                line += f", {metric} {result.primary_metric:.4f}"
            else:  # a test set left out (evaluate_test=false): its best dev score
                line += f", {metric} on dev {result.dev_primary_metric:.4f} (test set left out)"
            if result.device:
                line += f" on {result.device}"
            if result.job_memory_bytes is not None:
                line += f" ({result.job_memory_bytes / 2**20:.1f} MiB of job memory)"
        elif job.last_error:
            line += f": {_error_tail(job.last_error)}"
        click.echo(line)
    if any(job.status != "succeeded" for job in ended):
        raise SystemExit(1)


def _error_tail(error: str, limit: int = MAX_WATCH_ERROR_CHARS) -> str:
    """A job's stored error on one line (`printable`: a newline shows as `\\n`, so it cannot forge another
    job's line or restyle the terminal), its last `limit` characters (a traceback ends with its message)."""
    text = printable(error.strip())
    return text if len(text) <= limit else "…" + text[-(limit - 1) :]


@click.command("cancel")
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--sweep", "sweep_id", type=int, default=None, help="cancel every unfinished job of this sweep")
@client_errors
def cancel_command(job_ids: tuple[int, ...], sweep_id: int | None) -> None:
    """Cancel jobs (a running one stops within seconds; a cancelled job is never retried). A write token
    cancels the jobs and sweeps it submitted; another token's need an admin token."""
    if not job_ids and sweep_id is None:
        raise click.UsageError("give job ids or --sweep")
    with PeltClient() as client:
        for job_id in job_ids:
            job = client.cancel(job_id)
            click.echo(f"job {job.id}: {job.status}{' (stopping)' if job.status == 'running' else ''}")
        if sweep_id is not None:
            click.echo(f"sweep {sweep_id}: {client.cancel_sweep(sweep_id)} job(s) cancelled")


@click.command("result")
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="print the whole result as JSON")
@client_errors
def result_command(job_id: int, as_json: bool) -> None:
    """A succeeded job's result: its metrics, where and how long it trained, its delta version."""
    with PeltClient() as client:
        result = client.result(job_id)
    if as_json:
        click.echo(result.model_dump_json(indent=2))
        return
    metrics = ", ".join(f"{name} {value:.4f}" for name, value in result.metrics.items() if _number(value))
    if result.primary_metric is None:
        metrics = "no test metrics: the job left its test set out (evaluate_test=false)"
    click.echo(f"job {result.job_id} (attempt {result.attempt}): {metrics}")
    if result.dev_metrics:
        dev = ", ".join(f"{name} {value:.4f}" for name, value in result.dev_metrics.items() if _number(value))
        click.echo(f"  dev (the kept checkpoint): {dev}")
    click.echo(
        f"  trained {result.train_seconds:.1f} s on {result.device or '-'}; "
        f"{result.trainable_params:,} trainable parameters ({result.trainable_percent:.3f}%)"
    )
    click.echo(f"  delta: version {result.mlflow_model_version or '-'}, sha256 {result.delta_sha256 or '-'}")


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@click.command("events")
@click.argument("job_id", type=int)
@client_errors
def events_command(job_id: int) -> None:
    """A job's history: each change of status, when, why and on which worker."""
    with PeltClient() as client:
        events = client.events(job_id)
    print_table(
        [
            {
                "at": e.at.isoformat(timespec="seconds"),
                "from": e.from_status,
                "to": e.to_status,
                "worker": e.worker_id,
                "reason": e.reason,
            }
            for e in events
        ],
        ["at", "from", "to", "worker", "reason"],
    )


__all__ = [
    "cancel_command",
    "events_command",
    "jobs_command",
    "result_command",
    "say_if_first_use",
    "submit_command",
    "sweep_command",
    "watch_command",
]
