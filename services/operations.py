"""The service layer under the HTTP API: every route is one call of `PeltOperations`.

It joins the registry (tasks, methods, backbones, jobs, results, tokens), the uploaded datasets
(`services.uploads`: kept under PELT_DATA_DIR/datasets, content-addressed) and the MLflow delta store
(versions, downloads, composition). It holds no HTTP types: the API turns its errors into status codes
(`services.errors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
import shutil
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.backbones import (
    BackboneSource,
    SubprocessBackboneLoader,
    locate_backbone,
    public_message,
    same_source,
    shown_source,
)
from services.errors import ServiceError
from services.predicting import Prediction, PredictionService
from services.registry import (
    AlreadyExistsError,
    AuditEventRecord,
    BackboneRecord,
    JobEventRecord,
    JobRecord,
    LeaderboardRow,
    LossHistoryRecord,
    MethodRecord,
    Registry,
    RegistryValidationError,
    ResultRecord,
    SearchRecord,
    SweepRecord,
    TaskRecord,
    UnknownBackboneError,
    UnknownMethodError,
    UnknownTaskError,
)
from services.registry.models import DEFAULT_JOB_DEVICE
from services.registry.validation import check_device, check_json_numbers
from services.settings import Settings, get_settings
from services.uploads import TaskUploads, Upload

log = logging.getLogger("pelt.operations")
COMPOSE_RETRY_AFTER_SECONDS = 5  # Retry-After of a composition refused while PELT_COMPOSE_CONCURRENCY run


SCRATCH_DIR = "scratch"  # under PELT_DATA_DIR: downloads zipped while they are sent, each removed once sent
STALE_SCRATCH_SECONDS = 24 * 3600  # a download folder this old outlived its server (a crash): removed


@dataclass(frozen=True)
class DeltaArchive:
    """A version's files, zipped into a private temporary file for download: `path` (0600) in a folder
    (0700) of its own under PELT_DATA_DIR/scratch, sent from disk; `discard()` removes both once sent."""

    path: Path
    filename: str
    info: Any  # services.delta_store.VersionInfo

    def discard(self) -> None:
        """Remove the archive and its folder (again: nothing happens)."""
        shutil.rmtree(self.path.parent, ignore_errors=True)


class PeltOperations:
    """What a caller can do with pelt: tasks, methods, backbones, jobs, leaderboards and deltas, one
    method per API operation (the API calls it, and tests call it directly).

    registry: the registry (owned by the caller). store: the MLflow delta store, or None when the
    service runs without one (deltas routes then answer 503). backbone_loader: source -> an object with
    `content_hash` and `facts` (a `pelt_core.backbones.Backbone`, say), for registering a backbone
    (default `services.backbones.SubprocessBackboneLoader`: in a child process under the settings' limits).
    """

    def __init__(
        self,
        registry: Registry,
        store: Any = None,
        *,
        settings: Settings | None = None,
        backbone_loader: Any = None,
    ) -> None:
        self.registry = registry
        self.store = store
        self.settings = settings or get_settings()
        self._backbone_loader = backbone_loader
        self._backbone_lock = threading.Lock()
        self.uploads = TaskUploads(registry, self.settings)
        # compositions computed at once, each in a child process (PELT_COMPOSE_CONCURRENCY)
        self._compose_slots = threading.BoundedSemaphore(self.settings.compose_concurrency)
        self.predictions = PredictionService(self, self.settings)  # starts nothing until the first prediction

    # --- readiness -------------------------------------------------------------------------------

    def readiness(self) -> dict[str, str | None]:
        """Whether the stores this service needs answer now: "ok" or "did not answer" for the registry
        and the delta store (None: the service runs without one). The reasons go to the log only."""
        checks: dict[str, Any] = {"registry": self.registry.ping}
        if self.store is not None:
            checks["delta_store"] = self.store.ping
        answers: dict[str, str | None] = {"registry": None, "delta_store": None}
        for name, ping in checks.items():
            try:
                ping()
                answers[name] = "ok"
            except Exception as exc:
                log.warning("readiness: the %s did not answer: %s", name.replace("_", " "), exc)
                answers[name] = "did not answer"
        return answers

    # --- tasks -----------------------------------------------------------------------------------

    def register_task(
        self, name: str, files: Mapping[str, Upload], definition: Mapping[str, Any]
    ) -> TaskRecord:
        """Register a task from uploaded data: files keyed by split (train required; validation, test
        optional) in JSON Lines, CSV/TSV or Parquet, or one `dataset` archive (.zip/.tar.gz) of a folder
        written by `datasets`' save_to_disk, unpacked within bounds (`services.uploads`). The files are
        kept under PELT_DATA_DIR/datasets/<sha256>; when the registry refuses the task, nothing is kept."""
        return self.uploads.register_task(name, files, definition)

    def get_task(self, name: str) -> TaskRecord:
        return self.registry.get_task(name)

    def list_tasks(self) -> list[TaskRecord]:
        return self.registry.list_tasks()

    # --- methods and backbones -------------------------------------------------------------------

    def list_methods(self, builtin: bool | None = None) -> list[MethodRecord]:
        return self.registry.list_methods(builtin=builtin)

    def get_method(self, name: str) -> MethodRecord:
        return self.registry.get_method(name)

    def register_method(self, spec: Mapping[str, Any], replace: bool = False) -> MethodRecord:
        return self.registry.register_method(spec, replace=replace)

    def list_backbones(self) -> list[BackboneRecord]:
        """Every backbone, its source as users see it (`services.backbones.shown_source`)."""
        return [self._shown(record) for record in self.registry.list_backbones()]

    def get_backbone(self, name: str) -> BackboneRecord:
        return self._shown(self.registry.get_backbone(name))

    def register_backbone(self, name: str, source: str | None = None) -> BackboneRecord:
        """Register a backbone under `name`: a packaged alias (all-minilm-l6-v2, smollm2-135m) or a model
        folder inside one of PELT_BACKBONE_DIRS (`source`: relative to it or absolute; default: the name;
        never under PELT_DATA_DIR). It is loaded once, in a child process with a memory limit, for its
        content hash (which every delta trained on it records) and its facts. The name registered again
        with no source or the same one returns it; with another source it is a conflict."""
        from services.registry.validation import check_name

        check_name(name)
        if source is None:
            try:
                return self._shown(self.registry.get_backbone(name))
            except UnknownBackboneError:
                pass
        location = locate_backbone(source or name, self.settings)
        with self._backbone_lock:
            try:
                existing = self.registry.get_backbone(name)
            except UnknownBackboneError:
                loaded = self._load_backbone(location)
                return self._shown(
                    self.registry.register_backbone(
                        name, location.stored, loaded.content_hash, facts=getattr(loaded, "facts", None)
                    )
                )
        if not same_source(existing.source, location.stored):
            raise AlreadyExistsError(
                "source",
                f"backbone {name!r} is registered from another source "
                f"({self._shown(existing).source!r}); register {location.shown!r} under a new "
                "name",
            )
        return self._shown(existing)

    def ensure_backbone(self, name: str) -> None:
        """Jobs name their backbone; a packaged alias not registered yet is registered on first use, and
        a backbone registered without facts (before they were kept) gets them from its config, so the
        ranges that depend on it apply to its jobs too.

        Registering on first use happens with any write token's submit, although registering a backbone
        is otherwise admin-only (POST /v1/backbones). That is intended and safe only because it is limited
        to the packaged backbones, which ship with pelt and are trusted: any other name that is not
        registered (a model folder, even one inside PELT_BACKBONE_DIRS, or any path) is UnknownBackboneError,
        a 404, before anything is loaded or written. Keep that check first."""
        from pelt_core.backbone_names import BACKBONE_ALIASES, PACKAGED_BACKBONES

        try:
            record = self.registry.get_backbone(name)
        except UnknownBackboneError:
            if name not in PACKAGED_BACKBONES and name not in BACKBONE_ALIASES:
                raise
            self.register_backbone(name)
            return
        if record.facts is None:
            self._fill_backbone_facts(record)

    def _fill_backbone_facts(self, record: BackboneRecord) -> None:
        """Store the facts of a backbone registered without them, read from its config alone (no weights).
        A config that cannot be read leaves it without (logged): its jobs then fail where they load it."""
        from pelt_core.backbones import BackboneError, read_backbone_facts

        try:
            facts = read_backbone_facts(record.source)
        except (BackboneError, OSError, ValueError) as exc:
            log.warning(
                "backbone %s has no facts and its config cannot be read for them: %s", record.name, exc
            )
            return
        self.registry.set_backbone_facts(record.name, facts)

    def _load_backbone(self, location: BackboneSource) -> Any:
        """The loaded backbone at a located source; a failure is a 422 on `source` without server paths."""
        from pelt_core.errors import BackboneError

        loader = self._backbone_loader or SubprocessBackboneLoader(self.settings)
        try:
            return loader(location.stored)
        except (BackboneError, OSError, ValueError) as exc:
            message = public_message(str(exc), location, self.settings)
            if not message.startswith(("backbone ", "loading backbone ", "the process loading")):
                message = f"cannot load backbone {location.shown!r}: {message}"
            raise RegistryValidationError("source", message) from None

    def _shown(self, record: BackboneRecord) -> BackboneRecord:
        """The record with its source as users see it, never a server path."""
        return dataclasses.replace(record, source=shown_source(record.source, self.settings))

    # --- jobs ------------------------------------------------------------------------------------

    def submit_job(
        self,
        task: str,
        method: str,
        backbone: str,
        hyperparameters: Mapping[str, Any] | None = None,
        seed: int = 0,
        k_shot: int | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        device: str = DEFAULT_JOB_DEVICE,
    ) -> JobRecord:
        """Queue one job (`Registry.submit_job`); `device`: any, cpu or gpu, where it may run."""
        self.registry.get_task(task)  # unknown task: that error first, before any backbone is loaded
        self._get_method_to_run(method)
        check_json_numbers(hyperparameters)  # a JSON request's numbers are numbers, never text to parse
        check_device(device)  # before ensure_backbone, which may register a packaged backbone
        self.ensure_backbone(backbone)
        return self.registry.submit_job(
            task,
            method,
            backbone,
            hyperparameters,
            seed=seed,
            k_shot=k_shot,
            priority=priority,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
            device=device,
        )

    def submit_fusion(self, task: str, sources: Sequence[str], **options: Any) -> JobRecord:
        """Queue an AdapterFusion job on `task` over stored adapters (`services.fusing.submit_fusion`: the
        options, and what is checked before the job is written)."""
        from services.fusing import submit_fusion

        return submit_fusion(
            self.registry, self._store(), self.settings.data_dir / SCRATCH_DIR, task, sources, **options
        )

    def submit_sweep(
        self,
        task: str,
        methods: Sequence[str],
        backbone: str,
        seeds: Sequence[int] = (0,),
        k_values: Sequence[int | None] = (None,),
        hyperparameters: Mapping[str, Any] | None = None,
        method_hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        device: str = DEFAULT_JOB_DEVICE,
        again: bool = False,
    ) -> SweepRecord:
        """Queue a sweep (`Registry.submit_sweep`); `device` applies to every job. The same sweep as one
        already queued, running or done answers with it (`already_submitted`) unless `again`."""
        self._check_sweep_names(task, methods, backbone, hyperparameters, method_hyperparameters, device)
        return self.registry.submit_sweep(
            task,
            methods,
            seeds,
            k_values,
            backbone,
            hyperparameters,
            method_hyperparameters=method_hyperparameters,
            priority=priority,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
            device=device,
            again=again,
        )

    def check_sweep(
        self,
        task: str,
        methods: Sequence[str],
        backbone: str,
        seeds: Sequence[int] = (0,),
        k_values: Sequence[int | None] = (None,),
        hyperparameters: Mapping[str, Any] | None = None,
        method_hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        device: str = DEFAULT_JOB_DEVICE,
        again: bool = False,
    ) -> int:
        """Check a sweep as `submit_sweep` would and queue nothing (`Registry.check_sweep`): how many jobs
        it holds. A packaged backbone not yet registered is registered, as its first submission would."""
        self._check_sweep_names(task, methods, backbone, hyperparameters, method_hyperparameters, device)
        return self.registry.check_sweep(
            task,
            methods,
            seeds,
            k_values,
            backbone,
            hyperparameters,
            method_hyperparameters=method_hyperparameters,
            priority=priority,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
            device=device,
            again=again,
        )

    def _check_sweep_names(
        self,
        task: str,
        methods: Sequence[str],
        backbone: str,
        hyperparameters: Mapping[str, Any] | None,
        method_hyperparameters: Mapping[str, Mapping[str, Any]] | None,
        device: str,
    ) -> None:
        """What a sweep names exists (a packaged backbone is registered on first use), its numbers are
        JSON's, its device one of the known."""
        self.registry.get_task(task)
        for method in methods:
            self._get_method_to_run(method)
        check_json_numbers(hyperparameters)
        for values in (method_hyperparameters or {}).values():
            check_json_numbers(values)
        check_device(device)
        self.ensure_backbone(backbone)

    def _get_method_to_run(self, method: str) -> None:
        """A method a job or sweep may name: a known one, and not `fusion` (its jobs name their sources)."""
        from services.registry.presets import FUSION, FUSION_HOW

        if method == FUSION:
            raise RegistryValidationError("method", FUSION_HOW)
        self.registry.get_method(method)

    def get_job(self, job_id: int) -> JobRecord:
        return self.registry.get_job(job_id)

    def get_sweep(self, sweep_id: int) -> SweepRecord:
        return self.registry.get_sweep(sweep_id)

    # --- method searches ---------------------------------------------------------------------------

    def create_search(self, task: str, budget: float, **options: Any) -> SearchRecord:
        """Plan a method search and queue its first rung (services/registry/searches.py), once what it
        names exists (a packaged backbone is registered on first use, as for a sweep) and its numbers
        are JSON's."""
        self.registry.get_task(task)
        for method in options.get("methods") or ():
            self.registry.get_method(method)
        check_json_numbers(options.get("hyperparameters"))
        self.ensure_backbone(options["backbone"])
        return self.registry.create_search(task, budget, **options)

    def get_search(self, search_id: int) -> SearchRecord:
        return self.registry.get_search(search_id)

    def list_searches(
        self, *, task: str | None = None, status: str | None = None, limit: int = 100, offset: int = 0
    ) -> list[SearchRecord]:
        return self.registry.list_searches(task=task, status=status, limit=limit, offset=offset)

    def cancel_search(self, search_id: int, *, own_only: bool = False) -> SearchRecord:
        return self.registry.cancel_search(search_id, own_only=own_only)

    def list_jobs(
        self,
        *,
        task: str | None = None,
        status: Iterable[str] | None = None,
        method: str | None = None,
        backbone: str | None = None,
        sweep_id: int | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[JobRecord]:
        return self.registry.list_jobs(
            task=task,
            status=list(status) if status else None,
            method=method,
            backbone=backbone,
            sweep_id=sweep_id,
            limit=limit,
            offset=offset,
        )

    def cancel_job(self, job_id: int, *, own_only: bool = False) -> JobRecord:
        """Cancel a job; `own_only` (a token without the admin scope): only one the caller's token
        submitted, else NotOwnerError (a 403 naming the admin scope and whose job it is)."""
        return self.registry.cancel_job(job_id, own_only=own_only)

    def cancel_sweep(self, sweep_id: int, *, own_only: bool = False) -> int:
        """Cancel a sweep's unfinished jobs; `own_only` as for cancel_job (refused as a whole)."""
        return self.registry.cancel_sweep(sweep_id, own_only=own_only)

    def job_events(self, job_id: int) -> list[JobEventRecord]:
        return self.registry.job_events(job_id)

    def loss_history(self, job_id: int) -> LossHistoryRecord:
        return self.registry.loss_history(job_id)

    def get_result(self, job_id: int) -> ResultRecord | None:
        self.registry.get_job(job_id)  # unknown job: 404, not an empty result
        return self.registry.get_result(job_id)

    def leaderboard(
        self,
        task: str,
        k_shot: int | str | None = None,
        backbone: str | None = None,
        split: str = "test",
        order_by: str = "mean",
    ) -> list[LeaderboardRow]:
        """The task's methods and configurations ranked on `split` ("test": the evaluation split; "dev":
        the protocol's) by `order_by` ("mean" over seeds, or the "best" run)."""
        return self.registry.leaderboard(task, k_shot, backbone=backbone, split=split, order_by=order_by)

    def leaderboard_by_k(
        self, task: str, backbone: str | None = None, split: str = "test", order_by: str = "mean"
    ) -> dict[int | None, list[LeaderboardRow]]:
        """The leaderboard of each K the task's succeeded jobs used (None: the full training set, last)."""
        return self.registry.leaderboard_by_k(task, backbone=backbone, split=split, order_by=order_by)

    def audit_events(self, *, limit: int = 100, offset: int = 0) -> list[AuditEventRecord]:
        return self.registry.audit_events(limit=limit, offset=offset)

    # --- deltas ----------------------------------------------------------------------------------

    def _store(self) -> Any:
        if self.store is None:
            raise ServiceError(
                "this service runs without a delta store (start it with one: `pelt serve`)", status=503
            )
        return self.store

    def delta_versions(self, task: str) -> list[Any]:
        """Every version of a task's deltas (newest first), with aliases, sha256 and provenance tags
        (none yet for a registered task whose jobs have not finished)."""
        from services.delta_store import DeltaNotFoundError

        store = self._store()
        try:
            return store.list_versions(task)
        except DeltaNotFoundError:
            self.registry.get_task(task)  # an unknown task stays a 404 (naming the known tasks)
            return []

    def delta_info(self, ref: Any) -> Any:
        """One version: "task" (its best; a composition's name: its latest), "task@alias" (e.g.
        best-lora), "task/3", or a `DeltaRef` (a method's best: an unknown method is refused naming it)."""
        store = self._store()
        self._check_ref_method(ref)
        return store.get_version(ref)

    def delta_archive(self, ref: Any) -> DeltaArchive:
        """Download a version (checked against its sha256) and zip its files into a private temporary
        file, to be sent from disk: the caller discards it once sent (`DeltaArchive.discard`)."""
        store = self._store()
        self._check_ref_method(ref)
        info = store.get_version(ref)
        scratch = self.settings.data_dir / SCRATCH_DIR
        scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
        _remove_stale_downloads(scratch)
        folder = Path(tempfile.mkdtemp(prefix="download-", dir=scratch))  # 0700
        archive = DeltaArchive(folder / "delta.zip", f"{info.task}-v{info.version}.zip", info)
        try:
            delta = store.download(info.task, info.version, dest=folder / "delta")
            private = os.open(archive.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(private, "wb") as file, zipfile.ZipFile(file, "w", zipfile.ZIP_DEFLATED) as zipped:
                for item in sorted(delta.rglob("*")):
                    if item.is_file():
                        zipped.write(item, item.relative_to(delta).as_posix())
            shutil.rmtree(delta)  # only the archive waits for the client
        except BaseException:
            archive.discard()
            raise
        return archive

    def _check_ref_method(self, ref: Any) -> None:
        """A reference to a method's best names a method some job could have run: else UnknownMethodError
        naming it, the known methods listed nearest to it first."""
        method = getattr(ref, "method", None)
        if method is None:
            return
        try:
            self.registry.check_method_known(method)
        except UnknownMethodError as exc:
            near = difflib.get_close_matches(method, exc.existing, n=3, cutoff=0.6)
            known = [*near, *(name for name in exc.existing if name not in near)]
            raise UnknownMethodError("method", method, known) from None

    async def predict(self, task: str, texts: Any, version: str | int | None = None) -> Prediction:
        """Predictions for `texts` from a version of a task (`best` by default, an alias or a number),
        served by its backbone's Ray Serve replicas (`services.predicting`); awaited without holding a
        thread (the checks and the resolution run on the thread pool)."""
        self._store()
        return await self.predictions.predict(task, texts, version)

    def archive_version(self, task: str, version: str | int) -> Any:
        """Archive a version of a task (an admin's; audited): no pull by name or alias answers with it
        again (its aliases are removed; best and best-<method> move to the best other version), while its
        version number still pulls it. The audit event is recorded inside the store's step: a failure to
        record it leaves the version as it was. Archiving an archived version records nothing."""
        store = self._store()

        def audit(info: Any) -> None:
            self.registry.record_audit(
                "delta.archive",
                f"{info.task} version {info.version}",
                {"kind": info.kind, "method": info.method, "aliases": list(info.aliases)},
            )

        return store.archive_version(task, version, on_written=audit)

    def compose(
        self,
        op: str,
        sources: Sequence[str] | Mapping[str, str],
        into: str,
        options: Mapping[str, Any] | None = None,
        aliases: Sequence[str] = (),
        description: str = "",
        allow_existing: bool = False,
    ) -> Any:
        """Compose deltas (merge, average, merge_lora_svd, multi_task) into a new version of `into`. The
        request is checked first (`check_compose_request`: pelt_core.compose's options), so no option reaches
        the store as one of its own parameters; the audit event is recorded inside the store's
        all-or-nothing step, so a failure to record it takes the version back. Names (`into`, the sources'
        names) follow the registry's rule for task names, so the audit trail records names, never text.

        It is computed in a child process (`services.delta_store.compose_child`): one whose estimate is above
        PELT_COMPOSE_MEMORY_BYTES is a 413 before anything is loaded; at most PELT_COMPOSE_CONCURRENCY at
        once (beyond: a 503 with Retry-After), so this process never holds the sources' tensors.

        `into` is a new name (the composition's own: pulling it answers with its latest version), or a
        registered task only when that task is among the sources or `allow_existing` says so: a
        composition of other tasks' deltas does not become a version of a real task by accident."""
        from services.delta_store import check_compose_request
        from services.delta_store.compose_child import ComposeLimits

        options = dict(options or {})
        store = self._store()
        check_compose_request(op, sources, into, aliases, options)
        self._check_compose_into(sources, into, allow_existing)

        def audit(stored: Any) -> None:
            self.registry.record_audit(
                "delta.compose",
                f"{into} version {stored.model_version}",
                {
                    "op": op,
                    "sources": (
                        {str(name): str(ref) for name, ref in sources.items()}
                        if isinstance(sources, Mapping)
                        else [str(ref) for ref in sources]
                    ),
                    "aliases": list(aliases),
                },
            )

        if not self._compose_slots.acquire(blocking=False):
            raise ServiceError(
                f"{self.settings.compose_concurrency} compositions are being computed now, as many as "
                "PELT_COMPOSE_CONCURRENCY allows; nothing was written: send it again shortly",
                status=503,
                retry_after=COMPOSE_RETRY_AFTER_SECONDS,
            )
        try:
            return store.compose(
                op,
                sources,
                into=into,
                aliases=aliases,
                description=description,
                on_written=audit,
                limits=ComposeLimits(
                    self.settings.compose_memory_bytes,
                    self.settings.compose_timeout_seconds,
                    self.settings.sandbox_warm_seconds,
                ),
                **options,
            )
        finally:
            self._compose_slots.release()

    def _check_compose_into(
        self, sources: Sequence[str] | Mapping[str, str], into: str, allow_existing: bool
    ) -> None:
        """AlreadyExistsError (409, naming `into`) when `into` is a registered task that no source comes
        from and `allow_existing` is not set; nothing is pulled or written before."""
        from services.delta_store import DeltaRef

        if not isinstance(allow_existing, bool):
            raise RegistryValidationError("allow_existing", f"must be true or false, got {allow_existing!r}")
        if allow_existing:
            return
        try:
            self.registry.get_task(into)
        except UnknownTaskError:
            return  # a name of its own: the composition's
        refs = sources.values() if isinstance(sources, Mapping) else sources
        tasks = {DeltaRef.parse(ref).task for ref in refs}
        if into not in tasks:
            raise AlreadyExistsError(
                "into",
                f"{into!r} is a registered task and none of the sources ({', '.join(sorted(tasks))}) is one "
                "of its deltas: compose into a new name (it then pulls by that name), or set allow_existing "
                "(`pelt compose --into-existing`) to add the composition to that task's versions",
            )


def _remove_stale_downloads(scratch: Path, now: float | None = None) -> None:
    """Remove download folders older than STALE_SCRATCH_SECONDS: those a crashed server left behind (a
    download being sent is far younger; several API hosts may share the folder, so nothing younger goes)."""
    cutoff = (time.time() if now is None else now) - STALE_SCRATCH_SECONDS
    for folder in scratch.glob("download-*"):
        with contextlib.suppress(OSError):
            if folder.lstat().st_mtime < cutoff:
                shutil.rmtree(folder, ignore_errors=True)


__all__ = ["DeltaArchive", "PeltOperations"]
