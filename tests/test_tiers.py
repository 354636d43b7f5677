"""The suite's tiers (tests/tiers.py): what counts as starting a service, the guard around every test not
marked slow, and the list of slow tests written from a measured run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.tiers import SlowWorkInFastTest, is_service_command, refresh_slow_list


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
