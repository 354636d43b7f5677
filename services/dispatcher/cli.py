"""`pelt dispatcher`: run one dispatcher until SIGTERM/SIGINT (`serve`), and its command-line options."""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

from services.dispatcher.config import (
    DEFAULT_GPU_PACK_SIZE,
    DEFAULT_PACK_SIZE,
    MAX_PACK_SIZE,
    DispatcherConfig,
)
from services.dispatcher.ray_cluster import connect_ray
from services.settings import get_settings

if TYPE_CHECKING:
    from workers.job import DeltaSink


def serve(
    registry_url: str | None = None,
    *,
    config: DispatcherConfig | None = None,
    num_cpus: int | None = None,
    drain: bool = False,
    delta_store: str = "local",
    handover: bool = False,
) -> None:
    """Run a dispatcher until SIGTERM/SIGINT, then shut it down (the `pelt dispatcher` command): it leads
    the namespace, or stands by while another dispatcher leads and takes over when that one stops.

    delta_store: "local" (LocalDeltaSink under PELT_DATA_DIR/deltas) or "mlflow" (MlflowDeltaStore on
    PELT_MLFLOW_TRACKING_URI, its schema created or upgraded first). handover: on SIGTERM leave the workers
    and their jobs running for the next leader (a standby takes over at once) instead of stopping them."""
    from services.dispatcher.dispatcher import Dispatcher  # here: `pelt --help` needs none of it
    from services.registry import Registry

    settings = get_settings()
    config = config or DispatcherConfig()
    started = connect_ray(settings, namespace=config.namespace, num_cpus=num_cpus)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    registry = Registry(registry_url, settings=settings)
    sink: DeltaSink | None = None
    if delta_store == "mlflow":
        from services.delta_store import MlflowDeltaStore

        sink = MlflowDeltaStore.from_settings(settings, registry=registry, ensure=True)
    elif delta_store != "local":
        raise ValueError(f"delta_store must be local or mlflow, got {delta_store!r}")
    dispatcher = Dispatcher(registry, sink, config=config, settings=settings).start()
    print(
        f"dispatcher running as {dispatcher.role} (namespace {config.namespace}, "
        f"Ray {'started here' if started else 'joined'})",
        flush=True,
    )
    try:
        while not stop.wait(1.0) and not dispatcher.stopped.is_set():
            pass
    finally:
        if dispatcher.broken is not None:
            dispatcher.detach()
            summary = {"stats": dict(dispatcher.stats), "gave_up": dispatcher.broken}
        elif handover:
            dispatcher.detach()
            summary = {"stats": dict(dispatcher.stats), "handed_over": True}
        else:
            summary = dispatcher.shutdown(drain=drain)
        registry.close()
        print(f"dispatcher stopped: {summary}", flush=True)
        if started:
            import ray

            ray.shutdown()
    if dispatcher.broken is not None:  # for its supervisor (compose, Kubernetes) to start it again
        raise SystemExit(1)


def pack_size_option() -> Any:
    """The worker options `pelt dispatcher` and `pelt serve` share: `--pack-size` and the GPU workers'
    `--gpus-per-worker`, `--gpu-pack-size`, `--cpus-per-gpu-worker`."""
    import click

    options = [
        click.option(
            "--pack-size",
            type=click.IntRange(1, MAX_PACK_SIZE),
            default=DEFAULT_PACK_SIZE,
            show_default=True,
            help="jobs a CPU worker trains together through one backbone pass per step (same backbone; "
            "methods mixed)",
        ),
        click.option(
            "--gpus-per-worker",
            type=click.FloatRange(min=0),
            default=1.0,
            show_default=True,
            help="GPUs each GPU worker asks Ray for, on nodes with GPUs (a fraction: workers share a GPU, "
            "each with its own backbone copy; 0: no GPU workers)",
        ),
        click.option(
            "--gpu-pack-size",
            type=click.IntRange(1, MAX_PACK_SIZE),
            default=DEFAULT_GPU_PACK_SIZE,
            show_default=True,
            help="jobs a GPU worker trains together as one pack on its GPU",
        ),
        click.option(
            "--cpus-per-gpu-worker",
            type=click.FloatRange(min=0, min_open=True),
            default=1.0,
            show_default=True,
            help="Ray CPUs each GPU worker reserves (its torch threads, rounded)",
        ),
    ]

    def decorate(command: Any) -> Any:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def config_from_options(**options: Any) -> DispatcherConfig:
    """The DispatcherConfig of a command's options; options it refuses together are a usage error."""
    import click

    try:
        return DispatcherConfig(**options)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def _command() -> Any:
    import click

    @click.command("dispatcher")
    @click.option("--database-url", default=None, help="registry (default: PELT_DATABASE_URL)")
    @click.option("--namespace", default="pelt", show_default=True, help="Ray namespace of the workers")
    @click.option(
        "--cpus-per-worker",
        default=1.0,
        show_default=True,
        help="Ray CPUs per job slot (each job's torch threads, rounded)",
    )
    @click.option(
        "--jobs-per-worker",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="job slots per worker process: jobs that share its runtime and mapped backbones",
    )
    @pack_size_option()
    @click.option(
        "--max-workers-per-node",
        type=int,
        default=None,
        help="default: CPUs // (cpus-per-worker * jobs-per-worker); with packs: CPUs // cpus-per-worker "
        "(GPU workers: GPUs // gpus-per-worker)",
    )
    @click.option("--num-cpus", type=int, default=None, help="CPUs of a local Ray (without PELT_RAY_ADDRESS)")
    @click.option("--heartbeat-seconds", type=float, default=None, help="default: PELT_HEARTBEAT_SECONDS")
    @click.option(
        "--drain", is_flag=True, help="on SIGTERM, let running jobs finish instead of requeueing them"
    )
    @click.option(
        "--handover",
        is_flag=True,
        help="on SIGTERM leave the workers and their jobs running for the next leading dispatcher "
        "(a standby takes over at once) instead of giving the jobs back and stopping the workers",
    )
    @click.option(
        "--idle-worker-seconds",
        type=click.FloatRange(min=1),
        default=None,
        help="stop a worker idle this long while nothing of its kind is queued, so an autoscaled node can go "
        "(default: PELT_IDLE_WORKER_SECONDS, else workers stay warm)",
    )
    @click.option(
        "--scaling-seconds",
        type=click.FloatRange(min=0),
        default=5.0,
        show_default=True,
        help="how often to ask Ray's autoscaler for the workers the queue needs (0: never)",
    )
    @click.option(
        "--delta-store",
        type=click.Choice(["local", "mlflow"]),
        default="local",
        show_default=True,
        help="where deltas go: a folder under PELT_DATA_DIR, or MLflow (PELT_MLFLOW_TRACKING_URI)",
    )
    def dispatcher_command(
        database_url: str | None,
        namespace: str,
        cpus_per_worker: float,
        jobs_per_worker: int,
        pack_size: int,
        gpus_per_worker: float,
        gpu_pack_size: int,
        cpus_per_gpu_worker: float,
        max_workers_per_node: int | None,
        num_cpus: int | None,
        heartbeat_seconds: float | None,
        drain: bool,
        handover: bool,
        idle_worker_seconds: float | None,
        scaling_seconds: float,
        delta_store: str,
    ) -> None:
        """Drain the job queue into Ray workers (joins PELT_RAY_ADDRESS or starts a local Ray). One dispatcher
        leads a namespace; a second one started against the same registry stands by and takes over."""
        from services.filemodes import private_files

        config = config_from_options(
            namespace=namespace,
            cpus_per_worker=cpus_per_worker,
            jobs_per_worker=jobs_per_worker,
            pack_size=pack_size,
            gpus_per_worker=gpus_per_worker,
            gpu_pack_size=gpu_pack_size,
            cpus_per_gpu_worker=cpus_per_gpu_worker,
            max_workers_per_node=max_workers_per_node,
            heartbeat_seconds=heartbeat_seconds,
            idle_worker_seconds=idle_worker_seconds,
            scaling_seconds=scaling_seconds,
        )
        private_files()  # what the dispatcher and its local Ray write is for its user only (0600 / 0700)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        serve(
            database_url,
            config=config,
            num_cpus=num_cpus,
            drain=drain,
            delta_store=delta_store,
            handover=handover,
        )

    return dispatcher_command


dispatcher_command = _command()
