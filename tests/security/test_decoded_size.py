"""Uploaded data that decode or list far more than they weigh ("Harden, second round").

A Parquet file may store one text once and repeat it on every row: 1 KB on disk, 10 GiB decoded. The
registry counts what a file decodes to with each repeated text counted once per row, and refuses it
past PELT_MAX_DATASET_BYTES (413 naming the upload and the limit); the trainer's loader counts the same
way, in bounded batches, before `datasets` decodes anything. A zip's central directory is walked, not
taken at its end record's word (zipfile builds one entry per header it finds there), before zipfile
reads it.

The registration runs in a subprocess under an address-space (and file-size) limit, as the first
round's bombs do (`tests/security/test_uploads.py`), so a regression fails the test instead of
exhausting the machine.
"""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import BACKBONE
from tests.security.test_uploads import (
    nothing_kept,
    nothing_written,
    refused,
    run_python,
    upload,
    upload_bounded,
)

REPEATED_TEXT_BYTES = 10 << 20  # one 10 MiB text ...
REPEATED_ROWS = 1_000  # ... on every row: 10 GiB decoded, past the 4 GiB of PELT_MAX_DATASET_BYTES


def repeated_text_parquet(
    path: Path, rows: int = REPEATED_ROWS, text_bytes: int = REPEATED_TEXT_BYTES
) -> Path:
    """`rows` rows sharing one text of `text_bytes` bytes: the Parquet writer keeps it once (a dictionary
    page), zstd shrinks that page, and the stored Arrow schema says the column is dictionary-encoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(["x" * text_bytes]))
    pq.write_table(
        pa.table({"text": text, "label": pa.array([0, 1] * (rows // 2))}), path, compression="zstd"
    )
    return path


# --- Parquet: a repeated text counts once per row ----------------------------------------------------


def test_a_1_kb_parquet_file_decoding_to_10_gib_is_refused_at_registration(settings, tmp_path):
    bomb = repeated_text_parquet(tmp_path / "train.parquet")
    assert bomb.stat().st_size < 2048  # 1,000 rows of one 10 MiB text

    answer = upload_bounded(settings, {"train": ("train.parquet", bomb)})

    assert answer["status"] == 413, answer
    error = answer["body"]["error"]
    assert error["field"] == "source.train", error
    assert "PELT_MAX_DATASET_BYTES" in error["message"] and "train.parquet" in error["message"], error
    assert str(settings.data_dir) not in error["message"]
    nothing_kept(settings)


def test_a_parquet_file_without_its_arrow_schema_is_counted_the_same_way(settings, tmp_path):
    """Without the stored schema pyarrow would decode the text on every row (8 GB in one batch); the
    probe reads text columns dictionary-encoded whatever the file says, and counts them per row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 8_192
    text = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int16()), pa.array(["x" * (1 << 20)]))
    pq.write_table(
        pa.table({"text": text, "label": pa.array([0, 1] * (rows // 2))}),
        tmp_path / "t.parquet",
        store_schema=False,
        compression="zstd",
    )

    answer = upload_bounded(settings, {"train": ("train.parquet", tmp_path / "t.parquet")})

    assert answer["status"] == 413, answer
    assert "PELT_MAX_DATASET_BYTES" in answer["body"]["error"]["message"], answer
    nothing_kept(settings)


def test_a_parquet_file_of_repeated_short_texts_still_registers(api, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 10_000
    text = pa.DictionaryArray.from_arrays(
        pa.array([0, 1] * (rows // 2), pa.int8()), pa.array(["good", "bad"])
    )
    pq.write_table(
        pa.table({"text": text, "label": pa.array(["pos", "neg"] * (rows // 2))}), tmp_path / "t.parquet"
    )

    response = upload(api, {"train": ("train.parquet", (tmp_path / "t.parquet").read_bytes())})

    assert response.status_code == 201, response.text
    assert response.json()["split_sizes"] == {"train": rows}


def test_the_registration_counts_the_splits_together(api, tmp_path):
    """Each split within PELT_MAX_DATASET_BYTES (3 MB here), both together past it: refused naming the
    second."""
    from services.registry.dataset_probe import DatasetLimits

    api.registry.dataset_limits = DatasetLimits(api.registry.dataset_limits.max_rows, 3 << 20)
    train = repeated_text_parquet(tmp_path / "train.parquet", rows=200, text_bytes=10_000)  # 2 MB decoded
    validation = repeated_text_parquet(tmp_path / "validation.parquet", rows=200, text_bytes=10_000)

    response = upload(
        api,
        {
            "train": ("train.parquet", train.read_bytes()),
            "validation": ("validation.parquet", validation.read_bytes()),
        },
    )

    refused(response, 413, "source.validation", "PELT_MAX_DATASET_BYTES", "validation.parquet")
    nothing_written(api)


LOAD_PARQUET = r"""
import os, resource, signal, sys
os.environ["HF_DATASETS_CACHE"] = sys.argv[2]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past RLIMIT_FSIZE fails its write instead
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 20, 256 << 20))
from pelt_core.data import DataError, load_table
try:
    load_table(sys.argv[1], **({"max_decoded_bytes": int(sys.argv[3])} if len(sys.argv) > 3 else {}))
    print("LOADED")
except DataError as exc:
    print("REFUSED", exc)
"""


def test_the_trainer_refuses_a_parquet_file_decoding_past_the_limit_without_decoding_it(tmp_path):
    """A file registered under an older pelt, or one that slipped past: the loader counts it in bounded
    batches (under 2 GiB of address space here) and refuses it before `datasets` asks for 10 GB."""
    bomb = repeated_text_parquet(tmp_path / "train.parquet")

    done = run_python(LOAD_PARQUET, str(bomb), str(tmp_path / "cache"))

    assert done.returncode == 0 and "REFUSED" in done.stdout, (done.returncode, done.stderr[-2000:])
    assert "PELT_MAX_DATASET_BYTES" in done.stdout and "train.parquet" in done.stdout, done.stdout


def test_the_trainer_takes_its_limit_from_the_job_and_loads_what_fits(tmp_path):
    """The worker passes the registry's PELT_MAX_DATASET_BYTES (TaskSpec.max_data_bytes) to the loader."""
    data = repeated_text_parquet(tmp_path / "train.parquet", rows=100, text_bytes=1_000)  # 100 KB decoded

    assert "REFUSED" in run_python(LOAD_PARQUET, str(data), str(tmp_path / "cache"), str(50_000)).stdout
    assert "LOADED" in run_python(LOAD_PARQUET, str(data), str(tmp_path / "cache"), str(200_000)).stdout


def test_the_job_spec_carries_the_registrys_decoded_limit(api, toy_files):
    """The worker loads a job's data under the registry's PELT_MAX_DATASET_BYTES (TaskSpec.max_data_bytes)."""
    from services.dispatcher.job_specs import JobSpecs
    from services.registry.dataset_probe import DatasetLimits

    api.client().register_task("toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    api.registry.dataset_limits = DatasetLimits(api.registry.dataset_limits.max_rows, 12_345)
    api.registry.submit_job("toy", "lora", BACKBONE, {})
    claimed = api.registry.claim_job("w-limits")
    assert claimed is not None

    assert JobSpecs(api.registry).build(claimed).task.max_data_bytes == 12_345


def test_a_dictionary_encoded_text_counts_once_per_row_that_uses_it():
    import pyarrow as pa

    from pelt_core.parquet_size import decoded_bytes

    text = pa.DictionaryArray.from_arrays(pa.array([0, 0, None, 1], pa.int8()), pa.array(["x" * 1000, "yy"]))
    nested = pa.ListArray.from_arrays(pa.array([0, 2, 4]), text)
    assert decoded_bytes(text) >= 2 * 1000 + 2
    assert decoded_bytes(nested) >= decoded_bytes(text)
    assert decoded_bytes(pa.record_batch({"text": text})) == decoded_bytes(text)
    plain = pa.array(["x" * 1000] * 2 + [None, "yy"])
    assert abs(decoded_bytes(text) - plain.nbytes) < 64  # about what the decoded column takes


def test_distinct_long_texts_that_compress_well_are_refused_by_the_footer_before_any_batch(
    tmp_path, monkeypatch
):
    """200 distinct 1 MiB texts take 11 KB with zstd and 200 MiB decoded: the text column chunk's declared
    uncompressed size refuses them from the footer, even where the row group's total says less."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pelt_core import parquet_size

    path = tmp_path / "train.parquet"
    texts = ["a" * (1 << 20) + str(i) for i in range(200)]
    pq.write_table(pa.table({"text": texts, "label": [0, 1] * 100}), path, compression="zstd")
    assert path.stat().st_size < 64 << 10

    def never(*args, **kwargs):
        raise AssertionError("a batch was decoded; the footer alone refuses this file")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", never)
    with pytest.raises(parquet_size.DecodedSizeError, match="by its own footer"):
        parquet_size.check_parquet_decoded_size(path, 100 << 20)

    class UnderstatedGroup:  # a writer that records the compressed bytes as the row group's total
        def __init__(self, group):
            self.group = group
            self.total_byte_size = sum(
                group.column(i).total_compressed_size for i in range(group.num_columns)
            )

        def __getattr__(self, name):
            return getattr(self.group, name)

    metadata = pq.read_metadata(path)
    understated = type("Footer", (), {})()
    understated.num_columns, understated.num_row_groups = metadata.num_columns, metadata.num_row_groups
    understated.schema = metadata.schema
    understated.row_group = lambda index: UnderstatedGroup(metadata.row_group(index))
    assert parquet_size.footer_decoded_bytes(understated) >= 200 << 20
    assert parquet_size.parquet_batch_rows(understated, parquet_size.WORKER_BATCH_BYTES) <= 4


# --- zip: the central directory's entries, as zipfile walks it ------------------------------------------


def zip_directory_only(held: int, stated: int) -> bytes:
    """A zip of `held` central directory entries (46 bytes and a short name each, no members) whose end
    record states `stated` entries: zipfile ignores the count and builds one ZipInfo per entry."""
    central = struct.Struct("<4s4B4HL2L5H2L")  # a central directory entry (APPNOTE 4.3.12), 46 bytes
    directory = b"".join(
        central.pack(b"PK\x01\x02", 20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, len(name), 0, 0, 0, 0, 0, 0) + name
        for name in (f"{index}".encode() for index in range(held))
    )
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, stated, stated, len(directory), 0, 0)
    return directory + end


def refuse_zipfile(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("zipfile read the central directory of an archive pelt should have refused")

    monkeypatch.setattr(zipfile, "ZipFile", never)


def test_a_zip_listing_20_times_the_entry_limit_behind_an_end_record_of_1_is_refused_unread(api, monkeypatch):
    limit = api.settings.max_archive_entries
    archive = zip_directory_only(held=20 * limit, stated=1)
    assert len(zipfile.ZipFile(io.BytesIO(archive)).infolist()) == 20 * limit  # what zipfile would build

    refuse_zipfile(monkeypatch)
    response = upload(api, {"dataset": ("many.zip", archive)})

    refused(response, 413, "dataset", "entries", "PELT_MAX_ARCHIVE_ENTRIES", "many.zip")
    nothing_written(api)


def test_a_zip_whose_end_record_miscounts_its_directory_is_refused_unread(api, monkeypatch):
    archive = zip_directory_only(held=3, stated=1)

    refuse_zipfile(monkeypatch)
    response = upload(api, {"dataset": ("ds.zip", archive)})

    message = refused(response, 422, "dataset", "ds.zip", "1 entries", "holds 3")
    assert str(api.settings.data_dir) not in message
    nothing_written(api)


@pytest.mark.parametrize("shape", ["plain", "commented", "zip64", "prefixed"])
def test_the_directory_pelt_walks_is_the_one_zipfile_reads(tmp_path, monkeypatch, shape):
    from services.uploads import count_zip_entries, zip_directory

    if shape == "zip64":
        monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 2)  # zipfile then writes zip64 end records
    path = tmp_path / "data.zip"
    with zipfile.ZipFile(path, "w") as archive:
        for index in range(7):
            archive.writestr(f"ds/{index}.json", b"{}" * index)
        if shape == "commented":
            archive.comment = b"a comment"
    if shape == "prefixed":  # bytes before the archive (a self-extracting stub): offsets shift
        path.write_bytes(b"#!stub\n" * 100 + path.read_bytes())

    directory = zip_directory(path)

    with zipfile.ZipFile(path) as archive:
        assert directory.start == archive.start_dir
        assert count_zip_entries(path, directory, stop_after=100) == len(archive.infolist()) == 7
    assert count_zip_entries(path, directory, stop_after=3) == 4  # one past the limit, then it stops
