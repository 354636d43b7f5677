"""Fixtures of the security tests: those of the API tests (a real app over a real service, in-process)."""

from tests.api.conftest import *  # noqa: F403
