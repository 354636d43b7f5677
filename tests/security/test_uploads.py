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


def refused(response: Any, status: int, field: str, *words: str) -> str:
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
    Dataset.from_dict({"text": ["good", "bad", "great", "awful"],
                       "label": [labels[1], labels[0], labels[1], labels[0]]}).save_to_disk(folder)
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
    point_data_file_at(ds, str(victim_file) if how == "absolute" else "../" * 30 + str(victim_file).lstrip("/"))

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
    data[local + offset_in_header:local + offset_in_header + len(value)] = value
    central_offset = offset_in_header + 2  # the central entry has "version made by" before the shared fields
    data[central + central_offset:central + central_offset + len(value)] = value
    return bytes(data)


def broken_zips() -> dict[str, bytes]:
    members = {"ds/state.json": b"{}" * 200}
    encrypted = patched(zip_of(members), 6, b"\x01\x00")  # general-purpose flag bit 0: encrypted
    unknown_method = patched(zip_of(members), 8, b"\x63\x00")  # method 99 (AES): not supported by zipfile
    noise = random.Random(0).randbytes(4000)  # incompressible: the LZMA stream is long enough to corrupt
    lzma_data = bytearray(zip_of({"ds/state.json": noise}, zipfile.ZIP_LZMA))
    start = lzma_data.index(b"PK\x03\x04") + 30 + len("ds/state.json")
    lzma_data[start + 9:start + 40] = b"\xff" * 31  # the LZMA stream after its properties header
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
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive, \
            archive.open("ds/data-00000-of-00001.arrow", "w", force_zip64=True) as member:
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
from services.service import PeltService, Upload
from services.settings import Settings

settings = Settings(data_dir=args["data_dir"], ray_address=None)  # the production bounds
service = PeltService(Registry(settings=settings), None, settings=settings)
files = {field: Upload(name, open(path, "rb")) for field, (name, path) in args["files"].items()}
service.list_tasks(), classify(ValueError())  # warm: imports, the database
size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + args["headroom"], size + args["headroom"]))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past RLIMIT_FSIZE fails its write instead
resource.setrlimit(resource.RLIMIT_FSIZE, (args["file_size"], args["file_size"]))
try:
    service.register_task("bomb", files, json.loads(args["definition"]))
    answer = {"status": 201}
except Exception as exc:
    view = classify(exc)
    answer = {"status": view.status if view else 500, "body": view.body() if view else {"error": repr(exc)}}
print("RESPONSE " + json.dumps(answer))
"""


def upload_bounded(settings: Settings, files: dict[str, tuple[str, Path]], definition: str = DEFINITION,
                   headroom: int = 384 << 20, file_size: int = 200 << 20) -> dict[str, Any]:
    """Register a task from uploaded files (the service layer under POST /v1/tasks) in a fresh process
    with the production bounds, whose address space may grow by `headroom` bytes at most and whose files
    stay under `file_size` bytes; the answer as the API would give it."""
    arguments = {"data_dir": str(settings.data_dir), "definition": definition, "headroom": headroom,
                 "file_size": file_size,
                 "files": {field: (name, str(path)) for field, (name, path) in files.items()}}
    environment = {**os.environ, "MALLOC_ARENA_MAX": "2", "ARROW_DEFAULT_MEMORY_POOL": "system",
                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", BOUNDED_UPLOAD, json.dumps(arguments)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2], env=environment, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESPONSE ")]
    assert lines, f"the service process ended without an answer (exit {done.returncode}): {done.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("RESPONSE "))


def nothing_kept(settings: Settings) -> None:
    registry = Registry(settings=settings)
    try:
        assert registry.list_tasks() == []
    finally:
        registry.close()
    assert [p for p in settings.data_dir.rglob("*") if p.is_file() and not p.name.startswith(
        ("registry.db", "mlflow.db"))] == []


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
    from services.service import PeltService

    bounded = Settings(**{**settings.model_dump(), "max_dataset_rows": 100})
    registry = Registry(settings=bounded)
    _, token = registry.create_api_token("tests")
    try:
        yield Api(create_app(PeltService(registry, None, settings=bounded), bounded), None, registry, None, token,
                  bounded)
    finally:
        registry.close()


def test_the_row_bound_is_an_operator_knob_and_holds_for_every_format(api_of_100_rows):
    api = api_of_100_rows
    rows = "".join(json.dumps({"text": "t", "label": i % 2}) + "\n" for i in range(101)).encode()
    refused(upload(api, {"train": ("train.jsonl", rows)}), 413, "source.train", "PELT_MAX_DATASET_ROWS")
    csv = ("text,label\n" + "t,1\n" * 101).encode()
    refused(upload(api, {"train": ("train.csv", csv)}), 413, "source.train", "PELT_MAX_DATASET_ROWS")
    ok = "".join(json.dumps({"text": "t", "label": i % 2}) + "\n" for i in range(100)).encode()
    refused(upload(api, {"train": ("train.jsonl", ok), "validation": ("v.jsonl", rows)}), 413,
            "source.validation", "PELT_MAX_DATASET_ROWS")
    nothing_written(api)


# --- multipart fields and JSON (findings 7, 10) ----------------------------------------------------------


def test_an_unknown_multipart_field_is_refused_naming_it(api, toy_files):
    train = ("train.jsonl", Path(toy_files["train"]).read_bytes())
    refused(upload(api, {"train": train, "weights": ("w.bin", b"\x00" * 10)}), 422, "weights", "unknown")
    refused(upload(api, {"train": train}, note="hello"), 422, "note", "unknown")
    nothing_written(api)


def test_a_field_sent_twice_is_refused(api, toy_files):
    train = ("train.jsonl", Path(toy_files["train"]).read_bytes())
    response = api.client().http.post("/v1/tasks", data={"name": "attack", "definition": '{"text_fields": ["sentence"]}'},
                                      files=[("train", train), ("train", train)])
    refused(response, 422, "train", "twice")
    nothing_written(api)


def test_a_deeply_nested_definition_is_a_422_naming_it(api, toy_files):
    train = ("train.jsonl", Path(toy_files["train"]).read_bytes())
    response = upload(api, {"train": train}, definition="[" * 40_000 + "]" * 40_000)
    refused(response, 422, "definition", "nested")
    nothing_written(api)


@pytest.mark.parametrize("depth", [200, 20_000])
def test_a_deeply_nested_json_body_is_a_422_naming_the_body(api, toy_task, depth):
    body = ('{"task": "toy", "method": "lora", "backbone": "tiny-bert", "hyperparameters": {"q.layers": '
            + "[" * depth + "]" * depth + "}}")
    response = api.client().http.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    refused(response, 422, "body", "nested")
    assert api.registry.list_jobs() == []
