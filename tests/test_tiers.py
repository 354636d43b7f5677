"""The suite's tiers (tests/tiers.py): what counts as starting a service, the guard around every test not
marked slow, and the list of slow tests written from a measured run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiers import (
    CLUSTER_GROUP,
    SlowWorkInFastTest,
    UngroupedClusterTest,
    cluster_group_first,
    is_service_command,
    mark_slow_tests,
    refresh_slow_list,
    work_unit_of,
)


@pytest.mark.parametrize(
    "argv",
    [
        ["pelt", "serve"],
        ["/home/me/pelt/.venv/bin/pelt", "demo", "--fast"],
        ["pelt", "dispatcher", "--once"],
        ["ray", "start", "--head", "--port", "0"],
        "ray start --address 127.0.0.1:6380",
        [sys.executable, "-m", "services.cli", "serve"],
        ["mlflow", "server", "--port", "5000"],
        ["/usr/bin/chromium", "--headless"],
        ["node", "cli.js", "run-driver"],  # Playwright's driver, which starts the browser
    ],
)
def test_a_service_a_cluster_or_a_browser_counts_as_slow_work(argv):
    assert is_service_command(argv)


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-P", "-m", "services.sandbox"],  # the dataset probe's child: a unit under test
        ["pelt", "train", "--task", "toy"],
        ["pelt", "task", "register", "serve"],  # a task named serve is not `pelt serve`
        [sys.executable, "-c", "print(1)"],
        [],
    ],
)
def test_commands_that_end_by_themselves_are_not_slow_work(argv):
    assert not is_service_command(argv)


def test_a_test_not_marked_slow_cannot_start_ray_or_a_service():
    import ray

    with pytest.raises(SlowWorkInFastTest, match="not marked slow"):
        ray.init(num_cpus=1)
    with pytest.raises(SlowWorkInFastTest, match="ray start"):
        subprocess.Popen(["ray", "start", "--head"])
    assert not ray.is_initialized()


def test_the_slow_list_holds_the_tests_of_a_second_or_more_in_a_junit_report(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.api.test_api" name="test_quick" time="0.2"/>'
        '<testcase classname="tests.api.test_api" name="test_upload[a b]" time="1.0"/>'
        '<testcase classname="tests.core.test_train" name="test_epochs" time="3.5"/>'
        "</testsuite></testsuites>"
    )
    out = tmp_path / "slow_tests.txt"
    refresh_slow_list(report, out)
    assert out.read_text().splitlines() == [
        "tests/api/test_api.py::test_upload[a b]",
        "tests/core/test_train.py::test_epochs",
    ]
    out.write_text("tests/api/test_api.py::test_quick\n")  # slow on another machine
    refresh_slow_list(report, out, add=True)
    assert out.read_text().splitlines()[0] == "tests/api/test_api.py::test_quick"
    refresh_slow_list(report, out)
    assert "tests/api/test_api.py::test_quick" not in out.read_text().splitlines()


class StandIn:
    """What the grouping reads of a collected test: its node id and fixture names."""

    def __init__(self, nodeid: str, *fixtures: str) -> None:
        self.nodeid, self.fixturenames = nodeid, list(fixtures)


def test_every_cluster_test_runs_in_one_group_and_every_other_test_with_its_module():
    for module in (
        "tests/workers/test_dispatcher.py",
        "tests/workers/test_dispatcher_ha.py",
        "tests/security/test_workers_side.py",
        "tests/api/test_end_to_end.py",
        "tests/deploy/test_compose_smoke.py",
        "tests/api/test_page.py",
        "tests/api/test_demo.py",
    ):
        assert work_unit_of(f"{module}::test_a[x]") == CLUSTER_GROUP
    assert work_unit_of("tests/core/test_train.py::test_c[a::b]") == "tests/core/test_train.py"


def test_the_cluster_group_is_handed_out_first_and_keeps_its_collection_order():
    items = [
        StandIn("tests/api/test_api.py::test_1"),
        StandIn("tests/api/test_end_to_end.py::test_2"),
        StandIn("tests/api/test_page.py::test_3"),
        StandIn("tests/core/test_train.py::test_4"),
        StandIn("tests/workers/test_dispatcher.py::test_5", "local_ray"),
        StandIn("tests/workers/test_cluster.py::test_6"),
    ]
    cluster_group_first(items)
    assert [item.nodeid.rsplit("_", 1)[1] for item in items] == ["2", "3", "5", "6", "1", "4"]


def test_a_cluster_test_in_a_module_outside_the_cluster_group_is_refused_at_collection():
    with pytest.raises(UngroupedClusterTest, match=re.escape("tests/core/test_new.py in tests/tiers.py")):
        mark_slow_tests([StandIn("tests/core/test_new.py::test_x", "local_ray")])


# the scheduler's check below runs stand-in modules at real module paths, two tests each
STAND_INS = {
    CLUSTER_GROUP: [
        "tests/workers/test_dispatcher.py",
        "tests/workers/test_cluster.py",
        "tests/security/test_workers_side.py",
        "tests/api/test_page.py",
    ],
    "tests/core/test_spec.py": ["tests/core/test_spec.py"],
    "tests/registry/test_registry_queue.py": ["tests/registry/test_registry_queue.py"],
}


@pytest.mark.slow  # three pytest processes
def test_pelts_scheduler_hands_the_cluster_group_and_each_module_to_one_process_whole(tmp_path):
    """On three pytest-xdist processes, with this checkout's tests/conftest.py and tests/tiers.py: stand-in
    modules at the paths of four modules of the cluster group and of two other modules (two quick tests
    each): the group's tests, across its modules, all run on one process, and each other module on one."""
    checkout = Path(__file__).resolve().parents[1]
    (tmp_path / "tests").mkdir()
    for name in ("__init__.py", "conftest.py", "tiers.py", "ray_start.py"):
        shutil.copyfile(checkout / "tests" / name, tmp_path / "tests" / name)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    slow: stand-in\n    gpu: stand-in\n    postgres: stand-in\n"
    )
    for module in (m for modules in STAND_INS.values() for m in modules):
        path = tmp_path / module
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text("def test_one():\n    pass\n\n\ndef test_two():\n    pass\n")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "3", "-v", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d+)\] \[\s*\d+%\] PASSED (\S+)", done.stdout, re.MULTILINE)
    processes: dict[str, set[str]] = {}
    for worker, nodeid in ran:
        processes.setdefault(work_unit_of(nodeid), set()).add(worker)
    assert set(processes) == set(STAND_INS), done.stdout[-3000:]
    assert all(len(workers) == 1 for workers in processes.values()), processes
    assert len(ran) == 2 * sum(len(modules) for modules in STAND_INS.values())
