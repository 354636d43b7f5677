"""Run one of the service's functions in a child process under memory and time limits; JSON back.

Work that decodes what a user sent (a backbone's weights, an uploaded task's data) can need more memory
than the API may spend, or crash the interpreter (a native reader's bug); in the API's own process either
takes the service down for everyone. `run_in_child` runs it in a fresh interpreter
(`python -m services.sandbox`) under an address-space limit (RLIMIT_AS, at most the parent's own hard
limit) and a time limit, and returns what came back: the function's answer, or how the child ended
(timed out, killed by a signal, out of memory) and the last progress note it sent, so the caller can
name what it was reading. The callers turn that into a 422.

Only the functions listed in TARGETS run there (the request names one of them, never a module of its
choosing). A target is `function(request: dict, report: Callable[[dict], None]) -> dict`; `report`
sends a progress note at once (it survives a crash that follows). Everything the function prints goes
to stderr; stdout carries only JSON lines: {"progress": ...} notes, then {"answer": ...}.

The child holds no more than it needs: an allow-list of the environment (`child_environment`: no
PELT_* settings, tokens, cloud keys or RAY_* addresses), `python -P` in a fresh empty working folder
(nothing there is imported), no core files, no files written at all unless the caller allows it
(RLIMIT_FSIZE 0), at most MAX_OPEN_FILES open files. Its output is read as bytes and bounded: at most
MAX_ANSWER_BYTES of stdout (beyond, the child is stopped), the last MAX_STDERR_TAIL_BYTES of stderr;
bytes that are not UTF-8 become U+FFFD.

Warm children (services/warm_sandbox.py): each target's children are forked from a warm interpreter that has
imported the target's libraries (PRELOADS), started as a fresh child would be; a request runs in a fresh
interpreter whenever no warm child can be had, or with PELT_SANDBOX_WARM_SECONDS=0.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from services.warm_sandbox import ForkedChild, fork_warm

TARGETS = {
    "backbone": "services.backbones:load_in_child",
    "compose": "services.delta_store.compose_child:compose_in_child",
    "dataset_probe": "services.registry.dataset_probe.child:probe_in_child",
}
# what a target's warm child imports besides the target's own module: the libraries the function imports
# when it runs (so that a forked child starts with them imported)
PRELOADS = {
    "backbone": ("transformers", "transformers.modeling_utils", "pelt_core.backbones"),
    "compose": ("torch", "safetensors.torch", "pelt_core.compose", "pelt_core.backbones"),
    "dataset_probe": ("pyarrow", "pyarrow.compute", "pyarrow.csv", "pyarrow.json", "pyarrow.parquet"),
}

MEMORY_WORDS = (
    "memoryerror",
    "cannot allocate memory",
    "can't allocate memory",
    "failed to map segment",
    "bad_alloc",
    "out of memory",
    "malloc of size",
    "std::bad_alloc",
)
MAX_ANSWER_BYTES = 8 << 20  # the child's stdout kept (progress notes and its answer); beyond, it is stopped
MAX_STDERR_TAIL_BYTES = 64 << 10  # the end of its stderr kept (to tell an end for lack of memory)
MAX_OPEN_FILES = 4096  # RLIMIT_NOFILE of the child
PASSED_VARIABLES = (
    "PATH",
    "HOME",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TMPDIR",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "ARROW_DEFAULT_MEMORY_POOL",
)  # and LC_*: the rest stays in the parent
PROJECT_ROOT = Path(__file__).resolve().parents[1]  # where `services` and `pelt_core` are imported from


@dataclass(frozen=True)
class ChildOutcome:
    """How a child ended. `answer`: the function's answer (None when it ended without one: see
    `timed_out`, `returncode`, `out_of_memory`); `progress`: the notes it sent, in order."""

    answer: dict[str, Any] | None
    returncode: int | None
    timed_out: bool = False
    out_of_memory: bool = False
    progress: list[dict[str, Any]] = field(default_factory=list)
    stderr_tail: str = ""  # the last MAX_STDERR_TAIL_BYTES of its stderr, for the operator's log
    output_overflow: bool = False  # it sent more than MAX_ANSWER_BYTES on stdout and was stopped

    @property
    def last_progress(self) -> dict[str, Any]:
        return self.progress[-1] if self.progress else {}

    def how_it_ended(self) -> str:
        """How a child without an answer ended, for a message ("killed by signal 11", "exit code 1")."""
        if self.output_overflow:
            return f"it sent more than {MAX_ANSWER_BYTES:,} bytes of output"
        if self.timed_out:
            return "it ran past its time limit"
        if self.returncode is not None and self.returncode < 0:
            return f"killed by signal {-self.returncode}"
        return f"exit code {self.returncode}"


def run_in_child(
    target: str,
    request: Mapping[str, Any],
    *,
    memory_bytes: int,
    timeout_seconds: float,
    environment: Mapping[str, str] | None = None,
    write_files: bool = False,
    warm_seconds: float | None = None,
) -> ChildOutcome:
    """Run TARGETS[target](request) in a child process under `memory_bytes` of address space and
    `timeout_seconds`; `environment` adds variables to the child's (`child_environment`, set before it
    imports anything); `write_files`: the child may write files (else RLIMIT_FSIZE is 0); `warm_seconds`:
    how long the target's warm child stays after this request (default PELT_SANDBOX_WARM_SECONDS; 0: the
    child is a fresh interpreter)."""
    if target not in TARGETS:
        raise ValueError(f"no such sandbox target: {target!r}")
    message = json.dumps(
        {
            "function": TARGETS[target],
            "request": dict(request),
            "memory_bytes": int(memory_bytes),
            "write_files": write_files,
        }
    ).encode()
    if warm_seconds is None:
        from services.settings import get_settings

        warm_seconds = get_settings().sandbox_warm_seconds
    with tempfile.TemporaryDirectory(prefix="pelt-sandbox-") as folder:
        environment = child_environment(environment)
        process: subprocess.Popen[bytes] | ForkedChild | None = None
        if warm_seconds > 0:
            process = fork_warm(TARGETS[target], PRELOADS.get(target, ()), environment, warm_seconds, folder)
        if process is None:
            process = subprocess.Popen(
                [sys.executable, "-P", "-m", "services.sandbox"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=folder,
                env=environment,
                start_new_session=True,
            )
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        output = _Capture(process.stdout, head=MAX_ANSWER_BYTES, on_overflow=lambda: _stop(process))
        errors = _Capture(process.stderr, tail=MAX_STDERR_TAIL_BYTES)
        feeder = threading.Thread(target=_feed, args=(process.stdin, message), daemon=True)
        for thread in (output, errors, feeder):
            thread.start()
        timed_out = False
        try:
            process.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        _stop(process)  # and whatever it started, which could hold its pipes open
        process.wait()
        for thread in (output, errors, feeder):
            thread.join()
    stdout, stderr = output.text(), errors.text()
    progress, answer = _lines(stdout)
    if timed_out or output.overflowed:
        answer = None
    memory = any(word in stderr.lower() for word in MEMORY_WORDS)
    return ChildOutcome(
        answer,
        None if timed_out else process.returncode,
        timed_out=timed_out,
        out_of_memory=memory,
        progress=progress,
        stderr_tail=stderr,
        output_overflow=output.overflowed,
    )


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: PASSED_VARIABLES and LC_* of this one (never PELT_*, tokens, cloud keys,
    RAY_*), this project and the absolute entries of PYTHONPATH to import from, hubs offline, no
    bytecode written, fewer malloc arenas (less address space); then `extra`."""
    passed = {
        name: value
        for name, value in os.environ.items()
        if name in PASSED_VARIABLES or name.startswith("LC_")
    }
    paths = [
        str(PROJECT_ROOT),
        *(entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(entry)),
    ]
    return {
        **passed,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MALLOC_ARENA_MAX": "2",
        **(extra or {}),
    }


class _Capture(threading.Thread):
    """Reads one of the child's pipes to its end as bytes, keeping at most its first `head` bytes
    (`on_overflow` beyond them) or its last `tail` bytes."""

    def __init__(
        self,
        pipe: IO[bytes],
        *,
        head: int | None = None,
        tail: int | None = None,
        on_overflow: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.pipe, self.head, self.tail, self.on_overflow = pipe, head, tail, on_overflow
        self.kept = bytearray()
        self.overflowed = False

    def run(self) -> None:
        with self.pipe:
            while chunk := os.read(self.pipe.fileno(), 1 << 16):
                if self.tail is not None:
                    self.kept += chunk
                    del self.kept[: max(0, len(self.kept) - self.tail)]
                elif self.overflowed:
                    continue  # drained until the stopped child's pipe closes
                elif self.head is not None and len(self.kept) + len(chunk) > self.head:
                    self.overflowed = True
                    if self.on_overflow is not None:
                        self.on_overflow()
                else:
                    self.kept += chunk

    def text(self) -> str:
        return self.kept.decode("utf-8", errors="replace")


def _feed(pipe: IO[bytes], message: bytes) -> None:
    with contextlib.suppress(OSError), pipe:  # BrokenPipeError: the child ended before it read its request
        pipe.write(message)


def _stop(process: subprocess.Popen[bytes] | ForkedChild) -> None:
    """SIGKILL to the child's process group (its session, started for it)."""
    if isinstance(process, ForkedChild):
        process.kill()
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _lines(stdout: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    progress, answer = [], None
    for line in stdout.splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and isinstance(item.get("progress"), dict):
            progress.append(item["progress"])
        elif isinstance(item, dict) and isinstance(item.get("answer"), dict):
            answer = item["answer"]
    return progress, answer


# --- the child process ------------------------------------------------------------------------------


def _limit_memory(limit: int) -> None:
    """RLIMIT_AS to `limit`, or to the hard limit this process inherited when that is lower."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _limit_resources(memory_bytes: int, write_files: bool) -> None:
    """The child's limits, before it imports the function: address space, no core files, no file written
    unless `write_files` (a write then fails instead of killing it), MAX_OPEN_FILES."""
    _limit_memory(memory_bytes)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if not write_files:
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(MAX_OPEN_FILES, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))


def _not_dumpable() -> None:
    """Linux: no other process of this user may ptrace this one or read its memory or descriptors under
    /proc (its sibling children run as the same user); no core file either."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


def main() -> None:
    """`python -m services.sandbox`: {"function", "request", "memory_bytes", "write_files"} on stdin (from
    `run_in_child`, whose TARGETS chose the function); JSON lines on stdout."""
    _not_dumpable()  # first: no sibling can attach while it reads its request
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the function prints goes to stderr

    def send(item: dict[str, Any]) -> None:
        out.write(json.dumps(item) + "\n")
        out.flush()

    message = json.loads(sys.stdin.buffer.read())
    _limit_resources(int(message["memory_bytes"]), bool(message.get("write_files")))
    try:
        module, _, name = str(message["function"]).partition(":")
        function: Callable[..., dict[str, Any]] = getattr(importlib.import_module(module), name)
        answer = function(message["request"], lambda note: send({"progress": note}))
    except MemoryError as exc:
        answer = {"error": f"MemoryError: {exc}", "error_type": "MemoryError", "memory": True}
    except Exception as exc:  # the caller turns every failure into a refusal
        text = f"{type(exc).__name__}: {exc}"
        answer = {
            "error": text,
            "error_type": type(exc).__name__,
            "memory": any(word in text.lower() for word in MEMORY_WORDS),
        }
    send({"answer": answer})
    out.close()


__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_STDERR_TAIL_BYTES",
    "TARGETS",
    "ChildOutcome",
    "child_environment",
    "run_in_child",
]

if __name__ == "__main__":
    if sys.argv[1:2] == ["--warm"]:
        from services.warm_sandbox import warm_child

        warm_child(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        main()
