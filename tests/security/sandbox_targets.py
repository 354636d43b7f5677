"""Functions the security tests run in services.sandbox's child process (by patching its TARGETS).

Never in the service's own TARGETS: a request only ever names one of those.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from typing import Any


def what_the_child_sees(request: dict[str, Any], report: Any) -> dict[str, Any]:
    """The child's environment, working folder, import path and resource limits."""
    return {
        "environment": sorted(os.environ),
        "cwd": os.getcwd(),
        "cwd_entries": os.listdir("."),
        "path": sys.path,
        "core": resource.getrlimit(resource.RLIMIT_CORE)[0],
        "file_size": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
        "open_files": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
    }


def invalid_utf8_on_stderr(request: dict[str, Any], report: Any) -> dict[str, Any]:
    """32 MiB of bytes that are not UTF-8 on stderr (and on fd 1, which the sandbox sends there), then an answer."""
    chunk = b"\xff\xfe\xc3(" * (1 << 18)
    for _ in range(32):
        os.write(2, chunk)
    os.write(1, chunk)
    return {"done": True}


def a_flood_of_progress(request: dict[str, Any], report: Any) -> dict[str, Any]:
    """A progress note far larger than any answer, then an answer."""
    report({"split": "x" * (64 << 20)})
    return {"done": True}


REQUESTS_SEEN: list[Any] = []  # a module global a request could leave something in


def remember_and_describe(request: dict[str, Any], report: Any) -> dict[str, Any]:
    """Leaves its mark on the module, the environment and the process; says what it found of earlier ones,
    its pid and parent's, and every descriptor it holds (what each one is). With "wait_for": first waits
    until that path exists."""
    import time

    while request.get("wait_for") and not os.path.exists(request["wait_for"]):
        time.sleep(0.02)
    found = {"requests_seen": list(REQUESTS_SEEN), "mark": os.environ.get("PELT_SANDBOX_TEST_MARK")}
    REQUESTS_SEEN.append(request.get("tag"))
    os.environ["PELT_SANDBOX_TEST_MARK"] = str(request.get("tag"))
    descriptors = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            descriptors[name] = os.readlink(f"/proc/self/fd/{name}")
    import ctypes

    return {
        **found,
        "dumpable": ctypes.CDLL(None).prctl(3, 0, 0, 0, 0),  # PR_GET_DUMPABLE
        "tag": request.get("tag"),
        "pid": os.getpid(),
        "parent": os.getppid(),
        "session": os.getsid(0),
        "descriptors": descriptors,
    }


def report_pid_then_hang(request: dict[str, Any], report: Any) -> dict[str, Any]:
    """Says its pid in a progress note, then never answers."""
    import time

    report({"pid": os.getpid()})
    while True:
        time.sleep(60)


def crash(request: dict[str, Any], report: Any) -> dict[str, Any]:
    """Ends by SIGSEGV, as a native reader's bug would."""
    import signal

    os.kill(os.getpid(), signal.SIGSEGV)
    return {}
