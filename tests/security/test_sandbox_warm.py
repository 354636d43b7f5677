"""The sandbox's warm children (services/warm_sandbox.py): a request's child is forked from a warm interpreter
that has imported its target's libraries, and still sees nothing of another request, holds nothing of the
warm child's, dies with its time limit, and falls back to a fresh interpreter whenever a warm child
cannot be had. The warm child itself ends with its parent and after its idle time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import psutil
import pytest

from services import sandbox, warm_sandbox

TARGETS = "tests.security.sandbox_targets"


@pytest.fixture
def target(monkeypatch: pytest.MonkeyPatch):
    """Names a function of tests/security/sandbox_targets.py as sandbox target "test" (no preloads)."""

    def name(function: str) -> str:
        monkeypatch.setitem(sandbox.TARGETS, "test", f"{TARGETS}:{function}")
        monkeypatch.setitem(sandbox.PRELOADS, "test", ())
        return "test"

    yield name
    warm_sandbox._failed_starts.pop(sandbox.TARGETS["test"], None)
    warm = warm_sandbox._warm_children.pop(sandbox.TARGETS["test"], None)
    if warm is not None:
        warm.close()


def run(target: str, warm_seconds: float = 60, timeout: float = 120, **request: Any) -> sandbox.ChildOutcome:
    return sandbox.run_in_child(
        target, request, memory_bytes=2 << 30, timeout_seconds=timeout, warm_seconds=warm_seconds
    )


def until(condition: Any, within: float = 60) -> bool:
    """Whether `condition()` holds by the deadline (checked every 20 ms)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def gone(pid: int, within: float = 60) -> bool:
    """Whether process `pid` has ended (or is a zombie) by the deadline."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_each_request_is_a_fresh_fork_of_one_warm_child_and_sees_nothing_of_the_one_before(target):
    first = run(target("remember_and_describe"), tag="first").answer
    second = run("test", tag="second").answer

    assert first and second
    assert second["requests_seen"] == [] and second["mark"] is None  # no module state, no environment
    assert first["pid"] != second["pid"]
    assert first["parent"] == second["parent"] != os.getpid()  # both forked by the same warm child
    assert first["session"] == first["pid"]  # a session of its own: its time limit kills all it started
    assert first["dumpable"] == second["dumpable"] == 0  # no sibling may ptrace it or read its /proc


def kinds(descriptors: dict[str, str]) -> list[str]:
    """What each descriptor is ("pipe", "socket", a file's path), without inode numbers."""
    return sorted(what.split(":[")[0] for what in descriptors.values())


def test_a_forked_child_holds_no_descriptor_a_fresh_interpreter_would_not(target, monkeypatch, tmp_path):
    name = target("remember_and_describe")
    monkeypatch.setitem(
        sandbox.PRELOADS, "test", sandbox.PRELOADS["dataset_probe"] + sandbox.PRELOADS["compose"]
    )
    fresh = run(name, warm_seconds=0, tag="fresh").answer["descriptors"]
    run(name, tag="warming")
    go = tmp_path / "go"
    sibling = threading.Thread(target=run, args=(name,), kwargs={"tag": "sibling", "wait_for": str(go)})
    sibling.start()  # a request in flight while the next one forks: its socket is in the warm child then
    try:
        warm = psutil.Process(warm_sandbox._warm_children[sandbox.TARGETS["test"]].process.pid)
        assert until(lambda: warm.children()), "the sibling request never started"

        forked = run(name, tag="looked").answer["descriptors"]
    finally:
        go.touch()
        sibling.join()

    assert kinds(forked) == kinds(fresh), (forked, fresh)  # stdin, stdout, stderr and the answer's pipe
    assert "socket" not in kinds(forked)


def test_a_descriptor_a_preloaded_library_opened_is_not_inherited_by_a_forked_child(target, monkeypatch):
    name = target("remember_and_describe")
    monkeypatch.setitem(sandbox.PRELOADS, "test", ("tests.security.opens_a_file_at_import",))

    descriptors = run(name, tag="looked").answer["descriptors"]

    assert not [what for what in descriptors.values() if what.endswith("opens_a_file_at_import.py")]


def test_requests_at_once_each_get_their_own_answer(target):
    name = target("remember_and_describe")
    answers: dict[int, Any] = {}

    def ask(tag: int) -> None:
        answers[tag] = run(name, tag=tag).answer

    threads = [threading.Thread(target=ask, args=(tag,)) for tag in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert {tag: answer["tag"] for tag, answer in answers.items()} == {tag: tag for tag in range(6)}
    assert len({answer["pid"] for answer in answers.values()}) == 6


def test_a_forked_child_past_its_time_limit_is_killed_and_the_next_request_is_served(target):
    outcome = run(target("report_pid_then_hang"), timeout=5)

    assert outcome.timed_out and outcome.answer is None
    assert outcome.progress, "the child did not report its pid within its time limit"
    assert gone(outcome.last_progress["pid"])
    assert run(target("remember_and_describe"), tag="after").answer["tag"] == "after"


def test_without_warm_time_each_request_runs_in_a_fresh_interpreter_of_this_process(target):
    answer = run(target("remember_and_describe"), warm_seconds=0, tag="fresh").answer

    assert answer["parent"] == os.getpid()
    assert sandbox.TARGETS["test"] not in warm_sandbox._warm_children


def test_a_warm_child_that_cannot_start_leaves_requests_to_fresh_interpreters_without_retrying_each_time(
    target, monkeypatch
):
    name = target("remember_and_describe")
    monkeypatch.setitem(sandbox.PRELOADS, "test", ("no_such_module_anywhere",))
    starts = []
    start = warm_sandbox._WarmChild.__init__
    monkeypatch.setattr(
        warm_sandbox._WarmChild, "__init__", lambda self, *a: starts.append(a) or start(self, *a)
    )

    answers = [run(name, tag=tag).answer for tag in ("first", "second")]

    assert [(a["tag"], a["parent"]) for a in answers] == [("first", os.getpid()), ("second", os.getpid())]
    assert len(starts) == 1  # the second request did not pay a failing warm start again


def test_a_stopped_warm_child_is_killed_and_the_request_runs_in_a_fresh_interpreter(target, monkeypatch):
    name = target("remember_and_describe")
    warm_pid = run(name, tag="one").answer["parent"]
    warm = warm_sandbox._warm_children[sandbox.TARGETS["test"]]
    psutil.Process(warm_pid).suspend()  # SIGSTOP: it takes the request but never answers
    monkeypatch.setattr(warm_sandbox, "WARM_START_TIMEOUT_SECONDS", 2.0)

    answer = run(name, tag="two").answer

    assert answer["tag"] == "two" and answer["parent"] == os.getpid()
    assert gone(warm_pid), "the stopped warm child was left holding its memory"
    assert warm.retired


def test_a_warm_child_killed_between_requests_is_replaced(target):
    name = target("remember_and_describe")
    warm_pid = run(name, tag="one").answer["parent"]
    psutil.Process(warm_pid).kill()
    assert gone(warm_pid)

    answer = run(name, tag="two").answer

    assert answer["tag"] == "two" and answer["parent"] not in {warm_pid, os.getpid()}


def test_a_warm_child_serves_at_most_max_forks_requests_then_a_fresh_one_does(target, monkeypatch):
    monkeypatch.setattr(warm_sandbox, "MAX_FORKS", 2)
    name = target("remember_and_describe")

    parents = [run(name, tag=tag).answer["parent"] for tag in range(3)]

    assert parents[0] == parents[1] != parents[2]  # a fresh address-space layout every MAX_FORKS requests


def test_after_a_child_crashes_its_warm_child_serves_no_more_requests(target):
    name = target("crash")

    crashed = run(name)

    warm = warm_sandbox._warm_children[sandbox.TARGETS["test"]]
    assert crashed.returncode == -signal.SIGSEGV and crashed.answer is None
    assert warm.retired  # the crash may have learnt the layout every child of that warm child shares
    run(name)
    assert warm_sandbox._warm_children[sandbox.TARGETS["test"]] is not warm
    assert gone(warm.process.pid)


def test_a_warm_child_ends_after_its_idle_time_and_with_its_parent_and_so_do_its_running_children(
    tmp_path,
):
    script = textwrap.dedent(
        f"""
        import os, sys, threading, time
        import psutil
        from services import sandbox
        sandbox.TARGETS["test"] = "{TARGETS}:remember_and_describe"
        def run(warm_seconds, **request):
            return sandbox.run_in_child("test", request, memory_bytes=2 << 30, timeout_seconds=600,
                                        warm_seconds=warm_seconds)
        print(run(1.0).answer["parent"], flush=True)
        sys.stdin.readline()  # the test has seen that warm child end by itself
        warm = run(600.0).answer["parent"]
        threading.Thread(target=run, args=(600.0,), kwargs={{"wait_for": "{tmp_path / "never"}"}}, daemon=True).start()
        while not psutil.Process(warm).children():
            time.sleep(0.02)
        print(warm, psutil.Process(warm).children()[0].pid, flush=True)
        os._exit(0)  # gone, with a request in flight
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=sandbox.PROJECT_ROOT,
    )
    try:
        idle_one = int(parent.stdout.readline())
        assert gone(idle_one), "a warm child with 1 s of idle time was still running a minute later"
        parent.stdin.write("\n")
        parent.stdin.flush()
        warm, in_flight = map(int, parent.stdout.readline().split())
        assert parent.wait(120) == 0
        assert gone(in_flight), "a request's child outlived the process that asked for it"
        assert gone(warm), "a warm child outlived its parent"
    finally:
        parent.kill()
