"""`pelt study` as a specification: a study registers its GLUE-style task folders, queues one sweep per
task under the protocol, resumes without training anything twice, and reports the paper's table layout
with the paper's numbers beside ours, the answer to the paper's claim, a plot and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.client import PeltClient
from services.registry.testing import write_jsonl
from services.study import StudyPlan, collect_runs, register_task_folder, submit_study, wait_for, write_report
from services.study.plan import study_jobs
from tests.api.conftest import BACKBONE, Api
from tests.workers.conftest import toy_rows

# test score, dev score per (method, seed): UniPELT beats the best single method (lora) by 2 points
SCORES = {
    ("lora", 0): (0.80, 0.82),
    ("lora", 1): (0.78, 0.80),
    ("bitfit", 0): (0.60, 0.61),
    ("bitfit", 1): (0.62, 0.60),
    ("unipelt", 0): (0.82, 0.83),
    ("unipelt", 1): (0.80, 0.81),
}


@pytest.fixture
def sst2_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "sst2"
    folder.mkdir()
    write_jsonl(
        folder / "train.jsonl", [{"sentence": r["sentence"], "label": r["label"]} for r in toy_rows(200, 0)]
    )
    write_jsonl(folder / "validation.jsonl", toy_rows(40, 1))
    (folder / "task.json").write_text(json.dumps({"text_fields": ["sentence"], "metric": "accuracy"}))
    return folder


def plan() -> StudyPlan:
    return StudyPlan(
        tasks=("sst2",),
        k_values=(100,),
        seeds=(0, 1),
        methods=("bitfit", "lora", "unipelt"),
        backbone=BACKBONE,
        dev_rows=50,
        patience=3,
        training={"epochs": 5},
    )


def finish_every_job(api: Api, client: PeltClient, study: StudyPlan, job_ids: list[int]) -> None:
    """Act as the workers: every queued job of the study ends with its score from SCORES."""
    for job in study_jobs(client, study, job_ids):
        if job.status != "queued":
            continue
        claimed = api.registry.claim_job("w1")
        assert claimed is not None
        test, dev = SCORES[(claimed.method, claimed.seed)]
        api.registry.complete_job(
            claimed.id,
            "w1",
            {
                "metrics": {"accuracy": test},
                "dev_metrics": {"accuracy": dev, "epoch": 2, "step": 14},
                "trainable_params": 10,
                "total_params": 1000,
                "train_seconds": 3.0,
            },
        )
        assert job.hyperparameters["dev_rows"] == 50 and job.hyperparameters["patience"] == 3


def test_a_study_registers_its_folders_queues_once_and_reports_the_papers_layout(
    api: Api, client: PeltClient, sst2_folder: Path, tmp_path: Path
):
    assert register_task_folder(client, "sst2", sst2_folder)
    assert not register_task_folder(client, "sst2", sst2_folder)  # registered already: left as it is
    study = plan()
    job_ids, queued = submit_study(client, study)
    assert len(job_ids) == queued == study.job_count == 6
    assert submit_study(client, study) == (job_ids, 0)  # resuming: nothing queued twice
    finish_every_job(api, client, study, job_ids)
    lines: list[str] = []
    jobs = wait_for(client, study, job_ids, echo=lines.append, poll_seconds=0.1)
    assert lines[-1] == "study: 6/6 ended (6 succeeded, 0 failed, 0 cancelled), 0 running, 0 queued"
    runs = collect_runs(client, jobs)
    assert sorted((r.method, r.seed, r.test, r.dev, r.best_epoch) for r in runs)[0] == (
        "bitfit",
        0,
        0.60,
        0.61,
        2,
    )

    written = write_report(tmp_path / "report", study, runs, "pelt study --task sst2 ...")
    assert [p.name for p in written] == ["report.md", "report.json", "metric-vs-k.svg"]
    report = written[0].read_text()
    # mean ± std over the two seeds, ×100, and the paper's K=100 SST-2 number in brackets
    assert "| LoRA (`lora`) | 79.0 ± 1.4 (81.6) | **79.0 ± 1.4** | 49.26 | 81.0 | 1.00 |" in report
    assert (
        "| UniPELT (APL) (`unipelt`) | 81.0 ± 1.4 (82.4) | **81.0 ± 1.4** | 62.59 | 82.0 | 1.00 |" in report
    )
    assert (
        "**Claim at K=100:** UniPELT (APL) beats the best single method, LoRA, on the average: +2.00 points"
        in report
    )
    data = json.loads(written[1].read_text())
    assert data["by_k"]["100"]["claim"]["verdict"] == "beats" and len(data["run_list"]) == 6
    assert data["plan"]["hyperparameters"] == {"100": {"epochs": 5, "dev_rows": 50, "patience": 3}}
    svg = written[2].read_text()
    assert svg.startswith("<svg") and all(method in svg for method in study.methods)


def test_a_study_without_all_its_runs_says_the_claim_cannot_be_judged(
    api: Api, client: PeltClient, tmp_path: Path
):
    study = plan()
    written = write_report(tmp_path / "empty", study, [], "pelt study")
    assert [p.name for p in written] == ["report.md", "report.json"]  # nothing to plot yet
    assert "The claim cannot be judged at this K" in written[0].read_text()


def test_the_report_names_each_tasks_metric_not_accuracy_and_f1_for_mrpc(tmp_path: Path):
    study = StudyPlan(
        tasks=("sst2", "stsb"),
        k_values=(100,),
        seeds=(0,),
        methods=("lora",),
        backbone=BACKBONE,
        dev_rows=50,
    )
    metrics = {"sst2": "accuracy", "stsb": "pearson"}
    report = write_report(tmp_path / "report", study, [], "pelt study", metrics)[0].read_text()
    assert "mean ± std over seeds (accuracy for sst2; pearson for stsb)" in report
    assert "F1 for MRPC" not in report
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["metrics"] == metrics
    same = write_report(tmp_path / "same", study, [], "pelt study", dict.fromkeys(metrics, "pearson"))
    assert "mean ± std over seeds (pearson)" in same[0].read_text()


def test_a_study_folder_without_training_data_is_refused_before_anything_is_registered(
    client: PeltClient, tmp_path: Path
):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no train\.jsonl"):
        register_task_folder(client, "nothing", tmp_path / "empty")
    assert client.tasks() == []


def test_each_k_may_have_its_own_epochs_and_each_sweep_its_own_key():
    study = StudyPlan(
        tasks=("sst2", "rte"),
        k_values=(100, 500),
        seeds=(0,),
        methods=("lora",),
        backbone=BACKBONE,
        dev_rows=200,
        patience=None,
        training={"batch_size": 16},
        epochs_by_k={100: 10, 500: 4},
    )
    assert study.hyperparameters(100) == {"batch_size": 16, "epochs": 10, "dev_rows": 200}
    assert study.hyperparameters(500) == {"batch_size": 16, "epochs": 4, "dev_rows": 200}
    keys = {study.key(task, k, ["lora"], [0]) for task in study.tasks for k in study.k_values}
    assert len(keys) == 4
    assert study.key("sst2", 100, ["lora"], [0]) == plan_again(study).key("sst2", 100, ["lora"], [0])
    wider_dev = StudyPlan(**{**study.__dict__, "dev_rows": 300})
    assert study.key("sst2", 100, ["lora"], [0]) != wider_dev.key("sst2", 100, ["lora"], [0])


def plan_again(study: StudyPlan) -> StudyPlan:
    return StudyPlan(**study.__dict__)


@pytest.mark.parametrize(
    ("epochs", "message"),
    [("100=ten", "a number, or K=E pairs"), ("1000=4", "K=1000 is not among --k 100,500")],
)
def test_study_refuses_epochs_it_cannot_read_before_it_calls_the_service(epochs: str, message: str):
    from click.testing import CliRunner

    from services.commands.study import study_command

    answer = CliRunner().invoke(
        study_command, ["--task", "sst2", "--k", "100,500", "--epochs", epochs, "--out", "unused"]
    )
    assert answer.exit_code == 2 and message in answer.output


def test_study_refuses_to_leave_the_test_set_out_before_it_calls_the_service():
    from click.testing import CliRunner

    from services.commands.study import study_command

    answer = CliRunner().invoke(
        study_command, ["--task", "sst2", "--k", "100", "--set", "evaluate_test=false", "--out", "unused"]
    )
    assert answer.exit_code == 2 and "a study reports every run's test score" in answer.output


def test_a_study_extended_by_a_method_queues_only_that_methods_jobs(
    api: Api, client: PeltClient, sst2_folder: Path
):
    register_task_folder(client, "sst2", sst2_folder)
    study = plan()
    first, _ = submit_study(client, study)
    client.submit("sst2", "prefix", backbone=BACKBONE, k_shot=100, seed=0, hyperparameters={"epochs": 5})
    wider = StudyPlan(**{**study.__dict__, "methods": (*study.methods, "prefix")})
    job_ids, queued = submit_study(client, wider)
    assert queued == 2 and set(first) < set(job_ids) and len(job_ids) == 8  # the plain prefix job differs
    new = [job for job in study_jobs(client, wider, job_ids) if job.id not in first]
    assert {(job.method, job.seed, job.hyperparameters["dev_rows"]) for job in new} == {
        ("prefix", 0, 50),
        ("prefix", 1, 50),
    }


def test_a_study_whose_later_task_cannot_supply_its_k_is_refused_before_any_sweep_is_queued(
    api: Api, client: PeltClient, sst2_folder: Path, tmp_path: Path
):
    from services.client import PeltAPIError

    small = tmp_path / "small"
    small.mkdir()
    write_jsonl(small / "train.jsonl", toy_rows(120, 2))  # K=100 and 50 dev rows need 150
    write_jsonl(small / "validation.jsonl", toy_rows(40, 3))
    (small / "task.json").write_text(json.dumps({"text_fields": ["sentence"]}))
    register_task_folder(client, "sst2", sst2_folder)
    register_task_folder(client, "small", small)
    study = StudyPlan(**{**plan().__dict__, "tasks": ("sst2", "small")})

    with pytest.raises(PeltAPIError) as refused:
        submit_study(client, study)

    assert refused.value.status == 422 and refused.value.field == "dev_rows", refused.value
    assert refused.value.message.startswith("task 'small', K=100: dev_rows: 50 dev rows and K=100")
    assert client.jobs(limit=None) == []  # not even the first task's sweep


def test_a_study_against_a_service_without_the_sweep_check_queues_as_before(
    api: Api, client: PeltClient, sst2_folder: Path, monkeypatch: pytest.MonkeyPatch
):
    from services.client import PeltAPIError

    def older_service(*args, **kwargs):  # what a service older than the check answers: a POST on a GET route
        raise PeltAPIError(405, "Method Not Allowed")

    assert client.http.post("/v1/sweeps/1").status_code == 405  # how POST /v1/sweeps/check meets such a one
    register_task_folder(client, "sst2", sst2_folder)
    monkeypatch.setattr(client, "check_sweep", older_service)

    job_ids, queued = submit_study(client, plan())

    assert queued == 6 and len(job_ids) == 6


def test_short_training_keys_match_the_jobs_as_the_registry_stores_them(
    api: Api, client: PeltClient, sst2_folder: Path
):
    register_task_folder(client, "sst2", sst2_folder)
    study = StudyPlan(**{**plan().__dict__, "methods": ("lora",), "training": {"lr": 1e-3, "epochs": 5}})
    assert study.hyperparameters(100) == {"learning_rate": 1e-3, "epochs": 5, "dev_rows": 50, "patience": 3}
    job_ids, queued = submit_study(client, study)
    assert queued == 2 and len(job_ids) == 2
    assert submit_study(client, study) == (job_ids, 0)  # found again by their stored keys


def test_a_rerun_queues_again_the_cells_whose_job_failed_or_was_cancelled(
    api: Api, client: PeltClient, sst2_folder: Path
):
    register_task_folder(client, "sst2", sst2_folder)
    study = StudyPlan(**{**plan().__dict__, "methods": ("lora",)})
    job_ids, _ = submit_study(client, study)
    client.cancel(job_ids[0])
    retried, queued = submit_study(client, study)
    assert queued == 1 and job_ids[0] not in retried and job_ids[1] in retried and len(retried) == 2
    assert submit_study(client, study) == (retried, 0)


def test_a_rerun_after_a_preset_changed_queues_again_the_cells_of_that_method_only(
    api: Api, client: PeltClient, sst2_folder: Path, monkeypatch: pytest.MonkeyPatch
):
    """A preset edited since the jobs ran (a pelt upgrade, like UniPELT's per-module learning rates): the cells
    whose jobs ran the old version are run again; the other methods' jobs still fill theirs."""
    from pelt_core import methods

    register_task_folder(client, "sst2", sst2_folder)
    study = StudyPlan(**{**plan().__dict__, "methods": ("lora", "bitfit")})
    job_ids, queued = submit_study(client, study)
    assert queued == 4
    old = {job.id: job for job in study_jobs(client, study, job_ids)}
    edited = methods.BUILTIN_METHODS["lora"].with_overrides({"q.lr_multiplier": 2})
    monkeypatch.setitem(methods.BUILTIN_METHODS, "lora", edited)

    rerun, queued = submit_study(client, study)
    assert queued == 2 and len(rerun) == 4
    new = [job for job in study_jobs(client, study, rerun) if job.id not in old]
    assert sorted((job.method, job.seed) for job in new) == [("lora", 0), ("lora", 1)]
    assert {job.method_fingerprint for job in new} == {client.method("lora").fingerprint}
    assert {old[i].method for i in set(rerun) & set(old)} == {"bitfit"}
    assert submit_study(client, study) == (rerun, 0)


def test_pelt_study_starts_on_a_fresh_service_whose_registry_holds_no_job_on_the_packaged_backbone(
    api: Api, sst2_folder: Path, tmp_path: Path, tiny_bert_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """The study's default backbone is a packaged one that no job has registered yet: looking for the
    study's jobs on it finds none (not a 404), and the study queues its sweep, which registers it."""
    from click.testing import CliRunner

    from pelt_core.backbones import Backbone
    from services.commands import study

    loaded: list[str] = []

    def tiny_loader(source: str) -> Backbone:  # the packaged backbone, stood in for by the tiny BERT
        loaded.append(source)
        return Backbone.load(str(tiny_bert_dir))

    api.operations._backbone_loader = tiny_loader
    monkeypatch.setattr(study, "PeltClient", api.client)
    assert [b.name for b in api.registry.list_backbones()] == [BACKBONE] and api.registry.list_jobs() == []
    arguments = ["--task", f"sst2={sst2_folder}", "--k", "100", "--seeds", "0,1", "--methods", "lora"]
    options = ["--dev-rows", "50", "--epochs", "5", "--out", str(tmp_path / "report"), "--no-wait"]
    answer = CliRunner().invoke(study.study_command, [*arguments, *options])
    assert answer.exit_code == 0, answer.output
    assert "study: 2 of 2 jobs in the registry, 2 queued now" in answer.output
    assert loaded == ["all-minilm-l6-v2"]
    jobs = api.registry.list_jobs(task="sst2")
    assert [(job.backbone, job.method, job.seed, job.status) for job in jobs] == [
        ("all-minilm-l6-v2", "lora", 0, "queued"),
        ("all-minilm-l6-v2", "lora", 1, "queued"),
    ]
