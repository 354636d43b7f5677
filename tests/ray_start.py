"""A Ray node a test starts that never comes up is stopped and started again, instead of failing the test.

Ray gives a starting node's raylet a fixed 30 s to register with its GCS (ray/_private/node.py, not
configurable), then raises "The current node timed out during startup". In full runs of the suite on 2
cores this happened to a test process that had started and stopped Ray before: its GCS ran, but no raylet
ever wrote a line (the raylet is forked from a process full of gRPC threads; its child can hang before it
runs). Waiting longer does not help such a start; starting again does. While `patient_ray_starts` is on:
  - a node whose start times out has every process it started killed (Ray leaves them running), then the
    error goes on;
  - `ray.init` that raised it is tried again, up to ATTEMPTS times;
  - `start_with_retries` does the same for any other start (tests/workers/test_cluster.py's `Cluster`).
pelt itself keeps to Ray's public means (services.dispatcher.ray_cluster) and is not patched; this applies
only in the pytest processes (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

ATTEMPTS = 3
START_TIMED_OUT = "timed out during startup"  # Ray's words (ray/_private/node.py)
_T = TypeVar("_T")
log = logging.getLogger("tests.ray_start")


def timed_out(exc: BaseException) -> bool:
    return START_TIMED_OUT in str(exc)


def start_with_retries(
    start: Callable[[], _T], clean_up: Callable[[], object], attempts: int = ATTEMPTS
) -> _T:
    """`start()`, and after a start that timed out `clean_up()` and `start()` again, `attempts` in all."""
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except Exception as exc:
            if not timed_out(exc) or attempt == attempts:
                raise
            log.warning("a Ray node did not come up (attempt %d of %d); starting it again", attempt, attempts)
            clean_up()
    raise AssertionError("unreachable")


@contextlib.contextmanager
def patient_ray_starts() -> Iterator[None]:
    """While inside, in-process Ray starts that time out are cleaned up and tried again (module docstring)."""
    import ray
    import ray._private.node as ray_node

    # Ray renamed or moved these: this helper no longer applies and must be revisited, not silently skipped
    original_node_init, original_init = ray_node.Node.__init__, ray.init

    def node_init(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            original_node_init(self, *args, **kwargs)
        except Exception as exc:
            if timed_out(exc):
                with contextlib.suppress(Exception):
                    self.kill_all_processes(check_alive=False, allow_graceful=False)
            raise

    def init(*args: Any, **kwargs: Any) -> Any:
        return start_with_retries(lambda: original_init(*args, **kwargs), ray.shutdown)

    ray_node.Node.__init__, ray.init = node_init, init
    try:
        yield
    finally:
        ray_node.Node.__init__, ray.init = original_node_init, original_init
