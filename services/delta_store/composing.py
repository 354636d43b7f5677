"""Composing stored deltas (merge, average, merge_lora_svd, a multi-task bundle) into a new version, and
registering a delta folder made outside the service. The math is `pelt_core.compose`; this part pulls the
inputs, checks the request, and writes the result as a run and a model version tagged with its provenance,
all or nothing."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pelt_core.delta_format import BUNDLE_ROUTE_PATTERN
from pelt_core.pulled import MULTI_TASK, PulledModel
from pelt_core.vocabulary import COMPOSE_OPERATIONS
from services.delta_store.aliases import check_alias
from services.delta_store.base import read_delta_folder
from services.delta_store.errors import DeltaStoreError
from services.delta_store.reading import ReadMixin
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
    check_task,
    clip,
    version_uri,
)
from workers.job import StoredDelta

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
        if it raises, the version is taken back."""
        from pelt_core.compose import save_composed

        check_compose_request(op, sources, into, aliases, options)  # before anything is pulled or written
        named = self._named_sources(sources, bundle=op == MULTI_TASK)
        pulled = {name: self.pull(ref, backbone=backbone) for name, ref in named.items()}
        chosen = _one_backbone(pulled)
        inputs = [
            {"name": n, "task": p.task, "version": p.version, "sha256": p.sha256} for n, p in pulled.items()
        ]
        with tempfile.TemporaryDirectory(prefix="pelt-compose-") as scratch:
            out = Path(scratch) / "delta"
            if op == MULTI_TASK:
                composed_delta = None
                saved = _save_bundle(out, pulled, chosen)
                method = MULTI_TASK
                provenance = {"op": MULTI_TASK, "inputs": inputs, "backbone_hash": chosen.content_hash}
            else:
                composed_delta = _combine(op, pulled, chosen, options)
                saved = save_composed(composed_delta, chosen, out, extra={"sources": inputs})
                method, provenance = composed_delta.method.name, dict(composed_delta.provenance)
            tags = {
                TAG_KIND: MULTI_TASK if op == MULTI_TASK else "composed",
                TAG_TASK: into,
                TAG_METHOD: method,
                TAG_BACKBONE: next(iter(pulled.values())).manifest["backbone"]["name"],
                TAG_BACKBONE_HASH: chosen.content_hash,
                TAG_SHA256: saved.sha256,
                TAG_OP: str(provenance.get("op", op)),
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
            stored = self._write_composition(into, out, tags, params, text, provenance, aliases, on_written)
        sources_info = [p.info for p in pulled.values()]
        return Composed(into, str(stored.model_version), stored, provenance, composed_delta, sources_info)

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
    check_task(into)
    if isinstance(aliases, str) or len(aliases) > MAX_COMPOSE_ALIASES:
        raise DeltaStoreError(f"aliases: give a list of at most {MAX_COMPOSE_ALIASES} names", field="aliases")
    for index, name in enumerate(aliases):
        check_alias(name, f"aliases[{index}]")
    count = len(sources) if isinstance(sources, Sequence | Mapping) and not isinstance(sources, str) else 1
    if count > MAX_COMPOSE_SOURCES:
        raise DeltaStoreError(
            f"sources: at most {MAX_COMPOSE_SOURCES} deltas per composition, got {count}", field="sources"
        )
    try:
        pelt_compose.check_options(op, options, count)
    except pelt_compose.CompositionError as exc:
        raise _option_error(exc) from None


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
    pelt_compose.multi_task(backbone, {n: p.delta for n, p in pulled.items()})  # checks them
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
