"""What every part of the MLflow delta store shares: the connection (tracking URI, client, namespace,
registry, backbones), pickling for Ray, names of experiments and models, and the MLflow look-ups and
writes the sink, the aliases, the reading and the composing parts all use."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from pelt_core.delta_format import DELTA_FILE, DeltaError, read_manifest, sha256_file
from services.delta_store.bootstrap import (
    check_store,
    display_uri,
    ensure_store,
    is_server_uri,
    normalize_tracking_uri,
    quiet_mlflow,
)
from services.delta_store.errors import DeltaNotFoundError, DeltaStoreError
from services.delta_store.values import (
    ARTIFACT_PATH,
    NAMESPACE_PATTERN,
    TAG_ARCHIVED,
    TAG_JOB_ID,
    TAG_KIND,
    TAG_METHOD,
    TAG_METRIC,
    TAG_METRIC_VALUE,
    TAG_SHA256,
    TAG_TASK,
    VersionInfo,
    check_task,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run
    from mlflow.entities.model_registry import ModelVersion, RegisteredModel

    from pelt_core.backbones import Backbone
    from services.registry import Registry
    from services.settings import Settings

log = logging.getLogger("pelt.delta_store")

_REGISTRIES: dict[str, Registry] = {}
_REGISTRIES_LOCK = threading.Lock()


class StoreBase:
    """The store's connection and shared MLflow internals (the parameters: `MlflowDeltaStore`)."""

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
        from services.settings import get_settings  # pydantic: not at import (the compose child)

        settings = settings or get_settings()
        if not isinstance(namespace, str) or not NAMESPACE_PATTERN.fullmatch(namespace):
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
        self._backbones: dict[str, Backbone] = {b.content_hash: b for b in backbones}
        self._backbone_loader = backbone_loader
        self._experiments: dict[str, str] = {}

    @functools.cached_property
    def client(self) -> MlflowClient:
        """MLflow's client of this store, made on first use (its stores open their own engines and check
        their schema: about 0.1 s, which a service whose requests never reach MLflow need not spend)."""
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **kwargs: Any) -> Self:
        """The store the settings describe (PELT_MLFLOW_TRACKING_URI, PELT_MLFLOW_ARTIFACT_ROOT)."""
        from services.settings import get_settings

        settings = settings or get_settings()
        return cls(settings.mlflow_tracking_uri, None, settings=settings, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({display_uri(self.tracking_uri)!r}, namespace={self.namespace!r})"

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

    def ping(self, timeout: float = 3.0) -> None:
        """Raise unless the store answers: a tracking server its /health within `timeout` s; an embedded
        store its schema check."""
        if not self.is_server:
            check_store(self.tracking_uri)
            return
        import urllib.request

        with urllib.request.urlopen(f"{self.tracking_uri.rstrip('/')}/health", timeout=timeout) as answer:
            if answer.status != 200:
                raise ConnectionError(f"the MLflow server answered {answer.status}")

    # --- names -----------------------------------------------------------------------------------

    def model_name(self, task: str) -> str:
        """The registered model of a task: `<namespace>.<task>`."""
        check_task(task)
        return f"{self.namespace}.{task}"

    def experiment_name(self, task: str) -> str:
        """The experiment of a task: `<namespace>/<task>`."""
        check_task(task)
        return f"{self.namespace}/{task}"

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

    # --- registry --------------------------------------------------------------------------------

    def _registry(self, registry: Registry | None) -> Registry:
        registry = registry or self.registry
        if registry is None:
            raise DeltaStoreError("this needs the registry: MlflowDeltaStore(..., registry=Registry())")
        return registry

    # --- registered models and experiments -------------------------------------------------------

    def _registered_model(self, model: str) -> RegisteredModel:
        try:
            return self.client.get_registered_model(model)
        except Exception as exc:
            if not is_missing(exc):
                raise
            task = model[len(self.namespace) + 1 :]
            # no URI in the message: it reaches API users, and where the store lives is the server's business
            raise DeltaNotFoundError("task", task, self.list_tasks(), where="in the delta store") from None

    def _model_exists(self, task: str) -> bool:
        try:
            self.client.get_registered_model(self.model_name(task))
            return True
        except Exception as exc:
            if not is_missing(exc):
                raise
            return False

    def _ensure_model(self, task: str, metric: str | None = None, direction: str | None = None) -> str:
        model = self.model_name(task)
        if self._model_exists(task):
            return model
        tags = {TAG_TASK: task, "pelt.namespace": self.namespace}
        if metric:
            tags[TAG_METRIC] = metric
        if direction:
            tags["pelt.metric_direction"] = direction
        try:
            self.client.create_registered_model(model, tags=tags, description=f"pelt deltas of task {task}")
        except Exception as exc:
            if not is_already(exc):
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
                if not is_already(exc):
                    raise
                experiment_id = self.client.get_experiment_by_name(name).experiment_id
        else:
            experiment_id = found.experiment_id
            if found.lifecycle_stage == "deleted":
                self.client.restore_experiment(experiment_id)
        self._experiments[name] = experiment_id
        return experiment_id

    # --- versions and runs -----------------------------------------------------------------------

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

    def _archived_versions(self, model: str) -> dict[str, int | None]:
        """The model's archived versions: {version number: the id of the job that trained it, or None}."""
        found = self._versions(model, f"tags.`{TAG_ARCHIVED}` = 'true'")
        job_ids = {str(v.version): (v.tags or {}).get(TAG_JOB_ID, "") for v in found}
        return {version: int(job) if job.isdigit() else None for version, job in job_ids.items()}

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
            with ignore_missing():
                self.client.delete_model_version(version.name, version.version)
        for run in runs:
            with ignore_missing():
                self.client.delete_run(run.info.run_id)

    def _create_version(self, model: str, run_id: str, tags: dict[str, str], description: str) -> str:
        version = self.client.create_model_version(
            model, source=f"runs:/{run_id}/{ARTIFACT_PATH}", run_id=run_id, tags=tags, description=description
        )
        return str(version.version)

    def _log_batch(self, run_id: str, params: list, metrics: list) -> None:
        for start in range(0, len(params), 100):  # mlflow's per-request limits
            self.client.log_batch(run_id, params=params[start : start + 100])
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[start : start + 1000])

    def _finish_run(self, run_id: str, sha: str, log_files: Callable[[], None]) -> None:
        """Log a run's files with `log_files`, then tag its delta's sha256 (last: it marks the run's
        delta complete) and end it FINISHED; FAILED when anything raised."""
        try:
            log_files()
            self.client.set_tag(run_id, TAG_SHA256, sha)
            self.client.set_terminated(run_id, "FINISHED")
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.set_terminated(run_id, "FAILED")
            raise

    # --- what a version is -----------------------------------------------------------------------

    def _aliases_by_version(self, registered: RegisteredModel) -> dict[str, list[str]]:
        by_version: dict[str, list[str]] = {}
        for alias, version in (registered.aliases or {}).items():
            by_version.setdefault(str(version), []).append(alias)
        return by_version

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
            archived=tags.get(TAG_ARCHIVED) == "true",
        )


def is_missing(exc: Exception) -> bool:
    """An MLflow error saying the thing asked for does not exist."""
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def is_already(exc: Exception) -> bool:
    """An MLflow error saying the thing to create exists already."""
    return getattr(exc, "error_code", None) == "RESOURCE_ALREADY_EXISTS"


@contextlib.contextmanager
def ignore_missing() -> Iterator[None]:
    """Swallow MLflow's "does not exist" (a delete that someone else did first)."""
    try:
        yield
    except Exception as exc:
        if not is_missing(exc):
            raise


def read_delta_folder(folder: Path) -> tuple[dict[str, Any], str]:
    """(manifest, sha256 of the delta file) of a delta folder to store; DeltaStoreError if it is none."""
    try:
        manifest = read_manifest(folder)
    except DeltaError as exc:
        raise DeltaStoreError(str(exc)) from None
    if not isinstance(manifest.get("method"), dict) or not isinstance(manifest["backbone"].get("name"), str):
        raise DeltaStoreError(f"{folder}: its manifest names no method or no backbone name")
    return manifest, sha256_file(folder / DELTA_FILE)


def _shared_registry(url: str) -> Registry:
    """One Registry per database URL and process, for stores unpickled on workers (one per job)."""
    from services.registry import Registry

    with _REGISTRIES_LOCK:
        if url not in _REGISTRIES:
            _REGISTRIES[url] = Registry(url)
        return _REGISTRIES[url]


def _as_uri(location: str | Path) -> str:
    text = str(location)
    if "://" in text or text.startswith(("mlflow-artifacts:", "file:")):
        return text.rstrip("/")
    return Path(text).expanduser().resolve().as_uri()
