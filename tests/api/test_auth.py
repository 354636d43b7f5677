"""Auth: every route of the OpenAPI schema except /health, and the schema itself, refuse a request without
a token, with a wrong token and with a revoked token (401, nothing written); the right token gets past
the check."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import Api

OPEN_ROUTES = {("get", "/health"), ("get", "/ready")}


def routes(app) -> list[tuple[str, str]]:
    schema = app.openapi()
    found = [
        (method, path)
        for path, item in schema["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    ]
    assert len(found) >= 20, found  # the test is only as good as the list it walks
    return found


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", lambda m: "1" if m.group(0).endswith("_id}") else "toy", path)


def call(http: TestClient, method: str, path: str, token: str | None):
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    body = {"json": {}} if method == "post" else {}
    return http.request(method.upper(), concrete(path), headers=headers, **body)


@pytest.fixture
def revoked(api: Api) -> str:
    _, secret = api.registry.create_api_token("old")
    api.registry.revoke_api_token("old")
    return secret


@pytest.mark.parametrize("credential", ["none", "wrong", "malformed", "revoked"])
def test_every_route_but_health_refuses_requests_without_a_valid_token(
    api: Api, revoked: str, credential: str
):
    token = {"none": None, "wrong": "pelt_" + "x" * 43, "malformed": "Basic abc", "revoked": revoked}[
        credential
    ]
    http = TestClient(api.app)
    checked = []
    for method, path in routes(api.app):
        if (method, path) in OPEN_ROUTES:
            continue
        response = call(http, method, path, token)
        assert response.status_code == 401, (method, path, response.status_code, response.text)
        assert response.json()["error"]["field"] == "Authorization"
        assert response.headers["WWW-Authenticate"] == "Bearer"
        checked.append(path)
    assert len(checked) >= 19
    schema = call(http, "get", "/openapi.json", token)
    assert schema.status_code == 401 and schema.headers["WWW-Authenticate"] == "Bearer"
    assert api.registry.list_tasks() == [] and api.registry.list_jobs() == []
    assert [t.name for t in api.registry.list_api_tokens()] == ["old", "tests"]


def test_with_the_right_token_no_route_answers_401(api: Api):
    http = TestClient(api.app)
    for method, path in [*routes(api.app), ("get", "/openapi.json")]:
        response = call(http, method, path, api.token)
        assert response.status_code != 401, (method, path, response.text)


def test_a_token_stops_working_once_revoked(api: Api):
    _, secret = api.registry.create_api_token("temporary")
    client = api.client(secret)
    assert client.tasks() == []
    api.registry.revoke_api_token("temporary")
    assert client.http.get("/v1/tasks").status_code == 401


def test_tokens_are_stored_hashed(api: Api):
    from sqlalchemy import text

    with api.registry.engine.connect() as connection:
        stored = [row[0] for row in connection.execute(text("SELECT token_hash FROM api_tokens"))]
    assert api.token not in stored and all(len(value) == 64 for value in stored)


def test_the_api_reports_the_version_pyproject_declares_without_reading_installed_metadata(api: Api):
    """pelt also runs from a source tree on PYTHONPATH (no installed metadata), as on a lent GPU machine."""
    import tomllib
    from pathlib import Path

    from pelt_core import __version__

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert api.app.version == __version__ == pyproject["project"]["version"]
