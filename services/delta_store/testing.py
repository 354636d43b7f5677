"""Helpers for tests of the delta store: an MLflow tracking server on loopback, started and stopped by pid.

Nothing in the service imports this module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from services.delta_store.bootstrap import QUIET_ENVIRONMENT, wait_for_server

SERVER_ENVIRONMENT = {
    **QUIET_ENVIRONMENT,
    # no background job runner (huey consumers) and no periodic tasks: a test server only serves requests
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "MLFLOW_SERVER_JOB_ENABLE_PERIODIC_TASKS": "false",
}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class MlflowServer:
    """`mlflow server` on 127.0.0.1 and a free port, in its own process group.

    Artifacts are proxied (`--serve-artifacts --artifacts-destination <folder or s3://bucket/prefix>`):
    clients upload and download through the server's HTTP API and never touch the folder or the bucket, as
    workers on other nodes would in a deployment. One uvicorn worker, no job runner.
    """

    def __init__(
        self,
        backend_store_uri: str,
        artifacts_destination: str | Path,
        log_path: str | Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        environment: dict[str, str] | None = None,
    ) -> None:
        self.backend_store_uri = backend_store_uri
        # a folder, or an object store's URI (s3://bucket/prefix: credentials and endpoint in `environment`)
        self.artifacts_destination = (
            artifacts_destination
            if isinstance(artifacts_destination, str) and "://" in artifacts_destination
            else Path(artifacts_destination)
        )
        self.environment = dict(environment or {})
        self.log_path = Path(log_path)
        self.host = host
        self.port = port or free_port(host)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120.0) -> str:
        """Start the server and wait for its /health; returns its URL."""
        if isinstance(self.artifacts_destination, Path):
            self.artifacts_destination.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            self.backend_store_uri,
            "--serve-artifacts",
            "--artifacts-destination",
            str(self.artifacts_destination),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        env = {**os.environ, **SERVER_ENVIRONMENT, **self.environment}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                wait_for_server(self.url, 0)
                return self.url
            except Exception:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server's process group (the server and its uvicorn worker): SIGTERM, then SIGKILL."""
        process, self.process = self.process, None
        if process is None:
            return
        pgid = process.pid  # the group this server leads (start_new_session=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _group_alive(pgid) and time.monotonic() < deadline:
            process.poll()  # reap the leader so the group can empty
            time.sleep(0.2)
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> MlflowServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["SERVER_ENVIRONMENT", "MlflowServer", "free_port"]
