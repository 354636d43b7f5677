"""Write pelt's lock files (`make lock`): one hashed resolution of pyproject.toml for every install.

    deploy/lock/dev.txt          pyproject's dependencies and its dev extra: `make install`
    deploy/lock/runtime.txt      pyproject's dependencies: every image (deploy/Dockerfile), CPU and CUDA
    deploy/lock/torch-cpu.txt    torch 2.13.0's CPU build (hashed)
    deploy/lock/torch-cu130.txt  torch 2.13.0's CUDA 13.0 build and its CUDA libraries (hashed; PyPI's Linux
                                 wheel is that build)
    deploy/lock/torch-cu128.txt  torch 2.13.0's CUDA 12.8 build, from PyTorch's cu128 index (hashed only
                                 where this script could reach that index: `--torch-indexes`)

The resolution is for the platform every install runs on: Linux x86_64 (manylinux 2.28), CPython 3.11 (the
image's base, `python:3.11-slim`, and CI's). `runtime.txt` is resolved with `dev.txt` as its constraints, so a
package in both has one version and one set of hashes. torch is left out of both (its dependencies are
resolved as the CPU build declares them: deploy/lock/uv.toml) and installed from its variant's file.
Versions already locked stay unless `--upgrade` (everything) or `--upgrade-package NAME`.

    python deploy/lock.py                      relock after a change to pyproject.toml or constraints.txt
    python deploy/lock.py --upgrade            newest versions pyproject.toml allows
    python deploy/lock.py --torch-cpu-wheel torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    python deploy/lock.py --torch-indexes      torch-cpu.txt and torch-cu128.txt from PyTorch's indexes

It needs uv (in the dev extra) and PyPI; nothing else reads the network.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "deploy" / "lock"
TORCH_VERSION = "2.13.0"
PYTHON_VERSION = "3.11"
PLATFORM = "x86_64-manylinux_2_28"
TORCH_INDEXES = {
    "cpu": "https://download.pytorch.org/whl/cpu",
    "cu128": "https://download.pytorch.org/whl/cu128",
}
HEADER = "# Written by deploy/lock.py (make lock); do not edit by hand. Linux x86_64, CPython 3.11.\n"
_PACKAGE_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==")


def uv() -> str:
    from uv import find_uv_bin

    return find_uv_bin()


def compile_lock(inputs: list[Path] | list[str], out: Path, *extra: str) -> None:
    """`uv pip compile` the inputs into `out`, hashed, for the locked platform."""
    command = [
        uv(),
        "pip",
        "compile",
        *map(str, inputs),
        "--python-version",
        PYTHON_VERSION,
        "--python-platform",
        PLATFORM,
        "--generate-hashes",
        "--no-header",
        "--quiet",
        "-o",
        str(out),
        *extra,
    ]
    subprocess.run(command, check=True, cwd=ROOT)
    out.write_text(HEADER + out.read_text())


def locked_names(path: Path) -> set[str]:
    """The normalised names of the packages a lock file pins."""
    names = set()
    for line in path.read_text().splitlines():
        match = _PACKAGE_LINE.match(line)
        if match:
            names.add(re.sub(r"[-_.]+", "-", match.group(1)).lower())
    return names


def without_packages(path: Path, names: set[str]) -> str:
    """The lock file's text less the blocks (pin, hashes, `# via` comments) of `names`."""
    kept, skipping = [], False
    for line in path.read_text().splitlines(keepends=True):
        match = _PACKAGE_LINE.match(line)
        if match:
            skipping = re.sub(r"[-_.]+", "-", match.group(1)).lower() in names
        elif not line.startswith((" ", "#")) and line.strip():
            skipping = False
        if not skipping:
            kept.append(line)
    return "".join(kept)


def lock_cuda_130(upgrade: list[str]) -> None:
    """torch from PyPI (its Linux wheel is the CUDA 13.0 build) with the CUDA libraries it pulls, less what
    runtime.txt already pins (every image installs that first)."""
    out = LOCK / "torch-cu130.txt"
    with tempfile.TemporaryDirectory() as scratch:
        full = Path(scratch) / "torch-full.txt"
        if out.exists():
            full.write_text(out.read_text())  # keep its versions
        compile_lock(
            ["deploy/lock/torch-cu130.in"], full, "--no-config", "-c", "deploy/lock/dev.txt", *upgrade
        )
        dev_only = locked_names(LOCK / "dev.txt") - locked_names(LOCK / "runtime.txt")
        if dev_only & locked_names(full):  # an image (runtime.txt) would lack them: install --no-deps
            sys.exit(f"torch's CUDA build needs {sorted(dev_only & locked_names(full))}, locked for dev only")
        out.write_text(without_packages(full, locked_names(LOCK / "runtime.txt")))
    if not any(name.startswith("nvidia-cuda-runtime") for name in locked_names(out)):
        sys.exit(f"{out}: PyPI's torch {TORCH_VERSION} pulled no CUDA runtime: is it still the CUDA build?")


def lock_torch_wheel(wheel: Path) -> None:
    """torch-cpu.txt from a downloaded CPU wheel (the hash of that file)."""
    if not re.fullmatch(
        rf"torch-{re.escape(TORCH_VERSION)}\+cpu-cp311-cp311-manylinux.*_x86_64\.whl", wheel.name
    ):
        sys.exit(f"{wheel.name} is not torch {TORCH_VERSION}'s CPU wheel for CPython 3.11 on Linux x86_64")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (LOCK / "torch-cpu.txt").write_text(
        f"{HEADER}# torch's CPU build (PyTorch's CPU index; its dependencies are in runtime.txt)\n"
        f"torch=={TORCH_VERSION}+cpu \\\n    --hash=sha256:{digest}\n"
    )


def lock_from_torch_index(variant: str) -> None:
    """torch-<variant>.txt from PyTorch's index for it (run where that index can be reached)."""
    out = LOCK / f"torch-{variant}.txt"
    with tempfile.TemporaryDirectory() as scratch:
        full = Path(scratch) / "torch-full.txt"
        compile_lock(
            [f"deploy/lock/torch-{variant}.in"],
            full,
            "--no-config",
            "--index-url",
            TORCH_INDEXES[variant],
            "--index-strategy",
            "unsafe-best-match",
            "-c",
            "deploy/lock/dev.txt",
        )
        out.write_text(without_packages(full, locked_names(LOCK / "runtime.txt")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upgrade", action="store_true", help="take the newest versions pyproject allows")
    parser.add_argument("--upgrade-package", action="append", default=[], metavar="NAME")
    parser.add_argument("--torch-cpu-wheel", type=Path, help="write torch-cpu.txt from this downloaded wheel")
    parser.add_argument("--torch-indexes", action="store_true", help="torch-cpu/cu128 from PyTorch's indexes")
    options = parser.parse_args(argv)
    upgrade = ["--upgrade"] if options.upgrade else []
    upgrade += [f"--upgrade-package={name}" for name in options.upgrade_package]
    config = ["--config-file", "deploy/lock/uv.toml", "--no-emit-package", "torch", "-c", "constraints.txt"]
    inputs = ["pyproject.toml", "deploy/lock/extra.in"]  # relative: the files' `# via` comments name them
    compile_lock(inputs, LOCK / "dev.txt", "--extra", "dev", *config, *upgrade)
    compile_lock(inputs, LOCK / "runtime.txt", *config, "-c", "deploy/lock/dev.txt")
    lock_cuda_130(upgrade)
    if options.torch_cpu_wheel:
        lock_torch_wheel(options.torch_cpu_wheel)
    if options.torch_indexes:
        for variant in TORCH_INDEXES:
            lock_from_torch_index(variant)


if __name__ == "__main__":
    main()
