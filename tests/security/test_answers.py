"""Large answers against clients that never read them (issue "Harden, second round": answers a client
never reads).

A delta download is zipped into a private temporary file (0600, in a 0700 folder of its own under
PELT_DATA_DIR/scratch) and sent from disk in chunks: the API's memory does not grow with the delta, and
the file is removed once the answer is sent, when the client goes away mid-answer, or when sending fails.
A list route answers at most MAX_PAGE_LIMIT rows: a larger `limit` is a 422 naming `limit` and the
maximum, and the Python client, the CLI and the study helpers page (offset) to list more.

The downloads are driven as ASGI calls in this process (so that nothing but the app holds the answer's
bytes) and over a real `pelt serve` on 127.0.0.1; every wait polls for an event up to a deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import socket
import stat
import time
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pelt_core.delta_format import DELTA_FILE, MANIFEST_FILE
from pelt_core.limits import MAX_PAGE_LIMIT
from services.api.schemas import SweepOut
from services.api.server import ApiServer
from services.client import PeltClient
from services.settings import Settings
from tests.api.conftest import BACKBONE, Api
from tests.data_templates import copy_migrated_data

BIG_DELTA_BYTES = 32 << 20  # random bytes: zipped, as large (far above what loopback sockets buffer)
DEADLINE_SECONDS = 60.0  # how long a test waits for what must happen


# --- deltas to download ---------------------------------------------------------------------------------


def lora_folder(tiny_bert_dir: Path, folder: Path, padding_bytes: int = 0) -> Path:
    """A rank-2 LoRA delta folder on the tiny backbone; a tensor of `padding_bytes` random bytes added to
    its tensors makes it as large as wanted (its sha256 is that of the padded file)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from pelt_core.backbones import Backbone
    from pelt_core.delta import save_delta
    from pelt_core.methods import get_method
    from pelt_core.model import JobDelta

    backbone = Backbone.load(str(tiny_bert_dir))
    torch.manual_seed(0)
    save_delta(JobDelta(get_method("lora", {"r": 2}), backbone, num_labels=2), backbone, folder)
    if padding_bytes:
        tensors = load_file(str(folder / DELTA_FILE))
        with safe_open(str(folder / DELTA_FILE), framework="pt") as saved:
            metadata = saved.metadata()
        tensors["padding"] = torch.randint(0, 256, (padding_bytes,), dtype=torch.uint8)
        save_file(tensors, str(folder / DELTA_FILE), metadata=metadata)
    return folder


@pytest.fixture
def big_delta(api: Api, tiny_bert_dir: Path, tmp_path: Path) -> str:
    """The download path of a 32 MiB delta, stored as version 1 of task `big`."""
    api.store.register("big", lora_folder(tiny_bert_dir, tmp_path / "big", BIG_DELTA_BYTES))
    return "/v1/tasks/big/deltas/download?version=1"


def scratch_files(settings: Settings) -> list[Path]:
    """Every file under PELT_DATA_DIR/scratch, where downloads are zipped while they are sent."""
    scratch = settings.data_dir / "scratch"
    return sorted(p for p in scratch.rglob("*") if p.is_file()) if scratch.exists() else []


# --- a download as one ASGI call, the client's side in this test ----------------------------------------


@dataclass
class Answer:
    """What the app sent: the status, the headers and how many body bytes (the bytes are not kept)."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body_bytes: int = 0


def answer(
    api: Api,
    path_and_query: str,
    *,
    on_chunk: Callable[[Answer, asyncio.Event], None] | None = None,
    spec_version: str = "2.3",
) -> Answer:
    """GET `path_and_query` from the app as uvicorn would call it (ASGI `spec_version`), counting but not
    keeping the body. on_chunk(answer, gone) runs on each body chunk: setting `gone` makes the client
    disconnect (`receive` answers http.disconnect), raising makes `send` fail as on a broken connection."""
    path, _, query = path_and_query.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"authorization", f"Bearer {api.token}".encode())],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
        "extensions": {},
    }
    sent = Answer()

    async def call() -> None:
        gone = asyncio.Event()
        requested = False

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                sent.status = message["status"]
                sent.headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
            elif message["type"] == "http.response.body":
                sent.body_bytes += len(message.get("body", b""))
                if on_chunk is not None:
                    on_chunk(sent, gone)

        await api.app(scope, receive, send)

    asyncio.run(call())
    return sent


def held_privately(settings: Settings) -> Path:
    """The one archive being sent: a file 0600 in a folder 0700 of its own under PELT_DATA_DIR/scratch."""
    files = scratch_files(settings)
    assert len(files) == 1, f"the answer is not sent from one file under PELT_DATA_DIR/scratch: {files}"
    archive = files[0]
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600, oct(archive.stat().st_mode)
    assert stat.S_IMODE(archive.parent.stat().st_mode) == 0o700, oct(archive.parent.stat().st_mode)
    return archive


# --- the delta download: from disk, the same bytes, no file left ---------------------------------------


def test_a_delta_downloads_memory_in_the_api_does_not_grow_with_the_delta(api, big_delta):
    """The old answer held the whole zip as bytes (twice, while BytesIO.getvalue copied it)."""
    assert answer(api, big_delta).status == 200  # imports and caches warm, outside the measure
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        sent = answer(api, big_delta)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sent.status == 200 and sent.body_bytes > BIG_DELTA_BYTES
    assert peak - before < BIG_DELTA_BYTES / 8, f"the download's peak was {(peak - before) / 2**20:.1f} MiB"


def test_the_answer_is_sent_from_a_private_file_that_is_gone_once_sent(api, big_delta):
    seen: list[Path] = []

    def while_sending(sent: Answer, gone: asyncio.Event) -> None:
        if not seen:
            seen.append(held_privately(api.settings))

    sent = answer(api, big_delta, on_chunk=while_sending)
    assert sent.status == 200 and int(sent.headers["content-length"]) == sent.body_bytes
    assert seen and not seen[0].exists()
    assert scratch_files(api.settings) == []


def test_a_download_folder_a_crashed_server_left_a_day_ago_goes_with_the_next_download(api, big_delta):
    """A crash mid-answer leaves its folder behind; another API host's download in flight (younger) stays."""
    import os

    scratch = api.settings.data_dir / "scratch"
    stale, in_flight = scratch / "download-crashed", scratch / "download-another-host"
    for folder in (stale, in_flight):
        folder.mkdir(parents=True, mode=0o700)
        (folder / "delta.zip").write_bytes(b"partial")
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(stale, (two_days_ago, two_days_ago))
    assert answer(api, big_delta).status == 200
    assert not stale.exists()
    assert (in_flight / "delta.zip").read_bytes() == b"partial"


def test_a_client_that_goes_away_mid_answer_leaves_no_file(api, big_delta):
    def go_away(sent: Answer, gone: asyncio.Event) -> None:
        held_privately(api.settings)
        gone.set()

    sent = answer(api, big_delta, on_chunk=go_away)
    assert 0 < sent.body_bytes < BIG_DELTA_BYTES  # the app stopped sending when the client went
    assert scratch_files(api.settings) == []


def test_a_send_that_fails_mid_answer_leaves_no_file(api, big_delta):
    """As when the connection breaks, or a send timeout closes it (ASGI 2.4: `send` raises)."""

    def break_connection(sent: Answer, gone: asyncio.Event) -> None:
        held_privately(api.settings)
        raise OSError("the connection broke")

    with pytest.raises(OSError, match="the connection broke"):
        answer(api, big_delta, on_chunk=break_connection, spec_version="2.4")
    assert scratch_files(api.settings) == []


def test_the_downloaded_archive_keeps_its_bytes_headers_and_sha256(api, tiny_bert_dir, tmp_path):
    folder = lora_folder(tiny_bert_dir, tmp_path / "lora")
    api.store.register("toy", folder)
    response = api.client().http.get("/v1/tasks/toy/deltas/download", params={"version": "1"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/zip"
    assert response.headers["content-disposition"] == 'attachment; filename="toy-v1.zip"'
    assert response.headers["content-length"] == str(len(response.content))
    sha256 = hashlib.sha256((folder / DELTA_FILE).read_bytes()).hexdigest()
    assert (response.headers["x-pelt-version"], response.headers["x-pelt-sha256"]) == ("1", sha256)
    assert response.headers["x-pelt-kind"] == "imported"
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        assert sorted(archive.namelist()) == [DELTA_FILE, MANIFEST_FILE]
        assert archive.read(DELTA_FILE) == (folder / DELTA_FILE).read_bytes()
        assert json.loads(archive.read(MANIFEST_FILE)) == json.loads((folder / MANIFEST_FILE).read_text())
    pulled = api.client().download("toy", tmp_path / "pulled", version=1)  # checks the sha256 itself
    assert pulled.sha256 == sha256
    assert scratch_files(api.settings) == []


# --- over a real server: a client that reads the head and hangs up --------------------------------------


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ApiServer]:
    """`pelt serve` without a dispatcher, with long timeouts (nothing here waits for one), on a copy of a
    migrated data folder (tests/data_templates.py)."""
    settings = Settings(
        data_dir=copy_migrated_data(tmp_path / "pelt"),
        ray_address=None,
        api_header_timeout_seconds=600.0,
        api_body_idle_timeout_seconds=600.0,
    )
    with ApiServer(settings, port=0, dispatcher=False) as server:
        yield server


def test_a_client_that_hangs_up_on_a_real_server_leaves_no_file(served, tiny_bert_dir, tmp_path):
    served.app.state.operations.store.register(
        "big", lora_folder(tiny_bert_dir, tmp_path / "big", BIG_DELTA_BYTES)
    )
    with socket.create_connection((served.host, served.port), timeout=DEADLINE_SECONDS) as sock:
        sock.sendall(
            b"GET /v1/tasks/big/deltas/download?version=1 HTTP/1.1\r\nHost: pelt\r\n"
            + f"Authorization: Bearer {served.token}\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            assert chunk, f"the connection closed in the answer's head: {head!r}"
            head += chunk
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        held_privately(served.settings)  # 32 MiB do not fit in the sockets' buffers: still being sent
    deadline = time.monotonic() + DEADLINE_SECONDS
    while scratch_files(served.settings):
        assert time.monotonic() < deadline, f"left after the client hung up: {scratch_files(served.settings)}"
        time.sleep(0.05)


# --- page sizes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/audit"])
def test_a_limit_above_the_page_cap_is_422_naming_limit_and_the_maximum(api, path):
    http = api.client().http
    for limit in (MAX_PAGE_LIMIT + 1, 10_000):
        response = http.get(path, params={"limit": limit})
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["field"] == "limit", error
        assert f"{MAX_PAGE_LIMIT}" in error["message"], error
    assert http.get(path, params={"limit": MAX_PAGE_LIMIT}).status_code == 200


@pytest.fixture
def many_jobs(api: Api, toy_task: str) -> SweepOut:
    """A cancelled sweep of MAX_PAGE_LIMIT + 2 jobs (two methods x (MAX_PAGE_LIMIT/2 + 1) seeds)."""
    client = api.client()
    seeds = list(range(MAX_PAGE_LIMIT // 2 + 1))
    sweep = client.sweep(toy_task, ["lora", "bitfit"], backbone=BACKBONE, seeds=seeds, device="cpu")
    client.cancel_sweep(sweep.id)
    assert len(sweep.job_ids) == MAX_PAGE_LIMIT + 2
    return sweep


def paging_client(api: Api, limits: list[int]) -> Callable[[], PeltClient]:
    """A PeltClient factory whose clients record the `limit` of every list request in `limits`."""

    def make() -> PeltClient:
        client = api.client()
        client.http.event_hooks["request"].append(
            lambda request: (
                limits.append(int(request.url.params["limit"])) if "limit" in request.url.params else None
            )
        )
        return client

    return make


def test_the_client_lists_more_jobs_than_one_page_page_by_page(api, many_jobs):
    sweep_id, job_ids = many_jobs.id, sorted(many_jobs.job_ids)
    limits: list[int] = []
    client = paging_client(api, limits)()
    assert [job.id for job in client.jobs(sweep_id=sweep_id, limit=None)] == job_ids
    assert [job.id for job in client.jobs(sweep_id=sweep_id, limit=MAX_PAGE_LIMIT + 1)] == job_ids[:-1]
    assert [job.id for job in client.jobs(sweep_id=sweep_id, offset=1, limit=None)] == job_ids[1:]
    assert {job.id for job in client.wait(many_jobs, progress=False)} == set(job_ids)
    assert limits and max(limits) <= MAX_PAGE_LIMIT


def test_the_cli_and_the_study_list_more_jobs_than_one_page(api, many_jobs, monkeypatch):
    from click.testing import CliRunner

    from services.commands import jobs
    from services.study.plan import task_jobs

    sweep_id, job_ids = many_jobs.id, sorted(many_jobs.job_ids)
    limits: list[int] = []
    monkeypatch.setattr(jobs, "PeltClient", paging_client(api, limits))
    listing = CliRunner().invoke(jobs.jobs_command, ["--sweep", str(sweep_id), "--limit", "5000"])
    assert listing.exit_code == 0, listing.output
    assert [int(row.split()[0]) for row in listing.output.splitlines() if row.split()[0].isdigit()] == job_ids
    watched = CliRunner().invoke(jobs.watch_command, ["--sweep", str(sweep_id)])
    assert watched.exit_code == 1, watched.output  # every job was cancelled
    ended = {int(line.split()[1]) for line in watched.output.splitlines() if line.endswith(": cancelled")}
    assert ended == set(job_ids), watched.output[-2000:]
    assert [job.id for job in task_jobs(paging_client(api, limits)(), "toy", BACKBONE)] == job_ids
    assert limits and max(limits) <= MAX_PAGE_LIMIT
