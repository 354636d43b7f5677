"""ARCHITECTURE.md is the newcomer's map: every module it names exists, and every module of the three
layers is on it (a new module without a line there fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAP = (ROOT / "ARCHITECTURE.md").read_text()
LAYERS = ("pelt_core", "workers", "services")


def named_paths() -> set[str]:
    """Paths as the map writes them: `a/b.py`, a package `a/b/` (it covers its modules) and, in a row that
    also names a folder, bare names that folder holds (`sink.py` … in `services/delta_store/`)."""
    paths: set[str] = set()
    for line in MAP.splitlines():
        cells = [
            c for c in re.findall(r"`([^`]+)`", line) if " " not in c and ("/" in c or c.endswith(".py"))
        ]
        bare = [cell for cell in cells if "/" not in cell]
        folders = [cell for cell in cells if cell.endswith("/")]
        for cell in cells:
            if "/" in cell and not (bare and cell in folders):
                paths.add(cell)
        paths.update(folder + name for folder in folders for name in bare)
    return paths


def test_every_module_the_map_names_exists() -> None:
    missing = []
    for path in sorted(named_paths()):
        if "<" in path or "*" in path:  # a pattern such as routes/<resource>.py or compose_*.py
            pattern = re.sub(r"<[^>]+>", "*", path)
            if not list(ROOT.glob(pattern)):
                missing.append(path)
        elif not (ROOT / path.rstrip("/")).exists():
            missing.append(path)
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_module_is_on_the_map() -> None:
    named = named_paths()
    patterns = [re.sub(r"<[^>]+>", "*", p) for p in named if "<" in p or "*" in p]
    unlisted = []
    for layer in LAYERS:
        for module in sorted((ROOT / layer).rglob("*.py")):
            relative = module.relative_to(ROOT).as_posix()
            if module.name == "__init__.py" or "/methods/" in relative:
                continue
            in_package = any(p.endswith("/") and relative.startswith(p) for p in named)
            if relative in named or in_package or any(Path(relative).match(p) for p in patterns):
                continue
            unlisted.append(relative)
    assert not unlisted, f"modules missing from ARCHITECTURE.md: {unlisted}"
