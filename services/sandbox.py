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
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

TARGETS = {
    "backbone": "services.backbones:load_in_child",
    "dataset_probe": "services.registry.dataset_probe:probe_in_child",
}
MEMORY_WORDS = ("memoryerror", "cannot allocate memory", "can't allocate memory", "failed to map segment",
                "bad_alloc", "out of memory", "malloc of size", "std::bad_alloc")


@dataclass(frozen=True)
class ChildOutcome:
    """How a child ended. `answer`: the function's answer (None when it ended without one: see
    `timed_out`, `returncode`, `out_of_memory`); `progress`: the notes it sent, in order."""

    answer: dict[str, Any] | None
    returncode: int | None
    timed_out: bool = False
    out_of_memory: bool = False
    progress: list[dict[str, Any]] = field(default_factory=list)

    @property
    def last_progress(self) -> dict[str, Any]:
        return self.progress[-1] if self.progress else {}

    def how_it_ended(self) -> str:
        """How a child without an answer ended, for a message ("killed by signal 11", "exit code 1")."""
        if self.timed_out:
            return "it ran past its time limit"
        if self.returncode is not None and self.returncode < 0:
            return f"killed by signal {-self.returncode}"
        return f"exit code {self.returncode}"


def run_in_child(target: str, request: Mapping[str, Any], *, memory_bytes: int, timeout_seconds: float,
                 environment: Mapping[str, str] | None = None) -> ChildOutcome:
    """Run TARGETS[target](request) in a child process under `memory_bytes` of address space and
    `timeout_seconds`; `environment` adds variables to the child's (set before it imports anything)."""
    if target not in TARGETS:
        raise ValueError(f"no such sandbox target: {target!r}")
    message = json.dumps({"target": target, "request": dict(request), "memory_bytes": int(memory_bytes)})
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", **(environment or {})}  # fewer arenas: less address space
    try:
        done = subprocess.run([sys.executable, "-m", "services.sandbox"], input=message, capture_output=True,
                              text=True, timeout=timeout_seconds, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return ChildOutcome(None, None, timed_out=True, progress=_lines(stdout)[0])
    progress, answer = _lines(done.stdout)
    memory = any(word in done.stderr.lower() for word in MEMORY_WORDS)
    return ChildOutcome(answer, done.returncode, out_of_memory=memory, progress=progress)


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


def main() -> None:
    """`python -m services.sandbox`: {"target", "request", "memory_bytes"} on stdin; JSON lines on stdout."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the function prints goes to stderr

    def send(item: dict[str, Any]) -> None:
        out.write(json.dumps(item) + "\n")
        out.flush()

    message = json.loads(sys.stdin.read())
    _limit_memory(int(message["memory_bytes"]))
    try:
        module, _, name = TARGETS[message["target"]].partition(":")
        function: Callable[..., dict[str, Any]] = getattr(importlib.import_module(module), name)
        answer = function(message["request"], lambda note: send({"progress": note}))
    except MemoryError as exc:
        answer = {"error": f"MemoryError: {exc}", "memory": True}
    except Exception as exc:  # the caller turns every failure into a refusal
        text = f"{type(exc).__name__}: {exc}"
        answer = {"error": text, "memory": any(word in text.lower() for word in MEMORY_WORDS)}
    send({"answer": answer})
    out.close()


__all__ = ["TARGETS", "ChildOutcome", "run_in_child"]

if __name__ == "__main__":
    main()
