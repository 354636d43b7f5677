"""The PostgreSQL of the tests marked `postgres`: the server of PELT_TEST_DATABASE_URL (`make test` sets it
from deploy/local-postgres.sh). Where it is unset or its server cannot be connected to, those tests skip
with the reason; with PELT_REQUIRE_POSTGRES=1 (CI sets it) they fail instead, so that a PostgreSQL that
went missing cannot hide behind skips."""

from __future__ import annotations

import functools
import os
from typing import NoReturn

import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from services.registry.db import normalize_url
from services.registry.testing import MAINTENANCE_DATABASE

URL_VARIABLE = "PELT_TEST_DATABASE_URL"
REQUIRE_VARIABLE = "PELT_REQUIRE_POSTGRES"
CONNECT_TIMEOUT_SECONDS = 10


def postgres_url(what: str) -> str:
    """PELT_TEST_DATABASE_URL once its server takes a connection; otherwise a skip (a failure where
    PELT_REQUIRE_POSTGRES=1) saying that `what` cannot run, and why."""
    url = os.environ.get(URL_VARIABLE)
    if not url:
        unavailable(
            f"{URL_VARIABLE} is unset, so {what} cannot run "
            "(`make test` sets it when a local PostgreSQL is installed: deploy/local-postgres.sh)"
        )
    problem = connection_problem(url)
    if problem is not None:
        unavailable(
            f"the PostgreSQL of {URL_VARIABLE} cannot be connected to, so {what} cannot run: {problem}"
        )
    return url


def required() -> bool:
    return os.environ.get(REQUIRE_VARIABLE) == "1"


def unavailable(reason: str) -> NoReturn:
    if required():
        pytest.fail(f"{reason} ({REQUIRE_VARIABLE}=1: PostgreSQL is required here)", pytrace=False)
    pytest.skip(reason)


@functools.cache
def connection_problem(url: str) -> str | None:
    """Why the server of `url` takes no connection to its maintenance database (where the tests make their
    scratch databases), or None where it does. Asked once per URL and test session."""
    engine = create_engine(
        normalize_url(url).set(database=MAINTENANCE_DATABASE),
        poolclass=NullPool,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_SECONDS},
    )
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")
    except OperationalError as exc:  # refused, timed out, authentication failed, no such database
        cause = exc.orig or exc
        return f"{type(cause).__name__}: {' '.join(str(cause).split())}"  # one line, for pytest's summary
    finally:
        engine.dispose()
    return None
