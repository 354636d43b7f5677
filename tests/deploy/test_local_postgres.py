"""deploy/local-postgres.sh, which `make test` asks for the tests' PostgreSQL URL: it prints the URL of a server
that answers (starting Debian's cluster if it is down), fails loudly where PostgreSQL is installed but does
not come up, and, where none is installed, warns and prints nothing (the PostgreSQL tests then skip) unless
PostgreSQL is required (CI, PELT_REQUIRE_POSTGRES=1). Run against stand-ins for PostgreSQL's commands on a
PATH of their own, so that the machine's own server is neither used nor touched."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.deployment_files import DEPLOY

SCRIPT = DEPLOY / "local-postgres.sh"
URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
BASH = shutil.which("bash") or "/bin/bash"
CLUSTER_LINE = (
    "15 main 5432 down postgres /var/lib/postgresql/15/main /var/log/postgresql/postgresql-15-main.log"
)


class Machine:
    """A PATH with the script's ordinary tools and stand-ins for PostgreSQL's commands, and a flag file that
    says whether the stand-in server is up."""

    def __init__(self, folder: Path) -> None:
        self.bin = folder / "bin"
        self.bin.mkdir()
        self.up = folder / "server-is-up"
        self.calls = folder / "calls"
        for tool in ("awk", "seq", "sleep"):
            found = shutil.which(tool)
            assert found, tool
            (self.bin / tool).symlink_to(found)
        self.command("pg_isready", f'[ -e "{self.up}" ]')  # the client tools are installed

    def command(self, name: str, body: str) -> None:
        path = self.bin / name
        path.write_text(f'#!{BASH}\necho "{name} $*" >> "{self.calls}"\n{body}\n')
        path.chmod(0o755)

    def debian_cluster(self, *, starts: bool) -> None:
        """Debian's PostgreSQL with a cluster on 5432, stopped; `pg_ctlcluster start` brings it up or fails."""
        self.command("pg_lsclusters", f'echo "{CLUSTER_LINE}"')
        start = f': > "{self.up}"' if starts else 'echo "Error: could not bind IPv4 address" >&2; exit 1'
        self.command("pg_ctlcluster", f'if [ "$4" = start ]; then {start}; else exit 3; fi')

    def run(self, **environment: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [BASH, str(SCRIPT)],
            env={"PATH": str(self.bin), **environment},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def called(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    return Machine(tmp_path)


def test_a_server_that_answers_gets_its_url_printed(machine):
    machine.up.touch()
    result = machine.run(CI="true", PELT_REQUIRE_POSTGRES="1")
    assert (result.returncode, result.stdout) == (0, URL + "\n"), result.stderr


def test_a_stopped_debian_cluster_is_started(machine):
    machine.debian_cluster(starts=True)
    result = machine.run()
    assert (result.returncode, result.stdout) == (0, URL + "\n"), result.stderr
    assert "pg_ctlcluster --skip-systemctl-redirect 15 main start" in machine.called()


@pytest.mark.parametrize("environment", [{}, {"CI": "false"}])
def test_without_postgresql_it_warns_and_prints_nothing_so_the_tests_skip(machine, environment):
    result = machine.run(**environment)
    assert (result.returncode, result.stdout) == (0, "")
    assert "warning: no PostgreSQL is installed" in result.stderr
    assert "apt-get install -y postgresql" in result.stderr and "PELT_TEST_DATABASE_URL" in result.stderr


@pytest.mark.parametrize("environment", [{"CI": "true"}, {"PELT_REQUIRE_POSTGRES": "1"}])
def test_without_postgresql_where_it_is_required_it_fails(machine, environment):
    result = machine.run(**environment)
    assert (result.returncode, result.stdout) == (1, "")
    assert "no PostgreSQL is installed" in result.stderr and "is required here" in result.stderr


def test_an_installed_cluster_that_does_not_start_fails_saying_why(machine):
    machine.debian_cluster(starts=False)
    result = machine.run()  # not required: an installed server that is down is a failure all the same
    assert (result.returncode, result.stdout) == (1, "")
    assert "could not bind IPv4 address" in result.stderr
    assert "pg_ctlcluster 15 main start" in result.stderr and "/var/log/postgresql/" in result.stderr


def test_another_installed_server_that_does_not_answer_fails(machine):
    machine.command("postgres", "exit 0")  # a server on PATH that this script does not know how to start
    result = machine.run()
    assert (result.returncode, result.stdout) == (1, "")
    assert "installed but nothing answers on 127.0.0.1:5432" in result.stderr
    assert "pg_ctlcluster" not in " ".join(machine.called())
