"""The running server against clients that hold on, and the files it leaves (issue #11, findings 7, 9, 11).

Over a real `pelt serve` on 127.0.0.1: a handled error (500) keeps the keep-alive connection for the
client's next request; a connection whose request head is not complete within
PELT_API_HEADER_TIMEOUT_SECONDS is closed (the first request's or a kept-alive connection's next one);
connections beyond PELT_API_MAX_CONNECTIONS are answered 503 and the service still answers once they
go. Everything the service writes under PELT_DATA_DIR is its user's only (folders 0700, files 0600),
and so is Ray's token file where pelt starts Ray.
"""

from __future__ import annotations

import os
import select
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.api.server import Service
from services.client import PeltClient
from services.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_SECONDS = 30.0  # how long a test waits for what must happen (far above the timeouts it sets)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Service]:
    """`pelt serve` without a dispatcher, with a short header timeout and a small connection cap."""
    settings = Settings(data_dir=tmp_path / "pelt", ray_address=None, api_header_timeout_seconds=0.5,
                        api_max_connections=8)
    with Service(settings, port=0, dispatcher=False) as service:
        yield service


def connect(service: Service) -> socket.socket:
    return socket.create_connection((service.host, service.port), timeout=DEADLINE_SECONDS)


def until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection; fails if it is still open at the deadline."""
    received, deadline = b"", time.monotonic() + DEADLINE_SECONDS
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"the server kept the connection open for {DEADLINE_SECONDS:.0f} s")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def open_connections(service: Service) -> int:
    return len(service._server.server_state.connections)


def wait_for_connections(service: Service, count: int) -> None:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while open_connections(service) != count:
        assert time.monotonic() < deadline, f"{open_connections(service)} connections open, not {count}"
        time.sleep(0.01)


# --- finding 7: a 500 keeps the connection --------------------------------------------------------------


def test_an_unexpected_error_is_a_json_500_on_a_connection_that_stays_open(served: Service, monkeypatch):
    def broken() -> None:
        raise RuntimeError(f"boom in {served.settings.data_dir}")

    monkeypatch.setattr(served.app.state.service, "list_tasks", broken)
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.token}"}) as http:
        failed = http.get("/v1/tasks")
        assert failed.status_code == 500, failed.text
        assert failed.json()["error"]["type"] == "InternalError" and "boom" not in failed.text
        assert failed.headers.get("connection", "").lower() != "close"
        first = failed.extensions["network_stream"].get_extra_info("client_addr")
        answered = http.get("/v1/methods")
        assert answered.status_code == 200
        assert answered.extensions["network_stream"].get_extra_info("client_addr") == first  # the same connection


# --- finding 11: slow clients ---------------------------------------------------------------------------


def test_a_connection_sending_half_a_request_line_is_closed_unanswered(served: Service):
    with connect(served) as sock:
        sock.sendall(b"GET /v1/ta")
        assert until_closed(sock) == b""


def test_a_connection_that_sends_nothing_is_closed(served: Service):
    with connect(served) as sock:
        assert until_closed(sock) == b""


def test_a_kept_alive_connection_whose_next_request_head_stalls_is_closed(served: Service):
    with connect(served) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: pelt\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: pe")  # uvicorn's keep-alive timer stops at this first byte
        assert until_closed(sock) == b""


def test_many_slow_clients_are_all_closed_and_the_service_still_answers(tmp_path: Path):
    settings = Settings(data_dir=tmp_path / "pelt", ray_address=None, api_header_timeout_seconds=0.5)
    with Service(settings, port=0, dispatcher=False) as service:
        slow = [connect(service) for _ in range(60)]
        try:
            for sock in slow:
                sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: pelt\r\nX-Slow: ")
            assert httpx.get(f"{service.url}/health").status_code == 200
            for sock in slow:
                assert until_closed(sock) == b""
        finally:
            for sock in slow:
                sock.close()
        wait_for_connections(service, 0)


def test_connections_beyond_the_cap_are_answered_503_until_some_go(tmp_path: Path):
    settings = Settings(data_dir=tmp_path / "pelt", ray_address=None, api_max_connections=4,
                        api_header_timeout_seconds=600)  # the held connections stay until the test closes them
    with Service(settings, port=0, dispatcher=False) as service:
        holding = [connect(service) for _ in range(4)]
        try:
            wait_for_connections(service, 4)
            refused = httpx.get(f"{service.url}/health")
            assert refused.status_code == 503
        finally:
            for sock in holding:
                sock.close()
        wait_for_connections(service, 0)
        assert httpx.get(f"{service.url}/health").status_code == 200


# --- finding 9: file modes ------------------------------------------------------------------------------


def modes_open_to_others(root: Path) -> list[str]:
    """Every folder or file under `root` (itself included) that its group or other users may use."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_IMODE(mode) & 0o077:
            found.append(f"{path.relative_to(root.parent)} {stat.filemode(mode)}")
    return found


def read_line_until(process: subprocess.Popen, marker: str) -> str:
    """The first line of the process's output that contains `marker` (fails at the deadline)."""
    deadline = time.monotonic() + 180
    assert process.stdout is not None
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            break
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return line
    pytest.fail(f"no line with {marker!r} from the process: {''.join(seen)[-2000:]}")


def test_pelt_serve_keeps_everything_it_writes_to_its_own_user(tmp_path: Path, toy_files: dict[str, Path]):
    data = tmp_path / "pelt"
    data.mkdir()
    data.chmod(0o755)  # as an older pelt left it
    env = {**os.environ, "PELT_DATA_DIR": str(data), "HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PELT_DATABASE_URL", None)
    env.pop("PELT_MLFLOW_TRACKING_URI", None)
    command = [sys.executable, "-c", "from services.cli import main; main()", "serve", "--no-dispatcher", "--port", "0"]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        url = read_line_until(process, "pelt serving on").split()[3]
        client = PeltClient(url, settings=Settings(data_dir=data, ray_address=None))
        client.register_task("toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
        client.register_method({"name": "mine", "modules": {"q": {
            "form": "bottleneck", "representation": "attn.q", "insertion": "parallel", "composition": "scaled",
            "size": 2, "alpha": 4, "nonlinearity": "identity", "proj_bias": False, "init": "lora"}}})
        written = sorted(p.name for p in data.rglob("*"))
        assert {"registry.db", "mlflow.db", "api_token", "datasets", "train.jsonl"} <= set(written), written
        assert modes_open_to_others(data) == []
    finally:
        process.terminate()
        process.wait(60)


def test_the_ray_token_file_is_made_private(tmp_path: Path, monkeypatch):
    from services.dispatcher import private_ray_token

    token = tmp_path / "ray-token"
    token.write_text("secret")
    token.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert private_ray_token() == token
    assert stat.S_IMODE(token.stat().st_mode) == 0o600


def test_a_local_ray_started_by_pelt_leaves_its_token_file_private(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("RAY_AUTH", "RAY_ADDRESS", "PELT_RAY_ADDRESS"))}
    env.update(HOME=str(home), PELT_DATA_DIR=str(tmp_path / "pelt"))
    code = textwrap.dedent("""
        import ray
        from services.dispatcher import connect_ray
        assert connect_ray(num_cpus=1, namespace="file-modes-test")
        ray.shutdown()
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    token = home / ".ray" / "auth_token"
    assert token.is_file() and stat.S_IMODE(token.stat().st_mode) == 0o600
