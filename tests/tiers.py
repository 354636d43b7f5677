"""The two tiers of the suite, the guard that keeps them honest, and how `make test` spreads the suite
over processes.

`make test` runs every test. `make test-fast` (the inner loop) leaves out the tests marked `slow`: those
that start Ray, a browser or a stack of service processes (`pelt serve`, `pelt demo`, `pelt dispatcher`,
`ray start`, `mlflow server`), load a packaged real model, or took a second or more in the last measured
full run (tests/slow_tests.txt: `python -m tests.tiers refresh <junit.xml>` rewrites it from
`pytest --junitxml`). A test is marked `slow` by hand (`pytest.mark.slow`), by using one of
`SLOW_FIXTURES`, or by its line in tests/slow_tests.txt (`mark_slow_tests`, at collection).

`make test` runs on several pytest-xdist processes. What one process gets at a time is a unit of work
(`work_unit_of`, through `UnitScheduling`, pelt's pytest-xdist scheduler): a module (its module fixtures are
built once), or `CLUSTER_GROUP`, every test that starts Ray or a service stack (the dispatcher, the service
in-process, compose as processes, the demo, the two-node cluster, the browser), run one test at a time on
one process, so that two clusters never compete for a small machine's cores and heartbeats. It is handed
out first (`cluster_group_first`): it is the longest unit, and the other processes go through the modules
meanwhile. Measured on 2 cores: with two such groups running side by side beside a third process, leases
expired under the load and the cluster tests took 2-4x as long. (pytest-xdist's own `--dist loadgroup`
cannot do this under pytest 9: it renames each test's `_nodeid`, which pytest 9 no longer reads, so its
groups silently fall apart into single tests, and cluster tests ran side by side.)

The guard (`refuse_slow_work`) runs around every test not marked `slow` or `gpu`: starting Ray, a browser or
a service process there fails the test with a message naming the marker, so the fast tier cannot grow
a Ray start unnoticed. Child interpreters that are not services (the dataset probe's sandbox, `python -c`
scripts, `pelt` commands that end by themselves) stay allowed: they are what the unit tests check.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

# fixtures that start Ray, a browser or a service stack: a test that uses one (however indirectly) is slow
SLOW_FIXTURES = frozenset({"local_ray", "ray_session", "browser", "compose_stack", "service"})
# modules whose tests start Ray or a service stack without one of those fixtures
CLUSTER_MODULES = frozenset(
    {
        "tests/api/test_demo.py",
        "tests/api/test_end_to_end.py",
        "tests/api/test_page.py",
        "tests/benchmarks/test_soak.py",
        "tests/deploy/test_compose_smoke.py",
        "tests/workers/test_autoscaling.py",
        "tests/workers/test_backbone_store.py",
        "tests/workers/test_cluster.py",
        "tests/workers/test_dispatcher_ha.py",
    }
)
CLUSTER_GROUP = "cluster"
# every module with a test that starts Ray or a service stack: all of its tests run in `CLUSTER_GROUP`
# (CLUSTER_MODULES, and the modules whose cluster tests say so by a fixture)
CLUSTER_GROUP_MODULES = CLUSTER_MODULES | {
    "tests/security/test_workers_side.py",
    "tests/workers/test_dispatcher.py",
}
SLOW_LIST = Path(__file__).with_name("slow_tests.txt")
SLOW_SECONDS = 1.0  # a test that took this long or longer in the measured run is left out of test-fast
# argv words of a long-running service process (argv[0]'s base name, then its first arguments)
SERVICE_COMMANDS = (
    ("pelt", "serve"),
    ("pelt", "demo"),
    ("pelt", "dispatcher"),
    ("ray", "start"),
    ("mlflow", "server"),
)
BROWSERS = ("chromium", "chrome", "headless_shell")
HOW_TO_MARK = "mark it `@pytest.mark.slow` (tests/tiers.py) so that `make test-fast` leaves it out"


def starts_cluster(item: pytest.Item) -> bool:
    """Whether the test starts Ray or a service stack (by its fixtures or its module)."""
    return bool(SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ()))) or (
        item.nodeid.split("::")[0] in CLUSTER_MODULES
    )


def work_unit_of(nodeid: str) -> str:
    """What one xdist process runs as one unit: `CLUSTER_GROUP` for a module in `CLUSTER_GROUP_MODULES`, else
    the test's module. From the node id alone: the process that hands out the tests has no test objects."""
    module = nodeid.split("::", 1)[0]
    return CLUSTER_GROUP if module in CLUSTER_GROUP_MODULES else module


class UngroupedClusterTest(pytest.UsageError):
    """A test that starts a cluster lives in a module `CLUSTER_GROUP_MODULES` does not name."""


def mark_slow_tests(items: list[pytest.Item]) -> None:
    """Mark `slow` every test that starts Ray or a service stack, or that tests/slow_tests.txt lists; refuse
    a cluster test outside `CLUSTER_GROUP_MODULES`; hand out the cluster group first (`cluster_group_first`)."""
    listed = set(SLOW_LIST.read_text().splitlines()) if SLOW_LIST.exists() else set()
    for item in items:
        if starts_cluster(item):
            module = item.nodeid.split("::", 1)[0]
            if module not in CLUSTER_GROUP_MODULES:
                raise UngroupedClusterTest(
                    f"{item.nodeid} starts Ray or a service stack: name {module} in tests/tiers.py's "
                    "CLUSTER_GROUP_MODULES, so that it never runs beside another cluster test"
                )
        if starts_cluster(item) or item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
    cluster_group_first(items)


def cluster_group_first(items: list[pytest.Item]) -> None:
    """Reorder `items` in place: `CLUSTER_GROUP`'s tests first, then the rest, each in collection order
    (`UnitScheduling` hands out units in the order of their first test)."""
    items.sort(key=lambda item: work_unit_of(item.nodeid) != CLUSTER_GROUP)  # a stable sort


class UnitScheduling(LoadScopeScheduling):
    """pytest-xdist's scope scheduling with `work_unit_of` as the scope, units handed out in collection order
    (the cluster group first), each whole to one process."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # keep `cluster_group_first`'s order, not largest-unit-first

    def _split_scope(self, nodeid: str) -> str:
        return work_unit_of(nodeid)


def refresh_slow_list(junit_xml: Path, out: Path = SLOW_LIST, *, add: bool = False) -> list[str]:
    """Rewrite `out` (tests/slow_tests.txt): the tests that took `SLOW_SECONDS` or more (setup, call and
    teardown) in a full run's `pytest --junitxml` report; with `add`, those and the tests already listed
    (a run on a faster machine then adds its slow tests without dropping a slower machine's)."""
    slow = sorted(set(out.read_text().splitlines())) if add and out.exists() else []
    for case in ElementTree.parse(junit_xml).iter("testcase"):
        if float(case.get("time", 0)) >= SLOW_SECONDS:
            module = case.get("classname", "").replace(".", "/") + ".py"
            slow.append(f"{module}::{case.get('name')}")
    slow = sorted(set(slow))
    out.write_text("".join(f"{nodeid}\n" for nodeid in slow))
    return slow


def is_service_command(argv: Any) -> bool:
    """Whether a Popen argv (a list, or a shell string) starts a long-running service or a browser."""
    words = argv.split() if isinstance(argv, str) else [os.fspath(a) for a in argv]
    if not words:
        return False
    names = [os.path.basename(w) for w in words]
    if names[0].startswith(BROWSERS) or "run-driver" in words:  # a browser, or Playwright's driver
        return True
    for program, verb in SERVICE_COMMANDS:
        for index, name in enumerate(names[:-1]):
            if name == program and verb in words[index + 1 : index + 3]:
                return True
        # `python -m services.cli serve` and friends
        if program == "pelt" and "services.cli" in words and verb in words:
            return True
    return False


class SlowWorkInFastTest(AssertionError):
    """A test outside the `slow` tier started Ray, a browser or a service process."""


@pytest.fixture(autouse=True)
def refuse_slow_work(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Around a test not marked slow or gpu: starting Ray, a browser or a service process fails it."""
    if request.node.get_closest_marker("slow") or request.node.get_closest_marker("gpu"):
        yield
        return
    name = request.node.nodeid

    def refuse(what: str) -> None:
        raise SlowWorkInFastTest(f"{name} started {what} but is not marked slow: {HOW_TO_MARK}")

    import ray

    def refuse_ray(*args: Any, **kwargs: Any) -> Any:
        refuse("Ray (ray.init)")

    monkeypatch.setattr(ray, "init", refuse_ray)
    popen_init = subprocess.Popen.__init__

    def checked_popen(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if is_service_command(args):
            refuse(f"a service process ({args if isinstance(args, str) else ' '.join(map(str, args))})")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    yield


if __name__ == "__main__":  # python -m tests.tiers refresh [--add] JUNIT_XML
    arguments = sys.argv[1:]
    add = "--add" in arguments
    arguments = [a for a in arguments if a != "--add"]
    if len(arguments) != 2 or arguments[0] != "refresh":
        sys.exit(
            "usage: python -m tests.tiers refresh [--add] JUNIT_XML  (a full run's pytest --junitxml report; "
            "--add keeps the tests already listed)"
        )
    print(f"{len(refresh_slow_list(Path(arguments[1]), add=add))} tests listed in {SLOW_LIST}")
