"""Uploaded datasets against a token holder who means harm (issue #11, findings 2, 4, 7, 10).

A `datasets` folder may only read its own Arrow files; archives and Parquet files are bounded while
they are unpacked or read (rows, bytes written, entries, expansion), whatever their headers claim;
broken archives, unknown form fields and deeply nested JSON are 4xx naming the field. Every refusal
writes nothing: no task row, no file under the data folder.

The bombs run in a subprocess under an address-space (and file-size) limit, so a regression fails
the test instead of exhausting the machine.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from services.registry import Registry
from services.settings import Settings
from tests.api.conftest import Api

DEFINITION = json.dumps({"text_fields": ["text"]})
SECRET_LABELS = ["secret-alpha", "secret-beta"]


def nothing_written(api: Api) -> None:
    assert api.registry.list_tasks() == []
    assert api.files() == []


def refused(response: Any, status: int, field: str | None, *words: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    for word in words:
        assert word.lower() in error["message"].lower(), error
    return error["message"]


def upload(api: Api, files: dict[str, tuple[str, bytes]], **form: str) -> Any:
    data = {"name": "attack", "definition": DEFINITION, **form}
    return api.client().http.post("/v1/tasks", data=data, files=files)


def saved_dataset(folder: Path, labels: list[str] | None = None) -> Path:
    """A one-split `datasets` folder (save_to_disk) of four rows; returns it."""
    from datasets import Dataset

    labels = labels or ["neg", "pos"]
    Dataset.from_dict(
        {"text": ["good", "bad", "great", "awful"], "label": [labels[1], labels[0], labels[1], labels[0]]}
    ).save_to_disk(folder)
    return folder


def tar_gz(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(folder, arcname=folder.name)
    return buffer.getvalue()


def point_data_file_at(folder: Path, filename: str) -> None:
    state_file = folder / "state.json"
    state = json.loads(state_file.read_text())
    state["_data_files"] = [{"filename": filename}]
    state_file.write_text(json.dumps(state))


# --- a datasets folder reads its own files only (finding 2) ----------------------------------------------


@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_a_datasets_folder_whose_state_names_an_arrow_file_elsewhere_is_refused(api, tmp_path, how):
    victim = saved_dataset(tmp_path / "victim", SECRET_LABELS)
    victim_file = next(victim.glob("*.arrow"))
    ds = saved_dataset(tmp_path / "ds")
    point_data_file_at(
        ds, str(victim_file) if how == "absolute" else "../" * 30 + str(victim_file).lstrip("/")
    )

    response = upload(api, {"dataset": ("ds.tar.gz", tar_gz(ds))})

    refused(response, 422, "dataset", "data file", "state.json", "ds.tar.gz")
    assert "secret" not in response.text and str(tmp_path) not in response.text
    nothing_written(api)


def test_a_split_named_with_a_path_is_refused(api, tmp_path):
    victim = saved_dataset(tmp_path / "victim", SECRET_LABELS)
    root = tmp_path / "dsd"
    root.mkdir()
    saved_dataset(root / "train")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", str(victim)]}))

    response = upload(api, {"dataset": ("dsd.tar.gz", tar_gz(root))})

    refused(response, 422, "dataset", "split")
    assert "secret" not in response.text and str(tmp_path) not in response.text
    nothing_written(api)


def test_a_data_file_naming_a_server_path_tells_nothing_about_that_path(api, tmp_path):
    """No existence or size oracle: a file that exists and one that does not get the same answer."""
    answers = []
    for index, target in enumerate(["/etc/passwd", "/no/such/passwd"]):
        ds = saved_dataset(tmp_path / f"ds{index}")
        point_data_file_at(ds, target)
        response = upload(api, {"dataset": ("ds.tar.gz", tar_gz(ds))})
        message = refused(response, 422, "dataset")
        assert "root:" not in message and "no such file" not in message.lower() and "bytes" not in message
        answers.append(message)
    assert answers[0] == answers[1]
    nothing_written(api)


def test_the_trainer_refuses_a_datasets_folder_that_points_outside_itself(tmp_path):
    from pelt_core.data import DataError, load_split, load_table

    victim = saved_dataset(tmp_path / "victim", SECRET_LABELS)
    ds = saved_dataset(tmp_path / "ds")
    point_data_file_at(ds, str(next(victim.glob("*.arrow"))))
    with pytest.raises(DataError, match="data file") as caught:
        load_table(ds)
    assert "secret" not in str(caught.value)
    root = tmp_path / "dsd"
    root.mkdir()
    saved_dataset(root / "train")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", str(victim)]}))
    with pytest.raises(DataError, match="split"):
        load_split(f"{root}:train")


def test_a_datasets_folder_whose_features_would_open_files_is_refused(api, tmp_path):
    """An Image/Audio feature decodes a `path` stored in the rows: a reader of arbitrary files."""
    ds = saved_dataset(tmp_path / "ds")
    info_file = ds / "dataset_info.json"
    info = json.loads(info_file.read_text())
    info["features"]["text"] = {"_type": "Image"}
    info_file.write_text(json.dumps(info))
    response = upload(api, {"dataset": ("ds.tar.gz", tar_gz(ds))})
    refused(response, 422, "dataset", "Image")
    nothing_written(api)


def test_a_well_formed_datasets_folder_still_registers(api, tmp_path):
    response = upload(api, {"dataset": ("ds.tar.gz", tar_gz(saved_dataset(tmp_path / "ds")))})
    assert response.status_code == 201, response.text
    assert response.json()["label_names"] == ["neg", "pos"]


# --- broken archives are 422, not 500 (finding 7) ------------------------------------------------------


def zip_of(members: dict[str, bytes], compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def patched(archive: bytes, offset_in_header: int, value: bytes) -> bytes:
    """The zip with `value` written at an offset of its local header and of its central directory entry."""
    data = bytearray(archive)
    local, central = data.index(b"PK\x03\x04"), data.index(b"PK\x01\x02")
    data[local + offset_in_header : local + offset_in_header + len(value)] = value
    central_offset = offset_in_header + 2  # the central entry has "version made by" before the shared fields
    data[central + central_offset : central + central_offset + len(value)] = value
    return bytes(data)


def broken_zips() -> dict[str, bytes]:
    members = {"ds/state.json": b"{}" * 200}
    encrypted = patched(zip_of(members), 6, b"\x01\x00")  # general-purpose flag bit 0: encrypted
    unknown_method = patched(zip_of(members), 8, b"\x63\x00")  # method 99 (AES): not supported by zipfile
    noise = random.Random(0).randbytes(4000)  # incompressible: the LZMA stream is long enough to corrupt
    lzma_data = bytearray(zip_of({"ds/state.json": noise}, zipfile.ZIP_LZMA))
    start = lzma_data.index(b"PK\x03\x04") + 30 + len("ds/state.json")
    lzma_data[start + 9 : start + 40] = b"\xff" * 31  # the LZMA stream after its properties header
    return {"encrypted": encrypted, "unknown-method": unknown_method, "corrupt-lzma": bytes(lzma_data)}


@pytest.mark.parametrize("kind", ["encrypted", "unknown-method", "corrupt-lzma"])
def test_an_unreadable_zip_member_is_a_422_naming_the_archive(api, kind):
    response = upload(api, {"dataset": ("ds.zip", broken_zips()[kind])})
    refused(response, 422, "dataset", "ds.zip")
    assert str(api.settings.data_dir) not in response.text
    nothing_written(api)


@pytest.mark.parametrize("names", [["ds/" + "a" * 300], ["ds/x", "ds/x/y"]])
def test_an_archive_member_with_an_impossible_name_is_a_422_without_server_paths(api, names):
    response = upload(api, {"dataset": ("ds.zip", zip_of(dict.fromkeys(names, b"x")))})
    refused(response, 422, "dataset")
    assert str(api.settings.data_dir) not in response.text
    nothing_written(api)


# --- archives: entries, expansion (finding 4) --------------------------------------------------------


def test_an_archive_with_too_many_entries_is_refused_before_anything_is_unpacked(api):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for index in range(20_000):
            archive.writestr(f"ds/{index}.json", b"")
    response = upload(api, {"dataset": ("many.zip", buffer.getvalue())})
    refused(response, 413, "dataset", "entries", "PELT_MAX_ARCHIVE_ENTRIES")
    nothing_written(api)


class Zeros(io.RawIOBase):
    """`size` zero bytes, read in chunks (never held whole)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self.left)
        buffer[:count] = bytes(count)
        self.left -= count
        return count


BOMB_BYTES = 600 << 20


def zip_bomb(path: Path) -> Path:
    with (
        zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive,
        archive.open("ds/data-00000-of-00001.arrow", "w", force_zip64=True) as member,
    ):
        source = Zeros(BOMB_BYTES)
        while chunk := source.read(1 << 20):
            member.write(chunk)
    return path


def tar_bomb(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        info = tarfile.TarInfo("ds/data-00000-of-00001.arrow")
        info.size = BOMB_BYTES
        archive.addfile(info, io.BufferedReader(Zeros(BOMB_BYTES), 1 << 20))
    return path


def parquet_bomb(path: Path, rows: int = 50_000_000) -> Path:
    """`rows` rows of one short sentence and one label, in row groups of a million: a few hundred KB."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    group = pa.table({"text": pa.array(["x"] * 1_000_000), "label": pa.array([0] * 1_000_000, pa.int64())})
    with pq.ParquetWriter(path, group.schema) as writer:
        for _ in range(rows // 1_000_000):
            writer.write_table(group, row_group_size=1_000_000)
    return path


BOUNDED_UPLOAD = r"""
import json, resource, signal, sys
args = json.loads(sys.argv[1])
from services.errors import classify
from services.registry import Registry
from services.operations import PeltOperations
from services.uploads import Upload
from services.settings import Settings

settings = Settings(data_dir=args["data_dir"], ray_address=None)  # the production bounds
operations = PeltOperations(Registry(settings=settings), None, settings=settings)
files = {field: Upload(name, open(path, "rb")) for field, (name, path) in args["files"].items()}
operations.list_tasks(), classify(ValueError())  # warm: imports, the database
size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + args["headroom"], size + args["headroom"]))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past RLIMIT_FSIZE fails its write instead
resource.setrlimit(resource.RLIMIT_FSIZE, (args["file_size"], args["file_size"]))
try:
    operations.register_task("bomb", files, json.loads(args["definition"]))
    answer = {"status": 201}
except Exception as exc:
    view = classify(exc)
    answer = {"status": view.status if view else 500, "body": view.body() if view else {"error": repr(exc)}}
print("RESPONSE " + json.dumps(answer))
"""


def upload_bounded(
    settings: Settings,
    files: dict[str, tuple[str, Path]],
    definition: str = DEFINITION,
    headroom: int = 384 << 20,
    file_size: int = 200 << 20,
) -> dict[str, Any]:
    """Register a task from uploaded files (the service layer under POST /v1/tasks) in a fresh process
    with the production bounds, whose address space may grow by `headroom` bytes at most and whose files
    stay under `file_size` bytes; the answer as the API would give it."""
    arguments = {
        "data_dir": str(settings.data_dir),
        "definition": definition,
        "headroom": headroom,
        "file_size": file_size,
        "files": {field: (name, str(path)) for field, (name, path) in files.items()},
    }
    environment = {
        **os.environ,
        "MALLOC_ARENA_MAX": "2",
        "ARROW_DEFAULT_MEMORY_POOL": "system",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", BOUNDED_UPLOAD, json.dumps(arguments)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        env=environment,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESPONSE ")]
    assert lines, (
        f"the service process ended without an answer (exit {done.returncode}): {done.stderr[-3000:]}"
    )
    return json.loads(lines[-1].removeprefix("RESPONSE "))


def nothing_kept(settings: Settings) -> None:
    registry = Registry(settings=settings)
    try:
        assert registry.list_tasks() == []
    finally:
        registry.close()
    assert [
        p
        for p in settings.data_dir.rglob("*")
        if p.is_file() and not p.name.startswith(("registry.db", "mlflow.db"))
    ] == []


@pytest.mark.parametrize("kind", ["zip", "tar.gz"])
def test_an_archive_bomb_is_refused_while_it_unpacks_and_nothing_is_kept(settings, tmp_path, kind):
    bomb = zip_bomb(tmp_path / "bomb.zip") if kind == "zip" else tar_bomb(tmp_path / "bomb.tar.gz")
    assert bomb.stat().st_size < 4 << 20  # 600 MB of zeros, compressed

    answer = upload_bounded(settings, {"dataset": (bomb.name, bomb)})

    assert answer["status"] == 413, answer
    error = answer["body"]["error"]
    assert error["field"] == "dataset" and "PELT_MAX_ARCHIVE_EXPANSION" in error["message"], error
    assert str(settings.data_dir) not in error["message"]
    nothing_kept(settings)


def test_a_parquet_bomb_is_refused_from_its_metadata_without_decoding_it(settings, tmp_path):
    bomb = parquet_bomb(tmp_path / "train.parquet")
    assert bomb.stat().st_size < 2 << 20  # 50 M rows in a few hundred KB

    answer = upload_bounded(settings, {"train": ("train.parquet", bomb)}, headroom=256 << 20)

    assert answer["status"] == 413, answer
    error = answer["body"]["error"]
    assert error["field"] == "source.train" and "PELT_MAX_DATASET_ROWS" in error["message"], error
    nothing_kept(settings)


@pytest.fixture
def api_of_100_rows(settings: Settings, tiny_bert_dir: Path) -> Any:
    """The API of an operator who set PELT_MAX_DATASET_ROWS=100."""
    from services.api.app import create_app
    from services.operations import PeltOperations

    bounded = Settings(**{**settings.model_dump(), "max_dataset_rows": 100})
    registry = Registry(settings=bounded)
    _, token = registry.create_api_token("tests")
    try:
        yield Api(
            create_app(PeltOperations(registry, None, settings=bounded), bounded),
            None,
            registry,
            None,
            token,
            bounded,
        )
    finally:
        registry.close()


def test_the_row_bound_is_an_operator_knob_and_holds_for_every_format(api_of_100_rows):
    api = api_of_100_rows
    rows = "".join(json.dumps({"text": "t", "label": i % 2}) + "\n" for i in range(101)).encode()
    refused(upload(api, {"train": ("train.jsonl", rows)}), 413, "source.train", "PELT_MAX_DATASET_ROWS")
    csv = ("text,label\n" + "t,1\n" * 101).encode()
    refused(upload(api, {"train": ("train.csv", csv)}), 413, "source.train", "PELT_MAX_DATASET_ROWS")
    ok = "".join(json.dumps({"text": "t", "label": i % 2}) + "\n" for i in range(100)).encode()
    refused(
        upload(api, {"train": ("train.jsonl", ok), "validation": ("v.jsonl", rows)}),
        413,
        "source.validation",
        "PELT_MAX_DATASET_ROWS",
    )
    nothing_written(api)


# --- multipart fields and JSON (findings 7, 10) ----------------------------------------------------------


def test_an_unknown_multipart_field_is_refused_naming_it(api, toy_files):
    train = ("train.jsonl", Path(toy_files["train"]).read_bytes())
    refused(upload(api, {"train": train, "weights": ("w.bin", b"\x00" * 10)}), 422, "weights", "unknown")
    refused(upload(api, {"train": train}, note="hello"), 422, "note", "unknown")
    nothing_written(api)


def test_a_field_sent_twice_is_refused(api, toy_files):
    train = ("train.jsonl", Path(toy_files["train"]).read_bytes())
    response = api.client().http.post(
        "/v1/tasks",
        data={"name": "attack", "definition": '{"text_fields": ["sentence"]}'},
        files=[("train", train), ("train", train)],
    )
    refused(response, 422, "train", "twice")
    nothing_written(api)


def test_a_deeply_nested_definition_is_a_422_naming_it(api, toy_files):
    train = ("train.jsonl", Path(toy_files["train"]).read_bytes())
    response = upload(api, {"train": train}, definition="[" * 40_000 + "]" * 40_000)
    refused(response, 422, "definition", "nested")
    nothing_written(api)


@pytest.mark.parametrize("depth", [200, 20_000])
def test_a_deeply_nested_json_body_is_a_422_naming_the_body(api, toy_task, depth):
    body = (
        '{"task": "toy", "method": "lora", "backbone": "tiny-bert", "hyperparameters": {"q.layers": '
        + "[" * depth
        + "]" * depth
        + "}}"
    )
    response = api.client().http.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    refused(response, 422, "body", "nested")
    assert api.registry.list_jobs() == []


# --- round 2: what a reviewer found ---------------------------------------------------------------------


def run_python(code: str, *arguments: str, memory_bytes: int = 2 << 30) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter under an address-space limit (a crash there fails only its test)."""
    bounded = (
        f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({memory_bytes}, {memory_bytes}))\n" + code
    )
    environment = {
        **os.environ,
        "MALLOC_ARENA_MAX": "2",
        "ARROW_DEFAULT_MEMORY_POOL": "system",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    return subprocess.run(
        [sys.executable, "-c", bounded, *arguments],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        env=environment,
        timeout=300,
    )


def dataset_dict_with_a_root_state_pointing_at(root: Path, victim: Path) -> Path:
    """A clean DatasetDict folder (dataset_dict.json, train/) plus a root state.json naming `victim`'s
    Arrow file by its absolute path: `datasets.load_from_disk` loads the root state first."""
    root.mkdir()
    saved_dataset(root / "train")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    (root / "dataset_info.json").write_text((victim / "dataset_info.json").read_text())
    (root / "state.json").write_text((victim / "state.json").read_text())
    point_data_file_at(root, str(next(victim.glob("*.arrow"))))
    return root


def test_a_dataset_dict_with_a_root_state_json_is_refused_and_never_loads_it(api, tmp_path):
    victim = saved_dataset(tmp_path / "victim", SECRET_LABELS)
    root = dataset_dict_with_a_root_state_pointing_at(tmp_path / "dsd", victim)

    response = upload(api, {"dataset": ("dsd.tar.gz", tar_gz(root))})

    refused(response, 422, "dataset", "state.json")
    assert "secret" not in response.text and str(tmp_path) not in response.text
    nothing_written(api)


def test_the_trainer_refuses_a_dataset_dict_with_a_root_state_json(tmp_path):
    from pelt_core.data import DataError, load_split, load_table

    victim = saved_dataset(tmp_path / "victim", SECRET_LABELS)
    root = dataset_dict_with_a_root_state_pointing_at(tmp_path / "dsd", victim)
    for load in (lambda: load_table(root), lambda: load_split(f"{root}:train")):
        with pytest.raises(DataError, match=r"state\.json") as caught:
            load()
        assert "secret" not in str(caught.value)


def nested_row(depth: int) -> bytes:
    return (
        json.dumps({"text": "deep", "label": 1})[:-1].encode()
        + b', "x": '
        + b"[" * depth
        + b"]" * depth
        + b"}\n"
    )


def test_a_json_lines_row_nested_20000_deep_is_a_422_and_the_service_survives(settings, tmp_path):
    """pyarrow's JSON reader crashes the process (SIGSEGV) on it; depth 1,000 it reads."""
    train = tmp_path / "train.jsonl"
    train.write_bytes(json.dumps({"text": "fine", "label": 0}).encode() + b"\n" + nested_row(20_000))

    answer = upload_bounded(settings, {"train": ("train.jsonl", train)})

    assert answer["status"] == 422, answer
    error = answer["body"]["error"]
    assert (
        error["field"] == "source.train" and "nested" in error["message"] and "line 2" in error["message"]
    ), error
    nothing_kept(settings)


def test_the_trainer_refuses_a_json_lines_row_nested_too_deep(tmp_path):
    deep = tmp_path / "train.jsonl"
    deep.write_bytes(nested_row(20_000))
    done = run_python(
        "import sys\nfrom pelt_core.data import DataError, load_table\ntry:\n    load_table(sys.argv[1])\n"
        "except DataError as exc:\n    print('REFUSED', exc)\n",
        str(deep),
    )
    assert done.returncode == 0 and "REFUSED" in done.stdout and "nested" in done.stdout, (
        done.returncode,
        done.stderr[-2000:],
    )


def test_data_that_decode_past_the_probe_memory_limit_are_a_422_naming_the_split(settings, tmp_path):
    """8,192 rows of one 1 MB text, dictionary-encoded in a Parquet file of a few KB: one batch decodes
    to 8 GB. The probe runs in a child process under PELT_DATASET_PROBE_MEMORY_BYTES: the service
    answers 422 naming the split instead of dying."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 8_192
    text = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int8()), pa.array(["x" * (1 << 20)]))
    table = pa.table({"text": text, "label": pa.array([0, 1] * (rows // 2))})
    pq.write_table(table, tmp_path / "train.parquet", store_schema=False)  # read back as plain strings
    assert (tmp_path / "train.parquet").stat().st_size < 2 << 20

    answer = upload_bounded(
        settings, {"train": ("train.parquet", tmp_path / "train.parquet")}, headroom=1 << 30
    )

    assert answer["status"] in (413, 422), answer
    error = answer["body"]["error"]
    assert error["field"] == "source.train", error
    nothing_kept(settings)


def test_a_probe_past_its_memory_limit_is_a_422_and_the_api_stays_up(api, toy_files):
    api.settings.dataset_probe_memory_bytes = 32 << 20  # enough to start the probe, too little to read
    train = ("train.jsonl", Path(toy_files["train"]).read_bytes())
    message = refused(
        upload(api, {"train": train}),
        422,
        "source.train",
        "ran out of its memory limit",
        "PELT_DATASET_PROBE_MEMORY_BYTES",
    )
    assert "train.jsonl" in message  # the file it was reading
    nothing_written(api)
    api.settings.dataset_probe_memory_bytes = 4 << 30
    assert upload(api, {"train": train}, definition='{"text_fields": ["sentence"]}').status_code == 201


def test_a_probe_past_its_time_limit_is_a_422(api, toy_files):
    api.settings.sandbox_warm_seconds = 0  # a fresh interpreter, and none starts in a millisecond
    api.settings.dataset_probe_timeout_seconds = 0.001
    train = ("train.jsonl", Path(toy_files["train"]).read_bytes())
    refused(upload(api, {"train": train}), 422, "source", "PELT_DATASET_PROBE_TIMEOUT_SECONDS")
    nothing_written(api)


def sparse_tar(path: Path, real_size: int) -> Path:
    """A pax (GNU sparse 1.0) member of `real_size` bytes whose holes the archive does not hold."""
    sparse_map = b"1\n0\n1\n".ljust(512, b"\0")  # one data region: offset 0, 1 byte
    info = tarfile.TarInfo("ds/GNUSparseFile.0/data-00000-of-00001.arrow")
    info.size = len(sparse_map) + 1
    info.pax_headers = {
        "GNU.sparse.major": "1",
        "GNU.sparse.minor": "0",
        "GNU.sparse.name": "ds/data-00000-of-00001.arrow",
        "GNU.sparse.realsize": str(real_size),
    }
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as archive:
        archive.addfile(info, io.BytesIO(sparse_map + b"x"))
    return path


def test_a_sparse_tar_member_is_refused_before_its_holes_are_written(settings, tmp_path):
    bomb = sparse_tar(tmp_path / "ds.tar.gz", 10 << 30)
    assert bomb.stat().st_size < 4096

    answer = upload_bounded(settings, {"dataset": ("ds.tar.gz", bomb)})

    assert answer["status"] in (413, 422), answer
    error = answer["body"]["error"]
    assert error["field"] == "dataset" and "sparse" in error["message"], error
    nothing_kept(settings)


def test_a_dictionary_encoded_label_is_summarized_without_decoding_it(settings, tmp_path):
    """One million int8 indices into one 100 KB label: 100 GB decoded. The label is refused (too long)
    from its dictionary, in a few MB."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 1_000_000
    label = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int8()), pa.array(["y" * 100_000]))
    pq.write_table(pa.table({"text": pa.array(["t"] * rows), "label": label}), tmp_path / "train.parquet")

    answer = upload_bounded(
        settings, {"train": ("train.parquet", tmp_path / "train.parquet")}, headroom=384 << 20
    )

    assert answer["status"] == 422, answer
    error = answer["body"]["error"]
    assert error["field"] == "label_field" and "characters" in error["message"], error
    nothing_kept(settings)


def test_a_datasets_folder_with_dictionary_encoded_columns_is_refused(tmp_path):
    import pyarrow as pa

    from pelt_core.saved_dataset import SavedDatasetError, inspect_saved_dataset

    ds = saved_dataset(tmp_path / "ds")
    arrow = next(ds.glob("*.arrow"))
    with pa.memory_map(str(arrow)) as source:
        table = pa.ipc.open_stream(source).read_all()
    encoded = table.set_column(1, "label", table.column("label").combine_chunks().dictionary_encode())
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, encoded.schema) as writer:
        writer.write_table(encoded)
    with pytest.raises(SavedDatasetError, match="dictionary"):
        inspect_saved_dataset(ds)


def without_listed_features(ds: Path) -> Path:
    info_file = ds / "dataset_info.json"
    info = json.loads(info_file.read_text())
    del info["features"]
    info_file.write_text(json.dumps(info))
    return ds


def image_dataset(folder: Path) -> Path:
    """A save_to_disk folder whose `text` column is an Image feature (in its Arrow schema's metadata)."""
    from datasets import Dataset, Features, Image, Value

    Dataset.from_dict(
        {"text": [{"bytes": None, "path": "/etc/hostname"}] * 2, "label": ["a", "b"]},
        features=Features({"text": Image(), "label": Value("string")}),
    ).save_to_disk(folder)
    return folder


def test_features_from_the_arrow_schema_metadata_are_checked_too(api, tmp_path):
    """Without `features` in dataset_info.json, datasets takes them from the Arrow schema's metadata."""
    ds = without_listed_features(image_dataset(tmp_path / "ds"))
    response = upload(api, {"dataset": ("ds.tar.gz", tar_gz(ds))})
    refused(response, 422, "dataset", "features")
    nothing_written(api)


def test_the_trainer_never_takes_features_from_the_arrow_schema_metadata(tmp_path):
    from pelt_core.data import DataError, load_table

    with pytest.raises(DataError, match="features"):
        load_table(without_listed_features(image_dataset(tmp_path / "ds")))


def test_a_slow_upload_does_not_hold_up_another(api, toy_files, tmp_path, monkeypatch):
    """The upload lock covers the folder's rename and its in-use check, not the probe of the data."""
    import threading

    from services.uploads import Upload

    entered, release, finished = threading.Event(), threading.Event(), threading.Event()
    register = api.registry.register_task

    def slow_for_the_first(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "slow":
            entered.set()
            release.wait(60)
        return register(name, *args, **kwargs)

    monkeypatch.setattr(api.registry, "register_task", slow_for_the_first)
    slow_file = tmp_path / "slow.jsonl"
    slow_file.write_bytes(Path(toy_files["train"]).read_bytes() + b'{"sentence": "one more", "label": 1}\n')
    slow = threading.Thread(
        target=lambda: (
            api.operations.register_task(
                "slow", {"train": Upload("slow.jsonl", slow_file.open("rb"))}, {"text_fields": ["sentence"]}
            ),
            finished.set(),
        )
    )
    slow.start()
    try:
        assert entered.wait(60)
        with Path(toy_files["train"]).open("rb") as train:
            fast = api.operations.register_task(
                "fast", {"train": Upload("train.jsonl", train)}, {"text_fields": ["sentence"]}
            )
        assert fast.name == "fast" and not finished.is_set()
    finally:
        release.set()
        slow.join(60)
    assert finished.is_set() and {task.name for task in api.registry.list_tasks()} == {"slow", "fast"}


def test_the_zip_end_record_is_read_without_private_zipfile_internals():
    source = (Path(__file__).resolve().parents[2] / "services" / "uploads.py").read_text()
    assert "zipfile._" not in source


# --- round 3: zip64 end records, tar headers, concurrent probes, the sandboxed child ---------------------


def crafted_zip64(entries: int) -> bytes:
    """A zip whose end record, and the zip64 end record its locator points at, say one entry of 46 bytes,
    while the zip64 end record just before the locator (the one Python's zipfile reads) lists `entries`."""
    import struct

    central = struct.Struct("<4s4B4HL2L5H2L")  # a central directory entry (APPNOTE 4.3.12), 46 bytes
    names = [f"ds/{index}.json".encode() for index in range(entries)]
    directory = b"".join(
        central.pack(b"PK\x01\x02", 20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, len(name), 0, 0, 0, 0, 0, 0) + name
        for name in names
    )
    zip64_end = struct.Struct("<4sQ2H2L4Q")
    decoy = zip64_end.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, 1, 1, 46, zip64_end.size)
    real = zip64_end.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, entries, entries, len(directory), zip64_end.size)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, 0, 1)  # points at the decoy, at offset 0
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, 46, zip64_end.size, 0)
    return decoy + directory + real + locator + end


def test_a_zip_whose_end_records_disagree_is_refused_before_zipfile_reads_its_directory(api, monkeypatch):
    archive = crafted_zip64(3_000)
    assert len(zipfile.ZipFile(io.BytesIO(archive)).infolist()) == 3_000  # what zipfile would build in memory

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("zipfile read the central directory of an archive pelt should have refused")

    monkeypatch.setattr(zipfile, "ZipFile", never)
    response = upload(api, {"dataset": ("ds.zip", archive)})

    assert response.status_code in (413, 422), response.text
    assert response.json()["error"]["field"] == "dataset"
    nothing_written(api)


@pytest.mark.parametrize("shape", ["empty", "plain", "commented", "zip64", "zip64-commented", "zip64-65536"])
def test_the_zip_directory_pelt_checks_is_the_one_zipfile_reads(tmp_path, monkeypatch, shape):
    from services.uploads import count_zip_entries, zip_directory

    count = {"empty": 0, "zip64-65536": 65_536}.get(shape, 5)
    if shape in ("zip64", "zip64-commented"):
        monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 2)  # zipfile then writes zip64 end records
    path = tmp_path / "data.zip"
    with zipfile.ZipFile(path, "w") as archive:
        for index in range(count):
            archive.writestr(f"ds/{index}.json", b"{}" * (index % 7))
        if shape.endswith("commented"):
            archive.comment = b"a comment"

    directory = zip_directory(path)

    with zipfile.ZipFile(path) as archive:
        assert directory.entries == len(archive.infolist()) == count
        assert directory.start == archive.start_dir
    assert count_zip_entries(path, directory, stop_after=count) == count
    assert (b"PK\x06\x06" in path.read_bytes()) == shape.startswith("zip64")
    assert directory.size >= 46 * count


def test_a_tar_with_a_2_mib_pax_header_is_refused_as_the_header_is_read(api, tmp_path):
    folder = saved_dataset(tmp_path / "ds")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as archive:
        archive.add(folder, arcname="ds")
        notes = tarfile.TarInfo("ds/notes.txt")
        notes.pax_headers = {"comment": "x" * (2 << 20)}  # a few KB once compressed
        archive.addfile(notes, io.BytesIO(b""))

    response = upload(api, {"dataset": ("ds.tar.gz", buffer.getvalue())})

    refused(response, 413, "dataset", "ds.tar.gz", "header")
    nothing_written(api)


def test_a_tar_of_many_small_files_with_pax_headers_still_unpacks(tmp_path):
    from services.uploads import ArchiveBounds, Upload, extract_archive

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for index in range(999):  # GNU tar --format=posix: a pax header of times for each member
            info = tarfile.TarInfo(f"ds/{index}.json")
            info.pax_headers = {
                "mtime": "1700000000.123456789",
                "atime": "1700000000.1",
                "ctime": "1700000000.2",
            }
            info.size = 3
            archive.addfile(info, io.BytesIO(b"{}\n"))
    target = tmp_path / "out" / "dataset"
    target.parent.mkdir()

    extract_archive(Upload("ds.tar", io.BytesIO(buffer.getvalue())), target, [1 << 30], ArchiveBounds())

    assert len(list(target.iterdir())) == 999


def test_uploads_past_the_probe_concurrency_are_a_503_with_retry_after_and_write_nothing(api, toy_files):
    slots = api.operations.uploads.probe_slots
    taken = [slots.acquire(blocking=False) for _ in range(api.settings.dataset_probe_concurrency)]
    train = ("train.jsonl", Path(toy_files["train"]).read_bytes())
    try:
        assert all(taken)
        response = upload(api, {"train": train}, definition='{"text_fields": ["sentence"]}')
        refused(response, 503, None, "PELT_DATASET_PROBE_CONCURRENCY")  # the request, not a field
        assert int(response.headers["Retry-After"]) >= 1
        nothing_written(api)
    finally:
        for _ in taken:
            slots.release()
    assert upload(api, {"train": train}, definition='{"text_fields": ["sentence"]}').status_code == 201


def test_the_probe_memory_limit_defaults_above_the_dataset_bound_and_must_exceed_it(tmp_path):
    from pydantic import ValidationError

    assert Settings(data_dir=tmp_path).dataset_probe_memory_bytes == (4 << 30) + (2 << 30)
    assert Settings(data_dir=tmp_path, max_dataset_bytes=8 << 30).dataset_probe_memory_bytes == 10 << 30
    with pytest.raises(ValidationError, match="PELT_DATASET_PROBE_MEMORY_BYTES"):
        Settings(data_dir=tmp_path, dataset_probe_memory_bytes=1 << 30)


def test_a_string_view_label_longer_than_a_class_name_is_refused(api, tmp_path):
    import pyarrow as pa

    folder = saved_dataset(tmp_path / "ds", ["neg", "p" * 2_000])
    data_file = next(folder.glob("*.arrow"))
    table = pa.ipc.open_stream(data_file.read_bytes()).read_all()
    table = table.set_column(1, "label", table.column("label").cast(pa.string_view()))
    with pa.ipc.new_stream(str(data_file), table.schema) as writer:
        writer.write_table(table)

    response = upload(
        api,
        {"dataset": ("ds.tar.gz", tar_gz(folder))},
        definition=json.dumps({"text_fields": ["text"], "label_field": "label"}),
    )

    refused(response, 422, "label_field", "2000 characters")
    nothing_written(api)


def sandboxed(monkeypatch: pytest.MonkeyPatch, function: str, **request: Any) -> Any:
    """A function of tests/security/sandbox_targets.py run by services.sandbox as its targets are run."""
    from services import sandbox

    monkeypatch.setitem(sandbox.TARGETS, "test", f"tests.security.sandbox_targets:{function}")
    return sandbox.run_in_child("test", request, memory_bytes=2 << 30, timeout_seconds=120)


def test_the_sandboxed_child_sees_no_secrets_no_working_folder_and_writes_no_files(monkeypatch):
    import resource

    monkeypatch.setenv("PELT_DATABASE_URL", "postgresql://pelt:secret@db/pelt")
    monkeypatch.setenv("PELT_API_TOKEN", "secret-token")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")

    seen = sandboxed(monkeypatch, "what_the_child_sees").answer

    assert seen is not None
    assert not [name for name in seen["environment"] if name.startswith(("PELT_", "AWS_", "RAY_"))], seen
    assert seen["cwd"] != os.getcwd() and seen["cwd_entries"] == []
    assert seen["cwd"] not in seen["path"] and "" not in seen["path"]  # python -P
    assert seen["core"] == 0 and seen["file_size"] == 0
    assert seen["open_files"] != resource.RLIM_INFINITY


@pytest.mark.parametrize("function", ["invalid_utf8_on_stderr", "a_flood_of_progress"])
def test_a_child_sending_bytes_that_are_not_utf8_or_a_flood_of_output_ends_cleanly(monkeypatch, function):
    from services.sandbox import MAX_STDERR_TAIL_BYTES

    outcome = sandboxed(monkeypatch, function)

    if function == "invalid_utf8_on_stderr":
        assert outcome.answer == {"done": True}
        assert 0 < len(outcome.stderr_tail.encode()) <= 4 * MAX_STDERR_TAIL_BYTES  # replacement characters
    else:
        assert outcome.answer is None and "output" in outcome.how_it_ended()


def test_an_unexpected_error_in_the_probe_reports_its_type_not_its_text(tmp_path):
    from services.registry import RegistryValidationError
    from services.registry.dataset_probe import DatasetLimits, DatasetSource, probe_dataset_in_child

    source = DatasetSource("files", {"train": str(tmp_path / "train.secret-detail")})  # no reader for it
    with pytest.raises(RegistryValidationError) as caught:
        probe_dataset_in_child(source, None, DatasetLimits(), memory_bytes=2 << 30, timeout_seconds=120)

    assert caught.value.field == "source.train" and "KeyError" in str(caught.value)
    assert "secret-detail" not in str(caught.value) and str(tmp_path) not in str(caught.value)
