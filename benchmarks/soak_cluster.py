"""The soak's deployment (benchmarks/soak.py): pelt's services on the namespaced hosts of `soak_hosts`, in
compose.yaml's start order, each waited for, and a supervisor that restarts what exits on its own."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from soak_hosts import SERVICE_GID, SERVICE_UID, Network, Service

HOSTS = ["db", "api", "head", "w1", "w2", "client"]
WORKER_HOSTS = ("w1", "w2")
LEASE_SECONDS = 10.0  # short, so a cut-off host's jobs come back within the soak
QUEUE_KNOBS = {
    "PELT_LEASE_SECONDS": str(LEASE_SECONDS),
    "PELT_HEARTBEAT_SECONDS": "2",
    "PELT_RETRY_BACKOFF_SECONDS": "1",
    "PELT_RETRY_BACKOFF_MAX_SECONDS": "5",
    "PELT_MAX_ATTEMPTS": "6",
}


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


class ServiceDied(RuntimeError):
    """A service exited while the soak waited for it."""


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ServiceDied:
            raise
        except Exception:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(every)


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=3) as answer:
        return answer.status == 200


def port_open(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=2):
        return True


def postgres_bin(name: str) -> str:
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if found:
        return str(found[-1])
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"PostgreSQL's `{name}` was not found (apt install postgresql)")
    return path


class Cluster:
    """pelt's deployment on the namespaced hosts: the services, their start order, the supervisor."""

    def __init__(self, net: Network, work: Path, venv_bin: Path, gcs_redis: bool = True) -> None:
        self.net, self.work, self.bin, self.gcs_redis = net, work, venv_bin, gcs_redis
        self.ip = net.hosts
        self.ray_token = secrets.token_hex(32)
        self.api_token = "pelt_" + secrets.token_urlsafe(32)
        self.db_url = f"postgresql+psycopg://pelt@{self.ip['db']}:5432/pelt"
        self.mlflow_db_url = f"postgresql+psycopg://pelt@{self.ip['db']}:5432/mlflow"
        self.mlflow_url = f"http://{self.ip['db']}:5000"
        self.api_url = f"http://{self.ip['api']}:8000"
        self.services: dict[str, Service] = {}
        self.held: set[str] = set()  # services a fault keeps down on purpose
        self.restarts: Counter[str] = Counter()  # by the supervisor
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        (work / "logs").mkdir()
        for folder in ("data", "mlflow", "backbones", "homes", "ray"):
            (work / folder).mkdir()
            os.chown(work / folder, SERVICE_UID, SERVICE_GID)

    # --- services -------------------------------------------------------------------------------

    def env(self, name: str, **extra: str) -> dict[str, str]:
        home = self.work / "homes" / name
        if not home.exists():
            home.mkdir()
            os.chown(home, SERVICE_UID, SERVICE_GID)
        return {
            "PATH": f"{self.bin}:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.ray_token,
            "RAY_USAGE_STATS_ENABLED": "0",
            **extra,
        }

    def pelt_env(self, name: str, **extra: str) -> dict[str, str]:
        return self.env(
            name,
            PELT_DATABASE_URL=self.db_url,
            PELT_MLFLOW_TRACKING_URI=self.mlflow_url,
            PELT_RAY_ADDRESS=f"{self.ip['head']}:6379",
            **QUEUE_KNOBS,
            **extra,
        )

    def add(
        self, name: str, host: str, argv: list[str], env: dict[str, str], user: str = "service"
    ) -> Service:
        service = Service(name, self.net.argv(host, argv, user), env, self.work / "logs" / f"{name}.log")
        self.services[name] = service
        return service

    def ray_node(self, name: str, host: str, *options: str) -> Service:
        temp = self.work / "ray" / name
        temp.mkdir(exist_ok=True)
        os.chown(temp, SERVICE_UID, SERVICE_GID)
        where = ["--head", "--port", "6379", "--include-dashboard", "false"]
        env = self.env(name)
        if host == "head" and self.gcs_redis:  # the GCS keeps its state in Redis: a new head takes it up
            env.update(RAY_REDIS_ADDRESS=f"{self.ip['db']}:6380", RAY_external_storage_namespace="pelt-soak")
        if host != "head":
            where = ["--address", f"{self.ip['head']}:6379"]
        argv = ["ray", "start", *where, "--node-ip-address", self.ip[host], "--temp-dir", str(temp)]
        argv += ["--object-store-memory", str(300 * 2**20), "--disable-usage-stats", "--block", *options]
        return self.add(name, host, argv, env)

    def start_redis(self) -> None:
        """Redis for the Ray head's GCS fault tolerance (KubeRay's pattern), on the database host."""
        folder = self.work / "redis"
        folder.mkdir()
        os.chown(folder, SERVICE_UID, SERVICE_GID)
        argv = ["redis-server", "--bind", self.ip["db"], "--port", "6380", "--protected-mode", "no"]
        argv += ["--dir", str(folder), "--save", "", "--appendonly", "no"]
        self.add("redis", "db", argv, self.env("redis")).start()
        wait_until(lambda: port_open(self.ip["db"], 6380), 60, "Redis")

    def start_postgres(self) -> None:
        data = self.work / "pg"
        data.mkdir()
        shutil.chown(data, "postgres", "postgres")
        data.chmod(0o700)
        initdb = [postgres_bin("initdb"), "-D", str(data), "-U", "pelt", "--auth", "trust", "-E", "UTF8"]
        subprocess.run(self.net.argv("db", initdb, "postgres"), check=True, capture_output=True)
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {self.ip['db'].rsplit('.', 1)[0]}.0/24 trust\n")
        options = [f"listen_addresses={self.ip['db']}", "fsync=off", f"unix_socket_directories={data}"]
        argv = [postgres_bin("postgres"), "-D", str(data), *(x for o in options for x in ("-c", o))]
        self.add(
            "postgres", "db", argv, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}, "postgres"
        ).start()
        self.wait_postgres()
        for database in ("pelt", "mlflow"):
            create = [postgres_bin("createdb"), "-h", self.ip["db"], "-U", "pelt", database]
            subprocess.run(create, check=True, capture_output=True)

    def wait_postgres(self, timeout: float = 60) -> None:
        ready = [postgres_bin("pg_isready"), "-q", "-h", self.ip["db"], "-U", "pelt", "-d", "postgres"]
        service = self.services["postgres"]

        def accepting() -> bool:
            if not service.alive():
                raise ServiceDied(f"PostgreSQL exited:\n{service.tail()}")
            return subprocess.run(ready).returncode == 0

        wait_until(accepting, timeout, "PostgreSQL to accept connections")

    def migrate(self) -> None:
        steps = [
            ["pelt", "db", "upgrade"],
            ["pelt", "mlflow", "upgrade", "--uri", self.mlflow_db_url],
            ["pelt", "token", "create", "admin", "--scope", "admin", "--secret-from-env", "FIRST_API_TOKEN"],
        ]
        env = self.pelt_env("migrate", FIRST_API_TOKEN=self.api_token)
        for step in steps:
            done = subprocess.run(self.net.argv("api", step), env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{' '.join(step)} failed:\n{done.stdout}\n{done.stderr}")

    def start(self) -> None:
        """Every service, in compose.yaml's order, each waited for."""
        self.start_postgres()
        self.migrate()
        mlflow_env = self.env(
            "mlflow",
            MLFLOW_BACKEND_STORE_URI=self.mlflow_db_url,
            MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
            MLFLOW_SERVER_JOB_ENABLE_PERIODIC_TASKS="false",
        )
        mlflow = ["mlflow", "server", "--artifacts-destination", str(self.work / "mlflow" / "artifacts")]
        mlflow += ["--serve-artifacts", "--host", self.ip["db"], "--port", "5000", "--workers", "2"]
        mlflow += ["--allowed-hosts", f"{self.ip['db']}:5000"]
        self.add("mlflow", "db", mlflow, mlflow_env).start()
        self.start_redis()
        self.ray_node("ray-head", "head", "--num-cpus", "0").start()
        self.wait_mlflow()
        wait_until(lambda: port_open(self.ip["head"], 6379), 120, "the Ray head")
        self.ray_node("ray-w1", "w1", "--num-cpus", "1").start()
        self.ray_node("ray-w2", "w2", "--num-cpus", "1").start()
        self.ray_node("ray-api", "api", "--num-cpus", "0", "--num-gpus", "0").start()
        for name in ("ray-w1", "ray-w2", "ray-api"):
            self.wait_ray_node(name)
        api_env = self.pelt_env(
            "api", PELT_DATA_DIR=str(self.work / "data"), PELT_BACKBONE_DIRS=str(self.work / "backbones")
        )
        serve = ["pelt", "serve", "--no-dispatcher", "--host", self.ip["api"], "--port", "8000"]
        self.add("api", "api", serve, api_env).start()
        for name in ("dispatcher-1", "dispatcher-2"):
            dispatcher = ["pelt", "dispatcher", "--delta-store", "mlflow", "--handover", "--pack-size", "4"]
            self.add(name, "api", dispatcher, self.pelt_env(name)).start()
        self.wait_api()

    def users(self) -> dict[str, list[int]]:
        """The user ids each service's processes run as."""
        return {
            name: sorted({member.uids().real for member in service.members()})
            for name, service in self.services.items()
        }

    def wait_http(self, name: str, url: str, timeout: float = 180) -> None:
        service = self.services[name]

        def answers() -> bool:
            if not service.alive() and name not in self.held:
                raise ServiceDied(f"{name} exited:\n{service.tail()}")
            return http_ok(url)

        wait_until(answers, timeout, f"{name} to answer {url}")

    def wait_mlflow(self) -> None:
        self.wait_http("mlflow", f"{self.mlflow_url}/health")

    def wait_api(self) -> None:
        self.wait_http("api", f"{self.api_url}/health")

    def wait_ray_node(self, name: str, timeout: float = 180) -> None:
        service = self.services[name]
        start = f"=== start {service.starts} at"

        def started() -> bool:
            text = service.log.read_text(errors="replace")
            if not service.alive():
                raise ServiceDied(f"{name} exited:\n{service.tail()}")
            return "Ray runtime started" in text[text.rfind(start) :]

        wait_until(started, timeout, f"{name} to join the cluster")

    # --- the supervisor -------------------------------------------------------------------------

    def supervise(self) -> threading.Thread:
        """Restart any service that exits while no fault holds it down (compose's restart policy)."""

        def loop() -> None:
            while not self._stop.wait(1.0):
                for name, service in list(self.services.items()):
                    with self._lock:
                        if name in self.held or service.alive():
                            continue
                        log(f"supervisor: {name} exited ({service.process.returncode}); starting it again")
                        service.stop(signal.SIGKILL)
                        self.restarts[name] += 1
                        service.start()

        self._supervisor = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._supervisor.start()
        return self._supervisor

    @contextlib.contextmanager
    def holding(self, *names: str):
        with self._lock:
            self.held.update(names)
        try:
            yield
        finally:
            with self._lock:
                self.held.difference_update(names)

    def shutdown(self) -> list[str]:
        """SIGTERM every service (newest first), SIGKILL what is left after 20 s; returns the names of those
        with processes left even after SIGKILL (none, when all is well)."""
        self._stop.set()
        if self._supervisor is not None:  # no restart may race the stop
            self._supervisor.join()
        stubborn = []
        for name, service in reversed(list(self.services.items())):
            try:
                service.stop(signal.SIGTERM, timeout=20)
            except RuntimeError:
                stubborn.append(name)
        return stubborn
