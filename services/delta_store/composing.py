"""Composing stored deltas (merge, average, merge_lora_svd, a multi-task bundle) into a new version, and
registering a delta folder made outside the service. The math is `pelt_core.compose`; this part checks the
request, pulls the inputs and composes them (in this process, or for the service in a child process within
`compose_child.ComposeLimits`), and writes the result as a run and a model version tagged with its
provenance, all or nothing."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pelt_core.delta_format import (
    BUNDLE_ROUTE_PATTERN,
    DeltaError,
    read_bundle,
    read_manifest,
    sha256_mismatch,
)
from pelt_core.pulled import MULTI_TASK, PulledModel
from pelt_core.vocabulary import COMPOSE_OPERATIONS
from services.delta_store.aliases import check_alias
from services.delta_store.base import read_delta_folder
from services.delta_store.compose_child import (
    ComposeLimits,
    check_compose_budget,
    dense_lora_bytes,
    run_compose_child,
)
from services.delta_store.errors import DeltaStoreError
from services.delta_store.reading import ReadMixin, _run_artifact
from services.delta_store.sink import SinkMixin, param_value
from services.delta_store.values import (
    ARTIFACT_PATH,
    MAX_TAG_CHARS,
    TAG_ARTIFACT_PATH,
    TAG_BACKBONE,
    TAG_BACKBONE_HASH,
    TAG_KIND,
    TAG_METHOD,
    TAG_OP,
    TAG_SHA256,
    TAG_SOURCES,
    TAG_TASK,
    Composed,
    DeltaRef,
    VersionInfo,
    check_new_name,
    check_ref_text,
    check_task,
    clip,
    version_uri,
)
from workers.job import StoredDelta

TENSOR_SUFFIX = ".safetensors"  # a delta's tensor file (a bundle holds one per route)
MAX_ARTIFACT_LISTINGS = 100  # folders listed to size one version (a bundle: its tasks/<route>/ folders)

if TYPE_CHECKING:
    from pelt_core.backbones import Backbone
    from pelt_core.delta import SavedDelta
    from pelt_core.model import JobDelta


class ComposeMixin(SinkMixin, ReadMixin):
    """`compose` and `register`: versions that no job trained."""

    def compose(
        self,
        op: str,
        sources: Sequence[str | DeltaRef] | Mapping[str, str | DeltaRef],
        *,
        into: str,
        backbone: Backbone | Callable[[str], Backbone] | None = None,
        aliases: Sequence[str] = (),
        description: str = "",
        on_written: Callable[[StoredDelta], None] | None = None,
        limits: ComposeLimits | None = None,
        **options: Any,
    ) -> Composed:
        """Pull deltas, compose them with pelt_core.compose and register the result as a new version of
        task `into` (a run in its experiment + a model version tagged with the provenance).

        op: merge (options: weights, how=linear|ties|dare, density, seed, scale, combine, lora_rank),
        average (lora_rank), merge_lora_svd (weights, rank), multi_task (a bundle of task deltas on one
        backbone: sources maps each route name to a delta; pulled back it is a MultiTaskModel).
        aliases: set on the new version (e.g. ["soup"]); `best`/`best-*` of a registry task are the
        registry's to set and are refused here. on_written: called with the new version once it and its
        aliases are written, inside the all-or-nothing step (the service records its audit event there):
        if it raises, the version is taken back. limits: compute it in a child process within these bounds
        (the service's; `compose_child`: refused from an estimate before anything is downloaded; the
        result's `delta` is then None); without, it is pulled and composed in this process."""
        check_compose_request(op, sources, into, aliases, options)  # before anything is pulled or written
        named = self._named_sources(sources, bundle=op == MULTI_TASK)
        with tempfile.TemporaryDirectory(prefix="pelt-compose-") as scratch:
            if limits is None:
                made = self._compose_here(op, named, backbone, options, Path(scratch) / "delta")
            else:
                made = self._compose_in_child(op, named, options, limits, Path(scratch))
            inputs = [
                {"name": n, "task": info.task, "version": info.version, "sha256": info.sha256}
                for n, info in made.sources.items()
            ]
            tags = {
                TAG_KIND: MULTI_TASK if op == MULTI_TASK else "composed",
                TAG_TASK: into,
                TAG_METHOD: made.method,
                TAG_BACKBONE: made.backbone_name,
                TAG_BACKBONE_HASH: made.backbone_hash,
                TAG_SHA256: made.sha256,
                TAG_OP: str(made.provenance.get("op", op)),
                TAG_SOURCES: clip(json.dumps(inputs, separators=(",", ":")), MAX_TAG_CHARS),
                TAG_ARTIFACT_PATH: ARTIFACT_PATH,
            }
            params = {
                "op": op,
                "sources": json.dumps([str(ref) for ref in named.values()]),
                **{k: json.dumps(v) for k, v in options.items()},
            }
            text = description or f"{tags[TAG_OP]} of " + ", ".join(
                f"{s['task']}/{s['version']}" for s in inputs
            )
            stored = self._write_composition(
                into, made.folder, tags, params, text, made.provenance, aliases, on_written
            )
        return Composed(
            into, str(stored.model_version), stored, made.provenance, made.delta, list(made.sources.values())
        )

    def register(
        self,
        task: str,
        delta_dir: str | Path,
        *,
        aliases: Sequence[str] = (),
        description: str = "",
        tags: Mapping[str, str] | None = None,
    ) -> StoredDelta:
        """Register a delta folder made outside the service (e.g. `pelt train --out`) as a new version
        of `task` (kind imported; a run holds its artifact)."""
        check_task(task)
        folder = Path(delta_dir)
        manifest, sha = read_delta_folder(folder)
        all_tags = {
            TAG_KIND: "imported",
            TAG_TASK: task,
            TAG_METHOD: str(manifest["method"].get("name")),
            TAG_BACKBONE: str(manifest["backbone"]["name"]),
            TAG_BACKBONE_HASH: manifest["backbone"]["content_hash"],
            TAG_SHA256: sha,
            TAG_ARTIFACT_PATH: ARTIFACT_PATH,
            **(tags or {}),
        }
        stored = self._register_folder(
            task, folder, all_tags, {}, description or f"imported {folder.name}", "import"
        )
        self._set_aliases(task, stored, aliases)
        return stored

    # --- internals -------------------------------------------------------------------------------

    def _compose_here(
        self,
        op: str,
        named: Mapping[str, DeltaRef],
        backbone: Backbone | Callable[[str], Backbone] | None,
        options: dict[str, Any],
        out: Path,
    ) -> _Made:
        """Pull the sources and compose them in this process (a library call's way)."""
        pulled = {name: self.pull(ref, backbone=backbone) for name, ref in named.items()}
        saved, method, provenance, delta = compose_pulled(op, pulled, options, out)
        first = next(iter(pulled.values()))
        return _Made(
            out,
            saved.sha256,
            method,
            provenance,
            first.manifest["backbone"]["name"],
            first.backbone.content_hash,
            {name: p.info for name, p in pulled.items()},
            delta,
        )

    def _compose_in_child(
        self,
        op: str,
        named: Mapping[str, DeltaRef],
        options: dict[str, Any],
        limits: ComposeLimits,
        scratch: Path,
    ) -> _Made:
        """Compose in a child process within `limits` (the steps: `compose_child`'s docstring): the
        estimate from the stored sizes first, then the downloads into `scratch`, the estimate again from
        the files, the child; its result lies in `scratch`/delta, checked against the sha256 it reported."""
        infos = {name: self.get_version(ref) for name, ref in named.items()}
        _one_backbone_of(infos)
        check_compose_budget(op, options, {n: self._stored_bytes(i) for n, i in infos.items()}, limits)
        folders = {
            name: self._download(info, scratch / "sources" / str(index))
            for index, (name, info) in enumerate(infos.items())
        }
        manifests, dense = {}, {}
        for name, folder in folders.items():
            manifests[name], dense[name] = _read_source(name, infos[name], folder)
        stored = {name: _tensor_bytes(folder) for name, folder in folders.items()}
        check_compose_budget(op, options, stored, limits, dense)
        backbone = _one_manifest_backbone(manifests)
        out = scratch / "delta"
        request = {
            "op": op,
            "options": options,
            "backbone": {
                key: backbone.get(key)
                for key in (
                    "name",
                    "content_hash",
                    "model_type",
                    "num_layers",
                    "hidden_size",
                    "num_parameters",
                )
            },
            "sources": [
                {
                    "name": name,
                    "folder": str(folders[name]),
                    "task": info.task,
                    "version": info.version,
                    "kind": info.kind,
                    "sha256": info.sha256,
                }
                for name, info in infos.items()
            ],
            "out": str(out),
        }
        answer = run_compose_child(request, limits)
        problem = sha256_mismatch(out, str(answer["sha256"]), bundle=op == MULTI_TASK)
        if problem is not None:
            raise DeltaStoreError(f"the composed delta does not match what its process reported: {problem}")
        provenance = answer["provenance"]
        return _Made(
            out,
            str(answer["sha256"]),
            str(answer["method"]),
            provenance if isinstance(provenance, dict) else {},
            str(backbone["name"]),
            str(backbone["content_hash"]),
            infos,
            None,
        )

    def _stored_bytes(self, info: VersionInfo) -> int:
        """The bytes of a version's tensor files (`.safetensors`) as MLflow's artifact listing records
        them, without downloading anything (0 for a file the listing gives no size)."""
        run_id, path = _run_artifact(info)
        total, pending = 0, [path]
        for _ in range(MAX_ARTIFACT_LISTINGS):
            if not pending:
                break
            for item in self.client.list_artifacts(run_id, pending.pop()):
                if item.is_dir:
                    pending.append(item.path)
                elif item.path.endswith(TENSOR_SUFFIX):
                    total += int(item.file_size or 0)
        return total

    def _write_composition(
        self,
        into: str,
        folder: Path,
        tags: dict[str, str],
        params: Mapping[str, Any],
        description: str,
        provenance: dict[str, Any],
        aliases: Sequence[str],
        on_written: Callable[[StoredDelta], None] | None,
    ) -> StoredDelta:
        """The composed folder as a version of `into` with its aliases, then `on_written`; all or nothing:
        a failure once the version exists takes it back (and the registered model made for it)."""
        new_model = not self._model_exists(into)
        stored = None
        try:
            stored = self._register_folder(
                into,
                folder,
                tags,
                params,
                description,
                f"compose-{params['op']}",
                extra_artifacts={"provenance.json": provenance},
            )
            self._set_aliases(into, stored, aliases)
            if on_written is not None:
                on_written(stored)
        except BaseException:
            self._take_back(into, stored, new_model)
            raise
        return stored

    def _register_folder(
        self,
        task: str,
        folder: Path,
        tags: dict[str, str],
        params: Mapping[str, Any],
        description: str,
        run_name: str,
        extra_artifacts: Mapping[str, Any] | None = None,
    ) -> StoredDelta:
        """A run holding `folder` as its delta artifact, then a model version of it (composed, imported)."""
        from mlflow.entities import Param

        model = self._ensure_model(task)
        experiment_id = self._ensure_experiment(task)
        run = self.client.create_run(
            experiment_id, run_name=run_name, tags={k: v for k, v in tags.items() if k != TAG_SHA256}
        )
        run_id = run.info.run_id

        def log_files() -> None:
            self._log_batch(run_id, [Param(k, param_value(v)) for k, v in params.items()], [])
            self.client.log_artifacts(run_id, str(folder), ARTIFACT_PATH)
            for name, value in (extra_artifacts or {}).items():
                self.client.log_dict(run_id, value, name)

        self._finish_run(run_id, tags[TAG_SHA256], log_files)
        version = self._create_version(model, run_id, tags, description)
        return StoredDelta(version_uri(model, version), tags[TAG_SHA256], run_id, version)

    def _set_aliases(self, task: str, stored: StoredDelta, aliases: Sequence[str]) -> None:
        for name in aliases:
            self.client.set_registered_model_alias(self.model_name(task), name, stored.model_version)

    def _take_back(self, task: str, stored: StoredDelta | None, new_model: bool) -> None:
        """Undo a composition's writes after a failure: its model version and run, and the registered
        model when the composition created it (best effort: the failure itself is what the caller sees)."""
        model = self.model_name(task)
        if stored is not None:
            with contextlib.suppress(Exception):
                self.client.delete_model_version(model, str(stored.model_version))
            if stored.run_id:
                with contextlib.suppress(Exception):
                    self.client.delete_run(stored.run_id)
        if new_model:
            with contextlib.suppress(Exception):
                if not self.client.search_model_versions(f"name = '{model}'"):
                    self.client.delete_registered_model(model)

    def _named_sources(
        self, sources: Sequence[str | DeltaRef] | Mapping[str, str | DeltaRef], bundle: bool
    ) -> dict[str, DeltaRef]:
        if isinstance(sources, str | DeltaRef) or not isinstance(sources, Sequence | Mapping):
            raise DeltaStoreError("sources: give a list of delta references or a {name: reference} mapping")
        if isinstance(sources, Mapping):
            named = {str(k): DeltaRef.parse(v) for k, v in sources.items()}
        else:
            refs = [DeltaRef.parse(s) for s in sources]
            if bundle:
                named = {r.task.replace(".", "_"): r for r in refs}
            else:
                named = {}
                for r in refs:
                    info = self.get_version(r)
                    named[f"{r.task}/{info.version}"] = DeltaRef(r.task, version=info.version)
            if len(named) != len(refs):
                raise DeltaStoreError(f"sources name the same delta twice: {[str(r) for r in refs]}")
        if not named:
            raise DeltaStoreError("sources: no deltas given")
        if bundle:
            for key in named:
                if not BUNDLE_ROUTE_PATTERN.fullmatch(key):
                    raise DeltaStoreError(f"multi-task route name {key!r}: letters, digits, '_' and '-' only")
        return named


def check_compose_request(
    op: str, sources: Any, into: str, aliases: Sequence[str], options: Mapping[str, Any]
) -> None:
    """A composition request before anything is pulled or written: the op, the task `into`, the aliases,
    the number of sources and the options (pelt_core.compose's `check_options`: names, types, ranges).
    A caller that passes a request's options on as keywords checks them here first, so no option can
    name one of `MlflowDeltaStore.compose`'s own parameters."""
    from pelt_core import compose as pelt_compose
    from pelt_core.limits import MAX_COMPOSE_ALIASES, MAX_COMPOSE_SOURCES

    if op not in COMPOSE_OPERATIONS:
        raise DeltaStoreError(f"op must be one of {', '.join(COMPOSE_OPERATIONS)}, got {op!r}", field="op")
    if op == MULTI_TASK and options:
        raise DeltaStoreError(f"multi_task takes no options, got {', '.join(options)}", field="options")
    check_new_name(into, "into")
    if isinstance(aliases, str) or len(aliases) > MAX_COMPOSE_ALIASES:
        raise DeltaStoreError(f"aliases: give a list of at most {MAX_COMPOSE_ALIASES} names", field="aliases")
    for index, name in enumerate(aliases):
        check_alias(name, f"aliases[{index}]")
    count = len(sources) if isinstance(sources, Sequence | Mapping) and not isinstance(sources, str) else 1
    if count > MAX_COMPOSE_SOURCES:
        raise DeltaStoreError(
            f"sources: at most {MAX_COMPOSE_SOURCES} deltas per composition, got {count}", field="sources"
        )
    _check_sources(sources, bundle=op == MULTI_TASK)
    try:
        pelt_compose.check_options(op, options, count)
    except pelt_compose.CompositionError as exc:
        raise _option_error(exc) from None


def _check_sources(sources: Any, bundle: bool) -> None:
    """Every source a delta reference; in a {name: reference} mapping every name a valid name (the
    registry's rule for task names; a multi-task route: no '.' either). The names go into the version's
    provenance and the audit trail, so nothing else is taken."""
    if isinstance(sources, Mapping):
        for name, ref in sources.items():
            check_new_name(name, "sources")
            if bundle and not BUNDLE_ROUTE_PATTERN.fullmatch(name):
                raise DeltaStoreError(
                    f"sources: multi-task route name {name!r}: letters, digits, '_' and '-' only",
                    field="sources",
                )
            check_ref_text(ref, f"sources.{name}")
    elif isinstance(sources, Sequence) and not isinstance(sources, str):
        for index, ref in enumerate(sources):
            check_ref_text(ref, f"sources[{index}]")


@dataclass(frozen=True)
class _Made:
    """A composition written to `folder`, before it is stored."""

    folder: Path
    sha256: str
    method: str
    provenance: dict[str, Any]
    backbone_name: str
    backbone_hash: str
    sources: dict[str, VersionInfo]
    delta: JobDelta | None  # in memory when composed in this process


def compose_pulled(
    op: str, pulled: Mapping[str, PulledModel], options: dict[str, Any], out: Path
) -> tuple[SavedDelta, str, dict[str, Any], JobDelta | None]:
    """The pulled deltas composed by `op` and saved in `out` (a delta, or a multi-task bundle): (what was
    saved, the result's method, its provenance, the composed delta: None for a bundle). Both ways of
    composing end here: in this process and in the child (`compose_child.compose_in_child`)."""
    from pelt_core.compose import save_composed

    chosen = _one_backbone(pulled)
    inputs = [
        {"name": n, "task": p.task, "version": p.version, "sha256": p.sha256} for n, p in pulled.items()
    ]
    if op == MULTI_TASK:
        saved = _save_bundle(out, pulled, chosen)
        return (
            saved,
            MULTI_TASK,
            {"op": MULTI_TASK, "inputs": inputs, "backbone_hash": chosen.content_hash},
            None,
        )
    composed = _combine(op, pulled, chosen, options)
    saved = save_composed(composed, chosen, out, extra={"sources": inputs})
    return saved, composed.method.name, dict(composed.provenance), composed


def _one_backbone_of(infos: Mapping[str, VersionInfo]) -> None:
    """DeltaStoreError naming the versions when their tags record different backbones (before any
    download; the manifests are checked again once downloaded)."""
    if len({info.tags[TAG_BACKBONE_HASH] for info in infos.values() if info.tags.get(TAG_BACKBONE_HASH)}) > 1:
        raise DeltaStoreError(
            "these deltas belong to different backbones: "
            + ", ".join(f"{name} ({info.tags.get(TAG_BACKBONE)})" for name, info in infos.items()),
            field="sources",
        )


SOURCE_READ_ERRORS = (
    DeltaError,
    DeltaStoreError,
    KeyError,
    TypeError,
    ValueError,
    AttributeError,
    StopIteration,
)


def _read_source(name: str, info: VersionInfo, folder: Path) -> tuple[dict[str, Any], int]:
    """A downloaded source's manifest (a bundle: its first part's) and its LoRA modules' bytes as dense
    ΔW (`dense_lora_bytes`; 0 for a bundle), read without loading a tensor. A malformed one (a manifest
    without its method or backbone, a bundle without parts, a tensor file whose header is not JSON) is a
    DeltaStoreError naming the source (field "sources"), never a server's error."""
    try:
        if info.kind == MULTI_TASK:
            first = next(iter(read_bundle(folder)["tasks"].values()))
            manifest = read_manifest(folder / first["path"])
        else:
            manifest = read_manifest(folder)
        backbone = manifest["backbone"]
        for key in ("name", "content_hash"):
            if not isinstance(backbone.get(key), str):
                raise DeltaError(f"its manifest's backbone has no {key}")
        if not isinstance(manifest.get("method"), dict):
            raise DeltaError("its manifest has no method")
        dense = 0 if info.kind == MULTI_TASK else dense_lora_bytes(folder, manifest)
    except SOURCE_READ_ERRORS as exc:
        reason = f"its manifest has no {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
        raise DeltaStoreError(
            f"sources: {name} ({info.task}/{info.version}) is not a readable delta: "
            + clip(reason.replace(str(folder), "its folder"), 300),
            field="sources",
        ) from None
    return manifest, dense


def _one_manifest_backbone(manifests: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The backbone the manifests name (name, content_hash, num_parameters); DeltaStoreError naming the
    sources when they name different ones."""
    backbones = {name: manifest["backbone"] for name, manifest in manifests.items()}
    if len({backbone["content_hash"] for backbone in backbones.values()}) > 1:
        raise DeltaStoreError(
            "these deltas belong to different backbones: "
            + ", ".join(f"{name} ({backbone['name']})" for name, backbone in backbones.items()),
            field="sources",
        )
    return dict(next(iter(backbones.values())))


def _tensor_bytes(folder: Path) -> int:
    """The bytes of the tensor files (`.safetensors`) in a downloaded version's folder."""
    return sum(path.stat().st_size for path in folder.rglob(f"*{TENSOR_SUFFIX}") if path.is_file())


def _one_backbone(pulled: Mapping[str, PulledModel]) -> Backbone:
    """The backbone every pulled delta belongs to; DeltaStoreError naming them when they differ."""
    if len({p.backbone.content_hash for p in pulled.values()}) > 1:
        raise DeltaStoreError(
            "these deltas belong to different backbones: "
            + ", ".join(f"{name} ({p.manifest['backbone']['name']})" for name, p in pulled.items())
        )
    return next(iter(pulled.values())).backbone


def _save_bundle(out: Path, pulled: Mapping[str, PulledModel], backbone: Backbone) -> SavedDelta:
    """The pulled deltas as a multi-task bundle in `out`, each part recording where it was pulled from."""
    from pelt_core import compose as pelt_compose
    from pelt_core.delta import save_bundle

    for name, p in pulled.items():
        if p.info.kind == MULTI_TASK:
            raise DeltaStoreError(f"{name}: a multi-task bundle cannot go into another one")
    pelt_compose.check_multi_task(backbone, {n: p.delta for n, p in pulled.items()})
    return save_bundle(
        {n: p.delta for n, p in pulled.items()},
        backbone,
        out,
        extras={n: p.manifest.get("extra") for n, p in pulled.items()},
        sources={
            n: {"task": p.task, "version": p.version, "source_sha256": p.sha256} for n, p in pulled.items()
        },
    )


def _combine(
    op: str, pulled: Mapping[str, PulledModel], backbone: Backbone, options: dict[str, Any]
) -> JobDelta:
    """merge, average or merge_lora_svd of the pulled deltas (pelt_core.compose), in memory."""
    from pelt_core import compose as pelt_compose

    function = {
        "merge": pelt_compose.merge,
        "average": pelt_compose.average,
        "merge_lora_svd": pelt_compose.merge_lora_svd,
    }[op]
    if op == "merge_lora_svd":
        options.setdefault("weights", None)
    try:  # a rank above what the deltas' matrices hold is refused before it is allocated
        return function({n: p.delta for n, p in pulled.items()}, backbone=backbone, **options)
    except pelt_compose.CompositionError as exc:
        raise _option_error(exc) from None


def _option_error(exc: Exception) -> Exception:
    """pelt_core's error about a composition option, naming it as the request does (`options.<name>`)."""
    field = getattr(exc, "field", None)
    if not field or field in ("op",):
        return exc
    message = str(exc)
    message = f"options.{message}" if message.startswith(field) else f"options.{field}: {message}"
    return type(exc)(message, field=f"options.{field}")
