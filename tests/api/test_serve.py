"""`pelt serve`'s process (services.api.server.ApiServer) without a dispatcher: it migrates the embedded
registry, leaves a token for local clients, answers over real HTTP on loopback, and refuses what it cannot
serve."""

from __future__ import annotations

import socket

import pytest

from services.api.server import ApiServer
from services.client import PeltClient
from services.registry import SchemaOutOfDateError
from services.settings import Settings


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
