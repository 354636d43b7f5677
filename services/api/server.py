"""`pelt serve`: the API, the dispatcher, Ray, the registry and the MLflow store in one process.

Embedded by default: SQLite registry and MLflow store under PELT_DATA_DIR, a local Ray bound to
127.0.0.1 (dashboard off, token auth on). A deployment points the same process elsewhere with
PELT_DATABASE_URL (PostgreSQL), PELT_MLFLOW_TRACKING_URI (an MLflow server) and PELT_RAY_ADDRESS (a
Ray cluster); the API can also run without a dispatcher (`--no-dispatcher`) next to `pelt dispatcher`.

Tokens: on its first start a service with no active token creates one ("local", admin scope) and
writes its secret to PELT_DATA_DIR/api_token (mode 0600), where the client and the CLI on this machine
find it. PELT_DATA_DIR is made 0700 at start (`services.filemodes`). Connections: a deadline for each
request's head and a cap on connections (`services.api.connections`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from services.filemodes import secure_data_dir
from services.settings import Settings, get_settings

log = logging.getLogger("pelt.serve")

TOKEN_FILE = "api_token"


def token_path(settings: Settings) -> Path:
    """Where the service leaves the local token: PELT_DATA_DIR/api_token."""
    return settings.data_dir / TOKEN_FILE


def ensure_local_token(registry: Any, settings: Settings) -> str | None:
    """The secret in PELT_DATA_DIR/api_token if it is an active token; else, when the registry has no
    active token at all, a new admin token (written there, mode 0600). None: tokens exist, none of them
    local."""
    path = token_path(settings)
    if path.exists():
        secret = path.read_text().strip()
        if registry.authenticate(secret) is not None:
            return secret
    if any(token.active for token in registry.list_api_tokens()):
        return None
    taken = {token.name for token in registry.list_api_tokens()}
    name = next(n for n in ("local", *(f"local-{i}" for i in range(2, 10_000))) if n not in taken)
    _, secret = registry.create_api_token(name, scope="admin")
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    descriptor = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # a new file: mode 0600 whatever
    with os.fdopen(descriptor, "w") as handle:  # the old one's mode was
        handle.write(secret + "\n")
    os.replace(fresh, path)
    log.info("created API token %r; its secret is in %s", name, path)
    return secret


ACCESS_LOGS = ("changes", "all", "none")  # `pelt serve --access-log`


class ChangesOnly(logging.Filter):
    """Keeps uvicorn's access lines of requests that change something or fail: the page's polling (GETs
    that succeed, every 2 seconds per open page) would otherwise be most of the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) < 5:  # not uvicorn's (client, method, path, http version, status) line
            return True
        method, status = str(args[1]), args[4]
        return method not in ("GET", "HEAD") or not isinstance(status, int) or status >= 400


def is_embedded_registry(settings: Settings) -> bool:
    """True when the registry is the default SQLite file under PELT_DATA_DIR."""
    return settings.database_url == f"sqlite:///{settings.data_dir / 'registry.db'}"


class ApiServer:
    """`pelt serve`'s process: the HTTP API (uvicorn, in a thread) over the registry and the MLflow store,
    and, embedded, the dispatcher and Ray; `start()` returns once the API answers, `stop()` undoes it.

    dispatcher: run the dispatcher (and Ray) here. upgrade: create/upgrade the registry's schema first
    (default: only for the embedded SQLite registry; a deployment runs `pelt db upgrade`). port 0 picks
    a free port (see `url`).
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        host: str | None = None,
        port: int | None = None,
        dispatcher: bool = True,
        upgrade: bool | None = None,
        num_cpus: int | None = None,
        namespace: str = "pelt",
        dispatcher_config: Any = None,
        log_level: str = "warning",
        access_log: str = "changes",
    ) -> None:
        if access_log not in ACCESS_LOGS:
            raise ValueError(f"access_log must be one of {', '.join(ACCESS_LOGS)}, got {access_log!r}")
        self.settings = settings or get_settings()
        self.host = host or self.settings.api_host
        self.port = self.settings.api_port if port is None else port
        self.run_dispatcher = dispatcher
        self.upgrade = is_embedded_registry(self.settings) if upgrade is None else upgrade
        self.num_cpus = num_cpus
        self.namespace = namespace
        self.dispatcher_config = dispatcher_config
        self.log_level = log_level
        self.access_log = access_log
        self.token: str | None = None
        self.registry: Any = None
        self.dispatcher: Any = None
        self.app: Any = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._ray_started = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ApiServer:
        import uvicorn

        from services.api.app import create_app
        from services.api.connections import uvicorn_connection_options
        from services.delta_store import MlflowDeltaStore
        from services.operations import PeltOperations
        from services.registry import Registry, upgrade

        secure_data_dir(self.settings.data_dir)
        if self.upgrade:
            upgrade(self.settings.database_url)
        try:
            self.registry = Registry(settings=self.settings)
            store = MlflowDeltaStore.from_settings(self.settings, registry=self.registry, ensure=True)
            self.token = ensure_local_token(self.registry, self.settings)
            if self.run_dispatcher:
                self._start_dispatcher(store)
            operations = PeltOperations(self.registry, store, settings=self.settings)
            self.app = create_app(operations, self.settings, dispatcher=self.dispatcher)
            config = uvicorn.Config(
                self.app,
                host=self.host,
                port=self.port,
                log_level=self.log_level,
                access_log=self.access_log != "none",
                lifespan="off",
                timeout_graceful_shutdown=5,
                **uvicorn_connection_options(self.settings),
            )
            listening = _listen(self.host, self.port)
            self.port = listening.getsockname()[1]
            self._server = uvicorn.Server(config)  # its config set up uvicorn's loggers: filter after
            access = logging.getLogger("uvicorn.access")
            if self.access_log == "changes" and not any(isinstance(f, ChangesOnly) for f in access.filters):
                access.addFilter(ChangesOnly())
            elif self.access_log == "all":
                for quiet in [f for f in access.filters if isinstance(f, ChangesOnly)]:
                    access.removeFilter(quiet)
            self._thread = threading.Thread(
                target=self._server.run, kwargs={"sockets": [listening]}, name="pelt-api", daemon=True
            )
            self._thread.start()
            deadline = time.monotonic() + 30
            while not self._server.started:
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the API did not start on {self.host}:{self.port}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_dispatcher(self, store: Any) -> None:
        from services.dispatcher import Dispatcher, DispatcherConfig, connect_ray
        from services.registry import Registry

        config = self.dispatcher_config or DispatcherConfig(namespace=self.namespace)
        self._ray_started = connect_ray(self.settings, namespace=config.namespace, num_cpus=self.num_cpus)
        self.dispatcher = Dispatcher(
            Registry(settings=self.settings), store, config=config, settings=self.settings
        ).start()

    def stop(self, *, drain: bool = False) -> dict[str, Any] | None:
        """Stop the API, then the dispatcher (running jobs go back to the queue unless `drain`), then Ray."""
        summary = None
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if self.dispatcher is not None:
            summary = self.dispatcher.shutdown(drain=drain)
            self.dispatcher = None
        if self._ray_started:
            import ray

            with contextlib.suppress(Exception):
                ray.shutdown()
            self._ray_started = False
        if self.registry is not None:
            self.registry.close()
            self.registry = None
        return summary

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: a free port), or an error naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
        listening.listen(128)
    except OSError as exc:
        listening.close()
        raise RuntimeError(
            f"cannot listen on {host}:{port}: {exc.strerror} (PELT_API_HOST, PELT_API_PORT, or --host/--port)"
        ) from None
    listening.set_inheritable(True)
    return listening


__all__ = ["ApiServer", "ensure_local_token", "is_embedded_registry", "token_path"]
