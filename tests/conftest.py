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
# a Ray head waits this long for its GCS to bind its port (Ray's default, 30 s, ran out once on a loaded
# 2-core machine, before the GCS had written a line): a deadline for a start, not a margin to race
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")


def _threads_per_test_process() -> int:
    """The cores of this machine shared out over the suite's processes (pytest-xdist's, `make test`).

    torch's default, one OpenMP thread per core in every process, oversubscribes a machine that runs two
    test processes (and their Ray workers and service processes) at once: OpenMP's waiting threads spin
    on cores the other process needs. Measured on 2 cores, the 13 regression-learning tests of
    tests/core/test_train.py on 2 processes: 245.7 s with torch's default, 41.9 s with one thread each."""
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // processes)


# In each of pytest-xdist's processes (not in the one that hands them tests, whose environment they
# inherit), before torch is imported, so that it and every process a test starts take the share; a
# variable set by the caller wins. One process alone keeps torch's default.
if "PYTEST_XDIST_WORKER" in os.environ:
    for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_variable, str(_threads_per_test_process()))

import pytest  # noqa: E402  (after the environment above)

from tests.tiers import UnitScheduling, mark_slow_tests, refuse_slow_work  # noqa: E402, F401  (refuse_slow_work: autouse)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_slow_tests(items)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """pelt's units of work (tests/tiers.py `UnitScheduling`) for pytest-xdist's load-balancing modes."""
    if config.getvalue("dist") in ("load", "loadscope", "loadfile", "loadgroup"):
        return UnitScheduling(config, log)
    return None


@pytest.fixture(scope="session", autouse=True)
def patient_ray_starts() -> object:
    """A Ray node a test starts in this process that never comes up is started again (tests/ray_start.py)."""
    from tests.ray_start import patient_ray_starts as retrying

    with retrying():
        yield
