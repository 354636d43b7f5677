"""Functions the security tests run in services.sandbox's child process (by patching its TARGETS).

Never in the service's own TARGETS: a request only ever names one of those.
"""

from __future__ import annotations

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
