"""The deployment smoke test: deploy/compose.yaml's topology run as separate processes on this machine, each
service with the command and the environment compose.yaml gives it (read from the file, translated by
`Machine`), then used as a user would: register a task, run a sweep from the Python client, SIGKILL the
dispatcher and the Ray worker node mid-sweep and start them again with the same commands; every job ends
exactly once with one delta version in MLflow, the leaderboard lists the methods, `pull` by task name predicts,
and the API's prediction endpoint answers the same from the replicas it deploys onto the serving node.

How this machine stands in for Compose's containers, network and volumes (`Machine.localize`, `translate`):

- PostgreSQL is not started: the machine's server (PELT_TEST_DATABASE_URL, trust auth) holds one scratch
  database per database the stack names (POSTGRES_DB and deploy/postgres-init), dropped at the end. A
  database URL's user, host, port and database are mapped onto them (trust auth ignores the password).
- Network: `<service>:<port>` becomes 127.0.0.1 and a free local port of that service's own (Redis already
  holds 6379 here: no fixed port is used), as does `localhost:<port>`/`127.0.0.1:<port>` inside a service
  and its `--port`; `0.0.0.0`, a container's every interface, becomes 127.0.0.1. Published ports are reached
  on the service's local port.
- Files: a named volume is a folder tmp_path/volumes/<volume>, mounted where compose.yaml says; other
  /var/lib paths are the container's own folder (tmp_path/containers/<instance>), where its HOME and working
  directory are too; the image's /opt/venv is this checkout's virtual environment.
- The image: its ENV and ENTRYPOINT, read from deploy/Dockerfile.
- Ray: each `ray start` gets `--node-ip-address 127.0.0.1` and, on the head, `--include-dashboard false`
  where the command does not say them, and a `--temp-dir` of its own (short: Ray's socket paths must fit in
  107 bytes; nothing is shared with another Ray on this machine); every process gets
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the mode in which Ray binds 127.0.0.1 only (without it Ray binds every
  interface and rewrites 127.0.0.1 into the machine's address). Ray refuses `ray start --address` in that
  mode (it takes it for a laptop's), so the `ray` on the processes' PATH is Ray's own CLI with that one
  refusal lifted (RAY_CLI). The test checks that every address its processes listen on or talk to is a
  loopback one. The worker node's CPUs: compose's command as it is (Ray counts the machine's CPUs; the
  dispatcher starts one pelt worker per CPU).
- Test-only additions (`added_environment`): short leases and retry backoffs, so that the jobs of the
  killed worker node come back within seconds instead of PELT_LEASE_SECONDS' default minute, and
  PELT_BACKBONE_DIRS, so that the API can register the tiny test backbone (which the worker node and the
  dispatcher then load from the same path). The `pelt` on the processes' PATH is pelt's own CLI (PELT_CLI);
  in the dispatcher's container it first makes the dispatcher hold each attempt, trained but not yet
  stored, until the test lets it go (`tests.workers.hold`), so the jobs are certainly running when their
  node and dispatcher are killed, whatever the machine's speed, without training for long.
- Scale: one dispatcher (compose runs two: the standby's takeover is tested in
  tests/workers/test_dispatcher_ha.py), one ray-worker and one ray-predict.
- Ignored: `image`, `build`, `restart`, `init`, `shm_size`, `mem_limit`, `logging` (IGNORED_KEYS says why);
  a service of a profile (the GPU worker) is not started, as Compose does without `--profile`. Compose's start order
  is kept: a service starts once what it `depends_on` is started, healthy (its own healthcheck command,
  translated) or completed successfully.

Any other construct fails the test with its name, so this test cannot silently drift from the file. Each
process leads a session of its own: killing or stopping a container means signalling every process of its
session (a Ray node's raylet and workers included), and nothing else; none may be left at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import psutil
import pytest
from sqlalchemy.engine import make_url

from services.delta_store.testing import free_port
from services.registry.testing import create_postgres_database, drop_postgres_database, write_jsonl
from tests.deploy.deployment_files import DEPLOY, created_databases, env_file, instruction, load_compose
from tests.postgres import postgres_url
from tests.workers.conftest import LOAD_FACTOR, save_tiny_bert, toy_rows, wait_for
from tests.workers.hold import Hold

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from soak_hosts import session_members  # the live processes of a session: one container's, however deep

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

LOOPBACK = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2]  # the checkout
SECRET_MAKERS = {  # the secrets of deploy/env.example, made fresh for each run
    "POSTGRES_PASSWORD": lambda: secrets.token_urlsafe(24),
    "RAY_AUTH_TOKEN": lambda: secrets.token_hex(32),
    "FIRST_API_TOKEN": lambda: "pelt_" + secrets.token_urlsafe(32),
}
EXTERNAL = {"postgres"}  # services this machine provides instead of starting them
REPLICAS = {"dispatcher": 1}  # instead of compose's `deploy.replicas`
IGNORED_KEYS = {
    "image": "the processes run this checkout's virtual environment, which is what the image installs",
    "build": "no image is built",
    "restart": "the test restarts what it kills itself, and fails on any other exit",
    "init": "no container PID 1 to reap zombies: each process leads a session of its own",
    "shm_size": "processes here share the machine's /dev/shm",
    "mem_limit": "processes here share the machine's memory (the limits: test_image_and_compose.py)",
    "logging": "each process writes to a log file of the test's",
}
HANDLED_KEYS = {
    "entrypoint",
    "command",
    "environment",
    "volumes",
    "ports",
    "healthcheck",
    "depends_on",
    "deploy",
}
HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period", "disable"}
QUEUE_KNOBS = {  # test-only: a lost worker node's jobs come back in seconds
    "PELT_LEASE_SECONDS": "10",
    "PELT_HEARTBEAT_SECONDS": "2",
    "PELT_RETRY_BACKOFF_SECONDS": "0.5",
    "PELT_RETRY_BACKOFF_MAX_SECONDS": "2",
}
# `pelt` for the processes: pelt's CLI; where SMOKE_HOLD_FOLDER is set, its dispatcher holds every attempt there
PELT_CLI = """#!{python}
import os
import sys

if os.environ.get("SMOKE_HOLD_FOLDER"):  # with the checkout on PYTHONPATH (added_environment)
    from tests.workers.hold import hold_dispatcher_deltas

    hold_dispatcher_deltas(os.environ["SMOKE_HOLD_FOLDER"])
from services.cli import main

sys.exit(main())
"""
# `ray` for the processes: Ray's CLI in its loopback-only mode, which would refuse to join a cluster by address
RAY_CLI = '''#!{python}
"""Ray's `ray` command, with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0's refusal of `ray start --address` lifted
(the smoke test's nodes all run on this machine); everything else, binding 127.0.0.1 only included, as is."""
import sys
import types

from ray._private import ray_constants
from ray.scripts import scripts

scripts.ray_constants = types.SimpleNamespace(**{{**vars(ray_constants), "ENABLE_RAY_CLUSTER": True}})
sys.exit(scripts.main())
'''
_LOCAL = re.compile(  # what `Machine.localize` rewrites, tried in this order at each position
    r"(?P<url>postgres(?:ql)?(?:\+\w+)?://[^\s\"']+)"
    r"|(?P<host>\b[a-z][a-z0-9-]*|\b127\.0\.0\.1):(?P<port>\d+)\b"
    r"|(?P<path>(?:/var/lib|/opt/venv)(?:/[\w.-]+)*)"
    r"|(?P<any>\b0\.0\.0\.0\b)"
)
STEPS = 20  # optimisation steps of a job: each attempt then waits at its hold until the test lets it go


def refuse(what: str) -> NoReturn:
    pytest.fail(f"deploy/compose.yaml: {what}; teach tests/deploy/test_compose_smoke.py what it means")


# --- translating compose.yaml ----------------------------------------------------------------------------


def service_port(host: str) -> int:
    """A free port for a service, below the kernel's ephemeral range (where every bind to port 0 takes its
    ports: a Ray node's agents, started in the API's container before the API listens, take several) and
    above Ray's worker ports (10002-19999): a port chosen here is not taken in the meantime by a process
    that asked for any port."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(20000, max(20001, min(low, 32768)))
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)


@dataclass
class Launch:
    """One process standing for one container: what it runs, with what, and how to ask if it is healthy."""

    service: str
    instance: str
    argv: list[str]
    env: dict[str, str]
    home: Path
    healthcheck: list[str] | None


@dataclass
class Machine:
    """This machine standing in for compose.yaml's containers, network and volumes (module docstring)."""

    compose: dict[str, Any]
    root: Path
    ray_root: Path
    databases: dict[str, str]
    test_only: dict[str, dict[str, str]]
    ports: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        extra = {key for key in self.compose if not key.startswith("x-")} - {"name", "services", "volumes"}
        if extra:
            refuse(f"top-level keys {sorted(extra)}")
        for service, port in sorted(container_ports(self.compose)):
            self.ports[(service, port)] = service_port(LOOPBACK)
        (self.root / "bin").mkdir(parents=True, exist_ok=True)
        ray = self.root / "bin" / "ray"
        ray.write_text(RAY_CLI.format(python=sys.executable))
        ray.chmod(0o755)
        pelt = self.root / "bin" / "pelt"
        pelt.write_text(PELT_CLI.format(python=sys.executable))
        pelt.chmod(0o755)

    @property
    def services(self) -> dict[str, dict[str, Any]]:
        return self.compose["services"]

    def port(self, service: str, container_port: int) -> int:
        if (service, container_port) not in self.ports:
            refuse(f"{service} uses port {container_port}, which no other service or `ports:` names")
        return self.ports[(service, container_port)]

    def localize(self, text: str, service: str, instance: str) -> str:
        """`text` (a command-line word, an environment value) as it reads on this machine."""

        def replace(match: re.Match[str]) -> str:
            if match["url"]:
                return self.database_url(match["url"])
            if match["host"]:
                return self.address(match["host"], int(match["port"]), service, match[0])
            if match["path"]:
                return str(self.path(match["path"], service, instance))
            return LOOPBACK

        return _LOCAL.sub(replace, text)

    def database_url(self, url: str) -> str:
        parsed = make_url(url)
        if parsed.host not in EXTERNAL or parsed.database not in self.databases:
            refuse(
                f"a database URL names {parsed.host}/{parsed.database}, not one of {sorted(self.databases)}"
            )
        scratch = make_url(self.databases[parsed.database])
        local = parsed.set(
            username=scratch.username, host=scratch.host, port=scratch.port, database=scratch.database
        )
        return local.render_as_string(hide_password=False)

    def address(self, host: str, port: int, service: str, text: str) -> str:
        if host in ("localhost", LOOPBACK):
            return f"{host}:{self.port(service, port)}"
        if host in EXTERNAL:
            refuse(f"{text}: only database URLs may name {host}")
        if host in self.services:
            return f"{LOOPBACK}:{self.port(host, port)}"
        return text  # not a host name (e.g. an option's value): left as it is

    def path(self, path: str, service: str, instance: str) -> Path:
        if path == "/opt/venv" or path.startswith("/opt/venv/"):
            return Path(sys.prefix) / path.removeprefix("/opt/venv").lstrip("/")
        for volume, mount in self.mounts(service).items():
            if path == mount or path.startswith(mount + "/"):
                return self.root / "volumes" / volume / path.removeprefix(mount).lstrip("/")
        return self.root / "containers" / instance / path.lstrip("/")

    def mounts(self, service: str) -> dict[str, str]:
        """Named volume -> where the service mounts it."""
        found = {}
        for entry in self.services[service].get("volumes", []):
            volume, mount = entry.split(":")[:2]
            if volume not in (self.compose.get("volumes") or {}):
                refuse(f"{service} mounts {entry!r}, which is not a named volume")
            found[volume] = mount
        return found

    def image_environment(self, service: str, instance: str) -> dict[str, str]:
        """deploy/Dockerfile's ENV, localized; `$PATH` is this machine's, behind the test's `ray`."""
        environment = {}
        for arguments in instruction("ENV"):
            for word in shlex.split(arguments):
                key, value = word.split("=", 1)
                value = self.localize(value, service, instance)
                if key == "PATH":
                    value = f"{self.root / 'bin'}:{value.replace('$PATH', os.environ['PATH'])}"
                if "$" in value:
                    refuse(f"Dockerfile ENV {word!r} expands a variable other than $PATH")
                environment[key] = value
        return environment

    def translate(self, service: str, instance: str) -> Launch:
        """The process that stands for one container of `service`."""
        spec = self.services[service]
        unknown = set(spec) - HANDLED_KEYS - set(IGNORED_KEYS)
        if unknown:
            refuse(f"{service} uses {sorted(unknown)}")
        if set(spec.get("deploy", {})) - {"replicas"}:
            refuse(f"{service} deploy: {sorted(spec['deploy'])}")
        command = spec.get("command", [])
        entrypoint = spec.get("entrypoint", json.loads(instruction("ENTRYPOINT")[-1]))
        if not isinstance(command, list) or not isinstance(entrypoint, list):
            refuse(f"{service} gives its entrypoint or command as a string (lists only here)")
        environment = spec.get("environment", {})
        if not isinstance(environment, dict) or any(value is None for value in environment.values()):
            refuse(f"{service} environment: a mapping of values only here")
        home = self.root / "containers" / instance / "home"
        home.mkdir(parents=True, exist_ok=True)
        env = {
            "HOME": str(home),
            "LANG": "C.UTF-8",
            **self.image_environment(service, instance),
            **{key: self.localize(str(value), service, instance) for key, value in environment.items()},
            **self.test_only.get("*", {}),
            **self.test_only.get(service, {}),
        }
        argv = self.with_ray_node_options(
            [self.localize(str(word), service, instance) for word in entrypoint + command], instance
        )
        argv = self.with_ports(argv, service)
        return Launch(service, instance, argv, env, home, self.healthcheck(service, instance))

    def with_ray_node_options(self, argv: list[str], instance: str) -> list[str]:
        """`ray start` (as argv or in a `/bin/sh -c` script) on loopback, with a temp dir of its own and,
        on a head, no dashboard (where the command does not say these)."""

        def options(given: str) -> list[str]:
            added = [
                "--temp-dir",
                tempfile.mkdtemp(prefix=f"{len(os.listdir(self.ray_root))}-", dir=self.ray_root),
            ]
            if "--node-ip-address" not in given:
                added += ["--node-ip-address", LOOPBACK]
            if "--head" in given and "--include-dashboard" not in given:
                added += ["--include-dashboard", "false"]
            return added

        if argv[:2] == ["ray", "start"]:
            return [*argv[:2], *options(" ".join(argv)), *argv[2:]]
        if argv[:2] == ["/bin/sh", "-c"] and len(argv) == 3:
            starts = len(re.findall(r"\bray start\b", argv[2]))
            if starts > 1:
                refuse(f"{instance} starts {starts} Ray nodes in one container")
            if starts:
                return [
                    *argv[:2],
                    re.sub(r"\bray start\b", "ray start " + shlex.join(options(argv[2])), argv[2]),
                ]
            return argv
        if "ray" in argv:
            refuse(f"{instance} runs Ray in a way the translation does not know: {argv}")
        return argv

    def with_ports(self, argv: list[str], service: str) -> list[str]:
        """`--port N` (where the service listens in its container; also `--port=N` and in a shell script)
        -> its local port."""

        def local(match: re.Match[str]) -> str:
            return f"{match[1]}{self.port(service, int(match[2]))}"

        words = [re.sub(r"(--port[= ])(\d+)\b", local, word) for word in argv]
        return [
            str(self.port(service, int(word))) if index and words[index - 1] == "--port" else word
            for index, word in enumerate(words)
        ]

    def healthcheck(self, service: str, instance: str) -> list[str] | None:
        check = self.services[service].get("healthcheck")
        if check is None or check.get("disable"):
            return None
        if set(check) - HEALTHCHECK_KEYS:
            refuse(f"{service} healthcheck: {sorted(set(check) - HEALTHCHECK_KEYS)}")
        test = check["test"]
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        if test[0] == "CMD":
            argv = test[1:]
        elif test[0] == "CMD-SHELL" and len(test) == 2:
            argv = ["/bin/sh", "-c", test[1]]
        else:
            refuse(f"{service} healthcheck test {test!r}")
        return self.with_ports([self.localize(str(word), service, instance) for word in argv], service)

    def dependencies(self, service: str) -> dict[str, str]:
        """What the service waits for: {service: condition}."""
        depends = self.services[service].get("depends_on", {})
        if isinstance(depends, list):
            return dict.fromkeys(depends, "service_started")
        for name, rule in depends.items():
            if set(rule) - {"condition"}:
                refuse(f"{service} depends_on {name}: {sorted(rule)}")
        return {name: rule.get("condition", "service_started") for name, rule in depends.items()}

    def replicas(self, service: str) -> int:
        return REPLICAS.get(service, self.services[service].get("deploy", {}).get("replicas", 1))


def container_ports(compose: dict[str, Any]) -> set[tuple[str, int]]:
    """(service, port) for every port a service is called on (`service:port` anywhere) or publishes."""
    services = set(compose["services"]) - EXTERNAL
    text = json.dumps(compose["services"])
    found = {
        (host, int(port))
        for host, port in re.findall(r"\b([a-z][a-z0-9-]*):(\d+)\b", text)
        if host in services
    }
    for name, spec in compose["services"].items():
        for published in spec.get("ports", []):
            found.add((name, int(str(published).rsplit(":", 1)[-1])))
    return found


# --- the processes ---------------------------------------------------------------------------------------


@dataclass
class Running:
    launch: Launch
    process: subprocess.Popen[bytes]
    log: Path
    killed: bool = False


class Stack:
    """The compose services as processes on this machine, each leading a session of its own."""

    def __init__(self, machine: Machine, logs: Path) -> None:
        self.machine = machine
        self.logs = logs
        self.running: dict[str, Running] = {}  # instance -> process
        self.healthy: set[str] = set()
        self._checked: dict[str, float] = {}

    def start(self, service: str) -> Running:
        count = sum(1 for r in self.running.values() if r.launch.service == service)
        instance = service if count == 0 else f"{service}.{count + 1}"
        launch = self.machine.translate(service, instance)
        log = self.logs / f"{instance}.log"
        with log.open("wb") as out:
            out.write(f"$ {shlex.join(launch.argv)}\n".encode())
            out.flush()
            process = subprocess.Popen(
                launch.argv,
                env=launch.env,
                cwd=launch.home,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.running[instance] = Running(launch, process, log)
        return self.running[instance]

    def up(self, timeout: float) -> None:
        """Start every service once what it depends on is ready, as `docker compose up` orders them."""
        pending = [name for name in self.machine.services if name not in EXTERNAL]
        deadline = time.monotonic() + timeout
        while pending:
            for name in list(pending):
                if all(self.ready(dep, cond) for dep, cond in self.machine.dependencies(name).items()):
                    for _ in range(self.machine.replicas(name)):
                        self.start(name)
                    pending.remove(name)
            if pending:
                if time.monotonic() > deadline:
                    pytest.fail(f"services {pending} never had what they depend on within {timeout:.0f} s")
                time.sleep(0.5)

    def ready(self, service: str, condition: str) -> bool:
        if service in EXTERNAL:
            return True  # the machine's PostgreSQL answered when the test made its databases
        instances = [r for r in self.running.values() if r.launch.service == service]
        if condition == "service_started":
            return bool(instances)
        if condition == "service_completed_successfully":
            codes = [r.process.poll() for r in instances]
            if any(code not in (None, 0) for code in codes):
                pytest.fail(
                    f"{service} exited with {codes}:\n"
                    + "\n".join(self.tail(r.launch.instance) for r in instances)
                )
            return bool(codes) and all(code == 0 for code in codes)
        if condition == "service_healthy":
            return bool(instances) and all(self.is_healthy(r) for r in instances)
        refuse(f"depends_on condition {condition!r}")

    def is_healthy(self, running: Running) -> bool:
        """Its healthcheck command passes (asked at most once a second)."""
        instance = running.launch.instance
        if instance in self.healthy:
            return True
        self.assert_running(instance)
        if running.launch.healthcheck is None:
            refuse(f"{running.launch.service} has no healthcheck, but a service waits for it to be healthy")
        if time.monotonic() - self._checked.get(instance, 0.0) < 1.0:
            return False
        self._checked[instance] = time.monotonic()
        try:
            check = subprocess.run(
                running.launch.healthcheck,
                env=running.launch.env,
                cwd=running.launch.home,
                capture_output=True,
                timeout=60,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False
        if check.returncode == 0:
            self.healthy.add(instance)
        return check.returncode == 0

    def assert_running(self, *instances: str) -> None:
        """Fail if a long-running process (not one that was killed, not a one-shot step) has exited."""
        for name in instances or list(self.running):
            running = self.running[name]
            one_shot = self.machine.services[running.launch.service].get("restart") == "no"
            if not running.killed and not one_shot and running.process.poll() is not None:
                pytest.fail(f"{name} exited with {running.process.returncode}:\n{self.tail(name)}")

    def kill(self, instance: str, timeout: float = 30.0) -> None:
        """SIGKILL every process of the instance's session, and wait until none is left."""
        running = self.running[instance]
        running.killed = True
        self._signal_until_gone(running, signal.SIGKILL, timeout)
        if session_members(running.process.pid):
            pytest.fail(
                f"{instance} still has processes after SIGKILL: {session_members(running.process.pid)}"
            )

    def down(self, timeout: float = 30.0) -> list[str]:
        """SIGTERM every session (newest first), SIGKILL what is left after `timeout`; returns what survived."""
        for running in reversed(list(self.running.values())):
            for process in session_members(running.process.pid):
                with contextlib.suppress(psutil.Error):
                    process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self._alive()):
            time.sleep(0.2)
        for running in self.running.values():
            self._signal_until_gone(running, signal.SIGKILL, 10.0)
        return [f"{name}: {session_members(r.process.pid)}" for name, r in self._alive()]

    def _alive(self) -> Iterator[tuple[str, Running]]:
        for name, running in self.running.items():
            running.process.poll()  # reap the session leader
            if session_members(running.process.pid):
                yield name, running

    def _signal_until_gone(self, running: Running, signum: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (members := session_members(running.process.pid)) and time.monotonic() < deadline:
            for process in members:
                with contextlib.suppress(psutil.Error):
                    process.send_signal(signum)
            running.process.poll()
            time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            running.process.wait(5)

    def tail(self, instance: str, lines: int = 40) -> str:
        """The last lines of the instance's output."""
        text = self.running[instance].log.read_text(errors="replace")
        return f"--- {instance}\n" + "\n".join(text.splitlines()[-lines:])

    def listening_and_peers(self) -> set[str]:
        """Every address our processes listen on or talk to."""
        ours = {p.pid for r in self.running.values() for p in session_members(r.process.pid)}
        addresses = set()
        for connection in psutil.net_connections("inet"):
            if connection.pid in ours:
                addresses.add(connection.laddr.ip)
                if connection.raddr:
                    addresses.add(connection.raddr.ip)
        return addresses


def is_loopback(ip: str) -> bool:
    return ip.removeprefix("::ffff:").startswith("127.") or ip == "::1"


# --- the test --------------------------------------------------------------------------------------------


@pytest.fixture
def scratch_databases() -> Iterator[dict[str, str]]:
    """One fresh database on the machine's PostgreSQL per database the stack names, dropped afterwards."""
    base = postgres_url("the compose smoke test (its databases are on the machine's PostgreSQL)")
    compose = load_compose({key: "unused" for key in SECRET_MAKERS})
    names = [compose["services"]["postgres"]["environment"]["POSTGRES_DB"], *created_databases()]
    made: dict[str, str] = {}
    try:
        for name in names:
            made[name] = create_postgres_database(base, prefix=f"pelt_smoke_{name}_")
        yield made
    finally:
        for url in made.values():
            drop_postgres_database(url)


@pytest.fixture
def hold(tmp_path: Path) -> Hold:
    """Where the dispatcher's attempts wait, trained, until the test lets them store (tests/workers/hold.py)."""
    return Hold(tmp_path / "hold")


@pytest.fixture
def ray_root() -> Iterator[Path]:
    """A short folder for the Ray nodes' temp dirs (Ray's socket paths must fit in 107 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="pelt-smoke-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def compose_stack(
    tmp_path: Path, scratch_databases: dict[str, str], ray_root: Path, hold: Hold
) -> Iterator[tuple[Stack, dict]]:
    """The stack, not started yet, and the generated env file's variables; stopped afterwards whatever
    happened (the test itself checks that stopping leaves nothing behind)."""
    example = env_file(DEPLOY / "env.example")
    assert {key for key, value in example.items() if not value} == set(SECRET_MAKERS), "env.example's secrets"
    variables = {key: make() for key, make in SECRET_MAKERS.items()}
    env_path = tmp_path / "deploy.env"  # as an operator writes deploy/.env
    env_path.write_text("".join(f"{key}={value}\n" for key, value in variables.items()))
    env_path.chmod(0o600)
    backbones = tmp_path / "backbones"
    save_tiny_bert(backbones / "tiny-bert")
    machine = Machine(
        load_compose(env_file(env_path)),
        tmp_path,
        ray_root,
        scratch_databases,
        added_environment(backbones, hold),
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    stack = Stack(machine, logs)
    try:
        yield stack, variables
    finally:
        stack.down()


def added_environment(backbones: Path, hold: Hold) -> dict[str, dict[str, str]]:
    """Settings this test adds to compose.yaml's, per service ("*": every service)."""
    backbone_dirs = {"PELT_BACKBONE_DIRS": str(backbones)}
    holding = {  # the hold's sink travels to the worker node's processes, which import it from the checkout
        "PYTHONPATH": str(ROOT),
        "SMOKE_HOLD_FOLDER": str(hold.folder),
    }
    return {
        "*": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        "api": backbone_dirs,
        "ray-worker": {**backbone_dirs, "PYTHONPATH": str(ROOT)},
        "ray-predict": {
            **backbone_dirs,
            "PYTHONPATH": str(ROOT),
        },  # the replicas unpickle the store's fetcher
        "dispatcher": {**backbone_dirs, **QUEUE_KNOBS, **holding},
    }


@contextlib.contextmanager
def logs_shown_on_failure(stack: Stack) -> Iterator[None]:
    try:
        yield
    except BaseException:
        print(f"\n=== the stack's logs (all of them in {stack.logs}) ===")
        for instance in stack.running:
            print(stack.tail(instance, 30))
        raise


def client_of(stack: Stack, token: str, tmp_path: Path) -> Any:
    """A PeltClient on the API's published port, once the API answers /health."""
    from services.client import PeltClient
    from services.settings import Settings

    settings = Settings(data_dir=tmp_path / "client", backbone_dirs=[tmp_path / "backbones"])
    client = PeltClient(
        f"http://{LOOPBACK}:{stack.machine.port('api', 8000)}", token=token, settings=settings
    )

    def answers() -> bool:
        stack.assert_running()
        with contextlib.suppress(Exception):
            return client.health()["status"] == "ok"
        return False

    wait_for(answers, 90, "the API's /health")
    return client


def submit_sweep(client: Any, tmp_path: Path) -> Any:
    """The tiny backbone and the toy task registered, and a sweep of 2 methods x 2 seeds submitted."""
    client.register_backbone("tiny-bert", str(tmp_path / "backbones" / "tiny-bert"))
    data = tmp_path / "data"
    data.mkdir()
    client.register_task(
        "toy",
        write_jsonl(data / "train.jsonl", toy_rows(200, seed=0)),
        write_jsonl(data / "validation.jsonl", toy_rows(40, seed=1)),
        text_fields=["sentence"],
        label_names=["negative", "positive"],
    )
    hyperparameters = {"max_steps": STEPS, "batch_size": 8}
    return client.sweep(
        "toy", ["lora", "bitfit"], backbone="tiny-bert", seeds=[0, 1], hyperparameters=hyperparameters
    )


def held_and_running(stack: Stack, client: Any, sweep_id: int, hold: Hold) -> list[Any]:
    """The sweep's jobs once as many of them as the worker node has workers (one per CPU of this machine; at
    most the sweep's 4) wait at their hold, trained and still running, whichever attempt each is on (a
    first attempt may lose its lease to a loaded machine); [] before."""
    stack.assert_running()
    jobs = client.jobs(sweep_id=sweep_id)
    held = [job for job in jobs if any(hold.folder.glob(f"held-{job.id}-*"))]
    workers = min(len(jobs), os.cpu_count() or 1)
    return jobs if len(held) >= workers and all(job.status == "running" for job in held) else []


def test_the_compose_stack_runs_a_sweep_through_a_killed_dispatcher_and_worker_node(
    compose_stack, tmp_path, hold
):
    stack, variables = compose_stack
    started = time.monotonic()
    with logs_shown_on_failure(stack):
        stack.up(timeout=150 * LOAD_FACTOR)
        client = client_of(stack, variables["FIRST_API_TOKEN"], tmp_path)
        sweep = submit_sweep(client, tmp_path)
        job_ids = sorted(job.id for job in client.jobs(sweep_id=sweep.id))
        assert len(job_ids) == 4

        before = wait_for(
            lambda: held_and_running(stack, client, sweep.id, hold),
            150 * LOAD_FACTOR,
            "a job per worker to train and wait at its hold",
        )
        addresses = stack.listening_and_peers()
        assert addresses and all(is_loopback(ip) for ip in addresses), addresses
        stack.kill("dispatcher")
        stack.kill("ray-worker")
        killed_mid_job = {job.id for job in before if job.status == "running"}
        assert killed_mid_job
        stack.start("ray-worker")  # the same commands again
        stack.start("dispatcher")
        hold.release()  # every attempt from now on stores its delta and ends

        try:
            ended = client.wait(sweep, timeout=150 * LOAD_FACTOR, poll_seconds=1, progress=False)
        except TimeoutError as exc:
            pytest.fail(f"{exc}: {[(j.id, j.status, j.attempts) for j in client.jobs(sweep_id=sweep.id)]}")
        stack.assert_running()
        assert [job.status for job in ended] == ["succeeded"] * 4, [
            (j.id, j.status, j.last_error) for j in ended
        ]
        # the jobs killed mid-job were tried again; a job may also have been taken back once more when its
        # lease (10 s here) ran out under a loaded machine's late heartbeats, which is the queue working too.
        # What must hold is below: each job succeeded once, with one delta version.
        attempts = {job.id: job.attempts for job in ended}
        assert all(attempts[j] >= (2 if j in killed_mid_job else 1) for j in job_ids), (
            attempts,
            killed_mid_job,
        )
        for job_id in job_ids:
            events = client.events(job_id)
            assert [e.to_status for e in events].count("succeeded") == 1, events
        assert sorted(v.job_id for v in client.versions("toy")) == job_ids  # one delta version per job

        frame = client.leaderboard("toy")
        assert sorted(frame["method"]) == ["bitfit", "lora"] and list(frame["runs"]) == [2, 2]
        texts = ["w1 w2 good great", "w3 w4 bad awful"]
        predictions = client.pull("toy").predict(texts)
        assert all(p["label"] in ("negative", "positive") for p in predictions) and len(predictions) == 2
        served = client.predict("toy", texts)  # the API deploys the replicas onto the serving node
        assert [p["label"] for p in served.predictions] == [p["label"] for p in predictions]
        assert served.version == client.delta_info("toy").version

        survivors = stack.down()
        assert not survivors, f"processes left running: {survivors}"
    print(f"\ncompose smoke test: {time.monotonic() - started:.0f} s from `up` to `down`")
