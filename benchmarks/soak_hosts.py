"""Hosts that are not loopback: pelt's processes on one Linux machine as several hosts, each a network
namespace with its own address, joined by veth pairs to a bridge that lives in a namespace of its own.

Nothing outside the namespaces made here is addressed: the bridge has no address, the root namespace no
route into the subnet, and the tool that drives them joins a client namespace of its own (`enter`). Needs
root (as CI runs) and iproute2. The services run as an unprivileged user (uid/gid 10001, as in
pelt's image); PostgreSQL as the machine's `postgres` user.


Where this machine's Python lives under a folder that uid 10001 cannot enter (pyenv under /root, 0700),
`private_mounts` gives this process a mount namespace of its own in which only the interpreter's folder is
shown through (a tmpfs over the closed folder): nothing on the machine changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SERVICE_UID = SERVICE_GID = 10001  # pelt's image runs as this user
CLONE_NEWNET = 0x40000000
MOUNTS_READY = "PELT_SOAK_PRIVATE_MOUNTS"


def need_root() -> None:
    if os.geteuid() != 0:
        raise SystemExit("the soak makes network namespaces: run it as root (as CI does)")
    for tool in ("ip", "setpriv", "unshare", "mount"):
        if shutil.which(tool) is None:
            raise SystemExit(f"the soak needs `{tool}` (iproute2, util-linux) on PATH")


def closed_ancestor(path: Path) -> Path | None:
    """The first folder above `path` that other users cannot enter (no o+x), or None."""
    for parent in reversed(path.parents):
        if parent != Path("/") and not os.stat(parent).st_mode & stat.S_IXOTH:
            return parent
    return None


def private_mounts() -> None:
    """Re-run this program in a mount namespace of its own where uid 10001 can reach its interpreter
    (module docstring); returns at once where it already can, or once inside."""
    interpreter = Path(os.path.realpath(sys.executable))
    closed = closed_ancestor(interpreter)
    if closed is None:
        return
    if os.environ.get(MOUNTS_READY) != "1":
        env = {**os.environ, MOUNTS_READY: "1"}
        argv = ["unshare", "--mount", "--propagation", "private", sys.executable, *sys.argv]
        os.execvpe("unshare", argv, env)
    shown = closed / interpreter.relative_to(closed).parts[0]  # e.g. /root/.pyenv
    keep = Path(f"/tmp/.pelt-soak-keep-{os.getpid()}")
    keep.mkdir()
    subprocess.run(["mount", "--bind", str(shown), str(keep)], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "pelt-soak", str(closed)], check=True)
    shown.mkdir()
    subprocess.run(["mount", "--move", str(keep), str(shown)], check=True)
    keep.rmdir()


def as_service_user(command: list[str]) -> list[str]:
    """`command` run from root as uid/gid 10001; where this interpreter lives under a folder that user cannot
    enter, in a mount namespace of its own that shows the interpreter's folder through (as `private_mounts`,
    done by a shell before it becomes the command)."""
    switch = ["setpriv", f"--reuid={SERVICE_UID}", f"--regid={SERVICE_GID}", "--clear-groups", "--", *command]
    interpreter = Path(os.path.realpath(sys.executable))
    closed = closed_ancestor(interpreter)
    if closed is None:
        return switch
    shown = closed / interpreter.relative_to(closed).parts[0]
    script = (
        'keep=$(mktemp -d) && mount --bind "$1" "$keep" && mount -t tmpfs -o mode=0755 pelt "$2" '
        '&& mkdir "$1" && mount --move "$keep" "$1" && rmdir "$keep" && shift 2 && exec "$@"'
    )
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        str(shown),
        str(closed),
        *switch,
    ]


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


@dataclass
class Network:
    """Namespaces `<prefix>-<host>` on 10.<a>.<b>.0/24, a bridge in `<prefix>-switch`. `hosts`: name → address."""

    prefix: str
    hosts: dict[str, str] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)

    def create(self, names: list[str]) -> None:
        """The switch and one host per name, on a random 10.x.y.0/24; what was made is removed again if a
        step fails (and by `destroy`)."""
        rng = random.Random()
        subnet = f"10.{rng.randrange(100, 250)}.{rng.randrange(0, 250)}"
        try:
            switch = self.namespace("switch")
            self._add_namespace(switch)
            sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", switch, "link", "set", "br0", "up")
            for index, name in enumerate(names, start=2):
                namespace = self.namespace(name)
                self._add_namespace(namespace)
                outside = f"ps{index}"
                link = ["ip", "link", "add", "eth0", "netns", namespace, "type", "veth"]
                sh(*link, "peer", "name", outside, "netns", switch)
                sh("ip", "-n", switch, "link", "set", outside, "master", "br0")
                sh("ip", "-n", switch, "link", "set", outside, "up")
                address = f"{subnet}.{index}"
                sh("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
                sh("ip", "-n", namespace, "link", "set", "eth0", "up")
                self.hosts[name] = address
        except BaseException:
            self.destroy()
            raise

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def _add_namespace(self, namespace: str) -> None:
        sh("ip", "netns", "add", namespace)
        self.made.append(namespace)
        sh("ip", "-n", namespace, "link", "set", "lo", "up")

    def enter(self, host: str) -> None:
        """Move this process's network into `host` (call before any thread starts: threads inherit it)."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open(f"/run/netns/{self.namespace(host)}") as handle:
            if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.namespace(host)}")

    def argv(self, host: str, command: list[str], user: str = "service") -> list[str]:
        """`command` run on `host` as pelt's service user ("service"), `postgres`, or root ("root")."""
        inside = ["ip", "netns", "exec", self.namespace(host)]
        if user == "service":
            ids = [f"--reuid={SERVICE_UID}", f"--regid={SERVICE_GID}", "--clear-groups"]
            return [*inside, "setpriv", *ids, "--", *command]
        if user == "postgres":  # setpriv execs (runuser would stay the parent, and not pass signals on)
            account = pwd.getpwnam("postgres")
            ids = [f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--init-groups"]
            return [*inside, "setpriv", *ids, "--", *command]
        return [*inside, *command]

    def link(self, host: str, up: bool) -> None:
        """Cut (or restore) the host's one link to the others."""
        sh("ip", "-n", self.namespace(host), "link", "set", "eth0", "up" if up else "down")

    def destroy(self) -> None:
        for namespace in reversed(self.made):
            sh("ip", "netns", "del", namespace, check=False)
        self.made.clear()


def session_members(leader: int) -> list[psutil.Process]:
    """The live (not zombie) processes of the session `leader` leads: what one container's process started."""
    members = []
    for process in psutil.process_iter(["status"]):
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(process.pid) == leader and process.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(process)
    return members


@dataclass
class Service:
    """One process standing for one container (and what it starts: it leads a session of its own)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    _seen: dict[int, psutil.Process] = field(default_factory=dict)

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "ab") as out:
            out.write(f"\n=== start {self.starts} at {time.strftime('%H:%M:%S')} ===\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def members(self) -> list[psutil.Process]:
        """The live processes of the session and every descendant of them (Ray's GCS server leads a
        session of its own under the head's `ray start`); ones seen before stay counted once orphaned."""
        if self.process is None:
            return []
        found = {process.pid: process for process in session_members(self.process.pid)}
        for process in list(found.values()):
            with contextlib.suppress(psutil.Error):
                found.update({child.pid: child for child in process.children(recursive=True)})
        self._seen.update(found)
        alive = []
        for pid, process in list(self._seen.items()):
            try:
                running = process.is_running() and process.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                running = False
            if running:
                alive.append(process)
            else:
                del self._seen[pid]
        return alive

    def stop(self, sig: signal.Signals = signal.SIGKILL, timeout: float = 60.0) -> None:
        """Signal every process of the session (SIGKILL after `timeout`), and wait until none is left."""
        if self.process is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            members = self.members()
            if not members:
                break
            if time.monotonic() > deadline and sig != signal.SIGKILL:
                sig = signal.SIGKILL
                deadline = time.monotonic() + timeout
            elif time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: processes left after SIGKILL: {[p.pid for p in members]}")
            for member in members:
                with contextlib.suppress(psutil.Error):
                    member.send_signal(sig)
            time.sleep(0.2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    def tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""
