"""Backbones a token holder can register: where they may come from, how they are shown, and loading
them off the API's request path.

- `locate_backbone`: a source is a packaged alias, or a model folder (or .gguf file) inside one of
  PELT_BACKBONE_DIRS, named relative to it or by an absolute path, resolved (symlinks too); nothing
  under PELT_DATA_DIR (where uploads land) ever is. A refusal is a 422 naming `source` that echoes only
  what the caller sent and lists nothing of the filesystem.
- `shown_source`: what users see of a registered source: the packaged alias or the folder relative to
  its allowed folder, never an absolute server path (the registry keeps the resolved path workers load).
- `SubprocessBackboneLoader`: registering a backbone loads it once for its content hash and facts; that
  runs in a child process (`services.sandbox`) under an address-space limit
  (PELT_BACKBONE_LOAD_MEMORY_BYTES) and a time limit (PELT_BACKBONE_LOAD_TIMEOUT_SECONDS), so a model
  too big for them fails there, as a 422, instead of taking the API down.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.registry.errors import RegistryValidationError
from services.sandbox import MEMORY_WORDS, run_in_child
from services.settings import Settings

MAX_MESSAGE_CHARS = 2000


@dataclass(frozen=True)
class BackboneSource:
    """A source the service accepted: `stored` is what the registry keeps and workers load (a packaged
    name or a resolved absolute path), `shown` what users see of it."""

    stored: str
    shown: str


@dataclass(frozen=True)
class LoadedBackbone:
    """What registering needs of a loaded backbone (`pelt_core.backbones.Backbone` has the same two)."""

    content_hash: str
    facts: dict[str, Any]


def _packaged() -> tuple[dict[str, Any], dict[str, str]]:
    from pelt_core.backbone_names import BACKBONE_ALIASES, PACKAGED_BACKBONES

    return PACKAGED_BACKBONES, BACKBONE_ALIASES


def _roots(settings: Settings) -> list[Path]:
    return [Path(folder).expanduser().resolve() for folder in settings.backbone_dirs]


def _forbidden(settings: Settings) -> list[Path]:
    """Folders no backbone may come from: the data directory (uploads, stores) and a local artifact root."""
    folders = [Path(settings.data_dir).expanduser().resolve()]
    artifacts = settings.mlflow_artifact_root.removeprefix("file://")
    if artifacts.startswith("/"):
        folders.append(Path(artifacts).resolve())
    return folders


def _is_model(path: Path) -> bool:
    return (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf")


def _relative_name(path: Path, root: Path) -> str:
    relative = path.relative_to(root).as_posix()
    return root.name if relative == "." else relative


def locate_backbone(source: str, settings: Settings) -> BackboneSource:
    """Where `source` may be loaded from, or a RegistryValidationError("source", ...)."""
    packaged, aliases = _packaged()
    if source in packaged or source in aliases:
        canonical = aliases.get(source, source)
        return BackboneSource(canonical, canonical)
    roots = _roots(settings)
    if not roots:
        raise RegistryValidationError(
            "source",
            f"{source!r} is not a packaged backbone ({', '.join(packaged)}); "
            "this service registers no model folders (an operator allows some with "
            "PELT_BACKBONE_DIRS)",
        )
    given = Path(source) if source.strip() and "\0" not in source else None
    candidates = [] if given is None else [given] if given.is_absolute() else [root / given for root in roots]
    forbidden = _forbidden(settings)
    for candidate in candidates:
        try:
            resolved = candidate.resolve()
        except (OSError, RuntimeError, ValueError):
            continue
        if any(resolved.is_relative_to(folder) for folder in forbidden):
            continue
        root = next((root for root in roots if resolved.is_relative_to(root)), None)
        if root is not None and _is_model(resolved):
            return BackboneSource(str(resolved), _relative_name(resolved, root))
    raise RegistryValidationError(
        "source",
        f"{source!r} is neither a packaged backbone ({', '.join(packaged)}) nor a model folder (with a "
        "config.json) or .gguf file inside the service's backbone folders (PELT_BACKBONE_DIRS); give its path "
        "relative to one of them",
    )


def shown_source(stored: str, settings: Settings) -> str:
    """What users see of a stored source: a packaged name as it is, a folder relative to its allowed
    folder, and of any other absolute path only its last part."""
    path = Path(stored)
    if not path.is_absolute():
        return stored
    for root in _roots(settings):
        if path.is_relative_to(root):
            return _relative_name(path, root)
    return path.name or "…"


def same_source(stored: str, other: str) -> bool:
    """Whether two stored sources name the same backbone (a packaged alias is its canonical name)."""
    _, aliases = _packaged()
    return aliases.get(stored, stored) == aliases.get(other, other)


def public_message(message: str, source: BackboneSource, settings: Settings) -> str:
    """A loader's message for the caller: the stored path as shown, other server folders elided."""
    message = message.replace(source.stored, source.shown)
    for folder in sorted({*_roots(settings), *_forbidden(settings)}, key=lambda p: -len(str(p))):
        message = message.replace(str(folder), "…")
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 1] + "…"


class SubprocessBackboneLoader:
    """source -> LoadedBackbone, loaded with `pelt_core.backbones.Backbone.load` in a child process
    under the settings' memory and time limits (read at each call). Failures are BackboneErrors."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def __call__(self, source: str) -> LoadedBackbone:
        from pelt_core.errors import BackboneError

        memory, timeout = (
            self.settings.backbone_load_memory_bytes,
            self.settings.backbone_load_timeout_seconds,
        )
        outcome = run_in_child(
            "backbone",
            {"source": source, "max_parameters": self.settings.max_backbone_parameters},
            memory_bytes=memory,
            timeout_seconds=timeout,
            environment={
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "CUDA_VISIBLE_DEVICES": "",
                "TOKENIZERS_PARALLELISM": "false",
            },
            write_files=True,  # transformers' imports need a usable temporary folder (tempfile writes to test it)
            warm_seconds=self.settings.sandbox_warm_seconds,
        )
        if outcome.timed_out:
            raise BackboneError(
                f"loading backbone {source!r} took longer than PELT_BACKBONE_LOAD_TIMEOUT_SECONDS "
                f"({timeout:g} s)"
            )
        answer = outcome.answer
        if answer is None:
            raise BackboneError(
                f"the process loading backbone {source!r} ended without an answer ({outcome.how_it_ended()})"
                + ("; it ran out of" if outcome.out_of_memory else "; it may have run past")
                + f" its memory limit, PELT_BACKBONE_LOAD_MEMORY_BYTES ({memory:,} bytes)"
            )
        if answer.get("memory"):
            raise BackboneError(
                f"loading backbone {source!r} needs more memory than PELT_BACKBONE_LOAD_MEMORY_BYTES "
                f"allows ({memory:,} bytes): {answer.get('error', '')}"
            )
        if "error" in answer:
            raise BackboneError(str(answer["error"]))
        return LoadedBackbone(content_hash=str(answer["content_hash"]), facts=dict(answer["facts"]))


# --- the child process (services.sandbox runs it under the memory limit) ------------------------------


def load_in_child(request: dict[str, Any], report: Any = None) -> dict[str, Any]:
    """Load one backbone: its content hash and facts, or the error (a BackboneError's message as it is)."""
    from pelt_core.backbones import Backbone, BackboneError

    try:
        backbone = Backbone.load(request["source"], max_parameters=request["max_parameters"])
    except BackboneError as exc:
        return {"error": str(exc), "memory": any(word in str(exc).lower() for word in MEMORY_WORDS)}
    return {"content_hash": backbone.content_hash, "facts": backbone.facts}


__all__ = [
    "BackboneSource",
    "LoadedBackbone",
    "SubprocessBackboneLoader",
    "locate_backbone",
    "public_message",
    "same_source",
    "shown_source",
]
