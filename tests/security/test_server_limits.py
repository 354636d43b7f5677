"""The running server against clients that hold on, and the files it leaves (issue #11, findings 7, 9, 11).

Over a real `pelt serve` on 127.0.0.1: a handled error (500) keeps the keep-alive connection for the
client's next request; a connection whose request head is not complete within
PELT_API_HEADER_TIMEOUT_SECONDS is closed (the first request's or a kept-alive connection's next one),
and so is one whose request body stops arriving for PELT_API_BODY_IDLE_TIMEOUT_SECONDS; connections
beyond PELT_API_MAX_CONNECTIONS are answered 503 and the service still answers once they go.
Everything the service writes under PELT_DATA_DIR is its user's only (folders 0700, files 0600), and so
is Ray's token file where pelt starts Ray (found even without Ray's private helpers; never failing the
start).

The server runs in the test's own process (one GIL with the test), on a machine that may be loaded:
only the tests that expect a close use short timeouts (SHORT_TIMEOUT_SECONDS), every other one long
ones, and every wait polls for an event up to a deadline far above the timeouts: no test sleeps
against a timeout.
"""

from __future__ import annotations

import os
import queue
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.api.server import ApiServer
from services.client import PeltClient
from services.settings import Settings
from tests.api.helpers import tiny_lora_spec
from tests.data_templates import copy_migrated_data

ROOT = Path(__file__).resolve().parents[2]
SHORT_TIMEOUT_SECONDS = 2.0  # the header and body timeouts of the tests that expect a close
LONG_TIMEOUT_SECONDS = 600.0  # those of every other test: a healthy request is never closed under load
DEADLINE_SECONDS = 60.0  # how long a test waits for what must happen (far above SHORT_TIMEOUT_SECONDS)


def serve(tmp_path: Path, timeout: float, **options: object) -> ApiServer:
    """`pelt serve` without a dispatcher, with this header and body-idle timeout, on a copy of a migrated data
    folder (tests/data_templates.py)."""
    settings = Settings(
        data_dir=copy_migrated_data(tmp_path / "pelt"),
        ray_address=None,
        api_header_timeout_seconds=timeout,
        api_body_idle_timeout_seconds=timeout,
        **options,
    )
    return ApiServer(settings, port=0, dispatcher=False)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ApiServer]:
    """`pelt serve` with long timeouts and a small connection cap: for requests that must be answered."""
    with serve(tmp_path, LONG_TIMEOUT_SECONDS, api_max_connections=8) as server:
        yield server


@pytest.fixture
def impatient(tmp_path: Path) -> Iterator[ApiServer]:
    """`pelt serve` with short timeouts: for the tests that expect the server to close a connection."""
    with serve(tmp_path, SHORT_TIMEOUT_SECONDS) as server:
        yield server


def connect(server: ApiServer) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=DEADLINE_SECONDS)


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


def read_response(sock: socket.socket) -> bytes:
    """One whole response (its head and its Content-Length of body) from the connection."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed in a response's head: {received!r}"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed in a response's body: {received!r}"
        body += chunk
    return head + b"\r\n\r\n" + body


def open_connections(server: ApiServer) -> int:
    return len(server._server.server_state.connections)


def wait_for_connections(server: ApiServer, count: int) -> None:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while open_connections(server) != count:
        assert time.monotonic() < deadline, f"{open_connections(server)} connections open, not {count}"
        time.sleep(0.01)


# --- finding 7: a 500 keeps the connection --------------------------------------------------------------


def test_an_unexpected_error_is_a_json_500_on_a_connection_that_stays_open(served: ApiServer, monkeypatch):
    def broken() -> None:
        raise RuntimeError(f"boom in {served.settings.data_dir}")

    monkeypatch.setattr(served.app.state.operations, "list_tasks", broken)
    with httpx.Client(
        base_url=served.url, headers={"Authorization": f"Bearer {served.token}"}, timeout=DEADLINE_SECONDS
    ) as http:
        failed = http.get("/v1/tasks")
        assert failed.status_code == 500, failed.text
        assert failed.json()["error"]["type"] == "InternalError" and "boom" not in failed.text
        assert failed.headers.get("connection", "").lower() != "close"
        first = failed.extensions["network_stream"].get_extra_info("client_addr")
        answered = http.get("/v1/methods")
        assert answered.status_code == 200
        assert (
            answered.extensions["network_stream"].get_extra_info("client_addr") == first
        )  # the same connection


# --- finding 11: slow clients ---------------------------------------------------------------------------


def test_a_connection_sending_half_a_request_line_is_closed_unanswered(impatient: ApiServer):
    with connect(impatient) as sock:
        sock.sendall(b"GET /v1/ta")
        assert until_closed(sock) == b""


def test_a_connection_that_sends_nothing_is_closed(impatient: ApiServer):
    with connect(impatient) as sock:
        assert until_closed(sock) == b""


def test_a_kept_alive_connection_whose_next_request_head_stalls_is_closed(impatient: ApiServer):
    with connect(impatient) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: pelt\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(
            b"GET /health HTTP/1.1\r\nHost: pe"
        )  # uvicorn's keep-alive timer stops at this first byte
        assert until_closed(sock) == b""


def test_many_slow_clients_are_all_closed_and_the_service_still_answers(impatient: ApiServer):
    slow = [connect(impatient) for _ in range(60)]
    try:
        for sock in slow:
            sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: pelt\r\nX-Slow: ")
        assert httpx.get(f"{impatient.url}/health", timeout=DEADLINE_SECONDS).status_code == 200
        for sock in slow:
            assert until_closed(sock) == b""
    finally:
        for sock in slow:
            sock.close()
    wait_for_connections(impatient, 0)


def job_request_head(server: ApiServer, *, authorized: bool, length: int = 1000) -> bytes:
    """The head of a POST /v1/jobs announcing a JSON body of `length` bytes."""
    head = (
        f"POST /v1/jobs HTTP/1.1\r\nHost: pelt\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n"
    )
    if authorized:
        head += f"Authorization: Bearer {server.token}\r\n"
    return (head + "\r\n").encode()


@pytest.mark.parametrize(
    "body_sent", [b"", b'{"task": "toy", "meth'], ids=["no-body-byte", "part-of-the-body"]
)
def test_a_request_whose_body_stops_arriving_is_closed_and_writes_nothing(
    impatient: ApiServer, body_sent: bytes
):
    files_before = sorted(impatient.settings.data_dir.rglob("*"))
    with connect(impatient) as sock:
        sock.sendall(job_request_head(impatient, authorized=True) + body_sent)
        assert until_closed(sock) == b""  # the app was still waiting for the body: nothing answered
    assert impatient.registry.list_jobs() == []
    assert sorted(impatient.settings.data_dir.rglob("*")) == files_before


def test_a_body_still_trickling_after_an_early_answer_is_closed(served: ApiServer):
    """A 401 answers before the body is read; the client may keep sending its rest (uvicorn's keep-alive
    timer stops at each byte), but not trickle it forever."""
    with connect(served) as sock:
        sock.sendall(job_request_head(served, authorized=False) + b'{"task": ')
        assert read_response(sock).startswith(b"HTTP/1.1 401")
        # only now, with the answer read (a loaded machine may take long to make it), does this connection's
        # body get the short idle timeout that the next byte arms
        for protocol in list(served._server.server_state.connections):
            protocol.body_idle_timeout = SHORT_TIMEOUT_SECONDS
        sock.sendall(b'"toy", ')
        assert until_closed(sock) == b""


def body_deadlines(server: ApiServer) -> list[float]:
    """When each open connection's request body is due to be closed for idleness (event-loop time)."""
    return [
        deadline
        for protocol in list(server._server.server_state.connections)
        if (deadline := protocol.body_deadline) is not None
    ]


def next_body_deadline(server: ApiServer, after: float | None = None) -> float:
    """The one body deadline once it is set (and later than `after`); fails at the test's deadline."""
    waited_until = time.monotonic() + DEADLINE_SECONDS
    while True:
        deadlines = body_deadlines(server)
        if len(deadlines) == 1 and (after is None or deadlines[0] > after):
            return deadlines[0]
        assert time.monotonic() < waited_until, f"body deadlines {deadlines}, none after {after}"
        time.sleep(0.01)


def test_each_body_byte_that_arrives_pushes_the_body_deadline_back(served: ApiServer):
    """The body timeout is an idle timeout (like nginx's client_body_timeout): a slow upload whose bytes
    keep coming is never cut off, however long it takes in all."""
    with connect(served) as sock:
        sock.sendall(job_request_head(served, authorized=True) + b"{")
        first = next_body_deadline(served)
        sock.sendall(b" ")
        second = next_body_deadline(served, after=first)
        sock.sendall(b" ")
        next_body_deadline(served, after=second)


def test_connections_beyond_the_cap_are_answered_503_until_some_go(tmp_path: Path):
    # long timeouts: the held connections stay until the test closes them
    with serve(tmp_path, LONG_TIMEOUT_SECONDS, api_max_connections=4) as server:
        holding = [connect(server) for _ in range(4)]
        try:
            wait_for_connections(server, 4)
            refused = httpx.get(f"{server.url}/health", timeout=DEADLINE_SECONDS)
            assert refused.status_code == 503
        finally:
            for sock in holding:
                sock.close()
        wait_for_connections(server, 0)
        assert httpx.get(f"{server.url}/health", timeout=DEADLINE_SECONDS).status_code == 200


# --- finding 9: file modes ------------------------------------------------------------------------------


def modes_open_to_others(root: Path) -> list[str]:
    """Every folder or file under `root` (itself included) that its group or other users may use."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_IMODE(mode) & 0o077:
            found.append(f"{path.relative_to(root.parent)} {stat.filemode(mode)}")
    return found


def output_lines(process: subprocess.Popen) -> queue.Queue[str | None]:
    """The process's output, line by line, read by a thread of its own (None at its end)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="process-output", daemon=True).start()
    return lines


def read_line_until(lines: queue.Queue[str | None], marker: str) -> str:
    """The first line of the output that contains `marker` (fails at the end of it or at the deadline)."""
    deadline, seen = time.monotonic() + 180, []
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if marker in line:
            return line
    pytest.fail(f"no line with {marker!r} from the process: {''.join(seen)[-2000:]}")


def test_pelt_serve_keeps_everything_it_writes_to_its_own_user(tmp_path: Path, toy_files: dict[str, Path]):
    data = tmp_path / "pelt"
    data.mkdir()
    data.chmod(0o755)  # as an older pelt left it
    env = {
        **os.environ,
        "PELT_DATA_DIR": str(data),
        "HOME": str(tmp_path / "home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    env.pop("PELT_DATABASE_URL", None)
    env.pop("PELT_MLFLOW_TRACKING_URI", None)
    command = [
        sys.executable,
        "-c",
        "from services.cli import main; main()",
        "serve",
        "--no-dispatcher",
        "--port",
        "0",
    ]
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        url = read_line_until(output_lines(process), "pelt serving on").split()[3]
        client = PeltClient(url, settings=Settings(data_dir=data, ray_address=None))
        client.register_task("toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
        client.register_method(tiny_lora_spec("mine"))
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


RAY_TOKEN_SETUP = "ray._private.authentication.authentication_token_setup"


def test_the_ray_token_file_is_made_private_without_rays_private_helpers(tmp_path: Path, monkeypatch):
    """A Ray upgrade that moves its private modules must not break starting pelt: ~/.ray/auth_token,
    Ray's documented default, is found without them."""
    from services.dispatcher import private_ray_token

    monkeypatch.setitem(sys.modules, RAY_TOKEN_SETUP, None)  # importing it now raises ImportError
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("secret")
    token.chmod(0o644)
    assert private_ray_token() == token
    assert stat.S_IMODE(token.stat().st_mode) == 0o600


def test_a_ray_token_file_that_is_missing_or_cannot_be_made_private_is_a_warning(
    tmp_path: Path, monkeypatch, caplog
):
    from services.dispatcher import private_ray_token

    monkeypatch.setitem(sys.modules, RAY_TOKEN_SETUP, None)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with caplog.at_level("WARNING", logger="pelt.dispatcher"):
        assert private_ray_token() is None
    assert "no Ray token file" in caplog.text

    token = tmp_path / "ray-token"
    token.write_text("secret")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))

    def refused(self: Path, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "chmod", refused)
    caplog.clear()
    with caplog.at_level("WARNING", logger="pelt.dispatcher"):
        assert private_ray_token() is None
    assert "cannot make the Ray token file" in caplog.text


def test_a_local_ray_started_by_pelt_leaves_its_token_file_private(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("RAY_AUTH", "RAY_ADDRESS", "PELT_RAY_ADDRESS"))
    }
    env.update(HOME=str(home), PELT_DATA_DIR=str(tmp_path / "pelt"))
    code = textwrap.dedent("""
        import ray
        from services.dispatcher import connect_ray
        assert connect_ray(num_cpus=1, namespace="file-modes-test")
        ray.shutdown()
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    token = home / ".ray" / "auth_token"
    assert token.is_file() and stat.S_IMODE(token.stat().st_mode) == 0o600
