"""Shared fixtures: tiny random-config backbones built in code (no files, no hub)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray reads these once, when `ray` is first imported, and test modules import it while they are collected,
# before any test calls pelt's connect_ray (which sets them itself before it imports ray, and refuses a `ray`
# imported without them): a local Ray on 127.0.0.1 only, with token authentication (services.dispatcher)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "token")

import pytest

from tests.tiers import mark_slow_tests, refuse_slow_work  # noqa: F401  (refuse_slow_work: an autouse fixture)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_slow_tests(items)
