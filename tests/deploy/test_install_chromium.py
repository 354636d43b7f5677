"""deploy/install-chromium.sh, which `make test` runs before the browser tests: with the browser present it
does nothing; where it cannot install one it says how and lets the browser tests skip, unless the browser is
required (CI, PELT_REQUIRE_BROWSER=1, as .ci/run sets), where it exits 1 and the browser tests fail instead
of skipping. Run on a PATH of its own with stand-ins for `id` and `apt-get`, so nothing is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.api import browser
from tests.deploy.deployment_files import DEPLOY

SCRIPT = DEPLOY / "install-chromium.sh"
BASH = shutil.which("bash") or "/bin/bash"


def run_script(
    tmp_path: Path, *, root: bool, apt_works: bool, **variables: str
) -> subprocess.CompletedProcess:
    """The script as `root` (or not), with an apt-get stand-in that succeeds or fails; no CI variable."""
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir(exist_ok=True)
    for name, body in {
        "id": f"echo {0 if root else 1000}",
        "apt-get": "exit 0" if apt_works else "exit 100",
    }.items():
        (bin_folder / name).write_text(f"#!{BASH}\n{body}\n")
        (bin_folder / name).chmod(0o755)
    environment = {"PATH": str(bin_folder), "PELT_CHROMIUM": str(tmp_path / "no-chromium"), **variables}
    return subprocess.run([BASH, str(SCRIPT)], env=environment, capture_output=True, text=True, timeout=30)


def test_a_browser_that_is_there_is_left_alone(tmp_path):
    present = tmp_path / "chromium"
    present.write_text(f"#!{BASH}\n")
    present.chmod(0o755)
    done = run_script(tmp_path, root=True, apt_works=False, PELT_CHROMIUM=str(present))
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize("root", [True, False], ids=["apt-get-fails", "not-root"])
def test_without_a_browser_the_tests_skip_unless_one_is_required(tmp_path, root):
    optional = run_script(tmp_path, root=root, apt_works=False)
    assert optional.returncode == 0 and "the browser tests will skip" in optional.stderr, optional
    for required in ({"PELT_REQUIRE_BROWSER": "1"}, {"CI": "true"}):
        stopped = run_script(tmp_path, root=root, apt_works=False, **required)
        assert stopped.returncode == 1, (required, stopped)
        assert "the browser is required here" in stopped.stderr, stopped


def test_a_required_browser_that_is_missing_fails_the_browser_tests(tmp_path, monkeypatch):
    monkeypatch.setattr(browser, "CHROMIUM", tmp_path / "no-chromium")
    monkeypatch.setenv("PELT_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="PELT_REQUIRE_BROWSER=1"):
        next(browser.launch_chromium())
    monkeypatch.delenv("PELT_REQUIRE_BROWSER")
    with pytest.raises(pytest.skip.Exception, match="chromium"):
        next(browser.launch_chromium())
