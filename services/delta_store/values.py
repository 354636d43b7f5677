"""The delta store's names and plain values: MLflow tags, aliases, name rules, and the values it hands out
(DeltaRef, VersionInfo, Composed). No mlflow or torch import."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from services.delta_store.errors import DeltaStoreError
from workers.job import StoredDelta

if TYPE_CHECKING:
    from pelt_core.model import JobDelta

ARTIFACT_PATH = "delta"  # a run's artifact folder holding the delta (or bundle) files
BEST = "best"
METHOD_ALIAS_PREFIX = "best-"

# tags (runs and model versions)
TAG_KIND = "pelt.kind"  # job | fusion | composed | multi_task | imported
TAG_JOB_ID = "pelt.job_id"
TAG_TASK = "pelt.task"
TAG_METHOD = "pelt.method"
TAG_BACKBONE = "pelt.backbone"
TAG_BACKBONE_HASH = "pelt.backbone_hash"
TAG_SHA256 = "pelt.delta_sha256"
TAG_SWEEP_ID = "pelt.sweep_id"
TAG_ATTEMPT = "pelt.attempt"
TAG_METRIC = "pelt.metric"
TAG_METRIC_VALUE = "pelt.metric_value"
TAG_ARTIFACT_PATH = "pelt.artifact_path"
TAG_OP = "pelt.composition.op"
TAG_SOURCES = "pelt.composition.sources"
TAG_ARCHIVED = "pelt.archived"  # "true" on a version an admin archived: never pulled by name or alias

NAMESPACE_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,49}$")
TASK_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")  # the registry's task names
# a name the store gives something new (a composition's `into`, a source's name in it): the registry's rule
# for task names (services.registry.validation.NAME_PATTERN), so no `.`, `..` or `-rf`
NEW_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")
REF_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,100}([@/][A-Za-z0-9_.-]{1,100})?$")  # task, task@alias, task/3
MAX_SHOWN_CHARS = 60  # of a refused value, quoted in its error message
# an alias MLflow takes: not "latest" and not v<digits> (its version references), any case
ALIAS_PATTERN = re.compile(r"^(?!(?i:latest|v[0-9]+)$)[A-Za-z0-9_-]{1,100}$")
MAX_PARAM_CHARS = 6000  # mlflow's limit on a param value
MAX_TAG_CHARS = 5000  # mlflow's limit on a model version tag value


@dataclass(frozen=True)
class DeltaRef:
    """Which delta of a task: its `best` alias (default), a method's best, an alias, or a version.

    As a string: "task" (best), "task@alias" (e.g. "sst2@best-lora"), "task/3" (version 3)."""

    task: str
    version: str | None = None
    method: str | None = None
    alias: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not TASK_PATTERN.fullmatch(self.task):
            raise DeltaStoreError(f"{self.task!r} is not a task name (letters, digits, '_', '.', '-')")
        if self.version is not None:
            object.__setattr__(self, "version", version_string(self.version))
        if sum(x is not None for x in (self.version, self.method, self.alias)) > 1:
            raise DeltaStoreError(
                f"pick one of version, method and alias for task {self.task!r}, not several"
            )

    @classmethod
    def parse(cls, ref: str | DeltaRef) -> DeltaRef:
        """A DeltaRef from "task", "task@alias" or "task/version" (a DeltaRef is returned as it is)."""
        if isinstance(ref, DeltaRef):
            return ref
        if not isinstance(ref, str):
            raise DeltaStoreError(f"a delta reference is a task name or a DeltaRef, got {ref!r}")
        if "@" in ref:
            task, alias = ref.split("@", 1)
            return cls(task, alias=alias)
        if "/" in ref:
            task, version = ref.split("/", 1)
            return cls(task, version=version)
        return cls(ref)

    def __str__(self) -> str:
        if self.version is not None:
            return f"{self.task}/{self.version}"
        if self.method is not None:
            return f"{self.task}@{method_alias(self.method)}"
        return f"{self.task}@{self.alias or BEST}"


@dataclass(frozen=True)
class VersionInfo:
    """One model version of a task, as the store sees it."""

    task: str
    model_name: str
    version: str
    kind: str  # job | fusion (an AdapterFusion job) | composed | multi_task | imported
    sha256: str | None
    run_id: str | None
    source: str
    job_id: int | None
    method: str | None
    metric: str | None
    metric_value: float | None
    aliases: tuple[str, ...]
    tags: dict[str, str]
    created_at: datetime
    archived: bool = False  # archived by an admin: pulled only by its version number

    @property
    def uri(self) -> str:
        """`models:/<model>/<version>`: what the registry's result row records as delta_uri."""
        return version_uri(self.model_name, self.version)


@dataclass(frozen=True)
class Composed:
    """A composition registered as a new version of `task`."""

    task: str
    version: str
    stored: StoredDelta
    provenance: dict[str, Any]
    delta: JobDelta | None = None  # the composed delta in memory (None for a multi-task bundle)
    sources: list[VersionInfo] = field(default_factory=list)


def method_alias(method: str) -> str:
    """The alias of a method's best version: `best-<method>` ('.' in a method name becomes '_':
    aliases allow letters, digits, '_' and '-')."""
    return METHOD_ALIAS_PREFIX + method.replace(".", "_")


def version_uri(model: str, version: str | int) -> str:
    """`models:/<model>/<version>`."""
    return f"models:/{model}/{version}"


def check_task(task: str) -> None:
    """DeltaStoreError unless `task` is a task name the registry could hold."""
    if not isinstance(task, str) or not TASK_PATTERN.fullmatch(task):
        raise DeltaStoreError(f"{task!r} is not a task name (letters, digits, '_', '.', '-'; at most 100)")


def check_new_name(value: object, field: str) -> str:
    """DeltaStoreError naming `field` unless `value` follows the registry's rule for task names: letters,
    digits, '_', '.', '-', starting with a letter or a digit, at most 100 characters."""
    if not isinstance(value, str) or not NEW_NAME_PATTERN.fullmatch(value):
        raise DeltaStoreError(
            f"{field}: {shown(value)} is not a valid name (letters, digits, '_', '.', '-', starting with a "
            "letter or digit; at most 100 characters)",
            field=field,
        )
    return value


def check_ref_text(value: object, field: str) -> None:
    """DeltaStoreError naming `field` unless `value` is a DeltaRef or reads as one: "task", "task@alias"
    or "task/3" of letters, digits, '_', '.', '-' (at most 100 characters each)."""
    if isinstance(value, DeltaRef):
        return
    problem = None if isinstance(value, str) and REF_PATTERN.fullmatch(value) else "letters, digits, _ . -"
    if problem is None:
        try:
            DeltaRef.parse(value)  # a version >= 1, a task name
        except DeltaStoreError as exc:
            problem = str(exc)
    if problem is not None:
        raise DeltaStoreError(
            f'{field}: {shown(value)} is not a delta reference ("task", "task@alias" or "task/3"; {problem})',
            field=field,
        )


def shown(value: object) -> str:
    """A refused value as its message quotes it: repr, cut to MAX_SHOWN_CHARS."""
    return clip(repr(value), MAX_SHOWN_CHARS)


def version_string(version: str | int) -> str:
    """A model version as MLflow names it ("3"); DeltaStoreError unless a whole number >= 1."""
    text = str(version)
    if isinstance(version, bool) or not text.isdigit() or int(text) < 1:
        raise DeltaStoreError(f"a model version is a whole number >= 1, got {version!r}")
    return str(int(text))


def resolve_ref(
    ref: str | DeltaRef, *, method: str | None, version: str | int | None, alias: str | None
) -> DeltaRef:
    """A reference plus the keyword form (`pull("sst2", method="lora")`): one DeltaRef; refuses both."""
    parsed = DeltaRef.parse(ref)
    if method is None and version is None and alias is None:
        return parsed
    if (parsed.version, parsed.method, parsed.alias) != (None, None, None):
        raise DeltaStoreError(
            f"{ref!r} already names a version or alias; do not also pass method/version/alias"
        )
    return DeltaRef(parsed.task, version=version, method=method, alias=alias)


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters (the last one an ellipsis) when longer."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


__all__ = [
    "BEST",
    "Composed",
    "DeltaRef",
    "VersionInfo",
    "check_new_name",
    "check_ref_text",
    "check_task",
    "method_alias",
    "resolve_ref",
    "version_string",
    "version_uri",
]
