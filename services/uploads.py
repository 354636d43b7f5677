"""Uploaded task data: staged, unpacked within bounds, kept content-addressed, then registered.

A task's data arrive as split files (JSON Lines, CSV/TSV or Parquet; `train` required, `validation` and
`test` optional) or as one `dataset` archive (.zip, .tar, .tar.gz, .tgz) of a folder written by
`datasets`' save_to_disk. They are written to a staging folder under PELT_DATA_DIR/datasets, renamed to
a folder named after their content (sha256 of the files' names, sizes and digests) and the registry
checks the task against them (`services.registry.dataset_probe`); a refused task keeps nothing.

Archives are unpacked with bounds counted on what is actually decompressed and written, whatever their
headers claim: at most PELT_MAX_ARCHIVE_ENTRIES entries and PELT_MAX_ARCHIVE_EXPANSION bytes per archive
byte (at least `limits.ARCHIVE_EXPANSION_FLOOR_BYTES`), PELT_MAX_DATASET_BYTES in all (413 beyond); no
links, devices, sparse members (whose holes tar writes without reading them) or paths that leave the
folder. A zip's central directory is checked against PELT_MAX_ARCHIVE_ENTRIES before zipfile reads
it: the counts and size every end record states (records that disagree are refused), then its entries
counted by walking the directory zipfile will read (zipfile builds one entry per header it finds there,
whatever the count says), stopping one past the limit; a tar's extended headers (pax records, GNU
long names) hold at most `limits.MAX_TAR_HEADER_BYTES`. A member that cannot be read (encrypted, an
unknown compression method, corrupt data) is a 422 naming the archive and the member. Errors name the form field and the uploaded file, never a path of
this machine.

The registry reads the data in a child process (`dataset_probe.probe_dataset_in_child`, under
PELT_DATASET_PROBE_MEMORY_BYTES and PELT_DATASET_PROBE_TIMEOUT_SECONDS). At most
PELT_DATASET_PROBE_CONCURRENCY uploads are unpacked and probed at once; one more is a 503 with
Retry-After before anything is written (the API holds an upload's slot from its headers until its
answer, `TaskUploads.probe_slot`, and refuses one more before reading any of its body).
Uploads run side by side: a lock covers only the rename of a staged folder to its content-addressed name and, for a refused task,
the check that no task and no other upload in progress uses that folder before it is removed.
"""

from __future__ import annotations

import bz2
import contextlib
import functools
import gzip
import hashlib
import lzma
import re
import shutil
import struct
import tarfile
import threading
import uuid
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

from pelt_core import limits
from services.errors import ServiceError, TooLargeError
from services.registry import Registry, RegistryValidationError, TaskRecord
from services.registry.dataset_probe import FILE_FORMATS, probe_dataset_in_child
from services.settings import Settings

SPLITS = ("train", "validation", "test")
FIELDS = ("name", "definition", *SPLITS, "dataset")  # the form fields of POST /v1/tasks
TASK_FIELDS = (
    "text_fields",
    "label_field",
    "problem_type",
    "metric",
    "metric_direction",
    "label_names",
    "max_length",
    "description",
)
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar")
ZIP_METHODS = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
CHUNK = 1 << 20
MAX_ZIP_ENTRY_BYTES = 4096  # central-directory bytes per allowed entry (name, extra fields, comment)
PROBE_RETRY_AFTER_SECONDS = (
    5  # Retry-After of an upload refused while PELT_DATASET_PROBE_CONCURRENCY are checked
)
_ARCHIVE_ERRORS = (
    zipfile.BadZipFile,
    tarfile.TarError,
    EOFError,
    OSError,
    ValueError,
    RuntimeError,
    lzma.LZMAError,
    zlib.error,
)  # RuntimeError: encrypted; NotImplementedError: unknown method


# the TaskUploads whose probe slot this context (an API request, and the thread it runs the route in) holds
_HOLDING_PROBE_SLOT: ContextVar[TaskUploads | None] = ContextVar("pelt_holding_probe_slot", default=None)


@dataclass(frozen=True)
class Upload:
    """One uploaded file: the name the client gave it and a binary stream of its bytes."""

    filename: str
    stream: IO[bytes]


class TaskUploads:
    """Registers tasks from uploaded data for `PeltOperations`. Uploads of the same data share their
    content-addressed folder: it is removed after a refusal only when no task uses it and no other
    upload is registering from it (counted under the lock)."""

    def __init__(self, registry: Registry, settings: Settings) -> None:
        self.registry = registry
        self.settings = settings
        self._lock = threading.Lock()  # the renames and the in-use checks, never the reading of the data
        self._registering: dict[Path, int] = {}  # folder -> uploads registering a task from it now
        # uploads unpacked and probed at once (PELT_DATASET_PROBE_CONCURRENCY): one service per process
        self.probe_slots = threading.BoundedSemaphore(settings.dataset_probe_concurrency)

    def register_task(
        self, name: str, files: Mapping[str, Upload], definition: Mapping[str, Any]
    ) -> TaskRecord:
        """Register a task from uploaded files keyed by form field (see the module); the files are kept
        under PELT_DATA_DIR/datasets/<sha256>, nothing is kept when the task is refused. When
        PELT_DATASET_PROBE_CONCURRENCY uploads are being checked already: a 503 with Retry-After, before
        anything is written."""
        from services.registry.validation import check_name

        check_name(name)
        _check_file_fields(files)
        fields = task_definition(definition)
        with self.probe_slot("dataset" if "dataset" in files else "train"):
            return self._register(name, files, fields)

    @contextlib.contextmanager
    def probe_slot(self, field: str | None = None) -> Iterator[None]:
        """Hold one of the PELT_DATASET_PROBE_CONCURRENCY slots until the block ends (a slot this context
        holds already, taken by the API from the request's headers, is used as it is); none free: a 503
        with Retry-After naming `field` (None: the whole request, as the API refuses it from its headers,
        before it knows which file fields the body holds)."""
        if _HOLDING_PROBE_SLOT.get() is self:
            yield
            return
        if not self.probe_slots.acquire(blocking=False):
            raise ServiceError(
                f"{self.settings.dataset_probe_concurrency} uploads are being checked now, as many as "
                "PELT_DATASET_PROBE_CONCURRENCY allows; nothing was kept: send it again shortly",
                status=503,
                field=field,
                retry_after=PROBE_RETRY_AFTER_SECONDS,
            )
        holding = _HOLDING_PROBE_SLOT.set(self)
        try:
            yield
        finally:
            _HOLDING_PROBE_SLOT.reset(holding)
            self.probe_slots.release()

    def _register(self, name: str, files: Mapping[str, Upload], fields: dict[str, Any]) -> TaskRecord:
        root = self.settings.data_dir / "datasets"
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f".upload-{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            manifest = self._stage(files, staging)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, RegistryValidationError):
                raise self._public(exc, files) from None
            raise
        final = root / hashlib.sha256("\n".join(manifest).encode()).hexdigest()[:32]
        with self._lock:
            try:
                staging.rename(final)
            except OSError:  # the same data were uploaded before: keep that folder
                shutil.rmtree(staging, ignore_errors=True)
            self._registering[final] = self._registering.get(final, 0) + 1
        refused = True
        try:
            if "dataset" in files:
                source: Any = str(final / "dataset")
            else:
                source = {p.stem: str(p) for p in sorted(final.iterdir())}
            task = self.registry.register_task(name, source, **fields, prober=self._probe)
            refused = False
            return task
        except RegistryValidationError as exc:
            raise self._public(exc, files) from None
        finally:
            with self._lock:
                self._registering[final] -= 1
                if not self._registering[final]:
                    del self._registering[final]
                    if refused and not self._dataset_in_use(final):
                        shutil.rmtree(final, ignore_errors=True)

    def _probe(self, source: Any, label_field: str | None, limits: Any) -> Any:
        """The registry's look at the uploaded data, in a child process under the settings' limits."""
        return probe_dataset_in_child(
            source,
            label_field,
            limits,
            memory_bytes=self.settings.dataset_probe_memory_bytes,
            timeout_seconds=self.settings.dataset_probe_timeout_seconds,
            warm_seconds=self.settings.sandbox_warm_seconds,
        )

    def _stage(self, files: Mapping[str, Upload], staging: Path) -> list[str]:
        """Write the uploads into `staging`; (split, suffix, size, sha256) of each, the folder's name."""
        budget = [self.settings.max_upload_bytes]
        if "dataset" in files:
            bounds = ArchiveBounds(
                entries=self.settings.max_archive_entries,
                expansion=self.settings.max_archive_expansion,
                max_bytes=self.settings.max_dataset_bytes,
            )
            return [extract_archive(files["dataset"], staging / "dataset", budget, bounds)]
        manifest = []
        for split in sorted(files):
            upload = files[split]
            suffix = _table_suffix(upload.filename, split)
            size, digest = save_stream(upload.stream, staging / f"{split}{suffix}", budget, split)
            manifest.append(f"{split}{suffix}:{size}:{digest}")
        return manifest

    def _dataset_in_use(self, folder: Path) -> bool:
        prefix = str(folder)
        return any(
            path.startswith(prefix) for task in self.registry.list_tasks() for path in task.source.values()
        )

    def _public(self, exc: RegistryValidationError, files: Mapping[str, Upload]) -> RegistryValidationError:
        """The error as the uploader sees it: the form field and the uploaded file's name, no server path."""
        if type(exc) not in (RegistryValidationError, TooLargeError):
            return exc
        field, message = exc.field, str(exc).removeprefix(f"{exc.field}: ")
        if field == "source" or field.startswith("source."):
            if "dataset" in files:
                field, message = "dataset", f"{message} (in {files['dataset'].filename!r})"
            elif field.removeprefix("source.") in files:
                message = f"{message} (uploaded as {files[field.removeprefix('source.')].filename!r})"
        data_dir = re.escape(str(self.settings.data_dir))
        message = re.sub(data_dir + r"[^\s'\"]*", lambda match: Path(match.group(0)).name, message)
        return type(exc)(field, message)


def _check_file_fields(files: Mapping[str, Upload]) -> None:
    unknown = set(files) - {*SPLITS, "dataset"}
    if unknown:
        raise RegistryValidationError(
            sorted(unknown)[0],
            f"unexpected file field; send {', '.join(SPLITS)} (train required) or one 'dataset' archive",
        )
    if "dataset" in files and len(files) > 1:
        raise RegistryValidationError("dataset", "send either a dataset archive or split files, not both")
    if not files:
        raise RegistryValidationError(
            "train", "no data: send a train file (and validation, test) or a dataset archive"
        )
    if "dataset" not in files and "train" not in files:
        raise RegistryValidationError("train", "a train file is required")


def task_definition(definition: Mapping[str, Any]) -> dict[str, Any]:
    """The task's definition fields (TASK_FIELDS), None values dropped (no text fields or problem type:
    the registry detects them from the data)."""
    unknown = [key for key in definition if key not in TASK_FIELDS]
    if unknown:
        raise RegistryValidationError(unknown[0], f"unknown task field; known: {', '.join(TASK_FIELDS)}")
    return {key: value for key, value in definition.items() if value is not None}


def _table_suffix(filename: str, split: str) -> str:
    name = (filename or "").lower()
    for suffix in FILE_FORMATS:
        if name.endswith(suffix):
            return suffix
    raise RegistryValidationError(
        split,
        f"{filename!r}: unsupported file type; use one of "
        f"{', '.join(FILE_FORMATS)} (or a 'dataset' archive of a datasets folder)",
    )


def save_stream(stream: IO[bytes], path: Path, budget: list[int], field: str) -> tuple[int, str]:
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


# --- archives ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchiveBounds:
    """entries: PELT_MAX_ARCHIVE_ENTRIES; expansion: PELT_MAX_ARCHIVE_EXPANSION (bytes per archive byte,
    at least limits.ARCHIVE_EXPANSION_FLOOR_BYTES in all); max_bytes: PELT_MAX_DATASET_BYTES."""

    entries: int = limits.MAX_ARCHIVE_ENTRIES
    expansion: float = limits.MAX_ARCHIVE_EXPANSION
    max_bytes: int = limits.MAX_DATASET_BYTES

    def allowed_bytes(self, archive_bytes: int) -> int:
        return int(
            min(self.max_bytes, max(self.expansion * archive_bytes, limits.ARCHIVE_EXPANSION_FLOOR_BYTES))
        )


class _Unpacking:
    """What an archive really produces, counted as it is written: entries and bytes."""

    def __init__(self, archive: str, bounds: ArchiveBounds, archive_bytes: int) -> None:
        self.archive, self.bounds = archive, bounds
        self.allowed = bounds.allowed_bytes(archive_bytes)
        self.entries = 0
        self.left = self.allowed
        self.written = 0  # tar: bytes written to members' files (the stream's count includes headers)
        self.member_blocks = (
            0  # tar: 512-byte blocks of the members handed to write_member (data and padding)
        )

    def entry(self, count: int = 1) -> None:
        self.entries += count
        if self.entries > self.bounds.entries:
            raise self.too_many_entries()

    def too_many_entries(self) -> TooLargeError:
        return TooLargeError(
            "dataset",
            f"{self.archive!r} holds more than {self.bounds.entries} entries (PELT_MAX_ARCHIVE_ENTRIES)",
        )

    def spend(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise TooLargeError(
                "dataset",
                f"{self.archive!r} unpacks to more than {self.allowed} bytes: at most "
                f"{self.bounds.expansion:g} bytes per archive byte (PELT_MAX_ARCHIVE_EXPANSION), "
                f"{self.bounds.max_bytes} in all (PELT_MAX_DATASET_BYTES)",
            )

    def copy(self, source: IO[bytes], destination: Path) -> None:
        with destination.open("wb") as out:
            while chunk := source.read(CHUNK):
                self.spend(len(chunk))
                out.write(chunk)

    def check_tar_headers(self) -> None:
        """Tar: the stream's bytes that are not members' data, beyond three 512-byte blocks per entry (a
        header, and a pax header of a few times), stay within limits.MAX_TAR_HEADER_BYTES: tarfile reads a
        pax record or a GNU long name whole into memory, so one is refused while it is read."""
        read = self.allowed - self.left
        headers = read - self.member_blocks * tarfile.BLOCKSIZE - 3 * tarfile.BLOCKSIZE * (self.entries + 1)
        if headers > limits.MAX_TAR_HEADER_BYTES + 2 * tarfile.RECORDSIZE:  # its read-ahead, the end blocks
            raise TooLargeError(
                "dataset",
                f"{self.archive!r} holds more than {limits.MAX_TAR_HEADER_BYTES} bytes of "
                "tar headers (pax records, long names) besides one header per entry",
            )

    def write_member(self, source: IO[bytes], destination: Path, declared: int) -> None:
        """A tar member's bytes (already counted by the stream they come from), refused before anything is
        written when its header declares more than is left, and counted again as they are written."""
        if declared > self.allowed - self.written:
            self.spend(self.left + 1)  # the same refusal as the stream's
        self.member_blocks += -(-declared // tarfile.BLOCKSIZE)
        with destination.open("wb") as out:
            while chunk := source.read(CHUNK):
                self.written += len(chunk)
                if self.written > self.allowed:
                    self.spend(self.left + 1)
                out.write(chunk)


class _CountedStream:
    """A decompressed tar stream whose bytes count against the unpacking bounds as they are read (tar
    headers and pax records included), so no single read can ask for more than is left, and whose
    header bytes stay within limits.MAX_TAR_HEADER_BYTES (`_Unpacking.check_tar_headers`)."""

    def __init__(self, inner: IO[bytes], unpacking: _Unpacking) -> None:
        self.inner, self.unpacking = inner, unpacking

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > self.unpacking.left + 1:
            size = self.unpacking.left + 1
        data = self.inner.read(size)
        self.unpacking.spend(len(data))
        self.unpacking.check_tar_headers()
        return data


def extract_archive(upload: Upload, target: Path, budget: list[int], bounds: ArchiveBounds) -> str:
    """Unpack a .zip/.tar(.gz) of a save_to_disk folder into `target` within `bounds`, refusing links
    and paths that leave it; an archive holding one folder is that folder. Returns its manifest line."""
    name = (upload.filename or "").lower()
    if not name.endswith(ARCHIVE_SUFFIXES):
        raise RegistryValidationError(
            "dataset",
            f"{upload.filename!r}: send a {', '.join(ARCHIVE_SUFFIXES)} "
            "archive of a folder written by datasets' save_to_disk",
        )
    raw = target.parent / ".archive"
    size, digest = save_stream(upload.stream, raw, budget, "dataset")
    target.mkdir()
    unpacking = _Unpacking(upload.filename, bounds, size)
    member = "?"
    try:
        if name.endswith(".zip"):
            _check_zip_directory(raw, unpacking)
            with zipfile.ZipFile(raw) as archive:
                members = archive.infolist()
                unpacking.entry(len(members))  # the central directory lists them all: refused before writing
                for info in members:
                    member = info.filename
                    _check_zip_member(info, upload.filename)
                    if info.is_dir():
                        continue
                    destination = _inside(target, info.filename)
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    with archive.open(info) as source:
                        unpacking.copy(source, destination)
        else:
            with (
                _decompressed(raw) as stream,
                tarfile.open(fileobj=_CountedStream(stream, unpacking), mode="r|") as archive,
            ):
                for info in archive:
                    member = info.name
                    unpacking.entry()
                    if info.isdir():
                        continue
                    if not info.isfile():
                        raise RegistryValidationError(
                            "dataset", f"{info.name!r}: links and devices are refused"
                        )
                    if info.issparse():  # tarfile writes its holes without reading them from the stream
                        raise RegistryValidationError(
                            "dataset",
                            f"{info.name!r}: a sparse file; sparse members "
                            "are refused (archive it without --sparse)",
                        )
                    destination = _inside(target, info.name)
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    source = archive.extractfile(info)
                    assert source is not None
                    with source:
                        unpacking.write_member(source, destination, info.size)
        member = "?"
        _unwrap_single_folder(target)
    except RegistryValidationError:
        raise
    except _ARCHIVE_ERRORS as exc:
        where = f" (member {member!r})" if member != "?" else ""
        raise RegistryValidationError(
            "dataset", f"{upload.filename!r} is not a readable archive{where}: {_reason(exc)}"
        ) from None
    finally:
        raw.unlink(missing_ok=True)
    return f"dataset:{size}:{digest}"


def _check_zip_directory(path: Path, unpacking: _Unpacking) -> None:
    """Before zipfile reads the central directory into memory: its end records' entry count and size (a
    directory entry is 46 bytes plus its name: MAX_ZIP_ENTRY_BYTES each is plenty), then the entries the
    directory really holds, counted up to one past the limit (zipfile ignores the stated count)."""
    directory = zip_directory(path)
    limit = unpacking.bounds.entries
    if directory.entries > limit or directory.size > limit * MAX_ZIP_ENTRY_BYTES:
        raise unpacking.too_many_entries()
    held = count_zip_entries(path, directory, stop_after=limit)
    if held > limit:
        raise unpacking.too_many_entries()
    if held != directory.entries:
        raise zipfile.BadZipFile(
            f"its end record lists {directory.entries} entries, its central directory holds {held}"
        )


_END_RECORD = struct.Struct(
    "<4s4H2LH"
)  # end of central directory: signature ... entries, size, offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, offset of the zip64 end record, disks
_ZIP64_END_RECORD = struct.Struct("<4sQ2H2L4Q")  # signature, size, versions, disks, entries (2), size, offset
_DIRECTORY_ENTRY = struct.Struct("<4s24x3H12x")  # a directory header: signature ... name, extra, comment


class ZipDirectory(NamedTuple):
    """A zip's central directory as its end records state it, and where zipfile reads it from."""

    entries: int
    size: int  # bytes
    start: int  # its offset in the file: zipfile reads `size` bytes from there


def zip_directory(path: Path) -> ZipDirectory:
    """A zip's central directory: entries and bytes from every end record that states them (PKWARE
    APPNOTE 4.3.14-16): the end record (the archive's last 22 bytes plus a comment of at most 65,535)
    and, when a zip64 locator precedes it, both the zip64 end record just before the locator (the one
    Python's zipfile reads) and the one at the locator's offset (the one the format names); a classic
    field that is full (0xFFFF, 0xFFFFFFFF) leaves it to them. zipfile.BadZipFile when a record is
    missing or they disagree, so that the numbers checked are the ones zipfile will use. Its start is
    where zipfile looks for it: `size` bytes before the end record (and before the zip64 end record and
    locator, 76 bytes, when there is a locator), whatever offset the records state."""
    with path.open("rb") as stream:
        file_size = stream.seek(0, 2)
        tail_size = min(file_size, _END_RECORD.size + 0xFFFF + _ZIP64_LOCATOR.size)
        tail_start = file_size - tail_size
        stream.seek(tail_start)
        tail = stream.read(tail_size)
        at = tail.rfind(b"PK\x05\x06", 0, max(len(tail) - _END_RECORD.size + 4, 0))  # a whole record after it
        if at < 0:
            raise zipfile.BadZipFile("no end of central directory record")
        _, _, _, disk_entries, entries, size, _, _ = _END_RECORD.unpack_from(tail, at)
        counts = {count for count in (disk_entries, entries) if count != 0xFFFF}
        sizes = {size} if size != 0xFFFFFFFF else set()
        locator = at - _ZIP64_LOCATOR.size
        zip64 = locator >= 0 and tail[locator : locator + 4] == b"PK\x06\x07"
        if zip64:
            _, _, offset, _ = _ZIP64_LOCATOR.unpack_from(tail, locator)
            for record_at in (tail_start + locator - _ZIP64_END_RECORD.size, offset):
                record_counts, record_size = _zip64_end_record(stream, record_at, file_size)
                counts.update(record_counts)
                sizes.add(record_size)
        elif not counts or not sizes:
            raise zipfile.BadZipFile("a zip64 archive without its zip64 end record locator")
        if len(counts) != 1 or len(sizes) != 1:
            raise zipfile.BadZipFile("its end records disagree on the central directory's entries or size")
        size = sizes.pop()
        start = tail_start + at - size - (_ZIP64_END_RECORD.size + _ZIP64_LOCATOR.size if zip64 else 0)
        if start < 0:
            raise zipfile.BadZipFile("its central directory would start before the archive")
        return ZipDirectory(counts.pop(), size, start)


def count_zip_entries(path: Path, directory: ZipDirectory, stop_after: int) -> int:
    """The entries of the central directory zipfile reads (`directory.size` bytes from `directory.start`,
    header after header, as zipfile walks it: it builds one ZipInfo per header, whatever the end record's
    count), counted without building them and no further than `stop_after + 1`. zipfile.BadZipFile where
    zipfile would stop on it: a header without its signature, a directory cut short."""
    held, walked = 0, 0
    with path.open("rb") as stream:
        while walked < directory.size and held <= stop_after:
            stream.seek(directory.start + walked)
            header = stream.read(_DIRECTORY_ENTRY.size)
            if len(header) < _DIRECTORY_ENTRY.size or walked + len(header) > directory.size:
                raise zipfile.BadZipFile("its central directory is cut short")
            signature, name, extra, comment = _DIRECTORY_ENTRY.unpack(header)
            if signature != b"PK\x01\x02":
                raise zipfile.BadZipFile(f"no central directory header at byte {walked} of its directory")
            held += 1
            walked += _DIRECTORY_ENTRY.size + name + extra + comment
    return held


def _zip64_end_record(stream: IO[bytes], offset: int, file_size: int) -> tuple[set[int], int]:
    """({entries on this disk, entries}, directory bytes) of the zip64 end record at `offset`."""
    if not 0 <= offset <= file_size - _ZIP64_END_RECORD.size:
        raise zipfile.BadZipFile("a zip64 end record would lie outside the archive")
    stream.seek(offset)
    signature, _, _, _, _, _, disk_entries, entries, size, _ = _ZIP64_END_RECORD.unpack(
        stream.read(_ZIP64_END_RECORD.size)
    )
    if signature != b"PK\x06\x06":
        raise zipfile.BadZipFile("no zip64 end record where one should be")
    return {disk_entries, entries}, size


def _check_zip_member(info: zipfile.ZipInfo, archive: str) -> None:
    """Before a member is read: encrypted members, compression methods zipfile lacks and links are refused."""
    if info.flag_bits & 0x1:
        raise RegistryValidationError(
            "dataset", f"{archive!r}: member {info.filename!r} is encrypted; send an unencrypted archive"
        )
    if info.compress_type not in ZIP_METHODS:
        raise RegistryValidationError(
            "dataset",
            f"{archive!r}: member {info.filename!r} uses compression method "
            f"{info.compress_type}, which pelt does not read; use deflate (zip's default)",
        )
    if (info.external_attr >> 16) & 0o170000 == 0o120000:
        raise RegistryValidationError(
            "dataset", f"{archive!r}: member {info.filename!r} is a link; links are refused"
        )


@contextlib.contextmanager
def _decompressed(path: Path) -> Iterator[IO[bytes]]:
    """The tar stream inside a file: gzip, bzip2 or xz by their magic bytes, else the file itself."""
    with path.open("rb") as probe:
        magic = probe.read(6)
    opener: Any = path.open
    for prefix, codec in ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open)):
        if magic.startswith(prefix):
            opener = functools.partial(codec, path)
    with opener("rb") as opened:
        yield opened


def _unwrap_single_folder(target: Path) -> None:
    entries = list(target.iterdir())
    if not entries:
        raise RegistryValidationError("dataset", "the archive is empty")
    if len(entries) == 1 and entries[0].is_dir():  # the archive holds one folder: that is the dataset
        inner = entries[0].rename(target.parent / ".inner")  # aside first: it may hold its own name
        for item in list(inner.iterdir()):
            item.rename(target / item.name)
        inner.rmdir()


def _inside(root: Path, member: str) -> Path:
    destination = (root / member).resolve()
    if not destination.is_relative_to(root.resolve()) or destination == root.resolve():
        raise RegistryValidationError("dataset", f"{member!r} would be written outside the dataset folder")
    return destination


def _reason(exc: BaseException) -> str:
    """Why an archive could not be read, without the paths of this machine."""
    if isinstance(exc, RuntimeError) and "encrypted" in str(exc):
        return "a member is encrypted"
    if isinstance(exc, NotImplementedError):
        return f"a member uses a compression method that cannot be read ({exc})"
    if isinstance(exc, OSError) and not isinstance(exc, zipfile.BadZipFile | gzip.BadGzipFile):
        return exc.strerror or type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


__all__ = [
    "FIELDS",
    "SPLITS",
    "ArchiveBounds",
    "TaskUploads",
    "Upload",
    "ZipDirectory",
    "count_zip_entries",
    "extract_archive",
    "save_stream",
    "task_definition",
]
