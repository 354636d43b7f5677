"""Joining or starting the Ray cluster the dispatcher runs its workers on, with Ray's token authentication
kept on, a local Ray bound to loopback and its session folders private.

`connect_ray` joins PELT_RAY_ADDRESS, or starts a local Ray bound to 127.0.0.1 with the dashboard off.
Ray's token authentication stays on (RAY_AUTH_MODE=token unless set otherwise): a local Ray writes
~/.ray/auth_token; every process that joins a cluster needs the cluster's token, as RAY_AUTH_TOKEN or in
~/.ray/auth_token on its machine.

Only Ray's public means are used: the environment variables it documents (RAY_AUTH_MODE,
RAY_AUTH_TOKEN_PATH, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER) and `ray.init`'s options. Ray reads those
variables once, when `ray` is first imported, so they are set before `connect_ray` imports it; a process
that imported `ray` before without them is refused (RuntimeError) rather than left open.

A local Ray's temp folder (its sessions: Unix sockets, logs, spilled objects) is `private_ray_temp_dir`,
<temp folder>/pelt-ray-<uid>/ray, inside a folder only this user may enter (Ray makes its own folders
0777), and `private_tree` takes group and other permissions off whatever Ray made there by the time it
started. Ray's logs of `pelt serve`: <temp folder>/pelt-ray-<uid>/ray/session_latest/logs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.dispatcher.config import WORKER_ENVIRONMENT
from services.settings import Settings, get_settings

log = logging.getLogger("pelt.dispatcher")

LOOPBACK = "127.0.0.1"
# Unix socket paths hold at most 107 bytes on Linux (103 on macOS); Ray puts its sockets at
# <temp dir>/session_<date>_<time>_<microseconds>_<pid>/sockets/<name>
RAY_SOCKET_PATH_MAX_BYTES = 103 if sys.platform == "darwin" else 107
RAY_SOCKET_SUFFIX = "/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store.99"


def connect_ray(
    settings: Settings | None = None,
    *,
    namespace: str = "pelt",
    num_cpus: int | None = None,
    **init_kwargs: Any,
) -> bool:
    """Join the cluster at PELT_RAY_ADDRESS, or start a local Ray (loopback only, no dashboard, its temp
    folder private).

    Returns True when this call started Ray (`ray.shutdown()` then stops it), False when Ray was
    already initialised in this process or an existing cluster was joined. Token authentication
    stays on: a new local Ray turns it on and creates ~/.ray/auth_token if missing; joining by
    address turns it on here (Ray would not), so the token must be in RAY_AUTH_TOKEN or
    ~/.ray/auth_token. Only an explicit RAY_AUTH_MODE=disabled turns it off (with a warning). The token
    file is made 0600 (`private_ray_token`): whoever reads it can join the cluster and run code.
    """
    already = sys.modules.get("ray")
    if already is not None and already.is_initialized():
        return False
    settings = settings or get_settings()
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        log.warning(
            "RAY_AUTH_MODE=%s: Ray's token authentication is off; anyone who reaches the cluster's "
            "ports can run code on it",
            mode,
        )
    init_kwargs.setdefault("configure_logging", False)
    if settings.ray_address:
        if mode is None:
            require_token_auth()
        import ray

        ray.init(address=settings.ray_address, namespace=namespace, **init_kwargs)
        private_ray_token()
        return False
    loopback_only()
    import ray

    temp_dir = init_kwargs.pop("_temp_dir", None) or private_ray_temp_dir()
    # address="local": always a new local Ray, never one that happens to run on this machine already. Its
    # processes (and so every worker it starts) inherit WORKER_ENVIRONMENT: workers then need no runtime
    # env of their own, with which each would wait for a process started for that env while the worker
    # processes Ray starts ahead stay unused.
    with environment(WORKER_ENVIRONMENT):
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            namespace=namespace,
            _node_ip_address=LOOPBACK,
            _temp_dir=str(temp_dir),
            **init_kwargs,
        )
    _local_ray.update(session=ray.get_runtime_context().get_session_name(), environment=WORKER_ENVIRONMENT)
    private_tree(Path(temp_dir))
    private_ray_token()
    return True


_local_ray: dict[str, Any] = {}  # the local Ray `connect_ray` started last: its session and environment


def local_ray_environment() -> dict[str, str]:
    """The environment every process of the connected Ray inherited from its start, when `connect_ray`
    started it in this process; empty when this process joined a cluster or Ray was started otherwise."""
    import ray

    if not ray.is_initialized() or _local_ray.get("session") != ray.get_runtime_context().get_session_name():
        return {}
    return dict(_local_ray["environment"])


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """`variables` set in this process's environment (for the processes it starts meanwhile), then restored."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


PRIVATE_FOLDER_TRIES = (
    9  # pelt-ray-<uid>-1 ... -9: the next ones tried when pelt-ray-<uid> is not this user's
)


def private_ray_temp_dir() -> Path:
    """The folder for a local Ray's temp files: `ray` inside <temp folder>/pelt-ray-<uid>, a folder only
    this user may enter (0700), kept from start to start as Ray keeps /tmp/ray (its sessions' logs stay
    there, session_latest the newest).

    Ray makes the temp folder it is given, and every folder it creates there, readable and writable by
    everyone (0777), so the folder around it is what keeps other local users out of its sockets, logs
    and spilled objects. One that is not this user's own folder (another user's, a symbolic link) is not
    used: the next of pelt-ray-<uid>-1 ... -<PRIVATE_FOLDER_TRIES> that is (the same one at every start, so
    none piles up). The temp folder is RAY_TMPDIR where set (Ray's own variable), else the system's
    (TMPDIR); /tmp where that path is too long for Ray's Unix sockets (RAY_SOCKET_PATH_MAX_BYTES)."""
    name = f"pelt-ray-{os.geteuid()}"
    room = RAY_SOCKET_PATH_MAX_BYTES - len(RAY_SOCKET_SUFFIX) - len(f"/{name}-{PRIVATE_FOLDER_TRIES}/ray")
    system = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    base = Path(system if len(os.fsencode(system)) <= room else "/tmp")
    candidates = [name, *(f"{name}-{n}" for n in range(1, PRIVATE_FOLDER_TRIES + 1))]
    for candidate in candidates:
        folder = base / candidate
        with contextlib.suppress(FileExistsError):  # kept from an earlier start (checked below)
            folder.mkdir(mode=0o700)
        status = folder.lstat()
        if stat.S_ISDIR(status.st_mode) and status.st_uid == os.geteuid():
            if stat.S_IMODE(status.st_mode) != 0o700:
                folder.chmod(0o700)
            return folder / "ray"
        log.warning("%s is not this user's own folder: Ray's temp files go to another one", folder)
    raise RuntimeError(
        f"none of {', '.join(str(base / c) for c in candidates)} is this user's own folder: set RAY_TMPDIR "
        "to a folder of your own for Ray's temp files"
    )


def private_tree(top: Path) -> list[Path]:
    """Take group and other permissions off `top` and everything under it (symbolic links are left alone,
    never followed). Returns what was changed.

    For a local Ray's temp folder once it started: Ray makes its folders 0777 (those it makes later stay
    out of reach: the folder around them is 0700). Never fails the start: a file that vanished meanwhile
    is skipped, one that cannot be changed is a warning."""
    changed: list[Path] = []
    for path in _walk(top):
        try:
            status = path.lstat()
            if stat.S_ISLNK(status.st_mode) or not status.st_mode & 0o077:
                continue
            path.chmod(stat.S_IMODE(status.st_mode) & ~0o077)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot make %s private to its owner (%s)", path, exc)
            continue
        changed.append(path)
    return changed


def _walk(top: Path) -> Iterator[Path]:
    yield top
    for folder, subfolders, files in os.walk(top):  # never into a linked folder
        for name in (*subfolders, *files):
            yield Path(folder) / name


def private_ray_token() -> Path | None:
    """Make Ray's auth token file (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token) readable by its owner only.

    Ray writes it with the process's umask, 0644 by default, so any local user could read the token,
    join the cluster and run code as this service. Returns the file (None when there is none, e.g. the
    token came in RAY_AUTH_TOKEN). Never fails the start: a file missing or left as it was is a warning.
    """
    given = os.environ.get("RAY_AUTH_TOKEN_PATH")
    try:
        path = Path(given).expanduser() if given else _default_ray_token_path()
    except RuntimeError as exc:  # no home folder to expand
        log.warning("cannot tell where Ray's token file is (%s)", exc)
        return None
    if not path.is_file():
        token_auth = os.environ.get("RAY_AUTH_MODE", "token").lower() == "token"
        if token_auth and not os.environ.get("RAY_AUTH_TOKEN"):  # then Ray's token should be in a file
            log.warning(
                "no Ray token file at %s to make private (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token)", path
            )
        return None
    try:
        path.chmod(0o600)
    except OSError as exc:
        log.warning(
            "cannot make the Ray token file %s readable by its owner only (%s): other local users "
            "may read it and join the cluster",
            path,
            exc,
        )
        return None
    return path


def _default_ray_token_path() -> Path:
    """Where Ray keeps its token without RAY_AUTH_TOKEN_PATH: ~/.ray/auth_token, as Ray documents."""
    return Path.home() / ".ray" / "auth_token"


def loopback_only() -> None:
    """Make a Ray started from this process bind to 127.0.0.1 only (ports, node address, agents).

    Ray does so when RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, a switch it reads once, when `ray` is first
    imported; set here for this process and its children. Where `ray` was imported already, Ray's public
    `ray.util.get_node_ip_address()` tells whether it took effect: a RuntimeError when it did not (import
    ray after this, or set the variable in the environment). Not for a process that joins a remote
    cluster (the cluster must reach it at its own address).
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if "ray" not in sys.modules:
        return
    import ray.util

    address = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(address).is_loopback:
        raise RuntimeError(
            f"Ray was imported before pelt could bind it to {LOOPBACK} (it would use {address}): set "
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment, or import ray after connect_ray"
        )


def require_token_auth() -> None:
    """RAY_AUTH_MODE=token for this process and its children: Ray's documented switch, which it reads
    once, when `ray` is first imported (`ray.init(address=...)` would not turn it on). A RuntimeError
    when `ray` was imported before without it: Ray would go on without token authentication here."""
    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"
    if "ray" in sys.modules and (before or "").lower() != "token":
        raise RuntimeError(
            "Ray was imported before pelt could turn its token authentication on: set RAY_AUTH_MODE=token "
            "in the environment, or import ray after connect_ray"
        )
