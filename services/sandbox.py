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

Warm children: starting an interpreter and importing a target's libraries (pyarrow for a dataset check,
torch for a composition, transformers for a backbone) costs 0.3-2 s of CPU per request, more than most
requests' own work. So each target has a warm child (`_WarmChild`): an interpreter started the same way,
with the same environment, that imports the target's module and PRELOADS and then only forks, one child
per request. A forked child starts a session of its own, takes the request's pipes as its stdin, stdout
and stderr, closes every other descriptor it inherited (the warm child's sockets and pipes, other
requests' sockets, files a library opened at import), moves into the request's fresh folder, sets the
request's limits and runs `main` as a fresh interpreter would; a change it makes to its memory,
environment or modules is its own (the next request is another fork of the same untouched warm child).
Every child, forked or fresh, and the warm child are non-dumpable (Linux): a sibling running as the same
user cannot ptrace them or read their /proc. What forked children share is the warm child's address-space
layout (one ASLR draw): a warm child serves at most MAX_FORKS requests, and none after one of its
children crashed (SIGSEGV, SIGBUS, SIGABRT, SIGILL, SIGFPE; a C++ allocation failing under the memory
limit aborts too, which costs only a warm start); the next request starts a fresh one. The warm child
never runs a request itself, is killed if it stops answering, and ends when its parent goes away (its
socket closes; its running children are then killed) or after PELT_SANDBOX_WARM_SECONDS without a request
(0: no warm child). It is a separate, single-threaded process: the API's threaded server is never
forked. Whenever a warm child cannot be had (it failed to start or to fork, stopped answering or ended
between two requests), the request runs in a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

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
WARM_START_TIMEOUT_SECONDS = 120.0  # a warm child not ready (or not answering) by then is given up
KILLED_WAIT_SECONDS = 60.0  # after a kill, how long a forked child's exit status is waited for at most
MAX_FORKS = 200  # requests one warm child serves before a fresh one (fresh address-space randomisation)
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE})
log = logging.getLogger("pelt.sandbox")
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
        process: subprocess.Popen[bytes] | _ForkedChild | None = None
        if warm_seconds > 0:
            process = _fork_warm(TARGETS[target], PRELOADS.get(target, ()), environment, warm_seconds, folder)
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


def _stop(process: subprocess.Popen[bytes] | _ForkedChild) -> None:
    """SIGKILL to the child's process group (its session, started for it)."""
    if isinstance(process, _ForkedChild):
        process.kill()
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


# --- warm children (the parent's side) ---------------------------------------------------------------


class _ForkedChild:
    """A child forked by a warm child, seen as the few parts of a Popen that `run_in_child` uses. Its
    pid, exit status and the order to kill it travel on a socket of its own to the warm child, which
    is its parent (and reaps it)."""

    def __init__(
        self, warm: _WarmChild, pid: int, channel: socket.socket, stdin: int, stdout: int, stderr: int
    ) -> None:
        self.warm, self.pid, self.channel = warm, pid, channel
        self.stdin, self.stdout, self.stderr = (
            os.fdopen(stdin, "wb"),
            os.fdopen(stdout, "rb"),
            os.fdopen(stderr, "rb"),
        )
        self.returncode: int | None = None
        self.lock = threading.Lock()  # between `kill` (an output reader's thread) and `wait`

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status as Popen gives it (-N: killed by signal N). `timeout` None (after `kill`): at most
        KILLED_WAIT_SECONDS, then its session is killed here and it counts as killed."""
        if self.returncode is not None:
            return self.returncode
        self.channel.settimeout(KILLED_WAIT_SECONDS if timeout is None else max(timeout, 0.001))
        try:
            message = self.channel.recv(64)
        except TimeoutError:
            if timeout is not None:
                raise subprocess.TimeoutExpired("services.sandbox (forked)", timeout) from None
            message = b""
        except OSError:
            message = b""
        if message.startswith(b"exit "):
            code = os.waitstatus_to_exitcode(int(message[5:]))
        else:  # its warm child ended or stopped answering: end the child's session here, and that warm child
            self._kill_group()
            self.warm.abandon()
            code = -signal.SIGKILL
        if (
            -code in CRASH_SIGNALS
        ):  # the crash may have learnt the layout every child of its warm child shares
            self.warm.retire()
        with self.lock:
            self.returncode = code
            self.channel.close()
        return code

    def kill(self) -> None:
        """SIGKILL to its session, by its warm child (which knows whether it is still running)."""
        with self.lock:
            if self.returncode is not None:
                return
            try:
                self.channel.send(b"kill")
            except OSError:  # its warm child is gone: its session is not reaped by anyone who could reuse it
                self._kill_group()

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


class _WarmChild:
    """A running warm child of one target function (see the module docstring): `fork(folder)` asks it for a
    child working in `folder`."""

    def __init__(
        self, function: str, preloads: tuple[str, ...], environment: dict[str, str], warm_seconds: float
    ) -> None:
        self.function, self.preloads, self.environment = function, preloads, environment
        self.warm_seconds = warm_seconds
        self.last_used = time.monotonic()
        self.lock = threading.Lock()
        self.forks, self.retired = 0, False
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        folder = tempfile.mkdtemp(prefix="pelt-sandbox-warm-")
        spec = json.dumps({"function": function, "preloads": list(preloads), "warm_seconds": warm_seconds})
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-m", "services.sandbox", "--warm", str(theirs.fileno()), spec],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=folder,
                env=environment,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
            theirs.close()
            mine.settimeout(WARM_START_TIMEOUT_SECONDS)
            try:
                ready = mine.recv(1024)
            except OSError as exc:
                ready = f"no answer ({type(exc).__name__})".encode()
            if ready != b"ready":
                mine.close()
                self.process.kill()
                self.process.wait()
                raise OSError(f"the warm child of {function} did not start: {ready.decode(errors='replace')}")
        finally:
            theirs.close()
            os.rmdir(folder)  # it never needs its working folder again: a forked child moves into its own
        self.channel = mine

    def usable(
        self, function: str, preloads: tuple[str, ...], environment: dict[str, str], warm_seconds: float
    ) -> bool:
        """Running, started for these arguments, and not about to end for want of requests."""
        idle = time.monotonic() - self.last_used
        return (
            not self.retired
            and self.forks < MAX_FORKS
            and idle < max(self.warm_seconds - 1.0, self.warm_seconds / 2)
            and self.process.poll() is None
            and (self.function, self.preloads, self.environment, self.warm_seconds)
            == (function, preloads, environment, warm_seconds)
        )

    def fork(self, folder: str) -> _ForkedChild | None:
        """A child of it working in `folder`, its stdin, stdout and stderr pipes to this process; None when
        it could not fork one or is gone (then abandoned); the caller then runs the request fresh."""
        stdin_read, stdin_write = os.pipe()
        stdout_read, stdout_write = os.pipe()
        stderr_read, stderr_write = os.pipe()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs_fd = theirs.fileno()
        try:
            with self.lock:
                socket.send_fds(
                    self.channel, [folder.encode()], [stdin_read, stdout_write, stderr_write, theirs_fd]
                )
            mine.settimeout(WARM_START_TIMEOUT_SECONDS)
            answer = mine.recv(64)
        except OSError:
            answer = b""
        finally:
            for fd in (stdin_read, stdout_write, stderr_write):
                os.close(fd)
            theirs.close()
        if not answer.startswith(b"pid "):
            mine.close()
            for fd in (stdin_write, stdout_read, stderr_read):
                os.close(fd)
            if not answer.startswith(b"failed:"):  # gone, or stuck (not "no process to be had just now")
                self.abandon()
            return None
        mine.settimeout(None)
        return _ForkedChild(self, int(answer[4:]), mine, stdin_write, stdout_read, stderr_read)

    def retire(self) -> None:
        """Serve no more requests from it (the next one starts a fresh warm child)."""
        self.retired = True

    def abandon(self) -> None:
        """It stopped answering: serve nothing more from it, and kill it (its memory would stay held)."""
        self.retired = True
        self.process.kill()

    def close(self) -> None:
        """Let it go: it takes no more requests and ends once its running children have ended."""
        with self.lock:
            self.channel.close()


_warm_children: dict[str, _WarmChild] = {}
_warm_locks: dict[str, threading.Lock] = {}
_warm_guard = threading.Lock()


def _fork_warm(
    function: str, preloads: tuple[str, ...], environment: dict[str, str], warm_seconds: float, folder: str
) -> _ForkedChild | None:
    """A child for `function` forked by its warm child (started if missing, stale or of another
    environment); None when none can be had (the request then runs in a fresh interpreter)."""
    with _warm_guard:
        lock = _warm_locks.setdefault(function, threading.Lock())
    with lock:
        warm = _warm_children.get(function)
        if warm is not None and not warm.usable(function, preloads, environment, warm_seconds):
            _warm_children.pop(function).close()
            warm = None
        if warm is None:
            try:
                warm = _WarmChild(function, preloads, environment, warm_seconds)
            except OSError as exc:
                log.warning("running %s in a fresh interpreter: %s", function, exc)
                return None
            _warm_children[function] = warm
        warm.forks, warm.last_used = warm.forks + 1, time.monotonic()  # reserved here: MAX_FORKS holds
    child = warm.fork(folder)
    if child is None and warm.retired:
        with lock:
            if _warm_children.get(function) is warm:
                warm.close()
                del _warm_children[function]
    return child


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


# --- the warm child ----------------------------------------------------------------------------------


def warm_child(channel_fd: int, spec: dict[str, Any]) -> None:
    """`python -m services.sandbox --warm FD SPEC`: import the target's module and preloads, say "ready" on
    the socket FD, then fork one child per request that arrives there (its folder, and as descriptors its
    stdin, stdout and stderr pipes and a socket of its own: "pid N" and later "exit STATUS" go back on
    it; "kill" or its closing kills the child). Ends once the parent closes FD (or after
    spec["warm_seconds"] without a request) and no child is running."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _not_dumpable()  # and so is every child it forks, from its first instruction
    channel = socket.socket(fileno=channel_fd)
    try:
        importlib.import_module(str(spec["function"]).partition(":")[0])
        for module in spec["preloads"]:
            importlib.import_module(module)
    except BaseException as exc:  # said to the parent, which then runs the request in a fresh interpreter
        with contextlib.suppress(OSError):
            channel.send(f"failed: {type(exc).__name__}: {exc}"[:1000].encode())
        return
    _WarmLoop(channel, float(spec["warm_seconds"])).run()


class _WarmLoop:
    """The warm child's one thread: requests, children's exits (SIGCHLD, through a wakeup pipe) and orders
    from the parent, each on a descriptor of `selector`."""

    def __init__(self, channel: socket.socket, warm_seconds: float) -> None:
        self.channel, self.warm_seconds = channel, warm_seconds
        self.wake_read, self.wake_write = os.pipe()
        for fd in (self.wake_read, self.wake_write):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup byte is what counts
        self.selector = selectors.DefaultSelector()
        self.selector.register(channel, selectors.EVENT_READ, "request")
        self.selector.register(self.wake_read, selectors.EVENT_READ, "ended")
        self.children: dict[int, socket.socket | None] = {}  # pid -> its socket (None once let go)
        self.accepting, self.last_request = True, time.monotonic()

    def run(self) -> None:
        self.channel.send(b"ready")
        while self.accepting or self.children:
            timeout = None
            if self.accepting and not self.children:
                timeout = self.last_request + self.warm_seconds - time.monotonic()
                if timeout <= 0:
                    return
            for key, _ in self.selector.select(timeout):
                if self.selector.get_map().get(key.fd) is not key:
                    continue  # unregistered by an earlier event of this round (its child was reaped)
                if key.data == "request":
                    self._request()
                elif key.data == "ended":
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_read, 512):
                            pass
                    self._reap()
                else:
                    self._order(key.data, key.fileobj)
            self._reap()  # a SIGCHLD that came between two selects

    def _request(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.channel, 4096, 4)
        except OSError:
            data, fds = b"", []
        if not data or len(fds) != 4:
            for fd in fds:
                os.close(fd)
            if not data:  # the parent closed it: no more requests
                self.selector.unregister(self.channel)
                self.accepting = False
            return
        self.last_request = time.monotonic()
        own = [self.channel.fileno(), self.wake_read, self.wake_write, self.selector.fileno()]
        own += [sock.fileno() for sock in self.children.values() if sock is not None]
        try:
            pid = os.fork()
        except OSError:  # no process to be had (EAGAIN, ENOMEM): the parent runs it in a fresh interpreter
            pid = -1
        if pid == 0:
            _forked(data.decode(), fds, own)  # never returns
        for fd in fds[:3]:
            os.close(fd)
        sock = socket.socket(fileno=fds[3])
        if pid < 0:
            with contextlib.suppress(OSError):
                sock.send(b"failed: no fork")
            sock.close()
            return
        self.children[pid] = sock
        self.selector.register(sock, selectors.EVENT_READ, pid)
        with contextlib.suppress(OSError):
            sock.send(f"pid {pid}".encode())

    def _order(self, pid: int, sock: socket.socket) -> None:
        """A "kill" order, or the parent closed the child's socket (it timed out, or went away): SIGKILL to
        the child and its session (the child itself too: it may not have started its session yet)."""
        if self.children.get(pid) is not sock:
            return
        try:
            order = sock.recv(64)
        except OSError:
            order = b""
        for kill in (os.kill, os.killpg):  # pid is not reaped yet: it cannot be another process's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)
        if not order:
            self.selector.unregister(sock)
            sock.close()
            self.children[pid] = None

    def _reap(self) -> None:
        """Collect ended children: SIGKILL to whatever each left in its session (before it is reaped, while
        its pid still names it), its exit status to its socket."""
        while self.children:
            try:
                ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if ended is None or ended.si_pid == 0:
                return
            pid = ended.si_pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                status = signal.SIGKILL
            sock = self.children.pop(pid, None)
            if sock is not None:
                self.selector.unregister(sock)
                with contextlib.suppress(OSError):
                    sock.send(f"exit {status}".encode())
                sock.close()


def _forked(folder: str, fds: list[int], own: list[int]) -> None:
    """A forked child: a session of its own, the request's pipes as 0, 1 and 2, none of the warm child's
    descriptors, the request's folder as working folder; then `main`, and an exit that runs nothing of
    the warm child's (no atexit, no finalizers)."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in own:
            with contextlib.suppress(OSError):
                os.close(fd)
        for target, fd in zip((0, 1, 2), fds[:3], strict=True):
            os.dup2(fd, target)
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # and whatever an import opened
        os.chdir(folder)
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        with contextlib.suppress(BaseException):
            import traceback

            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


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
        warm_child(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        main()
