"""PELT_DATA_DIR as deployed: a directory the service owns is made 0700 at start-up (its stores' files 0600); a
volume it does not own (NFS, EFS or Filestore, where a pod's fsGroup sets the group but not the owner) is
used as it is, with a warning, when the service can read, write and enter it, and refused with a message
naming the directory, its owner and mode, and the service's user when it cannot. The API starts as uid 10001
on such a volume."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import services.filemodes as filemodes
from services.delta_store.testing import free_port
from services.filemodes import DataDirError, secure_data_dir
from tests.workers.conftest import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from soak_hosts import SERVICE_GID, SERVICE_UID, as_service_user

OTHER_UID = SERVICE_UID + 1  # the volume's owner: not the service's user


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_data_directory_the_service_owns_is_made_private(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    (data / "registry.db").write_text("")
    (data / "registry.db").chmod(0o644)
    secure_data_dir(data)
    assert (mode(data), mode(data / "registry.db")) == (0o700, 0o600)


def test_a_volume_owned_by_another_user_is_used_as_it_is_with_a_warning(
    tmp_path, monkeypatch, caplog
) -> None:
    data = tmp_path / "volume"
    data.mkdir()
    data.chmod(0o770)
    (data / "registry.db").write_text("")
    (data / "registry.db").chmod(0o640)
    monkeypatch.setattr(filemodes.os, "geteuid", lambda: OTHER_UID)  # the service is not the owner here
    with caplog.at_level(logging.WARNING, "pelt.serve"):
        secure_data_dir(data)
    assert (mode(data), mode(data / "registry.db")) == (0o770, 0o640)  # not its own: nothing changed
    assert f"PELT_DATA_DIR {data} (owner uid {os.getuid()}" in caplog.text and "mode 0770" in caplog.text


def test_a_volume_the_service_cannot_write_is_refused_naming_what_is_wrong(tmp_path, monkeypatch) -> None:
    data = tmp_path / "volume"
    data.mkdir(mode=0o755)
    monkeypatch.setattr(filemodes.os, "geteuid", lambda: OTHER_UID)
    monkeypatch.setattr(filemodes.os, "access", lambda path, how, **ids: False)
    with pytest.raises(DataDirError) as error:
        secure_data_dir(data)
    message = str(error.value)
    assert str(data) in message and f"uid {OTHER_UID}" in message and "mode 0755" in message
    assert "fsGroup" in message


@pytest.fixture
def volume() -> Iterator[Path]:
    """A folder other users can enter (pytest's own are 0700), holding a volume owned by another user and
    group-writable by the service's group, as a pod's fsGroup leaves it, and the service's home."""
    if os.geteuid() != 0:
        why = "making folders of other users needs root"
        if os.environ.get("PELT_REQUIRE_ROOT") == "1":
            pytest.fail(f"{why} (PELT_REQUIRE_ROOT=1 is set)")
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="pelt-volume-"))
    root.chmod(0o755)
    data, home = root / "data", root / "home"
    data.mkdir()
    home.mkdir()
    os.chown(data, OTHER_UID, SERVICE_GID)
    data.chmod(0o2770)  # setgid, as fsGroup leaves it: new files keep the group
    os.chown(home, SERVICE_UID, SERVICE_GID)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow  # `pelt serve` as a process
def test_the_api_starts_as_uid_10001_on_a_volume_owned_by_another_user(volume: Path) -> None:
    data, port = volume / "data", free_port()
    venv_bin = Path(sys.executable).parent
    env = {
        "PATH": f"{venv_bin}:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(volume / "home"),
        "LANG": "C.UTF-8",
        "HF_HUB_OFFLINE": "1",
        "PELT_DATA_DIR": str(data),
    }
    command = ["pelt", "serve", "--no-dispatcher", "--host", "127.0.0.1", "--port", str(port)]
    log = volume / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            as_service_user(command), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:

        def healthy() -> bool:
            assert server.poll() is None, f"pelt serve exited:\n{log.read_text()[-4000:]}"
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as answer,
            ):
                return answer.status == 200
            return False

        wait_for(healthy, 180, "the API to answer as uid 10001")
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    info = data.stat()
    assert (info.st_uid, info.st_gid, mode(data)) == (OTHER_UID, SERVICE_GID, 0o2770)  # left as it was
    assert "is not this process's (uid 10001)" in log.read_text()
    registry = data / "registry.db"
    assert (registry.stat().st_uid, mode(registry)) == (SERVICE_UID, 0o600)  # its own files still private
