"""The delta store as the service's `DeltaSink`: every job a run, every delta a model version, one version
per job once the registry has decided.

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

`complete_job()` does it all in order: store → Registry.complete_job → finalize_job (→ sync_aliases).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.delta_store.aliases import AliasMixin
from services.delta_store.base import log, read_delta_folder
from services.delta_store.errors import DeltaNotFoundError
from services.delta_store.values import (
    ARTIFACT_PATH,
    MAX_PARAM_CHARS,
    MAX_TAG_CHARS,
    TAG_ARTIFACT_PATH,
    TAG_ATTEMPT,
    TAG_BACKBONE,
    TAG_BACKBONE_HASH,
    TAG_JOB_ID,
    TAG_KIND,
    TAG_METHOD,
    TAG_METRIC,
    TAG_METRIC_VALUE,
    TAG_SHA256,
    TAG_SOURCES,
    TAG_SWEEP_ID,
    TAG_TASK,
    clip,
    version_uri,
)
from workers.job import JobSpec, StoredDelta

if TYPE_CHECKING:
    from services.registry import Registry, ResultRecord

SEALED_READ_SECONDS = 60.0  # a restarting registry database, waited out before a delta is stored


class SinkMixin(AliasMixin):
    """`store`, `complete_job`, `finalize_job`, `reconcile`: runs and versions of jobs (module docstring)."""

    def store(
        self, job: JobSpec, delta_dir: Path, result: dict[str, Any], history: list[dict[str, Any]]
    ) -> StoredDelta:
        """Log the job as a run (params, metric history, final metrics, tags, the delta folder) and add
        its model version; idempotent per job id (module docstring). Aliases are not touched here."""
        return self._store(job, Path(delta_dir), result, history, self.registry)

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

    # --- internals -------------------------------------------------------------------------------

    def _store(
        self,
        job: JobSpec,
        folder: Path,
        result: Mapping[str, Any],
        history: list[dict[str, Any]],
        registry: Registry | None,
    ) -> StoredDelta:
        manifest, sha = read_delta_folder(folder)
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
        finished = {r.info.run_id: r for r in runs if r.info.status == "FINISHED"}
        same = [v for v in versions if v.tags.get(TAG_SHA256) == sha and v.run_id in finished]
        if same:  # this delta is stored already (a repeated call)
            keep = min(same, key=lambda v: int(v.version))
            return StoredDelta(version_uri(model, keep.version), sha, keep.run_id, str(keep.version))
        # its run finished but the version is missing
        run_id = next((i for i, r in finished.items() if r.data.tags.get(TAG_SHA256) == sha), None)
        if registry is None:  # no arbiter: the last attempt replaces the earlier ones now
            self._discard(versions, [r for r in runs if r.info.run_id != run_id])
        if run_id is None:
            run_id = self._log_job_run(experiment_id, job, folder, sha, manifest, result, history)
        metric_value = _primary_metric(result, job.task.metric)
        tags = {**_job_tags(job, manifest), TAG_SHA256: sha, TAG_ARTIFACT_PATH: ARTIFACT_PATH}
        if metric_value is not None:
            tags[TAG_METRIC_VALUE] = repr(metric_value)
        shown = "" if metric_value is None else f" ({job.task.metric} {metric_value:.4g})"
        version = self._create_version(
            model, run_id, tags, f"job {job.job_id}: {job.method} on {task}{shown}"
        )
        return StoredDelta(version_uri(model, version), sha, run_id, version)

    def _sealed(self, job_id: int, registry: Registry | None) -> StoredDelta | None:
        """The delta the registry recorded for a succeeded job (None: no result row yet, or no registry);
        read again for up to SEALED_READ_SECONDS while the registry's database does not answer."""
        if registry is None:
            return None
        from services.registry.db import call_through_outage

        result = call_through_outage(
            lambda: registry.get_result(job_id), SEALED_READ_SECONDS, f"job {job_id}: reading its result"
        )
        if result is None:
            return None
        return StoredDelta(
            result.delta_uri or "",
            result.delta_sha256 or "",
            result.mlflow_run_id,
            result.mlflow_model_version,
        )

    def _settle(self, task: str, job_id: int, registry: Registry) -> tuple[bool, str | None]:
        """(whether the registry has decided about the job, the version it recorded here)."""
        result = registry.get_result(job_id)
        model = self.model_name(task)
        keep_version = keep_run = None
        if result is not None:
            recorded = result.mlflow_model_version
            if recorded is not None and result.delta_uri in (None, version_uri(model, recorded)):
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

        tags = {**_job_tags(job, manifest), TAG_ATTEMPT: str(job.attempt)}
        for key, value in job.tags.items():
            if not key.startswith(("mlflow.", "pelt.")):
                tags[key] = str(value)
        run = self.client.create_run(experiment_id, run_name=f"job-{job.job_id}-{job.method}", tags=tags)
        run_id = run.info.run_id

        def log_files() -> None:
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
            self._log_batch(run_id, [Param(k, param_value(v)) for k, v in params.items()], metrics)
            self.client.log_artifacts(run_id, str(folder), ARTIFACT_PATH)
            self.client.log_dict(run_id, job.to_dict(), "job.json")
            self.client.log_dict(run_id, list(history), "history.json")

        self._finish_run(run_id, sha, log_files)
        return run_id


def _job_tags(job: JobSpec, manifest: Mapping[str, Any]) -> dict[str, str]:
    """The tags a job's run and version share (the run adds its attempt: a version is the job's)."""
    fusion = (job.method_spec or {}).get("fusion")
    tags = {
        TAG_KIND: "fusion" if fusion else "job",
        TAG_JOB_ID: str(job.job_id),
        TAG_TASK: job.task.name,
        TAG_METHOD: job.method,
        TAG_BACKBONE: job.backbone,
        TAG_BACKBONE_HASH: manifest["backbone"]["content_hash"],
        TAG_METRIC: job.task.metric,
    }
    if job.sweep_id is not None:
        tags[TAG_SWEEP_ID] = str(job.sweep_id)
    if fusion:  # where its frozen adapters came from, as a composition names its sources
        sources = [{k: s.get(k) for k in ("task", "version", "sha256", "method")} for s in fusion["sources"]]
        tags[TAG_SOURCES] = clip(json.dumps(sources, sort_keys=True, separators=(",", ":")), MAX_TAG_CHARS)
    return tags


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


def param_value(value: Any) -> str:
    """A value as an MLflow param: a string as it is, anything else as JSON, clipped to MLflow's limit."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return clip(text, MAX_PARAM_CHARS)
