"""`pelt serve`: the HTTP API, the dispatcher, Ray, the registry and the MLflow store in one process."""

from __future__ import annotations

import logging
import signal
import threading

import click

from services.dispatcher.cli import config_from_options, pack_size_option


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
@pack_size_option()
@click.option("--drain", is_flag=True, help="on SIGTERM, let running jobs finish instead of requeueing them")
@click.option(
    "--access-log",
    type=click.Choice(["changes", "all", "none"]),
    default="changes",
    show_default=True,
    help="HTTP access lines: requests that change something or fail, every request, or none",
)
def serve_command(
    host: str | None,
    port: int | None,
    dispatcher: bool,
    num_cpus: int | None,
    upgrade: bool | None,
    jobs_per_worker: int,
    pack_size: int,
    gpus_per_worker: float,
    gpu_pack_size: int,
    cpus_per_gpu_worker: float,
    drain: bool,
    access_log: str,
) -> None:
    """Run the service: HTTP API + dispatcher + Ray + registry + MLflow store (embedded by default)."""
    from services.api.server import ApiServer, token_path
    from services.filemodes import private_files

    dispatcher_config = config_from_options(
        jobs_per_worker=jobs_per_worker,
        pack_size=pack_size,
        gpus_per_worker=gpus_per_worker,
        gpu_pack_size=gpu_pack_size,
        cpus_per_gpu_worker=cpus_per_gpu_worker,
    )
    private_files()  # what the service and its local Ray write is for its user only (0600 / 0700)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    service = ApiServer(
        host=host,
        port=port,
        dispatcher=dispatcher,
        num_cpus=num_cpus,
        upgrade=upgrade,
        dispatcher_config=dispatcher_config,
        log_level="info",
        access_log=access_log,
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
    paste = f"the token from {token_path(settings)}" if service.token else "a token from `pelt token create`"
    click.echo(f"  page:         {service.url}/ (paste {paste})")
    click.echo(f"  registry:     {settings.database_url}")
    click.echo(f"  mlflow store: {settings.mlflow_tracking_uri}")
    click.echo(
        f"  ray:          {settings.ray_address or 'local (127.0.0.1)'}"
        f"{'' if dispatcher else ' (no dispatcher here)'}"
    )
    if dispatcher:
        click.echo(f"  workers:      {_workers_line(dispatcher_config)}")
    if service.token:
        click.echo(f"  API token:    in {token_path(settings)} (clients on this machine read it)")
    click.echo(f"  clients:      {client_environment(service.url, settings)}")
    click.echo("stop with Ctrl-C", err=True)
    try:
        stop.wait()
    finally:
        summary = service.stop(drain=drain)
        click.echo(f"pelt stopped{'' if summary is None else f': {summary}'}")


def client_environment(url: str, settings) -> str:
    """What a shell on this machine exports for `pelt` and the Python client to reach this service (the
    data directory is where they find the local token)."""
    return f"export PELT_API_URL={url} PELT_DATA_DIR={settings.data_dir}"


def _workers_line(config) -> str:
    """Which workers the dispatcher will start: on GPUs when Ray sees some (and GPU workers are on)."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    cpu = f"CPU workers of {config.cpus_per_actor:g} CPU(s)"
    if not gpus or not config.gpus_per_worker:
        return f"{cpu}{'' if gpus else ' (Ray sees no GPU)'}"
    return (
        f"GPU workers of {config.gpus_per_worker:g} GPU(s) (packs of up to {config.gpu_pack_size}) on "
        f"{gpus:g} GPU(s) for `any`/`gpu` jobs; {cpu} for `cpu` jobs"
    )


__all__ = ["serve_command"]
