"""The connection and ingress layer against a token holder, or a stranger, who means harm (issue "Harden,
second round": scope before body, answers a client never reads, unauthenticated connections, chunked
bodies, slow uploads).

Over a real `pelt serve` on 127.0.0.1:

- a request is authenticated, checked against its route's scope and, for an upload, given one of the
  PELT_DATASET_PROBE_CONCURRENCY slots from its headers alone: a refusal (401, 403, 503) comes before
  any byte of the body is sent, parses (nearly) none of a body that is sent, and closes the connection;
- that close lingers: the server shuts its side and discards what the client still sends, so the client
  sees the answer and a clean end, not a reset; and a client that keeps sending, trickles, or neither
  sends nor closes is still closed at the lingering bounds (total time, idle time, bytes);
- a connection whose answer the client stops reading is closed after PELT_API_SEND_IDLE_TIMEOUT_SECONDS
  without progress, and each read pushes that deadline back;
- connections that have not authenticated take at most PELT_API_MAX_UNAUTHENTICATED_CONNECTIONS of the
  cap (an authenticated request still gets in while many of them are opened) and are closed
  PELT_API_HEADER_TIMEOUT_SECONDS after they opened, public requests on them or not;
- a chunked JSON body above PELT_MAX_REQUEST_BYTES is a 413 (not a 500) that writes nothing;
- a body arriving slower than PELT_API_MIN_UPLOAD_BYTES_PER_SECOND over a whole window is closed (the
  window's arithmetic, with time the server holds the body back not counted, is tested on its own).

As in test_server_limits.py, the server runs in the test's process, only the tests that expect a close
use short timeouts, and every wait polls for an event up to a deadline far above them.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.api.connections import ClientDeadlines, UploadRate
from services.api.server import ApiServer
from tests.security.test_server_limits import (
    DEADLINE_SECONDS,
    LONG_TIMEOUT_SECONDS,
    SHORT_TIMEOUT_SECONDS,
    connect,
    job_request_head,
    open_connections,
    read_response,
    serve,
    until_closed,
    wait_for_connections,
)

MIB = 1 << 20


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ApiServer]:
    """`pelt serve` with long timeouts: for requests that must be answered."""
    with serve(tmp_path, LONG_TIMEOUT_SECONDS) as server:
        yield server


def token_with_scope(server: ApiServer, scope: str) -> str:
    _, secret = server.registry.create_api_token(f"a-{scope}-token", scope=scope)
    return secret


def upload_head(token: str, length: int, boundary: str = "pelt-boundary") -> bytes:
    """The head of a POST /v1/tasks announcing a multipart body of `length` bytes."""
    return (
        f"POST /v1/tasks HTTP/1.1\r\nHost: pelt\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def header(response: bytes, name: str) -> str | None:
    head = response.partition(b"\r\n\r\n")[0].decode("latin-1")
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def error_of(response: bytes) -> dict:
    return json.loads(response.partition(b"\r\n\r\n")[2])["error"]


def refused_and_closed(sock: socket.socket, status: int, field: str | None) -> bytes:
    """The answer on `sock` is `status` naming `field`, says Connection: close, and the server then closes."""
    response = read_response(sock)
    assert response.startswith(f"HTTP/1.1 {status}".encode()), response[:300]
    assert error_of(response)["field"] == field, response[:600]
    assert (header(response, "connection") or "").lower() == "close", response[:300]
    assert until_closed(sock) == b""
    return response


@pytest.fixture
def bytes_parsed(monkeypatch) -> list[int]:
    """How many bytes every connection of the servers in this test has handed to uvicorn's HTTP parser
    (not those a lingering close reads only to discard)."""
    counted = [0]
    original = H11Protocol.data_received

    def counting(self: H11Protocol, data: bytes) -> None:
        counted[0] += len(data)
        original(self, data)

    monkeypatch.setattr(H11Protocol, "data_received", counting)
    return counted


# --- scope and the upload slots before the body ---------------------------------------------------------


def test_a_read_tokens_upload_is_refused_403_from_its_headers_alone(served: ApiServer):
    reader = token_with_scope(served, "read")
    with connect(served) as sock:
        sock.sendall(upload_head(reader, 256 * MIB))  # and not one byte of the body
        response = refused_and_closed(sock, 403, "Authorization")
    assert "'write' scope" in error_of(response)["message"]
    assert served.registry.list_tasks() == []


def test_a_read_tokens_large_upload_is_not_read_after_its_403(served: ApiServer, bytes_parsed):
    """A real client streaming a 64 MiB file still gets the 403 (not a broken pipe), and the server parses
    at most what arrived before it answered (uvicorn's 64 KiB buffer and one socket read), never the
    upload: the rest is read only to be discarded (the lingering close), nothing of it is parsed or
    spooled to temporary files."""
    reader = token_with_scope(served, "read")
    head = (
        b'--pelt-boundary\r\nContent-Disposition: form-data; name="train"; filename="train.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n"
    )
    tail = b"\r\n--pelt-boundary--\r\n"
    line = b'{"sentence": "fine", "label": 1}\n'
    chunk, chunks = line * (MIB // len(line)), 64  # 64 MiB of JSON Lines

    def body() -> Iterator[bytes]:
        yield head
        for _ in range(chunks):
            yield chunk
        yield tail

    response = httpx.post(
        f"{served.url}/v1/tasks",
        content=body(),
        headers={
            "Authorization": f"Bearer {reader}",
            "Content-Type": "multipart/form-data; boundary=pelt-boundary",
            "Content-Length": str(len(head) + len(chunk) * chunks + len(tail)),
        },
        timeout=DEADLINE_SECONDS,
    )
    wait_for_connections(served, 0)
    assert bytes_parsed[0] < MIB, f"the server parsed {bytes_parsed[0]} bytes of a refused upload"
    assert response.status_code == 403, response.text
    assert response.json()["error"]["field"] == "Authorization"


def test_every_v1_route_declares_one_scope_which_is_checked_from_the_headers():
    """A route added without READ, PREDICT, WRITE or ADMIN would reach its body parsing with any token."""
    from fastapi.routing import APIRoute

    from services.api.middleware import declared_scopes
    from services.api.routes import API_PREFIX, V1_ROUTERS

    routes = [route for router in V1_ROUTERS for route in router.routes if isinstance(route, APIRoute)]
    declared = declared_scopes(V1_ROUTERS, API_PREFIX)
    assert len(declared) == len(routes)
    assert [len(route.checks) for route in declared] == [1] * len(routes)


def probe_slots_free(server: ApiServer) -> int:
    return server.app.state.operations.uploads.probe_slots._value  # threading.Semaphore's count


def test_an_upload_beyond_the_probe_concurrency_is_refused_503_from_its_headers_alone(served: ApiServer):
    slots = served.app.state.operations.uploads.probe_slots
    taken = [slots.acquire(blocking=False) for _ in range(served.settings.dataset_probe_concurrency)]
    try:
        assert all(taken)
        with connect(served) as sock:
            sock.sendall(upload_head(served.token, 100 * MIB))
            response = refused_and_closed(sock, 503, None)  # the request: its fields are not read yet
        assert int(header(response, "retry-after") or 0) >= 1
        assert "PELT_DATASET_PROBE_CONCURRENCY" in error_of(response)["message"]
    finally:
        for _ in taken:
            slots.release()
    assert served.registry.list_tasks() == []


def multipart(boundary: str, fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> bytes:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    parts += [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
        f"Content-Type: application/octet-stream\r\n\r\n".encode()
        + content
        + b"\r\n"
        for name, (filename, content) in files.items()
    ]
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


def test_an_upload_holds_its_probe_slot_from_its_headers_until_its_answer(
    tmp_path: Path, toy_files: dict[str, Path]
):
    """With one slot: an upload whose body is still arriving holds it (a second upload gets its 503 from
    its headers), registers once its body is complete, and gives the slot back."""
    body = multipart(
        "pelt-boundary",
        {"name": "toy", "definition": '{"text_fields": ["sentence"]}'},
        {"train": ("train.jsonl", toy_files["train"].read_bytes())},
    )
    with serve(tmp_path, LONG_TIMEOUT_SECONDS, dataset_probe_concurrency=1) as server:
        with connect(server) as first:
            first.sendall(upload_head(server.token, len(body)) + body[: len(body) // 2])
            deadline = time.monotonic() + DEADLINE_SECONDS
            while probe_slots_free(server) != 0:
                assert time.monotonic() < deadline, "the upload did not take its slot"
                time.sleep(0.01)
            with connect(server) as second:
                second.sendall(upload_head(server.token, len(body)))
                refused_and_closed(second, 503, None)
            first.sendall(body[len(body) // 2 :])
            assert read_response(first).startswith(b"HTTP/1.1 201")
        assert [task.name for task in server.registry.list_tasks()] == ["toy"]
        deadline = time.monotonic() + DEADLINE_SECONDS
        while probe_slots_free(server) != 1:  # given back once the answer is sent
            assert time.monotonic() < deadline, "the upload kept its slot after its answer"
            time.sleep(0.01)


# --- refusals close their connection; unauthenticated connections get a small share of the cap ----------


@pytest.mark.parametrize("scope", [None, "read"], ids=["no-token-401", "read-token-403"])
def test_a_refused_request_is_answered_with_connection_close_and_closed(served: ApiServer, scope):
    """The refusal comes from the headers; the body it announced is never read, the connection never
    reused (a client trickling that body after its 401 no longer holds a connection)."""
    head = job_request_head(served, authorized=False)
    if scope is not None:
        head = head.replace(
            b"\r\n\r\n", f"\r\nAuthorization: Bearer {token_with_scope(served, scope)}\r\n\r\n".encode()
        )
    with connect(served) as sock:
        sock.sendall(head + b'{"task": ')
        refused_and_closed(sock, 401 if scope is None else 403, "Authorization")


def refused_upload(server: ApiServer) -> socket.socket:
    """A connection whose read token announced a 256 MiB upload, sent none of it, and read its 403."""
    sock = connect(server)
    sock.sendall(upload_head(token_with_scope(server, "read"), 256 * MIB))
    response = read_response(sock)
    assert response.startswith(b"HTTP/1.1 403"), response[:300]
    assert (header(response, "connection") or "").lower() == "close"
    return sock


def test_a_client_still_sending_after_its_refusal_sees_a_clean_end_not_a_reset(served: ApiServer):
    """A lingering close: after a refusal the server shuts its side (FIN) and reads and discards what the
    client still sends, so a client that only reads the answer once its upload is written (as many do)
    is not reset (ECONNRESET, EPIPE), and does not lose the answer where a reset discards it (Windows)."""
    with refused_upload(served) as sock:
        piece = b"x" * 65536
        for _ in range(MIB // len(piece)):
            sock.sendall(piece)  # would raise BrokenPipeError or ConnectionResetError after a reset
        assert sock.recv(65536) == b""  # the server's FIN, not a reset
        sock.shutdown(socket.SHUT_WR)
        wait_for_connections(served, 0)  # the client's own end closes the lingering connection
    assert served.registry.list_tasks() == []


def wait_until_lingering(server: ApiServer) -> None:
    """Wait for the server's one connection to be in its lingering close (still counted as open)."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not any(
        protocol.linger_deadline is not None for protocol in list(server._server.server_state.connections)
    ):
        assert time.monotonic() < deadline, "the refused connection never lingered"
        time.sleep(0.01)
    assert open_connections(server) == 1


def test_a_client_trickling_after_its_refusal_is_closed_at_the_lingering_time_bound(
    served: ApiServer, monkeypatch
):
    """Each byte comes far within the idle time: only the bound on the whole lingering close ends it."""
    monkeypatch.setattr(ClientDeadlines, "linger_idle_timeout", LONG_TIMEOUT_SECONDS)
    monkeypatch.setattr(ClientDeadlines, "linger_total_timeout", SHORT_TIMEOUT_SECONDS)
    with refused_upload(served) as sock:
        wait_until_lingering(served)
        deadline = time.monotonic() + DEADLINE_SECONDS
        while open_connections(served) > 0:
            assert time.monotonic() < deadline, "a client trickling after its refusal kept its connection"
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.05)
        wait_for_connections(served, 0)


def test_a_client_silent_after_its_refusal_is_closed_after_the_lingering_idle_time(
    served: ApiServer, monkeypatch
):
    """A client that sends a little more and then neither sends nor closes its end."""
    monkeypatch.setattr(ClientDeadlines, "linger_idle_timeout", SHORT_TIMEOUT_SECONDS)
    monkeypatch.setattr(ClientDeadlines, "linger_total_timeout", LONG_TIMEOUT_SECONDS)
    with refused_upload(served) as sock:
        sock.sendall(b"x" * 1000)
        wait_until_lingering(served)
        wait_for_connections(served, 0)


def test_a_client_sending_more_than_the_lingering_bytes_after_its_refusal_is_closed(
    served: ApiServer, monkeypatch
):
    """The server discards at most LINGER_MAX_BYTES: past them it closes, however fast they come."""
    monkeypatch.setattr(ClientDeadlines, "linger_max_bytes", MIB)
    monkeypatch.setattr(ClientDeadlines, "linger_idle_timeout", LONG_TIMEOUT_SECONDS)
    monkeypatch.setattr(ClientDeadlines, "linger_total_timeout", LONG_TIMEOUT_SECONDS)
    with refused_upload(served) as sock:
        wait_until_lingering(served)
        piece = b"x" * 65536
        try:
            for _ in range(4 * MIB // len(piece)):
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed past the bound: a reset is what the bound costs the client
        wait_for_connections(served, 0)


def test_idle_unauthenticated_connections_leave_room_for_an_authenticated_request(tmp_path: Path):
    with serve(
        tmp_path, LONG_TIMEOUT_SECONDS, api_max_connections=20, api_max_unauthenticated_connections=5
    ) as server:
        strangers = [connect(server) for _ in range(60)]  # three times the cap, each sending nothing ...
        try:
            for sock in strangers[::2]:
                sock.sendall(b"GET /v1/tasks HTTP/1.1\r\nHost: pe")  # ... or half a request head
            answered = httpx.get(
                f"{server.url}/v1/tasks",
                headers={"Authorization": f"Bearer {server.token}"},
                timeout=DEADLINE_SECONDS,
            )
            assert answered.status_code == 200, answered.text
            deadline = time.monotonic() + DEADLINE_SECONDS
            while open_connections(server) > 5:  # the oldest were closed as newer ones came
                assert time.monotonic() < deadline, f"{open_connections(server)} connections still open"
                time.sleep(0.01)
        finally:
            for sock in strangers:
                sock.close()


def answer_or_close(sock: socket.socket) -> bytes:
    """The next response on the connection, or b"" when the server closes it instead."""
    try:
        first = sock.recv(65536)
    except ConnectionResetError:
        return b""
    if not first:
        return b""
    received = first
    while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < int(
        header(received, "content-length") or 0
    ):
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed in a response: {received!r}"
        received += chunk
    return received


def test_a_connection_that_never_authenticates_is_closed_after_the_header_timeout(tmp_path: Path):
    """Public requests (/health, the page) on a kept-alive connection do not hold it past the deadline
    of a connection that has not authenticated (the header timeout, counted from its opening)."""
    with serve(tmp_path, SHORT_TIMEOUT_SECONDS) as server, connect(server) as sock:
        deadline = time.monotonic() + DEADLINE_SECONDS
        while True:
            assert time.monotonic() < deadline, "a connection polling /health was never closed"
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: pelt\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            answer = answer_or_close(sock)
            if not answer:
                break
            assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
            time.sleep(0.05)  # a poller's pace, far inside uvicorn's 5 s keep-alive timeout


# --- a chunked JSON body above the bound ----------------------------------------------------------------


def test_a_chunked_json_body_above_the_bound_is_413_naming_the_body_and_writes_nothing(served: ApiServer):
    bound = served.settings.max_request_bytes

    def chunks() -> Iterator[bytes]:  # no Content-Length: httpx sends it chunked
        yield b'{"task": "toy", "method": "lora", "note": "'
        for _ in range(2 * bound // 8192):
            yield b"x" * 8192

    response = httpx.post(
        f"{served.url}/v1/jobs",
        content=chunks(),
        headers={"Authorization": f"Bearer {served.token}", "Content-Type": "application/json"},
        timeout=DEADLINE_SECONDS,
    )
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["field"] == "body" and str(bound) in error["message"]
    assert response.headers.get("connection", "").lower() == "close"
    assert served.registry.list_jobs() == []


# --- answers a client never reads -----------------------------------------------------------------------

ANSWER_BYTES = 32 * MIB  # far above what the kernel's socket buffers hold on loopback


def large_task_list(*args: object, **kwargs: object) -> list[dict]:
    """Four tasks of 8 MiB each (their descriptions): a GET /v1/tasks answer of 32 MiB."""
    return [
        {
            "id": number,
            "name": f"task-{number}",
            "source_kind": "files",
            "split_sizes": {"train": 1},
            "train_size": 1,
            "text_fields": ["text"],
            "label_field": "label",
            "problem_type": "single_label_classification",
            "metric": "accuracy",
            "metric_direction": "max",
            "label_names": None,
            "max_length": 128,
            "description": "d" * (ANSWER_BYTES // 4),
            "created_at": datetime(2025, 1, 1, tzinfo=UTC),
        }
        for number in range(4)
    ]


def request_the_large_answer(server: ApiServer) -> socket.socket:
    """A connection, with a small receive buffer, that has asked for the 32 MiB answer and read nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(DEADLINE_SECONDS)
    sock.connect((server.host, server.port))
    sock.sendall(
        f"GET /v1/tasks HTTP/1.1\r\nHost: pelt\r\nAuthorization: Bearer {server.token}\r\n\r\n".encode()
    )
    return sock


def test_a_client_that_stops_reading_a_large_answer_is_disconnected(tmp_path: Path, monkeypatch):
    with serve(tmp_path, LONG_TIMEOUT_SECONDS, api_send_idle_timeout_seconds=SHORT_TIMEOUT_SECONDS) as server:
        monkeypatch.setattr(server.app.state.operations, "list_tasks", large_task_list)
        with request_the_large_answer(server) as sock:
            wait_for_connections(server, 1)
            wait_for_connections(server, 0)  # without a byte read by the client: the server gave up
            received = until_closed(sock)
        assert 0 < len(received) < ANSWER_BYTES  # what the kernel's buffers held, not the answer


def send_deadlines(server: ApiServer) -> list[float]:
    return [
        deadline
        for protocol in list(server._server.server_state.connections)
        if (deadline := protocol.send_deadline) is not None
    ]


def next_send_deadline(server: ApiServer, after: float | None = None) -> float:
    waited_until = time.monotonic() + DEADLINE_SECONDS
    while True:
        deadlines = send_deadlines(server)
        if len(deadlines) == 1 and (after is None or deadlines[0] > after):
            return deadlines[0]
        assert time.monotonic() < waited_until, f"send deadlines {deadlines}, none after {after}"
        time.sleep(0.01)


def test_each_read_of_a_large_answer_pushes_the_send_deadline_back(served: ApiServer, monkeypatch):
    """The send timeout is an idle timeout (like nginx's send_timeout): a client that reads a large answer
    slowly is never cut off while it keeps reading."""
    monkeypatch.setattr(served.app.state.operations, "list_tasks", large_task_list)
    with request_the_large_answer(served) as sock:
        first = next_send_deadline(served)
        read = 0
        while read < 4 * MIB:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection"
            read += len(chunk)
        next_send_deadline(served, after=first)


# --- a minimum upload rate ------------------------------------------------------------------------------


def test_a_body_trickling_below_the_minimum_rate_is_closed_and_writes_nothing(tmp_path: Path):
    with serve(
        tmp_path,
        LONG_TIMEOUT_SECONDS,  # far above the trickle's pauses: only the rate can close it
        api_min_upload_bytes_per_second=1000,
        api_min_upload_rate_window_seconds=1.0,
    ) as server:
        with connect(server) as sock:
            sock.sendall(job_request_head(server, authorized=True, length=100_000))
            deadline, closed = time.monotonic() + DEADLINE_SECONDS, False
            while not closed:  # one byte per 50 ms at most: 20 bytes a second, whatever the machine's load
                assert time.monotonic() < deadline, "a body trickling at 20 bytes/s was never closed"
                try:
                    sock.sendall(b" ")
                except (BrokenPipeError, ConnectionResetError):
                    break
                readable, _, _ = select.select([sock], [], [], 0.05)
                closed = bool(readable)
            assert until_closed(sock) == b""  # closed unanswered: the app was still waiting for the body
        assert server.registry.list_jobs() == []


def test_a_body_at_the_minimum_rate_over_every_window_is_never_too_slow():
    rate = UploadRate(bytes_per_second=100, window_seconds=10, now=0.0)
    for second in range(1, 120):
        rate.arrived(100, now=float(second), held=False)
        assert not rate.too_slow(now=second + 0.5, held=False)


def test_a_body_is_judged_only_after_a_whole_window():
    rate = UploadRate(bytes_per_second=100, window_seconds=10, now=0.0)
    assert not rate.too_slow(now=9.9, held=False)  # nothing arrived yet: still within the grace
    assert rate.too_slow(now=10.0, held=False)


def test_a_fast_start_banks_no_credit_for_a_trickle_later():
    rate = UploadRate(bytes_per_second=100, window_seconds=10, now=0.0)
    rate.arrived(1_000_000, now=1.0, held=False)
    assert not rate.too_slow(now=10.5, held=False)
    for second in range(11, 22):
        rate.arrived(1, now=float(second), held=False)
    assert rate.too_slow(now=21.5, held=False)  # the last 10 s brought 10 bytes, not 1,000


def test_time_the_server_holds_the_body_back_does_not_count_against_the_client():
    rate = UploadRate(bytes_per_second=100, window_seconds=10, now=0.0)
    rate.arrived(500, now=5.0, held=True)  # the server stops reading for 100 s
    assert not rate.too_slow(now=105.0, held=False)  # 5 s of the client's time: within the grace
    rate.arrived(500, now=106.0, held=False)
    assert not rate.too_slow(now=110.0, held=False)  # 1,000 bytes over the client's last 10 s
    assert rate.too_slow(now=116.5, held=False)


def test_no_minimum_rate_when_it_is_zero():
    rate = UploadRate(bytes_per_second=0, window_seconds=10, now=0.0)
    assert not rate.too_slow(now=1_000.0, held=False)
