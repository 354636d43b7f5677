"""The service layer under the HTTP API: every route is one call of `PeltService`.

It joins the registry (tasks, methods, backbones, jobs, results, tokens), the uploaded datasets (kept
under PELT_DATA_DIR/datasets, content-addressed) and the MLflow delta store (versions, downloads,
composition). It holds no HTTP types: the API turns its errors into status codes (`services.errors`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import shutil
import tarfile
import tempfile
import threading
import uuid
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from services.errors import ServiceError, TooLargeError
from services.registry import (
    BackboneRecord,
    JobEventRecord,
    JobRecord,
    LeaderboardRow,
    MethodRecord,
    Registry,
    RegistryValidationError,
    ResultRecord,
    SweepRecord,
    TaskRecord,
    UnknownBackboneError,
)
from services.registry.dataset_probe import FILE_FORMATS
from services.settings import Settings, get_settings

log = logging.getLogger("pelt.service")

SPLITS = ("train", "validation", "test")
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar")
CHUNK = 1 << 20
COMPOSE_OPTIONS = {  # the keyword options of pelt_core.compose's functions a request may set
    "merge": ("weights", "how", "density", "seed", "scale", "combine", "lora_rank"),
    "average": ("lora_rank",),
    "merge_lora_svd": ("weights", "rank"),
    "multi_task": (),
}


@dataclass(frozen=True)
class Upload:
    """One uploaded file: the name the client gave it and a binary stream of its bytes."""

    filename: str
    stream: IO[bytes]


@dataclass(frozen=True)
class DeltaArchive:
    """A version's files, zipped, for download (deltas are small: KB to a few MB)."""

    content: bytes
    filename: str
    info: Any  # services.delta_store.VersionInfo


class PeltService:
    """Tasks, methods, backbones, jobs, leaderboards and deltas for the API (and for tests, directly).

    registry: the registry (owned by the caller). store: the MLflow delta store, or None when the
    service runs without one (deltas routes then answer 503). backbone_loader: name -> Backbone, for
    registering a backbone by name (default `pelt_core.backbones.Backbone.load`).
    """

    def __init__(self, registry: Registry, store: Any = None, *, settings: Settings | None = None,
                 backbone_loader: Any = None) -> None:
        self.registry = registry
        self.store = store
        self.settings = settings or get_settings()
        self._backbone_loader = backbone_loader
        self._backbone_lock = threading.Lock()
        self._upload_lock = threading.Lock()

    # --- tasks -----------------------------------------------------------------------------------

    def register_task(self, name: str, files: Mapping[str, Upload], definition: Mapping[str, Any]) -> TaskRecord:
        """Register a task from uploaded data: files keyed by split (train required; validation, test
        optional) in JSON Lines, CSV/TSV or Parquet, or one `dataset` archive (.zip/.tar.gz) of a folder
        written by `datasets`' save_to_disk. The files are kept under PELT_DATA_DIR/datasets/<sha256>;
        when the registry refuses the task, nothing is kept."""
        from services.registry.validation import check_name

        check_name(name)
        unknown = set(files) - {*SPLITS, "dataset"}
        if unknown:
            raise RegistryValidationError(sorted(unknown)[0], f"unexpected file field; send {', '.join(SPLITS)} "
                                          "(train required) or one 'dataset' archive")
        if "dataset" in files and len(files) > 1:
            raise RegistryValidationError("dataset", "send either a dataset archive or split files, not both")
        if not files:
            raise RegistryValidationError("train", "no data: send a train file (and validation, test) or a "
                                          "dataset archive")
        if "dataset" not in files and "train" not in files:
            raise RegistryValidationError("train", "a train file is required")
        root = self.settings.data_dir / "datasets"
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f".upload-{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            manifest = []  # (split, suffix, size, sha256) of every file: what the folder is named after
            budget = [self.settings.max_upload_bytes]
            if "dataset" in files:
                manifest.append(_extract_archive(files["dataset"], staging / "dataset", budget,
                                                 self.settings.max_upload_bytes))
            else:
                for split in sorted(files):
                    upload = files[split]
                    suffix = _table_suffix(upload.filename, split)
                    size, digest = _save_stream(upload.stream, staging / f"{split}{suffix}", budget, split)
                    manifest.append(f"{split}{suffix}:{size}:{digest}")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        final = root / hashlib.sha256("\n".join(manifest).encode()).hexdigest()[:32]
        with self._upload_lock:  # one upload at a time settles its folder and its task
            created = False
            try:
                staging.rename(final)
                created = True
            except OSError:  # the same data were uploaded before: keep that folder
                shutil.rmtree(staging, ignore_errors=True)
            try:
                if "dataset" in files:
                    source: Any = str(final / "dataset")
                else:
                    source = {p.stem: str(p) for p in sorted(final.iterdir())}
                return self.registry.register_task(name, source, **_task_definition(definition))
            except BaseException:
                if created and not self._dataset_in_use(final):
                    shutil.rmtree(final, ignore_errors=True)
                raise

    def _dataset_in_use(self, folder: Path) -> bool:
        prefix = str(folder)
        return any(path.startswith(prefix) for task in self.registry.list_tasks() for path in task.source.values())

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
        return self.registry.list_backbones()

    def get_backbone(self, name: str) -> BackboneRecord:
        return self.registry.get_backbone(name)

    def register_backbone(self, name: str, source: str | None = None) -> BackboneRecord:
        """Register a backbone under `name`: a packaged alias (all-minilm-l6-v2, smollm2-135m) or a model
        folder on the service's machine (`source`, default: the name). Its weights are loaded once to
        compute their content hash, which every delta trained on it records."""
        from services.registry.validation import check_name

        check_name(name)
        source = source or name
        try:
            return self.registry.get_backbone(name)
        except UnknownBackboneError:
            pass
        with self._backbone_lock:
            try:
                return self.registry.get_backbone(name)
            except UnknownBackboneError:
                pass
            loaded = self._load_backbone(source)
            return self.registry.register_backbone(name, source, loaded.content_hash)

    def ensure_backbone(self, name: str) -> None:
        """Jobs name their backbone; a packaged alias not registered yet is registered on first use."""
        from pelt_core.backbones import BACKBONE_ALIASES, PACKAGED_BACKBONES

        try:
            self.registry.get_backbone(name)
        except UnknownBackboneError:
            if name not in PACKAGED_BACKBONES and name not in BACKBONE_ALIASES:
                raise
            self.register_backbone(name)

    def _load_backbone(self, source: str) -> Any:
        from pelt_core.backbones import Backbone, BackboneError

        loader = self._backbone_loader or Backbone.load
        try:
            return loader(source)
        except (BackboneError, OSError, ValueError) as exc:
            raise RegistryValidationError("source", f"cannot load backbone {source!r}: {exc}") from None

    # --- jobs ------------------------------------------------------------------------------------

    def submit_job(self, task: str, method: str, backbone: str, hyperparameters: Mapping[str, Any] | None = None,
                   seed: int = 0, k_shot: int | None = None, priority: int = 0, max_attempts: int | None = None,
                   idempotency_key: str | None = None) -> JobRecord:
        self.registry.get_task(task)  # unknown task: that error first, before any backbone is loaded
        self.registry.get_method(method)
        self.ensure_backbone(backbone)
        return self.registry.submit_job(task, method, backbone, hyperparameters, seed=seed, k_shot=k_shot,
                                        priority=priority, max_attempts=max_attempts,
                                        idempotency_key=idempotency_key)

    def submit_sweep(self, task: str, methods: Sequence[str], backbone: str, seeds: Sequence[int] = (0,),
                     k_values: Sequence[int | None] = (None,), hyperparameters: Mapping[str, Any] | None = None,
                     method_hyperparameters: Mapping[str, Mapping[str, Any]] | None = None, priority: int = 0,
                     max_attempts: int | None = None, idempotency_key: str | None = None) -> SweepRecord:
        self.registry.get_task(task)
        for method in methods:
            self.registry.get_method(method)
        self.ensure_backbone(backbone)
        return self.registry.submit_sweep(task, methods, seeds, k_values, backbone, hyperparameters,
                                          method_hyperparameters=method_hyperparameters, priority=priority,
                                          max_attempts=max_attempts, idempotency_key=idempotency_key)

    def get_job(self, job_id: int) -> JobRecord:
        return self.registry.get_job(job_id)

    def get_sweep(self, sweep_id: int) -> SweepRecord:
        return self.registry.get_sweep(sweep_id)

    def list_jobs(self, *, task: str | None = None, status: Iterable[str] | None = None, method: str | None = None,
                  backbone: str | None = None, sweep_id: int | None = None, limit: int = 100,
                  offset: int = 0) -> list[JobRecord]:
        return self.registry.list_jobs(task=task, status=list(status) if status else None, method=method,
                                       backbone=backbone, sweep_id=sweep_id, limit=limit, offset=offset)

    def cancel_job(self, job_id: int) -> JobRecord:
        return self.registry.cancel_job(job_id)

    def cancel_sweep(self, sweep_id: int) -> int:
        return self.registry.cancel_sweep(sweep_id)

    def job_events(self, job_id: int) -> list[JobEventRecord]:
        return self.registry.job_events(job_id)

    def get_result(self, job_id: int) -> ResultRecord | None:
        self.registry.get_job(job_id)  # unknown job: 404, not an empty result
        return self.registry.get_result(job_id)

    def leaderboard(self, task: str, k_shot: int | None = None, backbone: str | None = None) -> list[LeaderboardRow]:
        return self.registry.leaderboard(task, k_shot, backbone=backbone)

    # --- deltas ----------------------------------------------------------------------------------

    def _store(self) -> Any:
        if self.store is None:
            raise ServiceError("this service runs without a delta store (start it with one: `pelt serve`)",
                               status=503)
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

    def delta_info(self, ref: str) -> Any:
        """One version: "task" (its best), "task@alias" (e.g. best-lora) or "task/3"."""
        return self._store().get_version(ref)

    def delta_archive(self, ref: str) -> DeltaArchive:
        """Download a version (checked against its sha256) and zip its files, in memory, for sending."""
        store = self._store()
        info = store.get_version(ref)
        buffer = io.BytesIO()
        with tempfile.TemporaryDirectory(prefix="pelt-archive-") as scratch:
            folder = store.download(info.task, info.version, dest=Path(scratch) / "delta")
            with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
                for item in sorted(folder.rglob("*")):
                    if item.is_file():
                        archive.write(item, item.relative_to(folder).as_posix())
        return DeltaArchive(buffer.getvalue(), f"{info.task}-v{info.version}.zip", info)

    def compose(self, op: str, sources: Sequence[str] | Mapping[str, str], into: str,
                options: Mapping[str, Any] | None = None, aliases: Sequence[str] = (),
                description: str = "") -> Any:
        """Compose deltas (merge, average, merge_lora_svd, multi_task) into a new version of `into`."""
        options = dict(options or {})
        allowed = COMPOSE_OPTIONS.get(op, ())
        for key in options:
            if key not in allowed:
                raise RegistryValidationError(f"options.{key}", f"not an option of {op}; its options: "
                                              f"{', '.join(allowed) or '(none)'}")
        return self._store().compose(op, sources, into=into, aliases=aliases, description=description, **options)


# --- uploads --------------------------------------------------------------------------------------


def _task_definition(definition: Mapping[str, Any]) -> dict[str, Any]:
    allowed = ("text_fields", "label_field", "problem_type", "metric", "metric_direction", "label_names",
               "max_length", "description")
    unknown = [key for key in definition if key not in allowed]
    if unknown:
        raise RegistryValidationError(unknown[0], f"unknown task field; known: {', '.join(allowed)}")
    if "text_fields" not in definition:
        raise RegistryValidationError("text_fields", "required: the column(s) holding the text, e.g. ['sentence']")
    return {key: value for key, value in definition.items() if value is not None}


def _table_suffix(filename: str, split: str) -> str:
    name = (filename or "").lower()
    for suffix in FILE_FORMATS:
        if name.endswith(suffix):
            return suffix
    raise RegistryValidationError(split, f"{filename!r}: unsupported file type; use one of "
                                  f"{', '.join(FILE_FORMATS)} (or a 'dataset' archive of a datasets folder)")


def _save_stream(stream: IO[bytes], path: Path, budget: list[int], field: str) -> tuple[int, str]:
    """Copy a stream to `path` within the shared upload budget (TooLargeError beyond); (size, sha256)."""
    digest, size = hashlib.sha256(), 0
    with path.open("wb") as out:
        while chunk := stream.read(CHUNK):
            budget[0] -= len(chunk)
            if budget[0] < 0:
                raise TooLargeError(field, "the upload is larger than PELT_MAX_UPLOAD_BYTES")
            digest.update(chunk)
            size += len(chunk)
            out.write(chunk)
    if size == 0:
        raise RegistryValidationError(field, "the file is empty")
    return size, digest.hexdigest()


def _extract_archive(upload: Upload, target: Path, budget: list[int], limit: int) -> str:
    """Unpack a .zip/.tar(.gz) of a save_to_disk folder into `target`, refusing links and paths that
    leave it; an archive holding one folder is that folder."""
    name = (upload.filename or "").lower()
    if not name.endswith(ARCHIVE_SUFFIXES):
        raise RegistryValidationError("dataset", f"{upload.filename!r}: send a {', '.join(ARCHIVE_SUFFIXES)} "
                                      "archive of a folder written by datasets' save_to_disk")
    raw = target.parent / ".archive"
    size, digest = _save_stream(upload.stream, raw, budget, "dataset")
    target.mkdir()
    unpacked = 0
    try:
        if name.endswith(".zip"):
            with zipfile.ZipFile(raw) as archive:
                for member in archive.infolist():
                    if member.is_dir():
                        continue
                    destination = _inside(target, member.filename)
                    unpacked += member.file_size
                    if unpacked > limit:
                        raise TooLargeError("dataset", "the unpacked archive is larger than PELT_MAX_UPLOAD_BYTES")
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    with archive.open(member) as source, destination.open("wb") as out:
                        shutil.copyfileobj(source, out, CHUNK)
        else:
            with tarfile.open(raw) as archive:
                for member in archive:
                    if member.isdir():
                        continue
                    if not member.isfile():
                        raise RegistryValidationError("dataset", f"{member.name!r}: links and devices are refused")
                    destination = _inside(target, member.name)
                    unpacked += member.size
                    if unpacked > limit:
                        raise TooLargeError("dataset", "the unpacked archive is larger than PELT_MAX_UPLOAD_BYTES")
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    source = archive.extractfile(member)
                    assert source is not None
                    with source, destination.open("wb") as out:
                        shutil.copyfileobj(source, out, CHUNK)
        entries = list(target.iterdir())
        if not entries:
            raise RegistryValidationError("dataset", "the archive is empty")
        if len(entries) == 1 and entries[0].is_dir():  # the archive holds one folder: that is the dataset
            inner = entries[0].rename(target.parent / ".inner")  # aside first: it may hold its own name
            for item in list(inner.iterdir()):
                item.rename(target / item.name)
            inner.rmdir()
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
        raise RegistryValidationError("dataset", f"{upload.filename!r} is not a readable archive: {exc}") from None
    finally:
        raw.unlink(missing_ok=True)
    return f"dataset:{size}:{digest}"


def _inside(root: Path, member: str) -> Path:
    destination = (root / member).resolve()
    if not destination.is_relative_to(root.resolve()):
        raise RegistryValidationError("dataset", f"{member!r} would be written outside the dataset folder")
    return destination


__all__ = ["DeltaArchive", "PeltService", "Upload"]
