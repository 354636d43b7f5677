"""Tasks that no job could train on are refused at registration, naming the reason; the others train
(issue #11, findings 6 and 7).

- A task without a validation split registers: each job holds out a dev split from the training rows
  by its seed (10% capped at 1,000 rows, at least 1), and K-shot samples are drawn from the rest.
- Integer labels are class names: -3..-1 or {0, 1, 1e9} map to classes through the task's label names
  in the registry and in the trainer alike, and their jobs train.
- Text that is not UTF-8, a label column given twice, a label that is an object, evaluation labels the
  training data does not have: 422 naming the field, nothing written, no server path in the message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.client import PeltAPIError
from tests.api.conftest import BACKBONE, Api
from tests.security.fakes import Lease
from tests.workers.conftest import toy_rows


def nothing_written(api: Api) -> None:
    assert api.registry.list_tasks() == []
    assert api.files() == []


def refused(call: Any, status: int, field: str, *words: str) -> str:
    with pytest.raises(PeltAPIError) as caught:
        call()
    error = caught.value
    assert (error.status, error.field) == (status, field), error
    for word in words:
        assert word.lower() in error.message.lower(), error
    return error.message


def jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_job(api: Api, task: str, backbone_dir: Path, tmp_path: Path, k_shot: int | None = None) -> Lease:
    """One job of the registered task, as the dispatcher hands it to a worker (in this process)."""
    from pelt_core import get_method
    from services.dispatcher import task_spec
    from workers.backbone_store import LocalBackbones
    from workers.job import JobSpec, LocalDeltaSink
    from workers.worker import PeltWorker, WorkerConfig

    spec = JobSpec(
        job_id=1,
        task=task_spec(api.registry.get_task(task)),
        method="lora",
        method_spec=get_method("lora").to_dict(),
        backbone=str(backbone_dir),
        train_config={"max_steps": 4, "batch_size": 4, "seed": 3, "bf16": "false", "k_shot": k_shot},
    )
    worker = PeltWorker(
        "w1", WorkerConfig(threads=None, heartbeat_seconds=0.05, lease_seconds=5), backbones=LocalBackbones()
    )
    lease = Lease(1)
    worker.run(spec, lease, LocalDeltaSink(tmp_path / "deltas"))
    return lease


# --- no validation split ------------------------------------------------------------------------------


def test_a_task_without_a_validation_split_registers_and_its_job_trains_on_a_held_out_dev_split(
    client, api, toy_files, tiny_bert_dir, tmp_path
):
    task = client.register_task("no-dev", toy_files["train"], text_fields=["sentence"])
    assert task.split_sizes == {"train": 200}

    lease = run_job(api, "no-dev", tiny_bert_dir, tmp_path, k_shot=50)

    assert [end for end, _ in lease.ends] == ["complete"], lease.ends
    assert "accuracy" in lease.ends[0][1]["metrics"]


def test_the_dev_split_is_held_out_by_seed_and_never_overlaps_the_k_shot_sample():
    from datasets import Dataset

    from pelt_core.data import hold_out_dev_split, sample_k_shot
    from pelt_core.limits import dev_split_rows

    assert [dev_split_rows(n) for n in (2, 9, 10, 200, 10_000, 400_000)] == [1, 1, 1, 20, 1000, 1000]
    rows = Dataset.from_dict(
        {"sentence": [f"row {i}" for i in range(200)], "label": [i % 2 for i in range(200)]}
    )
    train, dev = hold_out_dev_split(rows, seed=5)
    assert (len(train), len(dev)) == (180, 20)
    assert set(train["sentence"]).isdisjoint(dev["sentence"])
    assert set(sample_k_shot(train, 180, seed=5)["sentence"]).isdisjoint(dev["sentence"])
    again, _ = hold_out_dev_split(rows, seed=5)
    other, _ = hold_out_dev_split(rows, seed=6)
    assert again["sentence"] == train["sentence"] and other["sentence"] != train["sentence"]


def test_k_is_checked_against_the_rows_left_after_the_dev_split(client, api, toy_files):
    client.register_task("no-dev", toy_files["train"], text_fields=["sentence"])
    refused(lambda: client.submit("no-dev", "lora", backbone=BACKBONE, k_shot=181), 422, "k_shot", "dev")
    assert client.submit("no-dev", "lora", backbone=BACKBONE, k_shot=180).k_shot == 180


def test_a_single_training_row_without_a_validation_split_is_refused(client, api, tmp_path):
    one = jsonl(tmp_path / "train.jsonl", [{"sentence": "only", "label": 1}])
    refused(
        lambda: client.register_task("one", one, text_fields=["sentence"]),
        422,
        "source.validation",
        "dev split",
    )
    nothing_written(api)


# --- integer labels are class names -----------------------------------------------------------------


@pytest.mark.parametrize("values", [[-3, -2, -1], [0, 1, 1e9], [1, 2, 3]])
def test_integer_labels_outside_0_to_n_are_class_names_and_their_jobs_train(
    client, api, tiny_bert_dir, tmp_path, values
):
    rows = [
        {"sentence": row["sentence"], "label": values[index % len(values)]}
        for index, row in enumerate(toy_rows(60, seed=0))
    ]
    train, validation = jsonl(tmp_path / "train.jsonl", rows), jsonl(tmp_path / "validation.jsonl", rows[:12])
    task = client.register_task("ints", train, validation, text_fields=["sentence"])
    assert task.label_names == [str(int(v)) for v in values]

    lease = run_job(api, "ints", tiny_bert_dir, tmp_path)

    assert [end for end, _ in lease.ends] == ["complete"], lease.ends


def test_the_registry_and_the_trainer_map_labels_to_the_same_classes():
    from pelt_core.data import TaskFields, encode_labels

    task = TaskFields(("sentence",), "label", label_names=["-3", "-2", "-1"])
    assert encode_labels([-1, -3, -2.0], task, "data").tolist() == [2, 0, 1]
    declared = TaskFields(("sentence",), "label", label_names=["neg", "pos"])
    assert encode_labels([1, 0, "pos"], declared, "data").tolist() == [
        1,
        0,
        1,
    ]  # positions, as ClassLabel does


def test_evaluation_labels_the_training_data_lacks_are_refused(client, api, tmp_path):
    train = jsonl(tmp_path / "train.jsonl", [{"sentence": "a", "label": 0}, {"sentence": "b", "label": 1}])
    validation = jsonl(tmp_path / "validation.jsonl", [{"sentence": "c", "label": 7}])
    refused(
        lambda: client.register_task("odd", train, validation, text_fields=["sentence"]),
        422,
        "source.validation",
        "7",
    )
    nothing_written(api)


# --- data no job can read ---------------------------------------------------------------------------------


def test_a_latin1_csv_is_refused_naming_the_split_and_the_encoding(client, api, tmp_path):
    latin = tmp_path / "train.csv"
    latin.write_bytes("sentence,label\ncaf\u00e9 cr\u00e8me,1\nna\u00efve,0\n".encode("latin-1"))
    refused(
        lambda: client.register_task("latin", latin, text_fields=["sentence"]),
        422,
        "source.train",
        "UTF-8",
        "train.csv",
    )
    nothing_written(api)


def test_a_csv_with_its_label_column_twice_is_refused_naming_it(client, api, tmp_path):
    twice = tmp_path / "train.csv"
    twice.write_text("sentence,label,label\ngood,1,0\nbad,0,1\n")
    refused(
        lambda: client.register_task("twice", twice, text_fields=["sentence"]),
        422,
        "source.train",
        "label",
        "twice",
    )
    nothing_written(api)


@pytest.mark.parametrize("label", [{"a": 1}, [{"a": 1}]])
def test_a_label_that_is_an_object_is_refused_naming_the_label_field(client, api, tmp_path, label):
    rows = jsonl(
        tmp_path / "train.jsonl", [{"sentence": "good", "label": label}, {"sentence": "bad", "label": label}]
    )
    problem = "multi_label_classification" if isinstance(label, list) else "single_label_classification"
    refused(
        lambda: client.register_task("objects", rows, text_fields=["sentence"], problem_type=problem),
        422,
        "label_field",
    )
    nothing_written(api)


def test_dataset_errors_name_the_split_and_the_uploaded_file_not_a_server_path(
    client, api, tmp_path, toy_files
):
    broken = tmp_path / "mine.jsonl"
    broken.write_text('{"sentence": "fine", "label": 1}\n{"sentence": "cut off", "lab\n')
    message = refused(
        lambda: client.register_task("broken", broken, text_fields=["sentence"]),
        422,
        "source.train",
        "mine.jsonl",
        "cannot read",
    )
    assert str(api.settings.data_dir) not in message and "/" not in message.replace("mine.jsonl", "")
    not_parquet = tmp_path / "dev.parquet"
    not_parquet.write_bytes(b"PAR1 but not really")
    message = refused(
        lambda: client.register_task("broken", toy_files["train"], not_parquet, text_fields=["sentence"]),
        422,
        "source.validation",
        "dev.parquet",
    )
    assert str(api.settings.data_dir) not in message
    message = refused(
        lambda: client.register_task("broken", toy_files["train"], text_fields=["text"]), 422, "text_fields"
    )
    assert str(api.settings.data_dir) not in message
    nothing_written(api)


# --- positions apply to declared names only (round 2) -----------------------------------------------------


def test_an_evaluation_label_outside_the_inferred_names_is_refused_not_taken_as_a_position(
    client, api, tmp_path
):
    """Training labels {1, 2} infer the classes ["1", "2"]: a validation label 0 is no class (not "1")."""
    train = jsonl(tmp_path / "train.jsonl", [{"sentence": "a", "label": 1}, {"sentence": "b", "label": 2}])
    validation = jsonl(tmp_path / "validation.jsonl", [{"sentence": "c", "label": 0}])
    refused(
        lambda: client.register_task("shifted", train, validation, text_fields=["sentence"]),
        422,
        "source.validation",
        "0",
    )
    words = jsonl(
        tmp_path / "words.jsonl", [{"sentence": "a", "label": "neg"}, {"sentence": "b", "label": "pos"}]
    )
    refused(
        lambda: client.register_task("shifted", words, validation, text_fields=["sentence"]),
        422,
        "source.validation",
        "0",
    )
    nothing_written(api)


def test_declared_label_names_still_take_whole_numbers_as_positions(client, api, tmp_path):
    train = jsonl(tmp_path / "train.jsonl", [{"sentence": "a", "label": 0}, {"sentence": "b", "label": 1}])
    validation = jsonl(tmp_path / "validation.jsonl", [{"sentence": "c", "label": 1}])
    task = client.register_task(
        "declared", train, validation, text_fields=["sentence"], label_names=["neg", "pos"]
    )
    assert task.label_names == ["neg", "pos"]


def test_the_trainer_maps_labels_by_name_only_when_it_inferred_the_names():
    from datasets import Dataset

    from pelt_core.data import DataError, encode_labels, infer_task_fields

    rows = Dataset.from_dict({"sentence": ["a", "b"], "label": [1, 2]})
    task = infer_task_fields(rows)
    assert task.label_names == ["1", "2"]
    assert encode_labels([2, 1], task, "data").tolist() == [1, 0]
    with pytest.raises(DataError, match="0"):
        encode_labels([0], task, "data")


def test_the_trainer_loads_a_datasets_folder_without_hashing_its_table(tmp_path, monkeypatch):
    """Without a fingerprint given, `datasets` pickles and hashes the whole table: one more copy of the data."""
    import datasets.arrow_dataset
    from datasets import Dataset

    from pelt_core.saved_dataset import load_saved_dataset

    Dataset.from_dict({"sentence": ["good", "bad"], "label": [1, 0]}).save_to_disk(tmp_path / "ds")

    def hashing_the_table(*args: Any, **kwargs: Any) -> str:
        raise AssertionError("datasets fingerprinted the split by hashing its table")

    monkeypatch.setattr(datasets.arrow_dataset, "generate_fingerprint", hashing_the_table)
    assert load_saved_dataset(tmp_path / "ds").num_rows == 2
