"""The sandbox's warm children: services/sandbox.py runs its targets' children through them.

Warm children: starting an interpreter and importing a target's libraries (pyarrow for a dataset check,
torch for a composition, transformers for a backbone) costs 0.3-2 s of CPU per request, more than most
requests' own work. So each target has a warm child (`_WarmChild`, started by `fork_warm`): an interpreter started the same way,
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
import math
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
from typing import Any

WARM_START_TIMEOUT_SECONDS = 120.0  # a warm child not ready (or not answering) by then is given up
KILLED_WAIT_SECONDS = 60.0  # after a kill, how long a forked child's exit status is waited for at most
MAX_FORKS = 200  # requests one warm child serves before a fresh one (fresh address-space randomisation)
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE})
log = logging.getLogger("pelt.sandbox")
# services.sandbox is imported inside functions only: it imports this module


# --- the parent's side -------------------------------------------------------------------------------


class ForkedChild:
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
        # a crash may have learnt the address-space layout every child of its warm child shares
        if -code in CRASH_SIGNALS:
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

    def fork(self, folder: str) -> ForkedChild | None:
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
        return ForkedChild(self, int(answer[4:]), mine, stdin_write, stdout_read, stderr_read)

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
_failed_starts: dict[str, float] = {}  # function -> when its warm child last failed to start (monotonic)
_warm_locks: dict[str, threading.Lock] = {}
_warm_guard = threading.Lock()


def fork_warm(
    function: str, preloads: tuple[str, ...], environment: dict[str, str], warm_seconds: float, folder: str
) -> ForkedChild | None:
    """A child for `function` forked by its warm child (started if missing, stale or of another
    environment); None when none can be had (the request then runs in a fresh interpreter). A warm child
    that failed to start is not tried again for `warm_seconds`: each request would pay its imports twice."""
    with _warm_guard:
        lock = _warm_locks.setdefault(function, threading.Lock())
    with lock:
        warm = _warm_children.get(function)
        if warm is not None and not warm.usable(function, preloads, environment, warm_seconds):
            _warm_children.pop(function).close()
            warm = None
        if warm is None:
            if time.monotonic() - _failed_starts.get(function, -math.inf) < warm_seconds:
                return None
            try:
                warm = _WarmChild(function, preloads, environment, warm_seconds)
            except OSError as exc:
                _failed_starts[function] = time.monotonic()
                log.warning("running %s in fresh interpreters for %g s: %s", function, warm_seconds, exc)
                return None
            _failed_starts.pop(function, None)
            _warm_children[function] = warm
        warm.forks, warm.last_used = warm.forks + 1, time.monotonic()  # reserved here: MAX_FORKS holds
    child = warm.fork(folder)
    if child is None and warm.retired:
        with lock:
            if _warm_children.get(function) is warm:
                warm.close()
                del _warm_children[function]
    return child


# --- the warm child ----------------------------------------------------------------------------------


def warm_child(channel_fd: int, spec: dict[str, Any]) -> None:
    """`python -m services.sandbox --warm FD SPEC`: import the target's module and preloads, say "ready" on
    the socket FD, then fork one child per request that arrives there (its folder, and as descriptors its
    stdin, stdout and stderr pipes and a socket of its own: "pid N" and later "exit STATUS" go back on
    it; "kill" or its closing kills the child). Ends once the parent closes FD (or after
    spec["warm_seconds"] without a request) and no child is running."""
    from services.sandbox import _not_dumpable

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
    from services.sandbox import main  # imported in the warm child already: no cost here

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


__all__ = ["MAX_FORKS", "ForkedChild", "fork_warm", "warm_child"]
