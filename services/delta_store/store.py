"""MLflow as the delta store: every job a run, every delta a model version, pull by task name.

Layout in MLflow (namespace `pelt` by default, so several installations can share one server):

    experiment  pelt/<task>    one run per job: params (method, backbone, training config, method spec),
                               per-epoch metrics (step = epoch), final metrics (`final/<name>`), sizes and
                               times, tags pelt.job_id / task / method / backbone / sweep_id / attempt, and
                               the artifacts delta/ (delta.safetensors + manifest.json), job.json, history.json
    model       pelt.<task>    one version per successful job (source runs:/<run>/delta), tagged with the
                               job id, method, kind and the sha256 of delta.safetensors; composed deltas are
                               versions too (kind composed / multi_task, with provenance tags)
    aliases     best, best-<method>   the task's best version on its primary metric, overall and per method

Idempotency (a job is keyed by its id, never by attempt; the registry's result row is the arbiter):
- `store()` first asks the registry (when the store has one): a job whose result row exists is sealed and
  its recorded delta is returned unchanged, whatever was passed in.
- otherwise it looks the job up by the tag `pelt.job_id`: a version of the same delta (same sha256) is
  returned as it is (a repeated call); a finished run of the same delta whose version is missing (a crash
  between the two steps) gets its version; else a new run and version are made. An earlier attempt's
  version is not touched here: its worker may still be completing it (a lapsed lease may still complete).
- `finalize_job()`, after `Registry.complete_job` has committed, keeps only the version and run the result
  row names and deletes the job's others (a job that ended failed or cancelled keeps none). So once the
  registry has decided, a job has exactly one version, whichever attempt or worker won; version numbers
  can have gaps. Without a registry there is no arbiter and `store()` replaces earlier attempts at once.

Aliases are a projection of the registry (the source of truth), never written from a worker's own view:
`sync_aliases(task)` reads the registry's leaderboard after the result row has committed, points
`best-<method>` at each method's best job and `best` at the best of all (ties: fewer trainable
parameters, then the older job: an alias moves only when a new result beats the current one), then
reads again and repeats until what it read is what it wrote, so concurrent syncs converge on the last
committed state. It is idempotent: a crash between the result row and the alias move is repaired by
any later sync (the next completion on the task, `reconcile(task)` / `pelt mlflow reconcile` at start-up).
`complete_job()` does it all in order: store → Registry.complete_job → finalize_job (→ sync_aliases).

Everything torch-related is imported inside functions: `import services.delta_store` stays light.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.delta_store.bootstrap import (
    check_store,
    display_uri,
    ensure_store,
    is_server_uri,
    normalize_tracking_uri,
    quiet_mlflow,
)
from services.delta_store.errors import DeltaIntegrityError, DeltaNotFoundError, DeltaStoreError
from services.settings import Settings, get_settings
from workers.job import JobSpec, StoredDelta

if TYPE_CHECKING:
    import torch
    from mlflow.entities import Run
    from mlflow.entities.model_registry import ModelVersion, RegisteredModel

    from pelt_core.backbones import Backbone
    from pelt_core.model import JobDelta
    from services.registry import Registry, ResultRecord

log = logging.getLogger("pelt.delta_store")

DELTA_FILE = "delta.safetensors"  # = pelt_core.delta.DELTA_FILE (not imported: it pulls in torch)
MANIFEST_FILE = "manifest.json"
BUNDLE_FILE = "bundle.json"
BUNDLE_FORMAT = "pelt-multi-task"
ARTIFACT_PATH = "delta"
BEST = "best"
METHOD_ALIAS_PREFIX = "best-"

# tags (runs and model versions)
TAG_KIND = "pelt.kind"  # job | composed | multi_task | imported
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

NAMESPACE_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,49}$")
TASK_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")  # the registry's task names
# an alias MLflow takes: not "latest" and not v<digits> (its version references), any case
ALIAS_PATTERN = re.compile(r"^(?!(?i:latest|v[0-9]+)$)[A-Za-z0-9_-]{1,100}$")
BUNDLE_KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
MAX_PARAM_CHARS = 6000  # mlflow's limit on a param value
MAX_TAG_CHARS = 5000  # mlflow's limit on a model version tag value
COMPOSE_OPS = ("merge", "average", "merge_lora_svd", "multi_task")


# --------------------------------------------------------------------------------------------------
# Plain data handed out by the store
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeltaRef:
    """Which delta of a task: its `best` alias (default), a method's best, an alias, or a version.

    As a string: "task" (best), "task@alias" (e.g. "sst2@best-lora"), "task/3" (version 3)."""

    task: str
    version: str | None = None
    method: str | None = None
    alias: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not TASK_PATTERN.match(self.task):
            raise DeltaStoreError(f"{self.task!r} is not a task name (letters, digits, '_', '.', '-')")
        if self.version is not None:
            object.__setattr__(self, "version", _version_string(self.version))
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
    kind: str  # job | composed | multi_task | imported
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

    @property
    def uri(self) -> str:
        """`models:/<model>/<version>`: what the registry's result row records as delta_uri."""
        return f"models:/{self.model_name}/{self.version}"


@dataclass
class PulledModel:
    """A pulled delta loaded onto its backbone, ready for `predict(texts)`.

    `model` is a PeltModel (one delta), a MultiTaskModel (a multi-task bundle; predict takes
    (task, text) items) or a FoldedModel (pulled with fold=True)."""

    info: VersionInfo
    sha256: str
    manifest: dict[str, Any]
    backbone: Backbone
    deltas: dict[str, JobDelta]
    model: Any

    @property
    def task(self) -> str:
        return self.info.task

    @property
    def version(self) -> str:
        return self.info.version

    @property
    def delta(self) -> JobDelta:
        """The delta (a multi-task bundle has several: see `deltas`)."""
        if len(self.deltas) != 1:
            raise DeltaStoreError(
                f"{self.info.uri} holds {len(self.deltas)} task deltas: {', '.join(self.deltas)}"
            )
        return next(iter(self.deltas.values()))

    def predict(self, texts: Sequence[Any], batch_size: int = 32, max_length: int = 128) -> list[dict]:
        """pelt_core.model.predict's result format; a multi-task model takes (task, text) items."""
        from pelt_core.compose import FoldedModel, MultiTaskModel
        from pelt_core.model import predict

        if isinstance(self.model, MultiTaskModel | FoldedModel):
            return self.model.predict(list(texts), batch_size=batch_size, max_length=max_length)
        return predict(self.model, list(texts), batch_size=batch_size, max_length=max_length)

    def logits(self, texts: Sequence[str], task: str | None = None) -> torch.Tensor:
        """Logits for a batch of texts (a multi-task model needs `task`, or uses its only task)."""
        import torch

        from pelt_core.compose import MultiTaskModel

        batch = self.backbone.tokenizer(list(texts), padding=True, return_tensors="pt")
        device = next(self.model.parameters()).device
        inputs = {
            k: v.to(device)
            for k, v in batch.items()
            if k in ("input_ids", "attention_mask", "token_type_ids")
        }
        with torch.no_grad():
            if isinstance(self.model, MultiTaskModel):
                name = task or (next(iter(self.deltas)) if len(self.deltas) == 1 else None)
                if name is None:
                    raise DeltaStoreError(f"name the task: this model serves {', '.join(self.deltas)}")
                rows = self.model.forward_tasks(
                    inputs["input_ids"],
                    inputs["attention_mask"],
                    [name] * len(texts),
                    inputs.get("token_type_ids"),
                )
                return torch.stack(rows)
            return self.model(**inputs)


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


# --------------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------------
class MlflowDeltaStore:
    """The `DeltaSink` of the service, plus pull by task name, aliases and composition (module docstring).

    tracking_uri: PELT_MLFLOW_TRACKING_URI by default (SQLite under PELT_DATA_DIR); an `http(s)://` URI is an
    MLflow server, which decides where artifacts go; for a database URI they go under `artifact_root`
    (default PELT_MLFLOW_ARTIFACT_ROOT). registry: the registry whose result rows seal jobs and drive
    the aliases. namespace: prefix of experiment and model names. ensure: create/upgrade MLflow's
    schema now (the service start does it once; by default the store only checks it). backbones:
    already loaded backbones to reuse; backbone_loader: name -> Backbone for the others
    (default `Backbone.load`), each loaded once per store.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        artifact_root: str | Path | None = None,
        *,
        registry: Registry | None = None,
        namespace: str = "pelt",
        settings: Settings | None = None,
        ensure: bool = False,
        backbones: Iterable[Backbone] = (),
        backbone_loader: Callable[[str], Backbone] | None = None,
    ) -> None:
        quiet_mlflow()
        settings = settings or get_settings()
        if not isinstance(namespace, str) or not NAMESPACE_PATTERN.match(namespace):
            raise DeltaStoreError(f"namespace {namespace!r}: letters, digits, '_', '.', '-' (at most 50)")
        self.tracking_uri = normalize_tracking_uri(tracking_uri or settings.mlflow_tracking_uri)
        self.is_server = is_server_uri(self.tracking_uri)
        if artifact_root is None and not self.is_server:
            artifact_root = settings.mlflow_artifact_root
        self.artifact_root = None if artifact_root is None else _as_uri(artifact_root)
        self.namespace = namespace
        self.registry = registry
        if ensure:
            ensure_store(self.tracking_uri, None if artifact_root is None else str(artifact_root))
        else:
            check_store(self.tracking_uri)
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        self._backbones: dict[str, Backbone] = {b.content_hash: b for b in backbones}
        self._backbone_loader = backbone_loader
        self._experiments: dict[str, str] = {}

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **kwargs: Any) -> MlflowDeltaStore:
        """The store the settings describe (PELT_MLFLOW_TRACKING_URI, PELT_MLFLOW_ARTIFACT_ROOT)."""
        settings = settings or get_settings()
        return cls(settings.mlflow_tracking_uri, None, settings=settings, **kwargs)

    def __repr__(self) -> str:
        return f"MlflowDeltaStore({display_uri(self.tracking_uri)!r}, namespace={self.namespace!r})"

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the dispatcher ships the sink to Ray workers): the URIs travel, the MLflow client,
        loaded backbones and the registry's connections do not; the registry reopens from its URL
        (which carries its password, if any: keep it inside the authenticated cluster)."""
        registry_url = None
        if self.registry is not None:
            registry_url = self.registry.engine.url.render_as_string(hide_password=False)
        return {
            "tracking_uri": self.tracking_uri,
            "artifact_root": self.artifact_root,
            "namespace": self.namespace,
            "registry_url": registry_url,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        registry = None if state["registry_url"] is None else _shared_registry(state["registry_url"])
        self.__init__(
            state["tracking_uri"],
            state["artifact_root"],
            registry=registry,  # type: ignore[misc]
            namespace=state["namespace"],
        )

    # --- names -----------------------------------------------------------------------------------

    def model_name(self, task: str) -> str:
        """The registered model of a task: `<namespace>.<task>`."""
        _check_task(task)
        return f"{self.namespace}.{task}"

    def experiment_name(self, task: str) -> str:
        """The experiment of a task: `<namespace>/<task>`."""
        _check_task(task)
        return f"{self.namespace}/{task}"

    # --- DeltaSink -------------------------------------------------------------------------------

    def store(
        self, job: JobSpec, delta_dir: Path, result: dict[str, Any], history: list[dict[str, Any]]
    ) -> StoredDelta:
        """Log the job as a run (params, metric history, final metrics, tags, the delta folder) and add
        its model version; idempotent per job id (module docstring). Aliases are not touched here."""
        return self._store(job, Path(delta_dir), result, history, self.registry)

    def _store(
        self,
        job: JobSpec,
        folder: Path,
        result: Mapping[str, Any],
        history: list[dict[str, Any]],
        registry: Registry | None,
    ) -> StoredDelta:
        manifest = _read_manifest(folder)
        sha = _sha256_file(folder / DELTA_FILE)
        sealed = self._sealed(job.job_id, registry)
        if sealed is not None:
            if sealed.sha256 != sha:
                log.warning(
                    "job %s already has a recorded delta (sha256 %s…); the delta of attempt %s "
                    "(sha256 %s…) is not stored",
                    job.job_id,
                    (sealed.sha256 or "")[:12],
                    job.attempt,
                    sha[:12],
                )
            return sealed
        task = job.task.name
        model = self._ensure_model(task, metric=job.task.metric, direction=job.task.metric_direction)
        experiment_id = self._ensure_experiment(task)
        versions = self._job_versions(model, job.job_id)
        runs = self._job_runs(experiment_id, job.job_id)

        same = [
            v
            for v in versions
            if v.tags.get(TAG_SHA256) == sha
            and v.run_id
            and any(r.info.run_id == v.run_id and r.info.status == "FINISHED" for r in runs)
        ]
        if same:  # this delta is stored already (a repeated call)
            keep = min(same, key=lambda v: int(v.version))
            return StoredDelta(self._uri(model, keep.version), sha, keep.run_id, str(keep.version))
        run_id = next(
            (
                r.info.run_id
                for r in runs  # its run finished but the version is missing
                if r.info.status == "FINISHED" and r.data.tags.get(TAG_SHA256) == sha
            ),
            None,
        )
        if registry is None:  # no arbiter: the last attempt replaces the earlier ones now
            self._discard(versions, [r for r in runs if r.info.run_id != run_id])
        if run_id is None:
            run_id = self._log_job_run(experiment_id, job, folder, sha, manifest, result, history)
        metric_value = _primary_metric(result, job.task.metric)
        tags = {
            TAG_KIND: "job",
            TAG_JOB_ID: str(job.job_id),
            TAG_TASK: task,
            TAG_METHOD: job.method,
            TAG_BACKBONE: job.backbone,
            TAG_BACKBONE_HASH: manifest["backbone"]["content_hash"],
            TAG_SHA256: sha,
            TAG_METRIC: job.task.metric,
            TAG_ARTIFACT_PATH: ARTIFACT_PATH,
        }
        if metric_value is not None:
            tags[TAG_METRIC_VALUE] = repr(metric_value)
        if job.sweep_id is not None:
            tags[TAG_SWEEP_ID] = str(job.sweep_id)
        shown = "" if metric_value is None else f" ({job.task.metric} {metric_value:.4g})"
        version = self._create_version(
            model, run_id, tags, f"job {job.job_id}: {job.method} on {task}{shown}"
        )
        return StoredDelta(self._uri(model, version), sha, run_id, version)

    def complete_job(
        self,
        job: JobSpec,
        worker_id: str,
        delta_dir: Path,
        result: Mapping[str, Any],
        history: list[dict[str, Any]],
        registry: Registry | None = None,
    ) -> ResultRecord:
        """The whole success path of a job, in order: `store` the delta, record the result row
        (`Registry.complete_job`: one row per job, first wins), then `finalize_job` (drop the job's
        other versions, sync the task's aliases). Returns the registry's result record."""
        registry = self._registry(registry)
        stored = self._store(job, Path(delta_dir), result, history, registry)
        values = {
            **result,
            "delta_uri": stored.uri,
            "delta_sha256": stored.sha256,
            "mlflow_run_id": stored.run_id,
            "mlflow_model_version": stored.model_version,
        }
        try:
            record = registry.complete_job(job.job_id, worker_id, values)
        except Exception:
            with contextlib.suppress(Exception):  # the original error matters more
                self.finalize_job(job.task.name, job.job_id, registry)
            raise
        self.finalize_job(job.task.name, job.job_id, registry)
        return record

    def finalize_job(self, task: str, job_id: int, registry: Registry | None = None) -> str | None:
        """After the registry has decided about a job: keep only the version (and run) its result row
        names, or drop them all when the job ended failed or cancelled; then `sync_aliases(task)`.
        Returns the recorded version (None: none here; while the job has no result row and has not
        ended, nothing is deleted: an attempt may still be using its version). Idempotent."""
        registry = self._registry(registry)
        decided, version = self._settle(task, job_id, registry)
        if decided:
            self.sync_aliases(task, registry)
        return version

    def reconcile(self, task: str, registry: Registry | None = None) -> dict[str, str]:
        """Repair a task after crashes (start-up, `pelt mlflow reconcile`): settle every job that has a
        version here as `finalize_job` does, then sync the aliases once; returns {alias: version}."""
        from services.registry import UnknownJobError

        registry = self._registry(registry)
        job_ids = {
            int(v.tags[TAG_JOB_ID])
            for v in self._versions(self.model_name(task))
            if v.tags.get(TAG_JOB_ID, "").isdigit()
        }
        for job_id in sorted(job_ids):
            with contextlib.suppress(UnknownJobError):  # a job of another registry: not ours to judge
                self._settle(task, job_id, registry)
        return self.sync_aliases(task, registry)

    def _settle(self, task: str, job_id: int, registry: Registry) -> tuple[bool, str | None]:
        """(whether the registry has decided about the job, the version it recorded here)."""
        result = registry.get_result(job_id)
        model = self.model_name(task)
        keep_version = keep_run = None
        if result is not None:
            recorded = result.mlflow_model_version
            if recorded is not None and result.delta_uri in (None, self._uri(model, recorded)):
                keep_version, keep_run = recorded, result.mlflow_run_id  # else recorded in another store
        elif registry.get_job(job_id).status not in ("failed", "cancelled"):
            return False, None
        try:
            self._registered_model(model)
        except DeltaNotFoundError:
            return True, None
        experiment_id = self._ensure_experiment(task)
        self._discard(
            [v for v in self._job_versions(model, job_id) if str(v.version) != keep_version],
            [r for r in self._job_runs(experiment_id, job_id) if r.info.run_id != keep_run],
        )
        return True, keep_version

    # --- aliases ---------------------------------------------------------------------------------

    def sync_aliases(
        self, task: str, registry: Registry | None = None, max_rounds: int = 5
    ) -> dict[str, str]:
        """Point `best` and `best-<method>` at the versions of the registry's best results for the task
        (only results stored in this store count); returns {alias: version}. Idempotent (module docstring)."""
        from services.registry import UnknownTaskError

        registry = self._registry(registry)
        model = self.model_name(task)
        desired: dict[str, str] = {}
        for _ in range(max_rounds):
            try:
                desired = self._desired_aliases(task, registry)
            except UnknownTaskError:
                return {}  # not a registry task (e.g. only composed versions): no best aliases
            try:
                current = self._best_aliases(model)
            except DeltaNotFoundError:
                if not desired:
                    return {}
                raise
            if current == desired:
                return desired
            for alias, version in desired.items():
                if current.get(alias) != version:
                    self.client.set_registered_model_alias(model, alias, version)
            for alias in current.keys() - desired.keys():
                with _ignore_missing():
                    self.client.delete_registered_model_alias(model, alias)
        log.warning("aliases of %s kept changing while they were synced; last set to %s", task, desired)
        return desired

    def _desired_aliases(self, task: str, registry: Registry) -> dict[str, str]:
        rows = registry.leaderboard(task)
        model = self.model_name(task)
        desired: dict[str, str] = {}
        for row in rows:  # best first
            version = self._recorded_version(registry, model, row.best_job_id)
            if version is None:
                continue
            desired[method_alias(row.method)] = version
            desired.setdefault(BEST, version)
        return desired

    def _recorded_version(self, registry: Registry, model: str, job_id: int) -> str | None:
        """The version the registry recorded for a job, if it is one of this store's."""
        result = registry.get_result(job_id)
        if result is None or result.mlflow_model_version is None:
            return None
        if result.delta_uri is not None and result.delta_uri != self._uri(model, result.mlflow_model_version):
            return None  # stored elsewhere (another store or namespace)
        return result.mlflow_model_version

    def _best_aliases(self, model: str) -> dict[str, str]:
        aliases = self._registered_model(model).aliases or {}
        return {a: str(v) for a, v in aliases.items() if a == BEST or a.startswith(METHOD_ALIAS_PREFIX)}

    # --- reading ---------------------------------------------------------------------------------

    def list_tasks(self) -> list[str]:
        """The tasks that have a registered model in this store's namespace."""
        prefix = f"{self.namespace}."
        names: list[str] = []
        token = None
        while True:
            page = self.client.search_registered_models(
                filter_string=f"name LIKE '{prefix}%'", max_results=1000, page_token=token
            )
            names += [m.name[len(prefix) :] for m in page if m.name.startswith(prefix)]
            token = page.token
            if not token:
                return sorted(names)

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
        """Resolve a reference to one version; DeltaNotFoundError lists what exists."""
        ref = _ref(ref, method=method, version=version, alias=alias)
        model = self.model_name(ref.task)
        registered = self._registered_model(model)
        aliases = registered.aliases or {}
        if ref.version is not None:
            try:
                found = self.client.get_model_version(model, ref.version)
            except Exception as exc:
                if not _is_missing(exc):
                    raise
                known = [v.version for v in self._versions(model)]
                raise DeltaNotFoundError(
                    "version", ref.version, known, where=f"of task {ref.task!r}"
                ) from None
            return self._info(found, self._aliases_by_version(registered))
        if ref.method is not None:
            name = method_alias(ref.method)
            if name not in aliases:
                methods = self._methods_with_aliases(model, aliases)
                raise DeltaNotFoundError(
                    "method", ref.method, methods, where=f"with a best version for task {ref.task!r}"
                )
            wanted = name
        else:
            wanted = ref.alias or BEST
            if wanted not in aliases:
                versions = [str(v.version) for v in self._versions(model)]
                hint = (
                    f" (its versions: {', '.join(versions)}; pick one with version=...)"
                    if versions
                    else " (it has no versions yet)"
                )
                raise DeltaNotFoundError("alias", wanted, aliases, where=f"on task {ref.task!r}", hint=hint)
        found = self.client.get_model_version_by_alias(model, wanted)
        return self._info(found, self._aliases_by_version(registered))

    def download(
        self, task: str | DeltaRef, version: str | int | None = None, dest: str | Path | None = None
    ) -> Path:
        """Download a version's delta folder (into `dest`, else a new temporary folder the caller owns)
        and check it against its recorded sha256; DeltaIntegrityError (folder removed) when it differs."""
        ref = DeltaRef.parse(task) if version is None else DeltaRef(str(task), version=version)
        info = self.get_version(ref)
        return self._download(info, dest)

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
        info = self.get_version(_ref(task, method=method, version=version, alias=alias))
        with tempfile.TemporaryDirectory(prefix="pelt-pull-") as scratch:
            folder = self._download(info, Path(scratch) / "delta")
            return self._load(info, folder, backbone, fold)

    # --- composition -----------------------------------------------------------------------------

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
        from pelt_core import compose as pelt_compose

        check_compose_request(op, sources, into, aliases, options)  # before anything is pulled or written
        named = self._named_sources(sources, bundle=op == "multi_task")
        pulled = {name: self.pull(ref, backbone=backbone) for name, ref in named.items()}
        first = next(iter(pulled.values()))
        hashes = {p.backbone.content_hash for p in pulled.values()}
        if len(hashes) > 1:
            raise DeltaStoreError(
                "these deltas belong to different backbones: "
                + ", ".join(f"{name} ({p.manifest['backbone']['name']})" for name, p in pulled.items())
            )
        backbone_obj = first.backbone
        source_infos = [p.info for p in pulled.values()]
        sources_tag = [
            {"name": n, "task": p.task, "version": p.version, "sha256": p.sha256} for n, p in pulled.items()
        ]
        with tempfile.TemporaryDirectory(prefix="pelt-compose-") as scratch:
            out = Path(scratch) / "delta"
            if op == "multi_task":
                for name, p in pulled.items():
                    if p.info.kind == "multi_task":
                        raise DeltaStoreError(f"{name}: a multi-task bundle cannot go into another one")
                pelt_compose.multi_task(backbone_obj, {n: p.delta for n, p in pulled.items()})  # checks them
                provenance = {
                    "op": "multi_task",
                    "inputs": sources_tag,
                    "backbone_hash": backbone_obj.content_hash,
                }
                _write_bundle(out, pulled, backbone_obj)
                composed_delta, method, sha = None, "multi_task", _sha256_file(out / BUNDLE_FILE)
            else:
                function = {
                    "merge": pelt_compose.merge,
                    "average": pelt_compose.average,
                    "merge_lora_svd": pelt_compose.merge_lora_svd,
                }[op]
                if op == "merge_lora_svd":
                    options.setdefault("weights", None)
                try:  # a rank above what the deltas' matrices hold is refused before it is allocated
                    composed_delta = function(
                        {n: p.delta for n, p in pulled.items()}, backbone=backbone_obj, **options
                    )
                except pelt_compose.CompositionError as exc:
                    raise _option_error(exc) from None
                saved = pelt_compose.save_composed(
                    composed_delta, backbone_obj, out, extra={"sources": sources_tag}
                )
                provenance = dict(composed_delta.provenance)
                method, sha = composed_delta.method.name, saved.sha256
            tags = {
                TAG_KIND: "multi_task" if op == "multi_task" else "composed",
                TAG_TASK: into,
                TAG_METHOD: method,
                TAG_BACKBONE: first.manifest["backbone"]["name"],
                TAG_BACKBONE_HASH: backbone_obj.content_hash,
                TAG_SHA256: sha,
                TAG_OP: str(provenance.get("op", op)),
                TAG_SOURCES: _clip(json.dumps(sources_tag, separators=(",", ":")), MAX_TAG_CHARS),
                TAG_ARTIFACT_PATH: ARTIFACT_PATH,
            }
            params = {
                "op": op,
                "sources": json.dumps([str(named[n]) for n in named]),
                **{k: json.dumps(v) for k, v in options.items()},
            }
            text = description or f"{tags[TAG_OP]} of " + ", ".join(
                f"{s['task']}/{s['version']}" for s in sources_tag
            )
            new_model = not self._model_exists(into)
            stored = None
            try:  # all or nothing: a failure once the version exists takes it back (and a model made for it)
                stored = self._register_folder(
                    into,
                    out,
                    sha,
                    tags,
                    params,
                    text,
                    run_name=f"compose-{op}",
                    extra_artifacts={"provenance.json": provenance},
                )
                for name in aliases:
                    self.client.set_registered_model_alias(self.model_name(into), name, stored.model_version)
                if on_written is not None:
                    on_written(stored)
            except BaseException:
                self._take_back(into, stored, new_model)
                raise
        return Composed(into, str(stored.model_version), stored, provenance, composed_delta, source_infos)

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
        _check_task(task)
        folder = Path(delta_dir)
        manifest = _read_manifest(folder)
        sha = _sha256_file(folder / DELTA_FILE)
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
            task, folder, sha, all_tags, {}, description or f"imported {folder.name}", run_name="import"
        )
        for name in aliases:
            self.client.set_registered_model_alias(self.model_name(task), name, stored.model_version)
        return stored

    # --- internals: MLflow objects ---------------------------------------------------------------

    def _registry(self, registry: Registry | None) -> Registry:
        registry = registry or self.registry
        if registry is None:
            raise DeltaStoreError("this needs the registry: MlflowDeltaStore(..., registry=Registry())")
        return registry

    def _uri(self, model: str, version: str | int) -> str:
        return f"models:/{model}/{version}"

    def _sealed(self, job_id: int, registry: Registry | None) -> StoredDelta | None:
        """The delta the registry recorded for a succeeded job (None: no result row yet, or no registry)."""
        if registry is None:
            return None
        result = registry.get_result(job_id)
        if result is None:
            return None
        return StoredDelta(
            result.delta_uri or "",
            result.delta_sha256 or "",
            result.mlflow_run_id,
            result.mlflow_model_version,
        )

    def _registered_model(self, model: str) -> RegisteredModel:
        try:
            return self.client.get_registered_model(model)
        except Exception as exc:
            if not _is_missing(exc):
                raise
            task = model[len(self.namespace) + 1 :]
            # no URI in the message: it reaches API users, and where the store lives is the server's business
            raise DeltaNotFoundError("task", task, self.list_tasks(), where="in the delta store") from None

    def _model_exists(self, task: str) -> bool:
        try:
            self.client.get_registered_model(self.model_name(task))
            return True
        except Exception as exc:
            if not _is_missing(exc):
                raise
            return False

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

    def _ensure_model(self, task: str, metric: str | None = None, direction: str | None = None) -> str:
        model = self.model_name(task)
        try:
            self.client.get_registered_model(model)
            return model
        except Exception as exc:
            if not _is_missing(exc):
                raise
        tags = {TAG_TASK: task, "pelt.namespace": self.namespace}
        if metric:
            tags[TAG_METRIC] = metric
        if direction:
            tags["pelt.metric_direction"] = direction
        try:
            self.client.create_registered_model(model, tags=tags, description=f"pelt deltas of task {task}")
        except Exception as exc:
            if not _is_already(exc):
                raise
        return model

    def _ensure_experiment(self, task: str) -> str:
        name = self.experiment_name(task)
        if name in self._experiments:
            return self._experiments[name]
        found = self.client.get_experiment_by_name(name)
        if found is None:
            location = None if self.artifact_root is None else f"{self.artifact_root}/{self.namespace}/{task}"
            try:
                experiment_id = self.client.create_experiment(
                    name, artifact_location=location, tags={TAG_TASK: task, "pelt.namespace": self.namespace}
                )
            except Exception as exc:
                if not _is_already(exc):
                    raise
                experiment_id = self.client.get_experiment_by_name(name).experiment_id
        else:
            experiment_id = found.experiment_id
            if found.lifecycle_stage == "deleted":
                self.client.restore_experiment(experiment_id)
        self._experiments[name] = experiment_id
        return experiment_id

    def _versions(self, model: str, filter_extra: str = "") -> list[ModelVersion]:
        query = f"name='{model}'" + (f" and {filter_extra}" if filter_extra else "")
        found: list[ModelVersion] = []
        token = None
        while True:
            page = self.client.search_model_versions(query, max_results=10_000, page_token=token)
            found += list(page)
            token = page.token
            if not token:
                return sorted(found, key=lambda v: int(v.version))

    def _job_versions(self, model: str, job_id: int) -> list[ModelVersion]:
        return self._versions(model, f"tags.`{TAG_JOB_ID}` = '{int(job_id)}'")

    def _job_runs(self, experiment_id: str, job_id: int) -> list[Run]:
        return list(
            self.client.search_runs(
                [experiment_id], f"tags.`{TAG_JOB_ID}` = '{int(job_id)}'", max_results=1000
            )
        )

    def _discard(self, versions: Iterable[ModelVersion], runs: Iterable[Run]) -> None:
        """Delete an earlier attempt's versions and runs (runs are soft-deleted, as MLflow does)."""
        for version in versions:
            log.info(
                "deleting %s version %s (an earlier attempt of job %s)",
                version.name,
                version.version,
                version.tags.get(TAG_JOB_ID),
            )
            with _ignore_missing():
                self.client.delete_model_version(version.name, version.version)
        for run in runs:
            with _ignore_missing():
                self.client.delete_run(run.info.run_id)

    def _drop_unrecorded(self, registry: Registry, job: JobSpec, stored: StoredDelta) -> None:
        """Remove this store's version and run of a job unless the registry's result row names them."""
        try:
            result = registry.get_result(job.job_id)
        except Exception:  # cannot tell: keep it (a later store of the job replaces it)
            log.exception(
                "cannot read the result of job %s; keeping version %s", job.job_id, stored.model_version
            )
            return
        if result is not None and result.mlflow_model_version == stored.model_version:
            return
        model = self.model_name(job.task.name)
        with _ignore_missing():
            self.client.delete_model_version(model, str(stored.model_version))
        if stored.run_id and (result is None or result.mlflow_run_id != stored.run_id):
            with _ignore_missing():
                self.client.delete_run(stored.run_id)

    def _create_version(self, model: str, run_id: str, tags: dict[str, str], description: str) -> str:
        version = self.client.create_model_version(
            model, source=f"runs:/{run_id}/{ARTIFACT_PATH}", run_id=run_id, tags=tags, description=description
        )
        return str(version.version)

    def _log_job_run(
        self,
        experiment_id: str,
        job: JobSpec,
        folder: Path,
        sha: str,
        manifest: dict[str, Any],
        result: Mapping[str, Any],
        history: list[dict[str, Any]],
    ) -> str:
        from mlflow.entities import Metric, Param

        tags = {
            TAG_KIND: "job",
            TAG_JOB_ID: str(job.job_id),
            TAG_TASK: job.task.name,
            TAG_METHOD: job.method,
            TAG_BACKBONE: job.backbone,
            TAG_BACKBONE_HASH: manifest["backbone"]["content_hash"],
            TAG_ATTEMPT: str(job.attempt),
            TAG_METRIC: job.task.metric,
        }
        if job.sweep_id is not None:
            tags[TAG_SWEEP_ID] = str(job.sweep_id)
        for key, value in job.tags.items():
            if not key.startswith(("mlflow.", "pelt.")):
                tags[key] = str(value)
        run = self.client.create_run(experiment_id, run_name=f"job-{job.job_id}-{job.method}", tags=tags)
        run_id = run.info.run_id
        try:
            params = {
                "task": job.task.name,
                "method": job.method,
                "backbone": job.backbone,
                "backbone_dtype": job.backbone_dtype,
                **job.train_config,
                **_flatten(job.method_spec, "spec"),
            }
            now = int(time.time() * 1000)
            metrics = [Metric(key, value, now, step) for key, value, step in _history_metrics(history)]
            metrics += [Metric(key, value, now, 0) for key, value in _final_metrics(result)]
            self._log_batch(run_id, [Param(k, _param_value(v)) for k, v in params.items()], metrics)
            self.client.log_artifacts(run_id, str(folder), ARTIFACT_PATH)
            self.client.log_dict(run_id, job.to_dict(), "job.json")
            self.client.log_dict(run_id, list(history), "history.json")
            self.client.set_tag(run_id, TAG_SHA256, sha)  # last: marks the run's delta complete
            self.client.set_terminated(run_id, "FINISHED")
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.set_terminated(run_id, "FAILED")
            raise
        return run_id

    def _register_folder(
        self,
        task: str,
        folder: Path,
        sha: str,
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
        try:
            self._log_batch(run_id, [Param(k, _param_value(v)) for k, v in params.items()], [])
            self.client.log_artifacts(run_id, str(folder), ARTIFACT_PATH)
            for name, value in (extra_artifacts or {}).items():
                self.client.log_dict(run_id, value, name)
            self.client.set_tag(run_id, TAG_SHA256, sha)
            self.client.set_terminated(run_id, "FINISHED")
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.set_terminated(run_id, "FAILED")
            raise
        version = self._create_version(model, run_id, tags, description)
        return StoredDelta(self._uri(model, version), sha, run_id, version)

    def _log_batch(self, run_id: str, params: list, metrics: list) -> None:
        for start in range(0, len(params), 100):  # mlflow's per-request limits
            self.client.log_batch(run_id, params=params[start : start + 100])
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[start : start + 1000])

    # --- internals: reading ----------------------------------------------------------------------

    def _aliases_by_version(self, registered: RegisteredModel) -> dict[str, list[str]]:
        by_version: dict[str, list[str]] = {}
        for alias, version in (registered.aliases or {}).items():
            by_version.setdefault(str(version), []).append(alias)
        return by_version

    def _methods_with_aliases(self, model: str, aliases: Mapping[str, Any]) -> list[str]:
        methods = []
        for alias, version in aliases.items():
            if alias.startswith(METHOD_ALIAS_PREFIX):
                found = self.client.get_model_version(model, str(version))
                methods.append(found.tags.get(TAG_METHOD) or alias[len(METHOD_ALIAS_PREFIX) :])
        return methods

    def _info(self, version: ModelVersion, aliases: Mapping[str, list[str]]) -> VersionInfo:
        tags = dict(version.tags or {})
        job_id = tags.get(TAG_JOB_ID)
        value = tags.get(TAG_METRIC_VALUE)
        return VersionInfo(
            task=version.name[len(self.namespace) + 1 :],
            model_name=version.name,
            version=str(version.version),
            kind=tags.get(TAG_KIND, "unknown"),
            sha256=tags.get(TAG_SHA256),
            run_id=version.run_id,
            source=version.source,
            job_id=int(job_id) if job_id and job_id.isdigit() else None,
            method=tags.get(TAG_METHOD),
            metric=tags.get(TAG_METRIC),
            metric_value=float(value) if value is not None else None,
            aliases=tuple(sorted(aliases.get(str(version.version), []))),
            tags=tags,
            created_at=datetime.fromtimestamp(version.creation_timestamp / 1000, UTC),
        )

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
                _verify(info, local)
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

    def _load(self, info: VersionInfo, folder: Path, backbone: Any, fold: bool) -> PulledModel:
        return load_pulled(info, folder, lambda manifest: self._backbone(manifest, backbone), fold=fold)

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
                if not BUNDLE_KEY_PATTERN.match(key):
                    raise DeltaStoreError(f"multi-task route name {key!r}: letters, digits, '_' and '-' only")
        return named


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------
_REGISTRIES: dict[str, Registry] = {}
_REGISTRIES_LOCK = threading.Lock()


def load_pulled(
    info: VersionInfo, folder: Path, backbone_for: Callable[[dict[str, Any]], Backbone], fold: bool = False
) -> PulledModel:
    """Load a downloaded version folder (a delta, or a multi-task bundle) onto the backbone that
    `backbone_for(manifest)` returns, checking the recorded sha256: a PulledModel ready to predict.
    (The store's `pull` and the HTTP client's `pull` both end here.)"""
    from pelt_core.compose import fold_lora, multi_task
    from pelt_core.delta import load_delta, read_manifest
    from pelt_core.model import PeltModel

    if info.kind == "multi_task":
        bundle = json.loads((folder / BUNDLE_FILE).read_text())
        manifest = {"format": BUNDLE_FORMAT, **bundle}
        chosen = backbone_for({"backbone": bundle["backbone"]})
        deltas = {
            name: _to_device(load_delta(folder / entry["path"], chosen, entry["sha256"]), chosen)
            for name, entry in bundle["tasks"].items()
        }
        if fold:
            raise DeltaStoreError(f"{info.uri} is a multi-task bundle; fold its tasks one by one")
        return PulledModel(info, info.sha256 or "", manifest, chosen, deltas, multi_task(chosen, deltas))
    manifest = read_manifest(folder)
    chosen = backbone_for(manifest)
    delta = _to_device(load_delta(folder, chosen, expected_sha256=info.sha256), chosen)
    model = fold_lora(chosen, delta) if fold else PeltModel(chosen, {"delta": delta}).eval()
    return PulledModel(info, info.sha256 or "", manifest, chosen, {"delta": delta}, model)


def _shared_registry(url: str) -> Registry:
    """One Registry per database URL and process, for stores unpickled on workers (one per job)."""
    from services.registry import Registry

    with _REGISTRIES_LOCK:
        if url not in _REGISTRIES:
            _REGISTRIES[url] = Registry(url)
        return _REGISTRIES[url]


def _ref(
    ref: str | DeltaRef, *, method: str | None, version: str | int | None, alias: str | None
) -> DeltaRef:
    parsed = DeltaRef.parse(ref)
    if method is None and version is None and alias is None:
        return parsed
    if (parsed.version, parsed.method, parsed.alias) != (None, None, None):
        raise DeltaStoreError(
            f"{ref!r} already names a version or alias; do not also pass method/version/alias"
        )
    return DeltaRef(parsed.task, version=version, method=method, alias=alias)


def _check_alias(name: object, field: str) -> None:
    """An alias a caller may set: letters, digits, '_' and '-' (at most 100), not one MLflow reserves
    ("latest", v<digits>) and not one the registry's results set (best, best-<method>)."""
    if not isinstance(name, str) or not ALIAS_PATTERN.match(name):
        raise DeltaStoreError(
            f"{field}: {name!r} is not an alias: letters, digits, '_' and '-' (at most 100), "
            "and not 'latest' or v<digits> (MLflow's version references)",
            field=field,
        )
    if name == BEST or name.startswith(METHOD_ALIAS_PREFIX):
        raise DeltaStoreError(
            f"{field}: alias {name!r} is set by sync_aliases from the registry's results; "
            "give the composed version another alias",
            field=field,
        )


def check_compose_request(
    op: str, sources: Any, into: str, aliases: Sequence[str], options: Mapping[str, Any]
) -> None:
    """A composition request before anything is pulled or written: the op, the task `into`, the aliases,
    the number of sources and the options (pelt_core.compose's `check_options`: names, types, ranges).
    A caller that passes a request's options on as keywords checks them here first, so no option can
    name one of `MlflowDeltaStore.compose`'s own parameters."""
    from pelt_core import compose as pelt_compose
    from pelt_core.limits import MAX_COMPOSE_ALIASES, MAX_COMPOSE_SOURCES

    if op not in COMPOSE_OPS:
        raise DeltaStoreError(f"op must be one of {', '.join(COMPOSE_OPS)}, got {op!r}", field="op")
    if op == "multi_task" and options:
        raise DeltaStoreError(f"multi_task takes no options, got {', '.join(options)}", field="options")
    _check_task(into)
    if isinstance(aliases, str) or len(aliases) > MAX_COMPOSE_ALIASES:
        raise DeltaStoreError(f"aliases: give a list of at most {MAX_COMPOSE_ALIASES} names", field="aliases")
    for index, name in enumerate(aliases):
        _check_alias(name, f"aliases[{index}]")
    count = len(sources) if isinstance(sources, Sequence | Mapping) and not isinstance(sources, str) else 1
    if count > MAX_COMPOSE_SOURCES:
        raise DeltaStoreError(
            f"sources: at most {MAX_COMPOSE_SOURCES} deltas per composition, got {count}", field="sources"
        )
    try:
        pelt_compose.check_options(op, options, count)
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


def _check_task(task: str) -> None:
    if not isinstance(task, str) or not TASK_PATTERN.match(task):
        raise DeltaStoreError(f"{task!r} is not a task name (letters, digits, '_', '.', '-'; at most 100)")


def _version_string(version: str | int) -> str:
    text = str(version)
    if isinstance(version, bool) or not text.isdigit() or int(text) < 1:
        raise DeltaStoreError(f"a model version is a whole number >= 1, got {version!r}")
    return str(int(text))


def _as_uri(location: str | Path) -> str:
    text = str(location)
    if "://" in text or text.startswith(("mlflow-artifacts:", "file:")):
        return text.rstrip("/")
    return Path(text).expanduser().resolve().as_uri()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_manifest(folder: Path) -> dict[str, Any]:
    if not (folder / DELTA_FILE).is_file() or not (folder / MANIFEST_FILE).is_file():
        raise DeltaStoreError(f"{folder} is not a pelt delta: it needs {DELTA_FILE} and {MANIFEST_FILE}")
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    if not isinstance(manifest.get("backbone"), dict) or "content_hash" not in manifest["backbone"]:
        raise DeltaStoreError(f"{folder / MANIFEST_FILE}: no backbone content hash")
    return manifest


def _run_artifact(info: VersionInfo) -> tuple[str, str]:
    """(run id, artifact path) of a version: from its `runs:/<run>/<path>` source, else run id + tag."""
    if info.source.startswith("runs:/"):
        run_id, _, path = info.source[len("runs:/") :].partition("/")
        return run_id, path or info.tags.get(TAG_ARTIFACT_PATH, ARTIFACT_PATH)
    if info.run_id:
        return info.run_id, info.tags.get(TAG_ARTIFACT_PATH, ARTIFACT_PATH)
    raise DeltaStoreError(f"{info.uri}: source {info.source!r} is not a pelt delta artifact")


def _verify(info: VersionInfo, folder: Path) -> None:
    """The downloaded files against the recorded sha256 (a bundle: bundle.json, then each task's delta)."""
    if info.kind == "multi_task":
        actual = _sha256_file(folder / BUNDLE_FILE) if (folder / BUNDLE_FILE).is_file() else None
        if actual != info.sha256:
            raise DeltaIntegrityError(
                f"{info.uri}: {BUNDLE_FILE} has sha256 {actual}, not the recorded "
                f"{info.sha256}; refusing to load it"
            )
        for name, entry in json.loads((folder / BUNDLE_FILE).read_text())["tasks"].items():
            part = folder / entry["path"] / DELTA_FILE
            actual = _sha256_file(part) if part.is_file() else None
            if actual != entry["sha256"]:
                raise DeltaIntegrityError(
                    f"{info.uri}: task {name!r} has sha256 {actual}, not the recorded "
                    f"{entry['sha256']}; refusing to load it"
                )
        return
    path = folder / DELTA_FILE
    actual = _sha256_file(path) if path.is_file() else None
    if actual != info.sha256:
        raise DeltaIntegrityError(
            f"{info.uri}: {DELTA_FILE} has sha256 {actual}, not the recorded {info.sha256}; "
            "refusing to load it"
        )


def _write_bundle(out: Path, pulled: Mapping[str, PulledModel], backbone: Backbone) -> None:
    """A multi-task bundle: tasks/<name>/ (delta + manifest, as pulled) and bundle.json with their sha256."""
    from pelt_core.delta import save_delta

    entries = {}
    for name, p in pulled.items():
        folder = out / "tasks" / name
        saved = save_delta(_copy_delta(p.delta), backbone, folder, extra=p.manifest.get("extra"))
        entries[name] = {
            "path": f"tasks/{name}",
            "sha256": saved.sha256,
            "task": p.task,
            "version": p.version,
            "source_sha256": p.sha256,
        }
    bundle = {
        "format": BUNDLE_FORMAT,
        "format_version": 1,
        "backbone": {"name": backbone.name, "content_hash": backbone.content_hash},
        "tasks": entries,
    }
    (out / BUNDLE_FILE).write_text(json.dumps(bundle, indent=2, sort_keys=True))


def _copy_delta(delta: JobDelta) -> JobDelta:
    import copy

    return copy.deepcopy(delta)


def _to_device(delta: JobDelta, backbone: Backbone) -> JobDelta:
    device = next(backbone.model.parameters()).device
    return delta.to(device).eval()


def _primary_metric(result: Mapping[str, Any], metric: str) -> float | None:
    value = result.get("primary_metric", (result.get("metrics") or {}).get(metric))
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _history_metrics(history: Iterable[Mapping[str, Any]]) -> list[tuple[str, float, int]]:
    """Per-epoch metrics (step = the epoch number; the record's optimiser step as `step`)."""
    points = []
    for index, record in enumerate(history, start=1):
        epoch = record.get("epoch", index)
        step = int(epoch) if isinstance(epoch, int | float) and float(epoch).is_integer() else index
        for key, value in _numbers(record):
            if key not in ("epoch", "step"):
                points.append((key, value, step))
    return points


def _final_metrics(result: Mapping[str, Any]) -> list[tuple[str, float]]:
    """`final/<metric>` for the final evaluation, plus the result's other numbers (sizes, times)."""
    found = [(f"final/{k}", v) for k, v in _numbers(result.get("metrics") or {})]
    found += [(k, v) for k, v in _numbers({k: v for k, v in result.items() if k != "metrics"})]
    return found


def _numbers(values: Mapping[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    found = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            found += _numbers(value, name + "/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found.append((name, float(value)))
    return [(k, v) for k, v in found if re.fullmatch(r"[\w./ -]{1,250}", k) and not math.isinf(v)]


def _flatten(values: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}.{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return _clip(text, MAX_PARAM_CHARS)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _is_missing(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def _is_already(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) == "RESOURCE_ALREADY_EXISTS"


@contextlib.contextmanager
def _ignore_missing():
    try:
        yield
    except Exception as exc:
        if not _is_missing(exc):
            raise


__all__ = [
    "BEST",
    "COMPOSE_OPS",
    "Composed",
    "DeltaRef",
    "MlflowDeltaStore",
    "PulledModel",
    "VersionInfo",
    "check_compose_request",
    "method_alias",
]
