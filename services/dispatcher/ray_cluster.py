"""Joining or starting the Ray cluster the dispatcher runs its workers on, with Ray's token authentication
kept on and a local Ray bound to loopback.

`connect_ray` joins PELT_RAY_ADDRESS, or starts a local Ray bound to 127.0.0.1 with the dashboard off.
Ray's token authentication stays on (RAY_AUTH_MODE=token unless set otherwise): a local Ray writes
~/.ray/auth_token; every process that joins a cluster needs the cluster's token, as RAY_AUTH_TOKEN or in
~/.ray/auth_token on its machine.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from services.settings import Settings, get_settings

log = logging.getLogger("pelt.dispatcher")


def connect_ray(
    settings: Settings | None = None,
    *,
    namespace: str = "pelt",
    num_cpus: int | None = None,
    **init_kwargs: Any,
) -> bool:
    """Join the cluster at PELT_RAY_ADDRESS, or start a local Ray (loopback only, no dashboard).

    Returns True when this call started Ray (`ray.shutdown()` then stops it), False when Ray was
    already initialised in this process or an existing cluster was joined. Token authentication
    stays on: a new local Ray turns it on and creates ~/.ray/auth_token if missing; joining by
    address turns it on here (Ray would not), so the token must be in RAY_AUTH_TOKEN or
    ~/.ray/auth_token. Only an explicit RAY_AUTH_MODE=disabled turns it off (with a warning). The token
    file is made 0600 (`private_ray_token`): whoever reads it can join the cluster and run code.
    """
    import ray

    if ray.is_initialized():
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
        ray.init(address=settings.ray_address, namespace=namespace, **init_kwargs)
        private_ray_token()
        return False
    loopback_only()
    # address="local": always a new local Ray, never one that happens to run on this machine already
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace=namespace, **init_kwargs)
    private_ray_token()
    return True


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
    """Where Ray keeps its token without RAY_AUTH_TOKEN_PATH: Ray's own answer where its (private) helper
    can be imported, else the documented default, ~/.ray/auth_token."""
    try:
        from ray._private.authentication.authentication_token_setup import _get_default_token_path

        return Path(_get_default_token_path())
    except (ImportError, AttributeError, TypeError):
        return Path.home() / ".ray" / "auth_token"


def loopback_only() -> None:
    """Make a Ray started from this process bind to 127.0.0.1 only (ports, node address, agents).

    Ray does so when RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, a switch it reads once, when `ray` is first
    imported; set here for child processes and, for a `ray` already imported, on Ray's constant too.
    Not for a process that joins a remote cluster (the cluster must reach it at its own address).
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def require_token_auth() -> None:
    """RAY_AUTH_MODE=token for this process and its children, and Ray's cached config refreshed
    (Ray reads the variable once, at import; `ray.init(address=...)` would not turn it on)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()
