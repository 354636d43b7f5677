"""`pelt serve`'s process (services.api.server.ApiServer) without a dispatcher: it migrates the embedded
registry, leaves a token for local clients, answers over real HTTP on loopback, and refuses what it cannot
serve."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pelt_core.backbones import backbone_facts
from pelt_core.testing import tiny_bert_config
from services.api.server import ApiServer
from services.client import PeltClient
from services.registry import SchemaOutOfDateError
from services.settings import Settings
from tests.data_templates import copy_migrated_data

WITHOUT_TORCH = """
import json, sys
from pathlib import Path
from services.api.server import ApiServer
from services.client import PeltClient
from services.registry import Registry
from services.settings import Settings

settings = Settings(data_dir=sys.argv[1], ray_address=None)
train = Path(sys.argv[1]) / "train.jsonl"
train.write_text("".join(json.dumps({"sentence": f"row {i}", "label": i % 2}) + "\\n" for i in range(8)))
with Registry(settings=settings) as registry:
    registry.register_task("toy", {"train": str(train)}, text_fields=["sentence"])
    registry.register_backbone("tiny", "/nowhere/tiny", "sha256:0", json.loads(sys.argv[2]))
with ApiServer(settings, port=0, dispatcher=False, upgrade=False) as server:
    http = PeltClient(server.url, settings=settings).http
    job = {"task": "toy", "method": "lora", "backbone": "tiny"}
    answers = [
        http.get("/v1/tasks").status_code,
        http.get("/v1/tasks/missing").status_code,  # the registry's NotFoundError
        http.post("/v1/jobs", json={**job, "backbone": "missing"}).status_code,  # the backbone names' check
        http.post("/v1/jobs", json={**job, "hyperparameters": {"r": 10**6}}).status_code,  # the limits
        http.post("/v1/jobs", json=job).status_code,  # queued
    ]
print(answers, sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_an_embedded_service_starts_migrated_with_a_local_token_and_answers_over_http(tmp_path):
    settings = Settings(data_dir=tmp_path / "pelt", ray_address=None)
    with ApiServer(settings, port=0, dispatcher=False) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.port > 0
        client = PeltClient(server.url, settings=settings)  # no token given: the local file is read
        assert client.tasks() == []
        assert client.health()["dispatcher"] is None
        assert {m.name for m in client.methods()} >= {"lora", "unipelt"}
        assert (
            PeltClient(server.url, token="pelt_wrong", settings=settings).http.get("/v1/tasks").status_code
            == 401
        )
    assert (tmp_path / "pelt" / "api_token").stat().st_mode & 0o777 == 0o600


def test_an_api_that_neither_composes_nor_predicts_never_imports_torch(tmp_path):
    """Listing, refusing (404s, a 422 from pelt_core's limits) and queueing a job on a registered backbone:
    the API process checks names, numbers and errors without loading torch."""
    data_dir = copy_migrated_data(tmp_path / "pelt")
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, str(data_dir), json.dumps(backbone_facts(tiny_bert_config()))],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[200, 404, 404, 422, 201] []", done.stdout


def test_a_second_start_keeps_the_token_of_the_first(tmp_path):
    settings = Settings(data_dir=tmp_path / "pelt", ray_address=None)
    with ApiServer(settings, port=0, dispatcher=False) as first:
        token = first.token
    with ApiServer(settings, port=0, dispatcher=False) as second:
        assert second.token == token


def test_a_taken_port_is_an_error_naming_it(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=str(port)):
            ApiServer(
                Settings(data_dir=tmp_path / "pelt", ray_address=None), port=port, dispatcher=False
            ).start()


def test_a_deployment_registry_is_not_migrated_behind_its_back(tmp_path):
    settings = Settings(
        data_dir=tmp_path / "pelt", ray_address=None, database_url=f"sqlite:///{tmp_path / 'elsewhere.db'}"
    )
    with pytest.raises(SchemaOutOfDateError, match="pelt db upgrade"):
        ApiServer(settings, port=0, dispatcher=False).start()


class Lines(logging.Handler):
    """Keeps the access lines that pass the access logger's filters."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize(("access_log", "polls_logged"), [("changes", False), ("all", True)])
def test_the_access_log_keeps_changes_and_failures_and_by_default_drops_the_pages_polling(
    tmp_path, access_log, polls_logged
):
    settings = Settings(data_dir=tmp_path / "pelt", ray_address=None)
    kept, access = Lines(), logging.getLogger("uvicorn.access")
    with ApiServer(settings, port=0, dispatcher=False, log_level="info", access_log=access_log) as server:
        access.addHandler(kept)  # after the server's start: uvicorn sets its loggers' handlers up then
        try:
            client = PeltClient(server.url, settings=settings)
            assert client.http.get("/v1/tasks").status_code == 200  # what the page polls
            assert client.http.get("/v1/jobs/999").status_code == 404
            assert client.http.post("/v1/jobs/999/cancel").status_code == 404
        finally:
            access.removeHandler(kept)
    assert any('"GET /v1/jobs/999 HTTP/1.1" 404' in line for line in kept.lines), kept.lines
    assert any('"POST /v1/jobs/999/cancel HTTP/1.1" 404' in line for line in kept.lines), kept.lines
    assert any('"GET /v1/tasks HTTP/1.1" 200' in line for line in kept.lines) == polls_logged, kept.lines


def test_an_unknown_access_log_setting_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="access_log must be one of changes, all, none, got 'some'"):
        ApiServer(Settings(data_dir=tmp_path / "pelt", ray_address=None), access_log="some")
