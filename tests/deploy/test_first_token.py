"""A deployment's first API token: its start-up step (`migrate` in deploy/compose.yaml, the migration Job in
deploy/k8s) runs `pelt token create admin --scope admin --secret-from-env FIRST_API_TOKEN --if-none`, so the
operator's secret store, not a log, holds the secret. A short or malformed secret is refused and writes
nothing; the step runs again at every upgrade and then changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from services.commands.admin import token_group
from services.registry import Registry, upgrade
from services.registry.testing import sqlite_url
from services.settings import get_settings

GOOD_SECRET = "pelt_" + "Ab3_-" * 9  # 45 URL-safe characters after the prefix
FIRST_TOKEN = ["create", "admin", "--scope", "admin", "--secret-from-env", "FIRST_API_TOKEN", "--if-none"]


@pytest.fixture
def registry_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    url = sqlite_url(tmp_path / "registry.db")
    upgrade(url)
    monkeypatch.setenv("PELT_DATA_DIR", str(tmp_path / "pelt"))
    monkeypatch.setenv("PELT_DATABASE_URL", url)
    get_settings.cache_clear()
    yield url
    get_settings.cache_clear()


def run_token(arguments: list[str], **environment: str) -> Result:
    return CliRunner().invoke(token_group, arguments, env=environment)


def token_names(url: str) -> list[str]:
    with Registry(url) as registry:
        return [token.name for token in registry.list_api_tokens()]


def test_the_first_token_takes_its_secret_from_the_environment_and_never_prints_it(registry_url: str):
    result = run_token(FIRST_TOKEN, FIRST_API_TOKEN=GOOD_SECRET)
    assert result.exit_code == 0, result.output
    assert GOOD_SECRET not in result.output and "$FIRST_API_TOKEN" in result.output
    with Registry(registry_url) as registry:
        assert registry.authenticate(GOOD_SECRET).scope == "admin"


def test_the_start_up_step_run_again_changes_nothing(registry_url: str):
    assert run_token(FIRST_TOKEN, FIRST_API_TOKEN=GOOD_SECRET).exit_code == 0
    other = "pelt_" + "Zz9-_" * 9
    again = run_token(FIRST_TOKEN, FIRST_API_TOKEN=other)
    assert again.exit_code == 0 and "not created" in again.output
    with Registry(registry_url) as registry:
        assert registry.authenticate(other) is None and registry.authenticate(GOOD_SECRET) is not None
    assert token_names(registry_url) == ["admin"]


def test_a_revoked_first_token_is_not_made_again(registry_url: str):
    assert run_token(FIRST_TOKEN, FIRST_API_TOKEN=GOOD_SECRET).exit_code == 0
    assert run_token(["revoke", "admin"]).exit_code == 0
    assert run_token(FIRST_TOKEN, FIRST_API_TOKEN=GOOD_SECRET).exit_code == 0
    with Registry(registry_url) as registry:
        assert registry.authenticate(GOOD_SECRET) is None


@pytest.mark.parametrize(
    "secret",
    [
        "pelt_short",
        "pelt_" + "a" * 42,  # one character short of what pelt makes
        "Ab3_-" * 10,  # no pelt_ prefix: the API would never accept it
        "pelt_" + "a" * 40 + " !@#$",  # characters outside A-Z a-z 0-9 _ -
        "pelt_" + "a" * 196,  # longer than the API reads
    ],
)
def test_a_malformed_secret_is_refused_without_repeating_it_and_writes_nothing(
    registry_url: str, secret: str
):
    result = run_token(FIRST_TOKEN, FIRST_API_TOKEN=secret)
    assert result.exit_code != 0
    assert "secret" in result.output and "token_urlsafe" in result.output
    assert secret not in result.output
    assert token_names(registry_url) == []


def test_a_missing_variable_is_named(registry_url: str):
    result = run_token(FIRST_TOKEN, FIRST_API_TOKEN="")
    assert result.exit_code != 0 and "FIRST_API_TOKEN is not set" in result.output
    assert token_names(registry_url) == []


def test_without_if_none_a_second_token_of_the_same_name_is_an_error(registry_url: str):
    assert run_token(FIRST_TOKEN, FIRST_API_TOKEN=GOOD_SECRET).exit_code == 0
    refused = run_token(["create", "admin"])
    assert refused.exit_code != 0 and "already exists" in refused.output
    made = run_token(["create", "colleague"])  # a made secret is printed once, as before
    assert made.exit_code == 0 and made.stdout.strip().startswith("pelt_")
