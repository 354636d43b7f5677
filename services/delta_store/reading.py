"""Reading the delta store: versions of a task, resolving a reference (best, a method's best, an alias, a
version), downloading a version's files checked against its recorded sha256, and pulling it onto its
backbone (`pelt_core.pulled`), ready for `predict(texts)`."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pelt_core.delta_format import DeltaError, sha256_mismatch
from pelt_core.pulled import MULTI_TASK, PulledModel, load_pulled
from services.delta_store.aliases import AliasMixin
from services.delta_store.base import is_missing
from services.delta_store.errors import DeltaIntegrityError, DeltaNotFoundError, DeltaStoreError
from services.delta_store.values import (
    ARTIFACT_PATH,
    BEST,
    METHOD_ALIAS_PREFIX,
    TAG_ARCHIVED,
    TAG_ARTIFACT_PATH,
    TAG_KIND,
    TAG_METHOD,
    TAG_METRIC_VALUE,
    TAG_SHA256,
    DeltaRef,
    VersionInfo,
    method_alias,
    resolve_ref,
)

if TYPE_CHECKING:
    from pelt_core.backbones import Backbone

COMPOSED_KINDS = ("composed", MULTI_TASK)  # the kinds of version `compose` writes


class ReadMixin(AliasMixin):
    """`list_versions`, `get_version`, `download`, `pull`."""

    def list_versions(self, task: str) -> list[VersionInfo]:
        """Every version of the task, oldest first."""
        model = self.model_name(task)
        aliases = self._aliases_by_version(self._registered_model(model))
        return [self._info(v, aliases) for v in self._versions(model)]

    def get_version(
        self,
        ref: str | DeltaRef,
        *,
        method: str | None = None,
        version: str | int | None = None,
        alias: str | None = None,
    ) -> VersionInfo:
        """Resolve a reference to one version; DeltaNotFoundError lists what exists.

        A plain name is its `best` alias; a composition's own name (every version of it a composition)
        has none, and answers with its latest version instead. An archived version answers only to its
        version number, never to a name or an alias."""
        ref = resolve_ref(ref, method=method, version=version, alias=alias)
        model = self.model_name(ref.task)
        registered = self._registered_model(model)
        aliases = registered.aliases or {}
        if ref.version is None and (
            ref.alias is None or ref.alias == BEST or ref.alias.startswith(METHOD_ALIAS_PREFIX)
        ):
            aliases = self._with_live_best(ref.task, aliases)
        if ref.version is not None:
            try:
                found = self.client.get_model_version(model, ref.version)
            except Exception as exc:
                if not is_missing(exc):
                    raise
                known = [v.version for v in self._versions(model)]
                raise DeltaNotFoundError(
                    "version", ref.version, known, where=f"of task {ref.task!r}"
                ) from None
            return self._info(found, self._aliases_by_version(registered))
        if ref.method is not None:
            wanted = method_alias(ref.method)
            if wanted not in aliases:
                methods = self._methods_with_aliases(model, aliases)
                raise DeltaNotFoundError(
                    "method", ref.method, methods, where=f"with a best version for task {ref.task!r}"
                )
        else:
            wanted = ref.alias or BEST
            if wanted not in aliases:
                latest = None if ref.alias is not None else self._latest_composition(model)
                if latest is not None:
                    return self._info(latest, self._aliases_by_version(registered))
                found = self._versions(model)
                versions = [str(v.version) for v in found]
                # a search's early rungs store versions with no test metric: none of them is ranked yet
                unranked = bool(found) and not any(TAG_METRIC_VALUE in (v.tags or {}) for v in found)
                hint = (
                    f" (its versions: {', '.join(versions)}"
                    + ("; none has a test metric to be ranked by yet" if unranked else "")
                    + "; pick one with version=...)"
                    if versions
                    else " (it has no versions yet)"
                )
                raise DeltaNotFoundError("alias", wanted, aliases, where=f"on task {ref.task!r}", hint=hint)
        found = self.client.get_model_version(model, str(aliases[wanted]))
        info = self._info(found, self._aliases_by_version(registered))
        if info.archived:  # archive_version moves aliases off; one set since then is not followed either
            raise DeltaNotFoundError(
                "alias",
                wanted,
                [a for a, v in aliases.items() if str(v) != info.version],
                where=f"on task {ref.task!r}",
                hint=f" (it points at version {info.version}, which is archived; pick it with version=...)",
            )
        return info

    def download(
        self, task: str | DeltaRef, version: str | int | None = None, dest: str | Path | None = None
    ) -> Path:
        """Download a version's delta folder (into `dest`, else a new temporary folder the caller owns)
        and check it against its recorded sha256; DeltaIntegrityError (folder removed) when it differs."""
        ref = DeltaRef.parse(task) if version is None else DeltaRef(str(task), version=version)
        info = self.get_version(ref)
        return self._download(info, dest)

    def fetch(self, task: str, version: int | None, sha256: str, dest: Path) -> Path:
        """An AdapterFusion job's source (`workers.job.DeltaSource`): version `version` of `task`
        downloaded into `dest` and checked against `sha256`, the hash the fusion recorded when it was
        submitted. A version gone, archived or changed since is a pelt_core DeltaError naming it (the job
        fails for good: another try would find the same); a store that cannot be reached is retried."""
        where = f"source {task} version {version}"
        if version is None:
            raise DeltaError(f"{where}: the fusion recorded no version to fetch")
        try:
            info = self.get_version(DeltaRef(task, version=str(version)))
            if info.archived:
                raise DeltaError(f"{where} was archived since the fusion was submitted; it is not fused")
            if info.sha256 != sha256:
                raise DeltaError(
                    f"{where} now has sha256 {str(info.sha256)[:12]}…, not the {sha256[:12]}… the fusion "
                    "was submitted with; submit the fusion again"
                )
            return self._download(info, dest)
        except (DeltaNotFoundError, DeltaIntegrityError) as exc:
            raise DeltaError(f"{where}: {exc}") from exc
        except DeltaStoreError as exc:  # a name the store refuses: the same on every try
            if getattr(exc, "field", None) is None:
                raise  # the store itself failed (unreachable, ...): the job may try again
            raise DeltaError(f"{where}: {exc}") from exc

    def pull(
        self,
        task: str | DeltaRef,
        *,
        method: str | None = None,
        version: str | int | None = None,
        alias: str | None = None,
        backbone: Backbone | Callable[[str], Backbone] | None = None,
        fold: bool = False,
    ) -> PulledModel:
        """The task's `best` delta (or a method's best, an alias, a version), checked against its sha256
        and loaded onto the backbone its manifest names: a model ready for `predict(texts)`.

        backbone: a loaded Backbone (reused; its content hash must match the manifest's) or a loader
        name -> Backbone; default: the store's loader. fold: LoRA folded into a copy of the backbone's
        dense weights (a FoldedModel: same logits, no adapter overhead)."""
        info = self.get_version(resolve_ref(task, method=method, version=version, alias=alias))
        with tempfile.TemporaryDirectory(prefix="pelt-pull-") as scratch:
            folder = self._download(info, Path(scratch) / "delta")
            return load_pulled(info, folder, lambda manifest: self._backbone(manifest, backbone), fold=fold)

    # --- internals -------------------------------------------------------------------------------

    def _with_live_best(self, task: str, aliases: Mapping[str, Any]) -> dict[str, Any]:
        """The aliases with `best` and `best-<method>` read from the registry's leaderboard as it is now,
        when the store has a registry and the task is one of its: a job is `succeeded` in the registry
        before its completion moves the MLflow aliases, and a caller who saw it succeed pulls its delta."""
        from services.registry import UnknownTaskError

        if self.registry is None:
            return dict(aliases)
        try:
            live = self._desired_aliases(task, self.registry)
        except UnknownTaskError:
            return dict(aliases)  # not a registry task (a composition's own name): MLflow's aliases
        kept = {a: v for a, v in aliases.items() if a != BEST and not a.startswith(METHOD_ALIAS_PREFIX)}
        return {**kept, **live}

    def _latest_composition(self, model: str) -> Any:
        """The latest version that is not archived, of a model every version of which is a composition
        (a composition's own name); None for a task with trained or imported versions, or none left."""
        versions = self._versions(model)
        if not versions or any((v.tags or {}).get(TAG_KIND) not in COMPOSED_KINDS for v in versions):
            return None
        kept = [v for v in versions if (v.tags or {}).get(TAG_ARCHIVED) != "true"]
        return kept[-1] if kept else None

    def _methods_with_aliases(self, model: str, aliases: Mapping[str, Any]) -> list[str]:
        methods = []
        for alias, version in aliases.items():
            if alias.startswith(METHOD_ALIAS_PREFIX):
                found = self.client.get_model_version(model, str(version))
                methods.append(found.tags.get(TAG_METHOD) or alias[len(METHOD_ALIAS_PREFIX) :])
        return methods

    def _download(self, info: VersionInfo, dest: str | Path | None) -> Path:
        if not info.sha256:
            raise DeltaIntegrityError(
                f"{info.uri} has no recorded sha256 (tag {TAG_SHA256}); refusing to load it"
            )
        self._cross_check(info)
        run_id, path = _run_artifact(info)
        owned = dest is None
        target = Path(tempfile.mkdtemp(prefix=f"pelt-{info.task}-v{info.version}-")) if owned else Path(dest)
        target.mkdir(parents=True, exist_ok=True)
        try:
            with tempfile.TemporaryDirectory(dir=target, prefix=".download-") as scratch:
                local = Path(self.client.download_artifacts(run_id, path, scratch))
                problem = sha256_mismatch(local, info.sha256, bundle=info.kind == MULTI_TASK)
                if problem is not None:
                    raise DeltaIntegrityError(f"{info.uri}: {problem}; refusing to load it")
                for item in local.iterdir():
                    destination = target / item.name
                    if destination.is_dir():
                        shutil.rmtree(destination)
                    shutil.move(str(item), destination)
        except BaseException:
            if owned:
                shutil.rmtree(target, ignore_errors=True)
            raise
        return target

    def _cross_check(self, info: VersionInfo) -> None:
        """A job's version: its tag must agree with the registry's result row (when it has one)."""
        if self.registry is None or info.job_id is None:
            return
        try:
            result = self.registry.get_result(info.job_id)
        except Exception:  # a job unknown to this registry (another installation): nothing to compare
            return
        if (
            result is not None
            and result.mlflow_model_version == info.version
            and result.delta_sha256 not in (None, info.sha256)
        ):
            raise DeltaIntegrityError(
                f"{info.uri}: its sha256 tag {info.sha256} differs from the registry's "
                f"{result.delta_sha256} (job {info.job_id}); refusing to load it"
            )

    def _backbone(
        self, manifest: dict[str, Any], backbone: Backbone | Callable[[str], Backbone] | None
    ) -> Backbone:
        wanted = manifest["backbone"]
        if backbone is not None and hasattr(backbone, "content_hash"):  # a loaded Backbone
            self._backbones.setdefault(backbone.content_hash, backbone)
            return backbone  # load_delta refuses it if it is not the manifest's
        cached = self._backbones.get(wanted["content_hash"])
        if cached is not None:
            return cached
        loader = backbone or self._backbone_loader
        if loader is None:
            from pelt_core.backbones import Backbone as BackboneClass

            loader = BackboneClass.load
        loaded = loader(wanted["name"])
        self._backbones[loaded.content_hash] = loaded
        return loaded


def _run_artifact(info: VersionInfo) -> tuple[str, str]:
    """(run id, artifact path) of a version: from its `runs:/<run>/<path>` source, else run id + tag."""
    if info.source.startswith("runs:/"):
        run_id, _, path = info.source[len("runs:/") :].partition("/")
        return run_id, path or info.tags.get(TAG_ARTIFACT_PATH, ARTIFACT_PATH)
    if info.run_id:
        return info.run_id, info.tags.get(TAG_ARTIFACT_PATH, ARTIFACT_PATH)
    raise DeltaStoreError(f"{info.uri}: source {info.source!r} is not a pelt delta artifact")
