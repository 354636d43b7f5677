"""`pelt mlflow …`: set up the MLflow delta store, list a task's versions, repair its aliases."""

from __future__ import annotations

import click

_URI_HELP = "MLflow tracking URI (default: PELT_MLFLOW_TRACKING_URI, else SQLite under PELT_DATA_DIR)"


@click.group("mlflow")
def mlflow_group() -> None:
    """The MLflow delta store: `pelt mlflow upgrade` creates its schema or brings it up to date."""


@mlflow_group.command("upgrade")
@click.option("--uri", default=None, help=_URI_HELP)
@click.option(
    "--wait",
    "wait_seconds",
    default=0.0,
    show_default=True,
    help="for a tracking server: seconds to wait for it to answer",
)
def upgrade_command(uri: str | None, wait_seconds: float) -> None:
    """Create or upgrade MLflow's schema (locked: safe while other processes start); for a tracking
    server, check that it answers (the server upgrades its own database)."""
    from services.delta_store.bootstrap import display_uri, ensure_store, normalize_tracking_uri
    from services.settings import get_settings

    target = normalize_tracking_uri(uri or get_settings().mlflow_tracking_uri)
    revision = ensure_store(uri, wait_seconds=wait_seconds)
    if revision is None:
        click.echo(f"the MLflow server {target} answers")
    else:
        click.echo(f"{display_uri(target)} is at MLflow schema revision {revision}")


@mlflow_group.command("versions")
@click.argument("task")
@click.option("--uri", default=None, help=_URI_HELP)
def versions_command(task: str, uri: str | None) -> None:
    """List a task's model versions: version, kind, job, method, metric, sha256, aliases."""
    from services.delta_store import DeltaStoreError, MlflowDeltaStore

    try:
        versions = MlflowDeltaStore(uri).list_versions(task)
    except DeltaStoreError as exc:
        raise click.ClickException(str(exc)) from exc
    if not versions:
        click.echo(f"task {task!r} has no model versions yet")
        return
    click.echo(
        f"{'version':>7}  {'kind':<10} {'job':<10} {'method':<16} {'metric':<18} {'sha256':<12}  aliases"
    )
    for v in versions:
        metric = "" if v.metric_value is None else f"{v.metric}={v.metric_value:.4g}"
        click.echo(
            f"{v.version:>7}  {v.kind:<10} job={v.job_id or '-':<6} {v.method or '-':<16} {metric:<18} "
            f"{(v.sha256 or '')[:12]}  {' '.join(v.aliases)}"
        )


@mlflow_group.command("reconcile")
@click.argument("tasks", nargs=-1)
@click.option("--uri", default=None, help=_URI_HELP)
def reconcile_command(tasks: tuple[str, ...], uri: str | None) -> None:
    """Repair tasks after crashes (all tasks when none is named): keep only each job's recorded
    version, then point best / best-<method> at the registry's best results."""
    from services.delta_store import DeltaStoreError, MlflowDeltaStore
    from services.registry import Registry

    with Registry() as registry:
        store = MlflowDeltaStore(uri, registry=registry)
        try:
            for task in tasks or store.list_tasks():
                aliases = store.reconcile(task)
                shown = ", ".join(f"{a}={v}" for a, v in sorted(aliases.items())) or "no aliases"
                click.echo(f"{task}: {shown}")
        except DeltaStoreError as exc:
            raise click.ClickException(str(exc)) from exc


__all__ = ["mlflow_group"]
