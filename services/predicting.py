"""Predicting by task name: the service side of `POST /v1/tasks/{task}/predict`.

A request names a task, texts (or text pairs) and which version answers (an alias, `best` by default,
`best-<method>`, or a version number). The service checks the rows against the limits table and the
task's text fields, resolves the version in the registry and delta store (again at most
PELT_PREDICT_RESOLVE_SECONDS, 2 s, after it last did: a new best answers within that time, and an archived
version stops being served within it), and sends (task, version, sha256)
with the rows to the Ray Serve application of the backbone the version was trained on
(`workers.serving`), starting that application at its first request. The replica checks the delta's file
against the sha256 the store recorded before it serves it.

The route awaits the replica without holding a thread: the checks and the resolution run on the API's
thread pool, the wait does not. At most PELT_PREDICT_MAX_QUEUED predictions wait in this process (a
503 with Retry-After beyond), and Ray Serve bounds the requests waiting for its replicas the same way.
Nothing here loads torch: the replicas do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pelt_core.limits import MAX_PREDICT_ROWS, MAX_PREDICT_TEXT_CHARS
from pelt_core.serving import FORWARD, INPUT, DeltaKey
from services.errors import ServiceError
from services.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "pelt"  # the Ray namespace the API joins when no dispatcher joined one before it
MAX_RESOLUTIONS = 10_000  # (task, version) resolutions kept at once; beyond, the cache starts again
START_RETRY_SECONDS = 30.0  # after a backbone's replicas failed to start, the next try waits this long
RESOURCE_TOLERANCE = 1e-4  # Ray counts resources in units of 1e-4: 1 - 0.4 - 0.4 leaves 0.2 for a replica
START_POLL_SECONDS = 0.1  # how often a request waiting for a start looks at what it waits for
INTEGRITY_ERRORS = ("DeltaError", "DeltaIntegrityError")  # a file that is not what the store recorded


@dataclass(frozen=True)
class Prediction:
    """An answer: the version that gave it and one prediction per row, in order."""

    task: str
    version: str
    method: str | None
    kind: str
    sha256: str
    backbone: str
    rows: list[dict[str, Any]]


@dataclass(frozen=True)
class Planned:
    """A checked request, ready for its backbone's replicas."""

    info: Any
    backbone: str
    key: DeltaKey
    rows: list[Any]
    method: Any  # the replicas' `predict` handle


class VersionFetcher:
    """What a replica calls to get a version's files: the delta store's download (checked against the
    sha256 the store recorded) into `dest`. Picklable: the store's URIs travel to the replica."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __call__(self, key: Any, dest: Path) -> Path:
        return self.store.download(key.task, key.version, dest=dest / "delta")


def check_rows(texts: Any, text_fields: Sequence[str] | None = None) -> list[str | tuple[str, str]]:
    """The request's rows as texts and (text, text_pair) tuples; a ServiceError naming `texts` (422, or
    413 beyond MAX_PREDICT_ROWS rows or MAX_PREDICT_TEXT_CHARS characters) for anything else, and for a
    pair given to a task trained on single texts (or the reverse), before any model work."""
    if not isinstance(texts, list) or not texts:
        raise ServiceError("give at least one text to predict", status=422, field="texts")
    if len(texts) > MAX_PREDICT_ROWS:
        raise ServiceError(
            f"{len(texts)} rows; one request takes at most {MAX_PREDICT_ROWS} (split the rest into more "
            "requests; `pelt predict --file` does)",
            status=413,
            field="texts",
        )
    pairs = None if not text_fields else len(text_fields) == 2
    rows: list[str | tuple[str, str]] = []
    for position, text in enumerate(texts):
        is_pair = (
            isinstance(text, list | tuple) and len(text) == 2 and all(isinstance(part, str) for part in text)
        )
        if not (isinstance(text, str) or is_pair):
            raise ServiceError(
                f"texts[{position}]: a text or a [text, text_pair] pair of strings, got {text!r:.80}",
                status=422,
                field="texts",
            )
        for part in (text,) if isinstance(text, str) else text:
            if len(part) > MAX_PREDICT_TEXT_CHARS:
                raise ServiceError(
                    f"texts[{position}]: {len(part):,} characters; a text holds at most "
                    f"{MAX_PREDICT_TEXT_CHARS:,}",
                    status=413,
                    field="texts",
                )
        if pairs is not None and is_pair != pairs:
            shape = (
                f"[{text_fields[0]}, {text_fields[1]}] pairs" if pairs else f"single texts ({text_fields[0]})"
            )
            raise ServiceError(
                f"texts[{position}]: this task was trained on {shape}; give every row that way",
                status=422,
                field="texts",
            )
        rows.append(text if isinstance(text, str) else (text[0], text[1]))
    return rows


def version_reference(task: str, version: str | int | None) -> Any:
    """The store's reference for `version`: a number, an alias (`best`, `best-lora`, one you set), or
    None for `best`."""
    from services.delta_store import DeltaRef

    if version is None or str(version).strip() == "":
        return DeltaRef(task)
    text = str(version).strip()
    if text.isdigit():
        return DeltaRef(task, version=text)
    return DeltaRef(task, alias=text)


def busy(message: str, retry_after: float) -> ServiceError:
    return ServiceError(message, status=503, retry_after=retry_after)


class PredictionService:
    """Resolves versions and sends rows to the backbones' Serve applications (one per backbone, started
    at its first request). `operations`: the service layer (registry, delta store, settings)."""

    def __init__(self, operations: Any, settings: Settings) -> None:
        self.operations, self.settings = operations, settings
        self._methods: dict[str, Any] = {}  # backbone name -> its replicas' `predict` handle
        self._starting: dict[str, threading.Event] = {}  # backbone name -> set once its start ended
        self._start_errors: dict[str, tuple[float, str]] = {}  # backbone name -> (retry at, why)
        self._start_waits: dict[str, str] = {}  # backbone name -> what its starting replicas wait for
        self._resolutions: dict[tuple, tuple[float, Any]] = {}  # key -> (kept until, value): `_kept`
        self._lock = threading.Lock()  # guards the dicts; never held while waiting
        self._waiting = 0  # predictions this process has in flight (the event loop's thread only)

    async def predict(self, task: str, texts: Any, version: str | int | None = None) -> Prediction:
        """Check, resolve, and await the replicas' answer (a ServiceError with the status for each refusal)."""
        from starlette.concurrency import run_in_threadpool

        if self._waiting >= self.settings.predict_max_queued:
            raise busy(
                f"{self._waiting} predictions are in flight here (PELT_PREDICT_MAX_QUEUED); try again", 1
            )
        self._waiting += 1
        try:
            planned = await run_in_threadpool(self.plan, task, texts, version)
            answer = await self._await(planned)
        finally:
            self._waiting -= 1
        if "failure" in answer:
            raise self._failure(planned.info, answer["failure"])
        return Prediction(
            task=planned.info.task,
            version=str(planned.info.version),
            method=planned.info.method,
            kind=planned.info.kind,
            sha256=planned.info.sha256,
            backbone=planned.backbone,
            rows=answer["rows"],
        )

    def plan(self, task: str, texts: Any, version: str | int | None = None) -> Planned:
        """The blocking part, on a worker thread: the checks, the resolution, the replicas' handle."""
        if not isinstance(texts, list) or not texts or len(texts) > MAX_PREDICT_ROWS:
            check_rows(texts)  # the count first: nothing is read for a request refused by its size
        fields = self._kept(("fields", task), lambda: list(self.operations.get_task(task).text_fields))
        rows = check_rows(texts, fields)  # an unknown task was a 404 naming the known ones
        reference = None if version is None else str(version).strip()
        info, backbone = self._kept(("version", task, reference), lambda: self._resolved(task, version))
        method = self._method(backbone)
        return Planned(info, backbone.name, DeltaKey(info.task, int(info.version), info.sha256), rows, method)

    def _resolved(self, task: str, version: str | int | None) -> tuple[Any, Any]:
        info = self._resolve(task, version)
        return info, self._backbone_of(info)

    def _kept(self, key: tuple, compute: Any) -> Any:
        """compute(), as computed at most PELT_PREDICT_RESOLVE_SECONDS ago for `key` (a task's text fields,
        the version a reference resolves to and its backbone): a new best, or an archived version, takes
        effect within that time (0: at every request). A refusal (an exception) is never kept."""
        now = time.monotonic()
        with self._lock:
            kept = self._resolutions.get(key)
        if kept is not None and now < kept[0]:
            return kept[1]
        value = compute()
        if self.settings.predict_resolve_seconds > 0:
            with self._lock:
                if len(self._resolutions) >= MAX_RESOLUTIONS:
                    self._resolutions.clear()
                self._resolutions[key] = (now + self.settings.predict_resolve_seconds, value)
        return value

    def _resolve(self, task: str, version: str | int | None) -> Any:
        """The version that answers, resolved in the store now (`_kept` keeps it a while)."""
        from services.delta_store import DeltaNotFoundError

        try:
            info = self.operations.delta_info(version_reference(task, version))
        except DeltaNotFoundError:
            if not self.operations.delta_versions(task):
                raise ServiceError(
                    f"task {task!r} has no trained version yet: predict once one of its jobs has succeeded",
                    status=404,
                    field="version",
                ) from None
            raise
        if info.archived:  # it answers to its number for pulls, never for predictions
            raise ServiceError(
                f"{task} version {info.version} is archived; it is not served (predict with another "
                "version, or `best`)",
                status=404,
                field="version",
            )
        if info.kind == "multi_task":
            raise ServiceError(
                f"{task} version {info.version} is a multi-task bundle; predict with each of its tasks' "
                "own versions",
                status=409,
                field="version",
            )
        if not info.sha256:
            from services.delta_store.errors import DeltaIntegrityError

            raise DeltaIntegrityError(
                f"{task} version {info.version} has no recorded sha256; it is not served"
            )
        return info

    def _backbone_of(self, info: Any) -> Any:
        """The registered backbone the version was trained on, found by the content hash the version
        records (its name there is what the job loaded: a registered name or the model's folder): a 409
        naming the backbone and its hash when the registry holds no such checkpoint (any more)."""
        from services.delta_store.values import TAG_BACKBONE, TAG_BACKBONE_HASH

        name, trained_on = info.tags.get(TAG_BACKBONE), info.tags.get(TAG_BACKBONE_HASH)
        if not trained_on:
            raise ServiceError(
                f"{info.task} version {info.version} does not record its backbone; it cannot be served",
                status=409,
                field="version",
            )
        registered = self.operations.registry.list_backbones()  # real sources (the API shows others)
        matching = [b for b in registered if b.content_hash == trained_on]
        if not matching:
            same_name = [b for b in registered if b.name == name or b.source == name]
            now = f", but that backbone is now {same_name[0].content_hash[:12]}…" if same_name else ""
            raise ServiceError(
                f"{info.task} version {info.version} was trained on backbone {Path(str(name)).name!r} with "
                f"content hash {trained_on[:12]}…{now}: this service has no backbone with that content "
                "(`pelt backbone list` lists them)",
                status=409,
                field="version",
            )
        return next((b for b in matching if b.name == name or b.source == name), matching[0])

    async def _await(self, planned: Planned) -> dict[str, Any]:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        timeout = self.settings.predict_timeout_seconds
        response = planned.method.remote((planned.key, planned.rows))
        try:
            return await asyncio.wait_for(_result(response), timeout)
        except TimeoutError:
            response.cancel()
            raise busy(
                f"the prediction took longer than {timeout:g} s (PELT_PREDICT_TIMEOUT_SECONDS); try again", 5
            ) from None
        except BackPressureError:
            raise busy(
                "the prediction replicas are busy (PELT_PREDICT_MAX_QUEUED wait already); try again", 1
            ) from None
        except (RayActorError, DeploymentUnavailableError) as exc:
            with self._lock:
                self._methods.pop(planned.backbone, None)  # the next request finds or starts them again
            raise busy(
                f"the prediction replicas of {planned.backbone!r} are unavailable ({exc}); try again", 5
            ) from None

    def _method(self, backbone: Any) -> Any:
        """The `predict` handle of the backbone's replicas, their application started (or joined) at the
        first request: a 503 while they start (a request waits up to the prediction timeout, and not at
        all once the start is known to wait for a node with the resources they ask for), and for
        START_RETRY_SECONDS after they failed to."""
        with self._lock:
            method = self._methods.get(backbone.name)
            if method is not None:
                return method
            failed = self._start_errors.get(backbone.name)
            if failed is not None and time.monotonic() < failed[0]:
                raise busy(failed[1], max(1.0, failed[0] - time.monotonic()))
            started = self._starting.get(backbone.name)
            if started is None:
                started = self._starting[backbone.name] = threading.Event()
                threading.Thread(
                    target=self._start, args=(backbone, started), name=f"serve-{backbone.name}", daemon=True
                ).start()
        deadline = time.monotonic() + self.settings.predict_timeout_seconds
        while not started.wait(min(START_POLL_SECONDS, max(0.0, deadline - time.monotonic()))):
            waiting_for = self._start_waits.get(backbone.name)
            if waiting_for:  # no request waits out the timeout for a node that may never come
                raise busy(
                    f"the prediction replicas of backbone {backbone.name!r} wait for a node that can hold "
                    f"them: {waiting_for}",
                    START_RETRY_SECONDS,
                )
            if time.monotonic() >= deadline:
                raise busy(
                    f"the prediction replicas of backbone {backbone.name!r} are still starting; try again", 10
                )
        with self._lock:
            method = self._methods.get(backbone.name)
            if method is not None:
                return method
            failed = self._start_errors.get(backbone.name)
        raise busy(
            failed[1] if failed else "the prediction replicas did not start; try again", START_RETRY_SECONDS
        )

    def _start(self, backbone: Any, started: threading.Event) -> None:
        """On its own thread: join the backbone's Serve application, or deploy it, and keep its handle."""
        try:
            method = self._deploy(backbone)
            with self._lock:
                self._methods[backbone.name] = method
                self._start_errors.pop(backbone.name, None)
        except Exception as exc:
            log.exception("the prediction replicas of backbone %s did not start", backbone.name)
            with self._lock:
                self._start_errors[backbone.name] = (
                    time.monotonic() + START_RETRY_SECONDS,
                    f"the prediction replicas of backbone {backbone.name!r} did not start: {exc}",
                )
        finally:
            with self._lock:
                self._starting.pop(backbone.name, None)
                self._start_waits.pop(backbone.name, None)
            started.set()

    def _deploy(self, backbone: Any) -> Any:
        import ray
        from ray import serve

        from services.dispatcher import connect_ray
        from workers.serving import ReplicaConfig, app_name, predict_application

        connect_ray(self.settings, namespace=DEFAULT_NAMESPACE, log_to_driver=False)
        serve.start(proxy_location="Disabled")
        name = app_name(ray.get_runtime_context().namespace, backbone.name)
        running = serve.status().applications.get(name)
        if running is not None and running.status in ("RUNNING", "DEPLOYING"):
            handle = serve.get_app_handle(name)  # another API process (or this one, before) started it
        else:
            if running is not None:
                with contextlib.suppress(Exception):
                    serve.delete(name)
            shortfall = replica_shortfall(self.settings, ray.available_resources(), ray.cluster_resources())
            if shortfall:  # Serve waits for such a node (an autoscaler may bring one); requests hear why now
                log.warning("the prediction replicas of backbone %s wait: %s", backbone.name, shortfall)
                with self._lock:
                    self._start_waits[backbone.name] = shortfall
            config = ReplicaConfig(
                backbone_name=backbone.name,
                backbone_source=backbone.source,
                content_hash=backbone.content_hash,
                max_deltas=self.settings.predict_max_deltas,
                max_delta_bytes=self.settings.predict_max_delta_bytes,
                threads=self.settings.predict_threads,
                # Ray shows a replica only the GPU it reserved: "cuda" is that one
                device="cuda" if self.settings.predict_gpus_per_replica else "cpu",
            )
            app = predict_application(
                config,
                VersionFetcher(self.operations.store),
                replicas=self.settings.predict_replicas,
                cpus_per_replica=self.settings.predict_cpus_per_replica,
                gpus_per_replica=self.settings.predict_gpus_per_replica,
                resource=self.settings.predict_resource,
                max_queued_requests=self.settings.predict_max_queued,
            )
            log.info("starting the prediction replicas of backbone %s (%s)", backbone.name, name)
            try:
                handle = serve.run(app, name=name, route_prefix=None)
            except Exception:
                with contextlib.suppress(Exception):
                    serve.delete(name)  # a replica that cannot start is not retried forever
                raise
        return handle.options(method_name="predict")  # initialised here, once: shared by every request

    def _failure(self, info: Any, failure: dict[str, Any]) -> Exception:
        """The error of a request the replica could not answer, by where it failed."""
        from services.delta_store.errors import DeltaIntegrityError

        kind, message = failure.get("type"), failure.get("error", "")
        where = f"{info.task} version {info.version}"
        if kind in INTEGRITY_ERRORS:
            return DeltaIntegrityError(f"{where}: {message}; it is not served")
        if failure.get("phase") == INPUT:
            return ServiceError(message, status=422, field="texts")
        if failure.get("phase") == FORWARD:
            return ServiceError(f"{where} failed to predict: {message}", status=500)
        return busy(f"{where} could not be loaded ({kind}: {message}); try again", 5)


def replica_shortfall(settings: Settings, free: dict[str, float], total: dict[str, float]) -> str | None:
    """What a prediction replica asks Ray for that the cluster does not have free now, counted over all its
    nodes (`ray.available_resources()`, of `ray.cluster_resources()`), naming the setting that asks for it;
    None when it has. A necessary condition only: shares free on different nodes add up here, while a
    replica needs them on one (Serve then waits, and requests wait up to the timeout, as for any start)."""
    wanted = {
        "GPU": (settings.predict_gpus_per_replica, "PELT_PREDICT_GPUS_PER_REPLICA"),
        "CPU": (settings.predict_cpus_per_replica, "PELT_PREDICT_CPUS_PER_REPLICA"),
    }
    if settings.predict_resource:
        wanted[settings.predict_resource] = (1.0, "PELT_PREDICT_RESOURCE")
    for resource, (amount, variable) in wanted.items():
        if amount and free.get(resource, 0.0) < amount - RESOURCE_TOLERANCE:
            return (
                f"{variable} asks for {amount:g} {resource} per replica, and the Ray cluster has "
                f"{free.get(resource, 0.0):g} {resource} free of {total.get(resource, 0.0):g} (training "
                f"workers hold theirs while they live): add a node that has it, or change {variable}"
            )
    return None


async def _result(response: Any) -> Any:
    return await response


__all__ = [
    "Prediction",
    "PredictionService",
    "VersionFetcher",
    "check_rows",
    "replica_shortfall",
    "version_reference",
]
