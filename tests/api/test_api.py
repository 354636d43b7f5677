"""The HTTP API through the Python client, in-process: tasks from uploaded data, methods, backbones,
jobs, sweeps, leaderboards; bad input is refused with a message naming the field and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.client import PeltClient
from tests.api.conftest import BACKBONE, Api
from tests.api.helpers import refused


def nothing_written(api: Api) -> None:
    assert api.registry.list_tasks() == []
    assert api.files() == []


# --- tasks ------------------------------------------------------------------------------------------


def test_a_task_registers_from_uploaded_json_lines_and_its_labels_are_inferred(client, toy_files, api):
    task = client.register_task("toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    assert (task.name, task.train_size, task.split_sizes) == ("toy", 200, {"train": 200, "validation": 40})
    assert task.label_names == ["0", "1"] and task.metric == "accuracy"
    assert [t.name for t in client.tasks()] == ["toy"]
    assert client.task("toy") == task
    stored = sorted(p.name for p in api.files())
    assert stored == ["train.jsonl", "validation.jsonl"]  # kept by the service, content-addressed


def test_pelt_task_add_detects_the_text_fields_and_regression_from_float_labels(api, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from services.commands import tasks
    from services.registry.testing import write_jsonl

    monkeypatch.setattr(tasks, "PeltClient", api.client)
    scores = [5.0, 3.8, 3.8, 0.0, 2.6, 4.2]
    rows = [{"sentence1": f"a {i}", "sentence2": f"b {i}", "label": s} for i, s in enumerate(scores)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    validation = write_jsonl(tmp_path / "validation.jsonl", rows[:3])
    result = CliRunner().invoke(
        tasks.task_group, ["add", "stsb", "--train", str(train), "--validation", str(validation)]
    )
    assert result.exit_code == 0, result.output
    task = api.registry.get_task("stsb")
    assert (task.problem_type, task.text_fields, task.metric) == (
        "regression",
        ["sentence1", "sentence2"],
        "pearson",
    )


def test_a_task_registers_from_csv_and_parquet(client, toy_files):
    task = client.register_task(
        "toy-csv",
        toy_files["train_csv"],
        toy_files["validation_parquet"],
        text_fields="sentence",
        label_names=["negative", "positive"],
    )
    assert task.split_sizes == {"train": 200, "validation": 40}
    assert task.label_names == ["negative", "positive"]


def test_a_task_registers_from_a_datasets_folder(client, tmp_path):
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    features = Features({"text": Value("string"), "label": ClassLabel(names=["neg", "pos"])})
    rows = {"text": ["good", "bad", "great", "awful"], "label": [1, 0, 1, 0]}
    DatasetDict(
        {
            "train": Dataset.from_dict(rows, features=features),
            "validation": Dataset.from_dict(rows, features=features),
        }
    ).save_to_disk(tmp_path / "ds")
    task = client.register_task("from-disk", dataset=tmp_path / "ds", text_fields=["text"])
    assert task.source_kind == "datasets"
    assert task.label_names == ["neg", "pos"] and task.split_sizes == {"train": 4, "validation": 4}


def test_registering_the_same_task_twice_is_idempotent_and_a_different_one_conflicts(client, toy_files):
    first = client.register_task("toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    again = client.register_task("toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    assert again.id == first.id
    refused(lambda: client.register_task("toy", toy_files["train"], text_fields=["sentence"]), 409, "name")


def test_a_malformed_dataset_file_is_refused_and_nothing_is_kept(client, api, tmp_path):
    broken = tmp_path / "train.jsonl"
    broken.write_text('{"sentence": "fine", "label": 1}\n{"sentence": "cut off", "lab\n')
    refused(
        lambda: client.register_task("broken", broken, text_fields=["sentence"]),
        422,
        "source.train",
        "cannot read",
    )
    nothing_written(api)


def test_a_missing_text_field_is_refused_naming_it_and_listing_the_columns(client, api, toy_files):
    error = refused(
        lambda: client.register_task("toy", toy_files["train"], text_fields=["text"]), 422, "text_fields"
    )
    assert "sentence" in error.message  # the columns the data does have
    nothing_written(api)


def test_labels_that_do_not_fit_the_given_names_are_refused(client, api, toy_files):
    refused(
        lambda: client.register_task(
            "toy", toy_files["train"], text_fields=["sentence"], label_names=["only-one"]
        ),
        422,
        "label_names",
    )
    nothing_written(api)


def test_an_unsupported_file_type_and_a_missing_train_split_are_refused(client, api, tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("hello\n")
    refused(lambda: client.register_task("toy", text, text_fields=["sentence"]), 422, "train", ".jsonl")
    refused(
        lambda: client.register_task("toy", None, text, text_fields=["sentence"]), 422, "train", "required"
    )
    nothing_written(api)


def test_a_bad_task_definition_is_refused_naming_the_field(client, api, toy_files):
    refused(
        lambda: client.register_task(
            "toy", toy_files["train"], text_fields=["sentence"], problem_type="clustering"
        ),
        422,
        "definition.problem_type",
    )
    refused(
        lambda: client.register_task("bad name!", toy_files["train"], text_fields=["sentence"]), 422, "name"
    )
    nothing_written(api)


def test_an_upload_above_the_bound_is_refused_with_413_and_nothing_is_kept(client, api, tmp_path):
    big = tmp_path / "train.jsonl"
    line = json.dumps({"sentence": "word " * 200, "label": 1}) + "\n"
    big.write_text(line * (3 * 1024 * 1024 // len(line)))  # 3 MiB > the 2 MiB bound of these tests
    refused(lambda: client.register_task("big", big, text_fields=["sentence"]), 413)
    nothing_written(api)


def test_an_oversized_json_body_is_refused_with_413(client, toy_task, api):
    refused(
        lambda: client.submit(toy_task, "lora", backbone=BACKBONE, hyperparameters={"note": "x" * 100_000}),
        413,
        "body",
    )
    assert api.registry.list_jobs() == []


def test_an_archive_that_writes_outside_its_folder_is_refused(client, api, tmp_path):
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        data = b'{"text": "x", "label": 1}\n'
        member = tarfile.TarInfo("../../escape.jsonl")
        member.size = len(data)
        archive.addfile(member, io.BytesIO(data))
    response = client.http.post(
        "/v1/tasks",
        data={"name": "evil", "definition": '{"text_fields": ["text"]}'},
        files={"dataset": ("evil.tar.gz", buffer.getvalue())},
    )
    assert response.status_code == 422 and response.json()["error"]["field"] == "dataset"
    assert "outside" in response.json()["error"]["message"]
    nothing_written(api)
    assert not (api.settings.data_dir.parent / "escape.jsonl").exists()


# --- methods and backbones ------------------------------------------------------------------------------


def test_built_in_methods_are_listed_and_a_user_preset_is_data(client):
    names = {m.name for m in client.methods(builtin=True)}
    assert {"lora", "bitfit", "prefix", "pfeiffer", "houlsby", "mam", "unipelt"} <= names
    lora = client.methods(builtin=True)[[m.name for m in client.methods(builtin=True)].index("lora")]
    spec = {**lora.spec, "name": "lora-r2-all"}
    mine = client.register_method(spec)
    assert mine.name == "lora-r2-all" and not mine.builtin
    assert {m.name for m in client.methods(builtin=False)} == {"lora-r2-all"}


def test_an_invalid_method_spec_is_refused_naming_the_field(client):
    error = refused(
        lambda: client.register_method(
            {"name": "broken", "modules": {"ffn": {"form": "cube", "representation": "ffn", "size": 4}}}
        ),
        422,
    )
    assert error.field and "form" in error.field and "cube" in error.message
    refused(
        lambda: client.register_method({"name": "broken", "modules": [{"form": "bottleneck"}]}),
        422,
        "broken.modules",
    )


def test_backbones_register_by_folder_and_an_unloadable_one_is_refused(client, tiny_bert_dir, tmp_path):
    assert [b.name for b in client.backbones()] == [BACKBONE]
    again = client.register_backbone("tiny-again", str(tiny_bert_dir))
    assert again.content_hash == client.backbones()[0].content_hash
    refused(lambda: client.register_backbone("nothing", str(tmp_path / "missing")), 422, "source")
    assert sorted(b.name for b in client.backbones()) == sorted([BACKBONE, "tiny-again"])


# --- jobs ---------------------------------------------------------------------------------------------


def test_a_job_is_queued_listed_followed_and_cancelled(client, toy_task):
    job = client.submit(toy_task, "lora", backbone=BACKBONE, hyperparameters={"lr": 1e-3, "r": 4}, k_shot=50)
    assert (job.status, job.task, job.method, job.k_shot) == ("queued", "toy", "lora", 50)
    assert job.train_config["learning_rate"] == 1e-3
    assert [j.id for j in client.jobs(task="toy", status="queued")] == [job.id]
    assert client.jobs(status=["running", "succeeded"]) == []
    progress = client.http.get(f"/v1/jobs/{job.id}/progress").json()
    assert progress["status"] == "queued" and progress["progress_detail"] is None
    cancelled = client.cancel(job.id)
    assert cancelled.status == "cancelled"
    assert [e.to_status for e in client.events(job.id)] == ["queued", "cancelled"]
    refused(lambda: client.result(job.id), 404, "job_id", "no result")


def test_an_unknown_method_task_or_backbone_is_404_listing_what_exists_and_writes_nothing(
    client, toy_task, api
):
    error = refused(
        lambda: client.submit(toy_task, "lorra", backbone=BACKBONE), 404, "method", "unknown method"
    )
    assert "lora" in error.message
    refused(lambda: client.submit("nope", "lora", backbone=BACKBONE), 404, "task", "toy")
    refused(lambda: client.submit(toy_task, "lora", backbone="gpt-9"), 404, "backbone", BACKBONE)
    assert api.registry.list_jobs() == []


@pytest.mark.parametrize(
    ("hyperparameters", "field"),
    [
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"epochs": "many"}, "epochs"),
        ({"batch_size": 0}, "batch_size"),
        ({"r": -4}, "r"),
        ({"warp_speed": 9}, "warp_speed"),
    ],
)
def test_bad_hyperparameters_are_422_naming_the_field_and_write_nothing(
    client, toy_task, api, hyperparameters, field
):
    error = refused(
        lambda: client.submit(toy_task, "lora", backbone=BACKBONE, hyperparameters=hyperparameters), 422
    )
    assert field in (error.field or "") + error.message
    assert api.registry.list_jobs() == []


def test_an_unknown_request_field_is_refused_not_ignored(client, toy_task, api):
    response = client.http.post(
        "/v1/jobs", json={"task": toy_task, "method": "lora", "backbone": BACKBONE, "learning_rate": 0.1}
    )
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "learning_rate"
    assert api.registry.list_jobs() == []


# --- devices --------------------------------------------------------------------------------------

H100 = "cuda:0 (NVIDIA H100 80GB HBM3)"


def test_a_job_names_the_device_it_needs_any_by_default(client, toy_task):
    assert client.submit(toy_task, "lora", backbone=BACKBONE).device == "any"
    job = client.submit(toy_task, "lora", backbone=BACKBONE, seed=1, device="gpu")
    assert (job.device, client.job(job.id).device) == ("gpu", "gpu")
    sweep = client.sweep(toy_task, ["lora", "bitfit"], backbone=BACKBONE, device="cpu")
    assert {j.device for j in client.jobs(sweep_id=sweep.id)} == {"cpu"}


@pytest.mark.parametrize("device", ["tpu", "GPU", "cuda:0", ""])
def test_an_unknown_device_is_422_naming_the_field_and_writes_nothing(client, toy_task, api, device):
    words = "'any', 'cpu' or 'gpu'"
    refused(lambda: client.submit(toy_task, "lora", backbone=BACKBONE, device=device), 422, "device", words)
    refused(lambda: client.sweep(toy_task, ["lora"], backbone=BACKBONE, device=device), 422, "device", words)
    assert api.registry.list_jobs() == []


def test_the_api_and_the_registry_know_the_same_devices():
    from typing import get_args

    from services.api.schemas import JOB_DEVICES, JobDevice
    from services.registry.models import JOB_DEVICES as REGISTRY_DEVICES

    assert JOB_DEVICES == REGISTRY_DEVICES == get_args(JobDevice)


def test_a_retried_submit_with_another_device_returns_the_job_already_made(client, toy_task, api):
    first = client.submit(toy_task, "lora", backbone=BACKBONE, device="cpu", idempotency_key="k-1")
    again = client.submit(toy_task, "lora", backbone=BACKBONE, device="gpu", idempotency_key="k-1")
    assert (again.id, again.device) == (first.id, "cpu")
    assert len(api.registry.list_jobs()) == 1


def complete_on_a_gpu(api: Api, job_id: int) -> None:
    claimed = api.registry.claim_job("gpu-worker", devices=["any", "gpu"])
    assert claimed is not None and claimed.id == job_id
    result = {"metrics": {"accuracy": 0.8}, "trainable_params": 10, "trainable_percent": 0.1}
    result |= {"train_seconds": 1.0, "device": H100, "job_memory_bytes": 3 * 2**20}
    api.registry.complete_job(job_id, "gpu-worker", {**result, "peak_memory_bytes": 2**30})


def test_a_result_says_where_the_job_trained_and_its_own_memory(client, toy_task, api):
    job = client.submit(toy_task, "lora", backbone=BACKBONE, device="gpu")
    assert api.registry.queued_by_device() == {"any": 0, "cpu": 0, "gpu": 1}
    complete_on_a_gpu(api, job.id)
    result = client.result(job.id)
    assert (result.device, result.job_memory_bytes, result.peak_memory_bytes) == (H100, 3 * 2**20, 2**30)
    raw = client.http.get(f"/v1/jobs/{job.id}/result").json()
    assert (raw["device"], raw["job_memory_bytes"]) == (H100, 3 * 2**20)


def test_pelt_result_and_pelt_events_show_what_a_job_ended_with_and_what_happened_to_it(
    api, toy_task, monkeypatch
):
    import json

    from click.testing import CliRunner

    from services.commands import jobs

    monkeypatch.setattr(jobs, "PeltClient", api.client)
    job = api.client().submit(toy_task, "lora", backbone=BACKBONE, device="gpu")
    pending = CliRunner().invoke(jobs.result_command, [str(job.id)])
    assert pending.exit_code != 0 and "result" in pending.output.lower()  # nothing yet: the service says so
    complete_on_a_gpu(api, job.id)

    shown = CliRunner().invoke(jobs.result_command, [str(job.id)])
    assert shown.exit_code == 0, shown.output
    assert shown.output.splitlines()[0] == f"job {job.id} (attempt 1): accuracy 0.8000"
    assert f"on {H100}" in shown.output and "10 trainable parameters (0.100%)" in shown.output
    as_json = CliRunner().invoke(jobs.result_command, [str(job.id), "--json"])
    assert json.loads(as_json.output)["metrics"] == {"accuracy": 0.8}

    events = CliRunner().invoke(jobs.events_command, [str(job.id)])
    assert events.exit_code == 0, events.output
    header, *rows = events.output.splitlines()
    assert header.split() == ["at", "from", "to", "worker", "reason"]
    assert [row.split()[1:3] for row in rows] == [
        ["-", "queued"],
        ["queued", "running"],
        ["running", "succeeded"],
    ]


def test_pelt_submit_sweep_and_jobs_take_and_show_the_device(api, toy_task, monkeypatch):
    from click.testing import CliRunner

    from services.commands import jobs

    monkeypatch.setattr(jobs, "PeltClient", api.client)
    runner = CliRunner()
    submitted = runner.invoke(
        jobs.submit_command, [toy_task, "lora", "--backbone", BACKBONE, "--device", "gpu"]
    )
    assert submitted.exit_code == 0, submitted.output
    assert submitted.output.strip().endswith("on tiny-bert (gpu only)")
    swept = runner.invoke(
        jobs.sweep_command, [toy_task, "--methods", "lora,bitfit", "--backbone", BACKBONE, "--device", "cpu"]
    )
    assert swept.exit_code == 0, swept.output
    assert [job.device for job in api.registry.list_jobs()] == ["gpu", "cpu", "cpu"]

    listing = runner.invoke(jobs.jobs_command, [])
    assert listing.exit_code == 0, listing.output
    header, *rows = listing.output.splitlines()
    assert "device" in header.split()
    assert [row.split()[header.split().index("device")] for row in rows if row.split()[0].isdigit()] == [
        "gpu",
        "cpu",
        "cpu",
    ]


@pytest.mark.parametrize("command", ["submit", "sweep"])
def test_pelt_submit_and_sweep_refuse_an_unknown_device_naming_the_choices(
    api, toy_task, monkeypatch, command
):
    from click.testing import CliRunner

    from services.commands import jobs

    monkeypatch.setattr(jobs, "PeltClient", api.client)
    arguments = {
        "submit": (jobs.submit_command, [toy_task, "lora"]),
        "sweep": (jobs.sweep_command, [toy_task, "--methods", "lora"]),
    }
    function, args = arguments[command]
    result = CliRunner().invoke(function, [*args, "--backbone", BACKBONE, "--device", "tpu"])
    assert result.exit_code == 2
    assert "'tpu' is not one of 'any', 'cpu', 'gpu'" in result.output
    assert api.registry.list_jobs() == []


def test_pelt_watch_says_where_a_succeeded_job_trained(api, toy_task, monkeypatch):
    from click.testing import CliRunner

    from services.commands import jobs

    monkeypatch.setattr(jobs, "PeltClient", api.client)
    job = api.registry.submit_job(toy_task, "lora", BACKBONE, device="gpu")
    complete_on_a_gpu(api, job.id)
    watched = CliRunner().invoke(jobs.watch_command, [str(job.id)])
    assert watched.exit_code == 0, watched.output
    assert (
        f"job {job.id} lora: succeeded, accuracy 0.8000 on {H100} (3.0 MiB of job memory)" in watched.output
    )


def test_a_sweep_queues_methods_times_seeds_times_k_and_cancels_as_one(client, toy_task):
    sweep = client.sweep(
        toy_task,
        ["lora", "bitfit"],
        backbone=BACKBONE,
        seeds=[0, 1],
        k_values=[16, None],
        method_hyperparameters={"lora": {"r": 2}},
    )
    assert len(sweep.job_ids) == 8
    jobs = client.jobs(sweep_id=sweep.id)
    assert {(j.method, j.seed, j.k_shot) for j in jobs} == {
        (m, s, k) for m in ("lora", "bitfit") for s in (0, 1) for k in (16, None)
    }
    assert client.cancel_sweep(sweep.id) == 8
    assert {j.status for j in client.jobs(sweep_id=sweep.id)} == {"cancelled"}


def test_the_same_sweep_again_answers_with_its_jobs_already_submitted_unless_asked_again(
    client, toy_task, api
):
    body = {"task": toy_task, "methods": ["lora", "bitfit"], "backbone": BACKBONE, "seeds": [0, 1]}
    first = client.http.post("/v1/sweeps", json=body)
    assert first.status_code == 201 and first.json()["already_submitted"] is False
    repeat = client.http.post("/v1/sweeps", json=body)
    assert repeat.status_code == 200 and repeat.json()["already_submitted"] is True
    assert repeat.json()["job_ids"] == first.json()["job_ids"] and len(api.registry.list_jobs()) == 4

    existing = client.sweep(toy_task, ["lora", "bitfit"], backbone=BACKBONE, seeds=[0, 1])
    assert existing.already_submitted and existing.job_ids == first.json()["job_ids"]
    rerun = client.sweep(toy_task, ["lora", "bitfit"], backbone=BACKBONE, seeds=[0, 1], again=True)
    assert not rerun.already_submitted and set(rerun.job_ids).isdisjoint(existing.job_ids)
    assert len(api.registry.list_jobs()) == 8
    refused(
        lambda: client.sweep(toy_task, ["lora"], backbone=BACKBONE, again=True, idempotency_key="k"),
        422,
        "again",
    )


def test_pelt_sweep_run_twice_says_already_submitted_and_queues_again_only_with_again(
    api, toy_task, monkeypatch
):
    from click.testing import CliRunner

    from services.commands import jobs

    monkeypatch.setattr(jobs, "PeltClient", api.client)
    arguments = [toy_task, "--methods", "lora,bitfit", "--seeds", "0,1", "--backbone", BACKBONE]
    runner = CliRunner()
    first = runner.invoke(jobs.sweep_command, arguments)
    assert first.exit_code == 0 and "4 jobs queued (1..4)" in first.output, first.output
    repeat = runner.invoke(jobs.sweep_command, arguments)
    assert repeat.exit_code == 0, repeat.output
    assert "already submitted: its 4 jobs (1..4)" in repeat.output and "--again" in repeat.output
    assert len(api.registry.list_jobs()) == 4
    again = runner.invoke(jobs.sweep_command, [*arguments, "--again"])
    assert again.exit_code == 0 and "4 jobs queued (5..8)" in again.output, again.output
    assert len(api.registry.list_jobs()) == 8


def test_pelt_sweep_check_says_how_many_jobs_the_sweep_holds_or_why_it_would_be_refused_and_queues_nothing(
    api, toy_task, monkeypatch
):
    from click.testing import CliRunner

    from services.commands import jobs

    monkeypatch.setattr(jobs, "PeltClient", api.client)
    arguments = [toy_task, "--methods", "lora,bitfit", "--seeds", "0,1", "--backbone", BACKBONE, "--check"]
    checked = CliRunner().invoke(jobs.sweep_command, arguments)
    too_many = CliRunner().invoke(jobs.sweep_command, [*arguments, "--k", "1000000"])
    with_again = CliRunner().invoke(jobs.sweep_command, [*arguments, "--again"])

    assert checked.exit_code == 0 and "it holds 4 jobs (nothing queued)" in checked.output, checked.output
    assert too_many.exit_code != 0 and "k_shot" in too_many.output, too_many.output
    assert with_again.exit_code == 2 and "--check queues nothing" in with_again.output, with_again.output
    assert api.registry.list_jobs() == []


def test_a_sweeps_k_takes_full_for_the_whole_training_set_and_refuses_all_naming_full(
    api, toy_task, monkeypatch
):
    from click.testing import CliRunner

    from services.commands import jobs

    monkeypatch.setattr(jobs, "PeltClient", api.client)
    arguments = [toy_task, "--methods", "lora", "--backbone", BACKBONE]
    for spelling in ("all", "none"):
        refused_k = CliRunner().invoke(jobs.sweep_command, [*arguments, "--k", spelling])
        assert refused_k.exit_code != 0 and "write 'full' for the whole training set" in refused_k.output
    assert api.registry.list_jobs() == []
    swept = CliRunner().invoke(jobs.sweep_command, [*arguments, "--k", "16,full"])
    assert swept.exit_code == 0, swept.output
    assert sorted(job.k_shot or 0 for job in api.registry.list_jobs()) == [0, 16]


def test_pelt_submits_k_takes_full_for_the_whole_training_set_and_refuses_all_naming_full(
    api, toy_task, monkeypatch
):
    from click.testing import CliRunner

    from services.commands import jobs

    monkeypatch.setattr(jobs, "PeltClient", api.client)
    arguments = [toy_task, "lora", "--backbone", BACKBONE]
    for spelling, words in (("all", "write 'full' for the whole training set"), ("0", "nor 'full'")):
        refused_k = CliRunner().invoke(jobs.submit_command, [*arguments, "--k-shot", spelling])
        assert refused_k.exit_code == 2 and words in refused_k.output, refused_k.output
    assert api.registry.list_jobs() == []
    for spelling in ("full", "16"):
        submitted = CliRunner().invoke(jobs.submit_command, [*arguments, "--k-shot", spelling])
        assert submitted.exit_code == 0, submitted.output
    assert [job.k_shot for job in api.registry.list_jobs()] == [None, 16]


def test_a_sweep_with_one_bad_method_queues_nothing(client, toy_task, api):
    refused(lambda: client.sweep(toy_task, ["lora", "nope"], backbone=BACKBONE), 404, "method")
    assert api.registry.list_jobs() == []


def test_checking_a_sweep_answers_how_many_jobs_it_holds_or_its_refusal_and_queues_nothing(
    client, toy_task, api
):
    answer = client.http.post(
        "/v1/sweeps/check",
        json={"task": toy_task, "methods": ["lora", "bitfit"], "backbone": BACKBONE, "seeds": [0, 1]},
    )
    assert answer.status_code == 200 and answer.json() == {"task": toy_task, "jobs": 4}
    assert client.check_sweep(toy_task, ["lora"], backbone=BACKBONE, k_values=[8, None]) == 2
    refused(
        lambda: client.check_sweep(toy_task, ["lora"], backbone=BACKBONE, k_values=[10**6]), 422, "k_shot"
    )
    refused(lambda: client.check_sweep(toy_task, ["lora", "nope"], backbone=BACKBONE), 404, "method")
    body = {
        "task": toy_task,
        "methods": ["lora"],
        "backbone": BACKBONE,
        "again": True,
        "idempotency_key": "k",
    }
    assert client.http.post("/v1/sweeps/check", json=body).json()["error"]["field"] == "again"
    assert api.registry.list_jobs() == []


def test_the_leaderboard_has_one_row_per_method_best_first(client, toy_task, api):
    sweep = client.sweep(toy_task, ["lora", "bitfit"], backbone=BACKBONE, seeds=[0, 1])
    scores = {("lora", 0): 0.9, ("lora", 1): 0.8, ("bitfit", 0): 0.7, ("bitfit", 1): 0.75}
    for job in client.jobs(sweep_id=sweep.id):
        claimed = api.registry.claim_job("w")
        assert claimed.id == job.id
        api.registry.complete_job(
            job.id,
            "w",
            {
                "metrics": {"accuracy": scores[(job.method, job.seed)]},
                "trainable_params": 10,
                "trainable_percent": 0.1,
                "train_seconds": 1.0,
            },
        )
    frame = client.leaderboard(toy_task)
    assert list(frame["method"]) == ["lora", "bitfit"]
    assert list(frame["best"]) == [0.9, 0.75] and list(frame["runs"]) == [2, 2]
    current = {m.name: m.fingerprint for m in client.methods(builtin=True)}
    assert {job.method_fingerprint for job in client.jobs(sweep_id=sweep.id, method="lora")} == {
        current["lora"]
    }
    assert list(frame["best_method_fingerprint"]) == [current["lora"], current["bitfit"]]
    assert list(frame["method_fingerprints"]) == [[current["lora"]], [current["bitfit"]]]
    assert frame.attrs["metric"] == "accuracy"
    assert client.leaderboard(toy_task, k_shot=16).empty
    refused(lambda: client.leaderboard("nope"), 404, "task")


def test_deltas_of_a_task_without_any_are_404_naming_it(client, toy_task):
    refused(lambda: client.pull(toy_task), 404)
    assert client.versions(toy_task) == []


def test_health_answers_without_a_token(api):
    response = api.client(token="none").http.get("/health", headers={"Authorization": ""})
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_the_client_explains_an_unreachable_service(settings):
    client = PeltClient("http://127.0.0.1:9", token="x", settings=settings, timeout=2)
    refused(lambda: client.tasks(), 0, None, "pelt serve")


def test_an_unknown_job_is_404_and_an_out_of_range_id_is_422(client):
    refused(lambda: client.job(999), 404, "job_id")
    assert client.http.get("/v1/jobs/99999999999999999999").status_code == 422


def test_the_stored_task_files_do_not_depend_on_the_client_paths(client, toy_files, tmp_path):
    copy = tmp_path / "elsewhere.jsonl"
    copy.write_bytes(Path(toy_files["train"]).read_bytes())
    task = client.register_task("toy", copy, text_fields=["sentence"])
    assert task.train_size == 200
    copy.unlink()  # the service kept its own copy
    assert client.task("toy").train_size == 200


def test_without_a_token_even_an_oversized_upload_is_refused_401_before_its_body_is_read(api):
    from fastapi.testclient import TestClient

    chunks_read = []

    def body():
        for _ in range(64):
            chunks_read.append(1)
            yield b"x" * (64 * 1024)

    response = TestClient(api.app).post(
        "/v1/tasks", content=body(), headers={"Content-Type": "multipart/form-data; boundary=b"}
    )
    assert response.status_code == 401
    assert len(chunks_read) <= 1  # answered before the body was read (TestClient may pull one chunk)


def test_an_archive_whose_folder_holds_its_own_name_registers(client, tmp_path):
    import io
    import tarfile

    from datasets import Dataset

    Dataset.from_dict({"text": ["good", "bad"], "label": [1, 0]}).save_to_disk(tmp_path / "ds")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(tmp_path / "ds", arcname="ds")
        data = b"not part of the dataset\n"
        member = tarfile.TarInfo("ds/ds")
        member.size = len(data)
        archive.addfile(member, io.BytesIO(data))
    response = client.http.post(
        "/v1/tasks",
        data={"name": "nested", "definition": '{"text_fields": ["text"]}'},
        files={"dataset": ("ds.tar.gz", buffer.getvalue())},
    )
    assert response.status_code == 201, response.text
    assert response.json()["train_size"] == 2


def test_compose_refuses_an_option_its_operation_does_not_take(client, toy_task, api):
    refused(
        lambda: client.compose("merge", ["toy/1", "toy/2"], "soup", into_typo=1), 422, "options.into_typo"
    )
    refused(lambda: client.compose("average", ["toy/1"], "soup", how="ties"), 422, "options.how", "lora_rank")
    response = client.http.post(
        "/v1/compose",
        json={"op": "merge", "sources": ["toy/1"], "into": "soup", "options": {"aliases": ["x"]}},
    )
    assert response.status_code == 422 and response.json()["error"]["field"] == "options.aliases"


def test_a_version_that_is_not_a_small_number_is_422(client, toy_task):
    response = client.http.get("/v1/tasks/toy/deltas/info", params={"version": "9" * 40})
    assert response.status_code == 422 and response.json()["error"]["field"] == "version"


def test_the_local_token_file_is_rewritten_private_whatever_its_old_mode(api, settings):
    from services.api.server import ensure_local_token, token_path

    path = token_path(settings)
    path.write_text("pelt_revoked-long-ago\n")
    path.chmod(0o644)
    api.registry.revoke_api_token("tests")  # no active token left: the service makes one
    secret = ensure_local_token(api.registry, settings)
    assert path.read_text().strip() == secret and path.stat().st_mode & 0o777 == 0o600
    assert ensure_local_token(api.registry, settings) == secret  # kept while it is active


def test_health_names_no_addresses(api):
    body = api.client().http.get("/health").json()
    assert body["registry"] == "sqlite" and body["delta_store"] == "mlflow-embedded"
    assert str(api.settings.data_dir) not in str(body)


def test_ready_answers_without_a_token_when_the_registry_and_the_store_answer(api):
    response = api.client(token="none").http.get("/ready", headers={"Authorization": ""})
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "registry": "ok", "delta_store": "ok"}


def test_ready_is_a_503_while_the_database_is_away_and_degraded_while_only_the_store_is(api, monkeypatch):
    from services.registry import RegistryUnavailableError

    def away() -> None:
        raise RegistryUnavailableError("no connection")

    def server_gone(timeout: float = 3.0) -> None:
        raise ConnectionError(f"connection refused by http://10.0.0.9:5000 ({api.settings.data_dir})")

    monkeypatch.setattr(api.registry, "ping", away)
    response = api.client().http.get("/ready")
    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert response.json() == {"status": "not ready", "registry": "did not answer", "delta_store": "ok"}
    monkeypatch.setattr(api.operations.store, "ping", server_gone)
    body = api.client().http.get("/ready").json()
    assert body["delta_store"] == "did not answer" and "10.0.0.9" not in str(body)
    assert str(api.settings.data_dir) not in str(body)
    monkeypatch.undo()
    monkeypatch.setattr(api.operations.store, "ping", server_gone)  # only the store: every other route works
    response = api.client().http.get("/ready")
    assert response.status_code == 200
    assert response.json() == {"status": "degraded", "registry": "ok", "delta_store": "did not answer"}


@pytest.mark.parametrize("command", ["submit", "sweep"])
def test_pelt_submit_and_sweep_say_before_the_wait_that_a_backbone_registers_on_first_use(
    api, toy_task, monkeypatch, command
):
    from click.testing import CliRunner

    from services.commands import jobs

    monkeypatch.setattr(jobs, "PeltClient", api.client)
    function, args = {
        "submit": (jobs.submit_command, [toy_task, "lora"]),
        "sweep": (jobs.sweep_command, [toy_task, "--methods", "lora"]),
    }[command]
    registered = CliRunner().invoke(function, [*args, "--backbone", BACKBONE])
    first_use = CliRunner().invoke(function, [*args, "--backbone", "not-registered-yet"])

    assert registered.exit_code == 0 and "first use" not in registered.output
    said = (
        "backbone not-registered-yet is not registered yet: registering it on first use (hashing its weights"
    )
    assert first_use.output.startswith(said)  # before the request that waits (here: refused, not packaged)


def test_pelt_watch_and_result_give_the_dev_score_of_a_job_that_left_its_test_set_out(
    api, toy_task, monkeypatch
):
    from click.testing import CliRunner

    from services.commands import jobs

    monkeypatch.setattr(jobs, "PeltClient", api.client)
    settings = {"dev_rows": 2, "evaluate_test": False}
    job = api.registry.submit_job(toy_task, "lora", BACKBONE, settings, k_shot=4)
    api.registry.claim_job("w")
    dev = {"accuracy": 0.75, "epoch": 1, "step": 1}
    api.registry.complete_job(
        job.id,
        "w",
        {"metrics": {}, "dev_metrics": dev, "trainable_params": 1, "total_params": 10, "train_seconds": 1.0},
    )
    watched = CliRunner().invoke(jobs.watch_command, [str(job.id)])
    assert watched.exit_code == 0, watched.output
    assert f"job {job.id} lora: succeeded, accuracy on dev 0.7500 (test set left out)" in watched.output
    shown = CliRunner().invoke(jobs.result_command, [str(job.id)])
    assert shown.exit_code == 0, shown.output
    assert "no test metrics: the job left its test set out (evaluate_test=false)" in shown.output
    assert "dev (the kept checkpoint): accuracy 0.7500" in shown.output
