"""AdapterFusion jobs before they are queued: their sources resolved in the delta store, checked, and the
job's method spec built (`pelt_core.methods.fusion`).

A source is a reference as `pelt pull` takes it: "sst2" (its best), "sst2@best-pfeiffer", "sst2/3". Each is
downloaded (its sha256 checked) to read its manifest: its method and the backbone it was trained on. Refused,
before anything is written: an unknown task or version (404), a multi-task bundle or a fusion as a source,
a method fusion cannot use (LoRA, prefix, UniPELT's gated mixture: the reason is named), sources of different
backbones, a backbone that is not theirs. The job records each source's task, version and sha256; its
worker fetches exactly those (`MlflowDeltaStore.fetch`) and fails if one has changed since."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pelt_core.delta_format import read_manifest
from pelt_core.methods import BUILTIN_METHODS
from pelt_core.methods.fusion import FusionError, Source, fusable_roles, fusion_method
from pelt_core.pulled import MULTI_TASK
from pelt_core.spec import MethodSpec, SpecError
from services.registry import JobRecord, Registry, RegistryValidationError
from services.registry.models import DEFAULT_JOB_DEVICE
from services.registry.presets import FUSION
from services.registry.validation import check_device, check_json_numbers

MAX_FUSION_SOURCES = 16  # the paper fuses 16 tasks' adapters
FIELD = "sources"


@dataclass(frozen=True)
class FusionPlan:
    """What a fusion job runs: the registered backbone of its sources and its method spec."""

    backbone: str
    spec: dict[str, Any]
    sources: list[Any]  # the sources' VersionInfo, in the order given


def plan_fusion(
    store: Any,
    registry: Registry,
    scratch: Path,
    sources: Sequence[str],
    backbone: str | None = None,
    own_adapter: bool = False,
) -> FusionPlan:
    """Resolve and check a fusion's sources (module docstring); RegistryValidationError names what is wrong."""
    refs = _check_refs(sources)
    infos = [store.get_version(ref) for ref in refs]  # DeltaNotFoundError (404) names an unknown one
    seen: dict[tuple[str, str], str] = {}
    for ref, info in zip(refs, infos, strict=True):
        earlier = seen.get((info.task, info.version))
        seen[(info.task, info.version)] = ref
        if earlier is not None:
            raise RegistryValidationError(
                FIELD, f"{ref!r} and {earlier!r} are the same delta ({info.task} version {info.version})"
            )
        if info.kind == MULTI_TASK:
            raise RegistryValidationError(
                FIELD,
                f"{ref!r} is a multi-task bundle ({info.task} version {info.version}); fuse task deltas",
            )
        if info.archived:
            raise RegistryValidationError(FIELD, f"{ref!r} ({info.task} version {info.version}) is archived")
        _refuse_by_method(info)  # before any download: a LoRA or `full` delta is refused by its method's name
    scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="fusion-", dir=scratch))
    try:
        manifests = [
            read_manifest(store.download(info.task, info.version, dest=folder / str(index)))
            for index, info in enumerate(infos)
        ]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    content_hash = _one_backbone(infos, manifests)
    name = _registered_backbone(registry, backbone, content_hash, manifests[0]["backbone"]["name"])
    try:
        spec = fusion_method(
            [
                Source(info.task, info.sha256, MethodSpec.from_dict(manifest["method"]), int(info.version))
                for info, manifest in zip(infos, manifests, strict=True)
            ],
            own_adapter=bool(own_adapter),
        )
    except (FusionError, SpecError) as exc:
        raise RegistryValidationError(FIELD, str(exc)) from None
    return FusionPlan(name, spec.to_dict(), infos)


def submit_fusion(
    registry: Registry,
    store: Any,
    scratch: Path,
    task: str,
    sources: Sequence[str],
    *,
    own_adapter: bool = False,
    backbone: str | None = None,
    hyperparameters: Mapping[str, Any] | None = None,
    seed: int = 0,
    k_shot: int | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    idempotency_key: str | None = None,
    device: str = DEFAULT_JOB_DEVICE,
) -> JobRecord:
    """Queue an AdapterFusion job on `task`: `sources` as `pelt pull` names deltas, on their backbone unless
    `backbone` names it; `own_adapter`: the target's own adapter trains alongside; the rest as
    `Registry.submit_job`. The task, the options and every source are checked before the job is written."""
    registry.get_task(task)
    check_json_numbers(hyperparameters)
    check_device(device)
    if not isinstance(own_adapter, bool):
        raise RegistryValidationError("own_adapter", f"must be true or false, got {own_adapter!r}")
    plan = plan_fusion(store, registry, scratch, sources, backbone, own_adapter)
    return registry.submit_job(
        task,
        FUSION,
        plan.backbone,
        hyperparameters,
        seed=seed,
        k_shot=k_shot,
        priority=priority,
        max_attempts=max_attempts,
        idempotency_key=idempotency_key,
        device=device,
        fusion_spec=plan.spec,
    )


def _refuse_by_method(info: Any) -> None:
    """A source whose method is a built-in preset fusion cannot use (or a fusion) is refused from its
    version's tags alone; other methods are read from the downloaded manifest."""
    if info.kind == "fusion":
        raise RegistryValidationError(
            FIELD, f"{info.task} version {info.version} is itself a fusion; fuse its sources directly instead"
        )
    if info.method in BUILTIN_METHODS:
        try:
            fusable_roles(BUILTIN_METHODS[info.method], f"source {info.task} version {info.version}")
        except FusionError as exc:
            raise RegistryValidationError(FIELD, str(exc)) from None


def _check_refs(sources: Any) -> list[str]:
    if isinstance(sources, str) or not isinstance(sources, Sequence):
        raise RegistryValidationError(FIELD, "a list of source deltas, e.g. ['sst2', 'mrpc@best-pfeiffer']")
    if not 1 <= len(sources) <= MAX_FUSION_SOURCES:
        raise RegistryValidationError(FIELD, f"1 to {MAX_FUSION_SOURCES} source deltas, got {len(sources)}")
    for ref in sources:
        if not isinstance(ref, str) or not ref:
            raise RegistryValidationError(
                FIELD, f"each source is a delta reference (task, task@alias, task/3), got {ref!r}"
            )
    return list(sources)


def _one_backbone(infos: Sequence[Any], manifests: Sequence[dict[str, Any]]) -> str:
    """The one backbone content hash of every source; RegistryValidationError listing them otherwise."""
    hashes = {manifest["backbone"]["content_hash"] for manifest in manifests}
    if len(hashes) == 1:
        return hashes.pop()
    listed = "; ".join(
        f"{info.task} version {info.version} on {m['backbone']['name']} ({m['backbone']['content_hash'][:12]}…)"
        for info, m in zip(infos, manifests, strict=True)
    )
    raise RegistryValidationError(FIELD, f"a fusion's sources share one backbone; these do not: {listed}")


def _registered_backbone(registry: Registry, asked: str | None, content_hash: str, trained_on: str) -> str:
    """The registered backbone the sources were trained on: `asked` when it is that one, else found by content
    hash; RegistryValidationError naming both backbones otherwise."""

    def hash_of(record: Any) -> str:
        return (record.content_hash or "").removeprefix("sha256:")

    if asked is not None:
        record = registry.get_backbone(asked)  # UnknownBackboneError (404) names the known ones
        if hash_of(record) != content_hash:
            raise RegistryValidationError(
                "backbone",
                f"the sources were trained on {trained_on} ({content_hash[:12]}…), not on backbone {asked!r} "
                f"({hash_of(record)[:12] or 'not loaded yet'}…); fuse them on their own backbone (leave backbone out)",
            )
        return asked
    for record in registry.list_backbones():
        if hash_of(record) == content_hash:
            return record.name
    raise RegistryValidationError(
        "backbone",
        f"the sources were trained on {trained_on} ({content_hash[:12]}…), which no registered backbone is now",
    )
