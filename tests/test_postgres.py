"""tests/postgres.py: without a PostgreSQL that takes connections the tests marked `postgres` skip, saying
why, unless PELT_REQUIRE_POSTGRES=1, where they fail instead."""

from __future__ import annotations

import pytest

from services.delta_store.testing import free_port
from tests.postgres import postgres_url

WHAT = "the PostgreSQL half of this specification"


@pytest.fixture
def no_url(monkeypatch):
    monkeypatch.delenv("PELT_TEST_DATABASE_URL", raising=False)


@pytest.fixture
def unreachable_url(monkeypatch):
    monkeypatch.setenv(
        "PELT_TEST_DATABASE_URL", f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"
    )


@pytest.mark.parametrize("required", ["", "0"])
def test_without_a_url_the_postgresql_tests_skip_saying_why(no_url, monkeypatch, required):
    monkeypatch.setenv("PELT_REQUIRE_POSTGRES", required)
    with pytest.raises(pytest.skip.Exception, match=f"PELT_TEST_DATABASE_URL is unset, so {WHAT} cannot run"):
        postgres_url(WHAT)


def test_without_a_url_the_postgresql_tests_fail_where_postgresql_is_required(no_url, monkeypatch):
    monkeypatch.setenv("PELT_REQUIRE_POSTGRES", "1")
    with pytest.raises(pytest.fail.Exception, match=r"PELT_TEST_DATABASE_URL is unset.*is required here"):
        postgres_url(WHAT)


def test_a_server_that_takes_no_connection_is_a_skip_naming_the_error(unreachable_url, monkeypatch):
    monkeypatch.delenv("PELT_REQUIRE_POSTGRES", raising=False)
    with pytest.raises(
        pytest.skip.Exception, match=f"cannot be connected to, so {WHAT} cannot run: .*refused"
    ):
        postgres_url(WHAT)


def test_a_server_that_takes_no_connection_is_a_failure_where_postgresql_is_required(
    unreachable_url, monkeypatch
):
    monkeypatch.setenv("PELT_REQUIRE_POSTGRES", "1")
    with pytest.raises(pytest.fail.Exception, match=r"cannot be connected to.*is required here"):
        postgres_url(WHAT)
