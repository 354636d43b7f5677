"""The whole service in one process (`services.api.server.ApiServer`, as `pelt serve` runs it): HTTP API on
a loopback port, dispatcher, local Ray, SQLite registry and MLflow store. Through the Python client and
the `pelt` CLI: register a backbone and a task, run a sweep, wait, read the leaderboard, pull the best
delta by task name and predict with it, compose two deltas into a new version."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from pelt_core.devices import resolve_device
from services.client import PeltClient
from services.settings import get_settings
from tests.api.conftest import BACKBONE

pytestmark = pytest.mark.slow  # the service with its dispatcher and Ray (tests/tiers.py)
TRAINING = {"epochs": 2, "batch_size": 8, "learning_rate": 5e-3}


@pytest.fixture
def server(service):
    """The service this module shares with test_page.py (tests/api/conftest.py), the tiny backbone registered."""
    return service


def cli(server, *args: str, exit_code: int = 0) -> str:
    from services.cli import main

    environment = {
        "PELT_API_URL": server.url,
        "PELT_API_TOKEN": server.token,
        "PELT_DATA_DIR": str(server.settings.data_dir),
    }
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(main, list(args), env=environment, catch_exceptions=False)
    finally:
        get_settings.cache_clear()
    assert result.exit_code == exit_code, result.output
    return result.output


def assert_predictions(predictions: list[dict], count: int) -> None:
    """One prediction per input, each a label of the toy task with a probability."""
    assert len(predictions) == count, predictions
    for prediction in predictions:
        assert prediction["label"] in {"negative", "positive"}, prediction
        assert 0.0 <= prediction["score"] <= 1.0, prediction


def test_register_sweep_wait_leaderboard_pull_and_compose_over_http(
    server, tiny_bert_dir, toy_files, tmp_path
):
    assert server.token and (server.settings.data_dir / "api_token").read_text().strip() == server.token
    client = PeltClient(server.url, token=server.token, settings=server.settings)
    assert client.health()["dispatcher"] is not None
    assert BACKBONE in {backbone.name for backbone in client.backbones()}  # registered by the fixture

    out = cli(
        server,
        "task",
        "add",
        "toy",
        "--train",
        str(toy_files["train"]),
        "--validation",
        str(toy_files["validation"]),
        "--text-field",
        "sentence",
        "--label-names",
        "negative,positive",
    )
    assert "task toy: 200 training rows" in out
    sweep = client.sweep(
        "toy", ["lora", "bitfit", "prefix"], backbone=BACKBONE, seeds=[0, 1], hyperparameters=TRAINING
    )
    ended = client.wait(sweep, timeout=300, poll_seconds=0.5, progress=False)
    assert [job.status for job in ended] == ["succeeded"] * 6, [(j.id, j.status, j.last_error) for j in ended]

    frame = client.leaderboard("toy")
    assert sorted(frame["method"]) == ["bitfit", "lora", "prefix"]  # one row per method
    assert list(frame["runs"]) == [2, 2, 2] and list(frame["rank"]) == [1, 2, 3]
    assert "rank" in cli(server, "leaderboard", "toy")
    assert json.loads(cli(server, "leaderboard", "toy", "--json"))["rows"][0]["method"] == frame["method"][0]

    best = client.delta_info("toy")
    assert "best" in best.aliases and best.job_id == int(frame["best_job_id"][0])
    assert best.sha256 == client.result(best.job_id).delta_sha256
    model = client.pull("toy")  # the best delta, by task name, on its backbone, here
    predictions = model.predict(["w1 w2 w3 w4 w5 good great", "w1 w2 w3 w4 w5 bad awful"])
    assert_predictions(predictions, 2)
    assert model.backbone.device == resolve_device("auto")  # a GPU where torch sees one
    on_cpu = client.pull("toy", device="cpu").predict(texts := ["w1 w2 good great", "w1 bad awful"])
    assert [p["label"] for p in on_cpu] == [p["label"] for p in model.predict(texts)]

    pulled_dir = tmp_path / "pulled"
    assert "sha256" in cli(server, "pull", "toy", "-o", str(pulled_dir), "--method", "lora")
    assert sorted(p.name for p in pulled_dir.iterdir()) == ["delta.safetensors", "manifest.json"]

    loras = [v for v in client.versions("toy") if v.method == "lora"]
    assert len(loras) == 2
    composed = client.compose(
        "merge", [f"toy/{v.version}" for v in loras], "toy-soup", how="ties", density=0.5
    )
    assert (composed.provenance["op"], composed.provenance["how"]) == ("merge(ties)", "ties")
    soup = client.pull("toy-soup", version=composed.version)
    texts = ["good great", "bad awful"]
    soup_predictions = soup.predict(texts)
    assert_predictions(soup_predictions, 2)
    assert client.pull("toy-soup", version=composed.version).predict(texts) == soup_predictions  # as stored
    refused = cli(
        server, "compose", "average", "toy@best-lora", "toy@best-bitfit", "--into", "toy-avg", exit_code=1
    )
    assert "only deltas of one method compose (HTTP 422)" in refused
    out = cli(
        server, "compose", "multi_task", "lora=toy@best-lora", "bitfit=toy@best-bitfit", "--into", "toy-both"
    )
    assert "toy-both version 1" in out
    both = client.pull("toy-both", version=1)  # a composed task has no "best": the registry ranks jobs
    assert set(both.deltas) == {"lora", "bitfit"}
    assert_predictions(both.predict([("lora", "good great"), ("bitfit", "bad awful")]), 2)

    jobs_table = cli(server, "jobs", "--task", "toy")
    assert jobs_table.count("succeeded") == 6


def test_a_running_job_cancelled_over_http_stops_and_is_not_retried(server, tiny_bert_dir, toy_files):
    import time

    client = PeltClient(server.url, token=server.token, settings=server.settings)
    client.register_task("toy-cancel", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    job = client.submit(
        "toy-cancel", "lora", backbone=BACKBONE, hyperparameters={"max_steps": 5000, "batch_size": 2}
    )
    deadline = time.monotonic() + 120
    while (client.job(job.id).progress_detail or {}).get("step", 0) < 3:
        assert time.monotonic() < deadline, client.job(job.id)
        time.sleep(0.2)
    cli(server, "cancel", str(job.id))
    (final,) = client.wait([job.id], timeout=120, poll_seconds=0.2, progress=False)
    assert final.status == "cancelled" and final.attempts == 1
    assert os.environ.get("PELT_API_TOKEN") is None  # the CLI's environment did not leak


def test_pelt_search_runs_its_rungs_through_the_dispatcher_and_answers_with_an_interval(server, toy_files):
    client = PeltClient(server.url, token=server.token, settings=server.settings)
    client.register_task("toy-search", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    out = cli(
        server,
        "search",
        "toy-search",
        "--budget",
        "4",
        "--methods",
        "lora,bitfit",
        "--backbone",
        BACKBONE,
        "--set",
        "epochs=1",
        "--set",
        "batch_size=8",
        "--watch",
    )
    assert "rung 2 of 2" in out and "chosen: " in out and "95% interval" in out, out
    (search,) = client.searches(task="toy-search")
    assert search.status == "succeeded" and len(search.trials) == 3 + 3
    assert {trial.status for trial in search.trials} == {"succeeded"}
    # the first rung's workers left the test set out (ranked on dev); the last rung's evaluated it
    first = [trial for trial in search.trials if trial.rung == 0]
    assert all(trial.test is None and trial.dev is not None for trial in first)
    assert {client.result(trial.job_id).primary_metric for trial in first} == {None}
    (row,) = client.leaderboard_raw("toy-search").rows  # only the last rung is ranked on the test split
    assert (row.config_id, row.seeds) == (search.chosen["config_id"], 3)
    assert row.ci_low == pytest.approx(search.chosen["ci_low"])


def test_predict_by_task_name_serves_each_version_from_one_backbone_and_follows_the_best(
    server, toy_files, tmp_path
):
    import time
    from concurrent.futures import ThreadPoolExecutor

    import ray
    from ray import serve

    from services.client import PeltAPIError
    from workers.serving import app_name

    client = PeltClient(server.url, token=server.token, settings=server.settings)
    task = "toy-serve"
    client.register_task(
        task,
        toy_files["train"],
        toy_files["validation"],
        text_fields=["sentence"],
        label_names=["negative", "positive"],
    )
    sweep = client.sweep(
        task, ["lora", "bitfit", "prefix"], backbone=BACKBONE, seeds=[0], hyperparameters=TRAINING
    )
    ended = client.wait(sweep, timeout=300, poll_seconds=0.5, progress=False)
    assert [job.status for job in ended] == ["succeeded"] * 3, [(j.id, j.last_error) for j in ended]
    by_method = {v.method: v for v in client.versions(task)}
    texts = ["w1 w2 w3 good great", "w1 w2 bad awful", "w3 w4 w5"]

    # a version whose file no longer matches its recorded sha256 is refused, and never held
    (stored,) = [
        path
        for path in server.settings.data_dir.rglob("delta.safetensors")
        if by_method["prefix"].run_id in str(path)
    ]
    stored.write_bytes(stored.read_bytes()[:-8] + b"tampered")
    with pytest.raises(PeltAPIError) as error:
        client.predict(task, texts, version=by_method["prefix"].version)
    assert error.value.status == 500 and "sha256" in str(error.value)
    client.archive_version(task, by_method["prefix"].version)  # out of the best's way below

    # every other version answers as its pulled delta does alone; requests for them arrive mixed
    def alone(version: str) -> list[dict]:
        return client.pull(task, version=version, device="cpu").predict(texts)

    expected = {v.version: alone(v.version) for v in (by_method["lora"], by_method["bitfit"])}
    asked = [("best-lora", by_method["lora"].version), ("best-bitfit", by_method["bitfit"].version)] * 6
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda pair: client.predict(task, texts, version=pair[0]), asked))
    for (_, version), answer in zip(asked, answers, strict=True):
        assert answer.version == version and answer.backbone == BACKBONE
        assert [p["label"] for p in answer.predictions] == [p["label"] for p in expected[version]]
        assert [p["score"] for p in answer.predictions] == pytest.approx(
            [p["score"] for p in expected[version]], abs=1e-5
        )
    replica = serve.get_app_handle(app_name(ray.get_runtime_context().namespace, BACKBONE))
    held = replica.held.remote().result(timeout_s=60)
    assert sorted(held) == sorted(f"{task}/{v}" for v in expected)  # one replica, one backbone, both deltas

    # the best by default, and the next request follows a new best (here: the best archived)
    best = client.delta_info(task)
    assert client.predict(task, texts).version == best.version
    client.archive_version(task, best.version)
    deadline = time.monotonic() + 60  # the best is resolved again within PELT_PREDICT_RESOLVE_SECONDS (2 s)
    while (after := client.predict(task, texts)).version == best.version:
        assert time.monotonic() < deadline, "the archived best was still served after 60 s"
        time.sleep(0.2)
    assert after.version == client.delta_info(task).version
    with pytest.raises(PeltAPIError) as error:
        client.predict(task, texts, version=best.version)
    assert error.value.status == 404 and "archived" in str(error.value)
    with pytest.raises(PeltAPIError) as error:
        client.predict(task, texts, version=99)
    assert error.value.status == 404 and "99" in str(error.value)
    with pytest.raises(PeltAPIError) as error:
        client.predict(task, [("a", "pair")], version=after.version)
    assert error.value.status == 422 and "single texts" in str(error.value)

    # the command line: texts in, a line each; JSON Lines in, JSON Lines out
    out = cli(server, "predict", task, "w1 good great", "w2 bad awful", "--version", after.version)
    lines = [line for line in out.splitlines() if line.split()[:1] in (["negative"], ["positive"])]
    assert len(lines) == 2 and f"({task} version {after.version}, {after.method})" in out
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"sentence": "w1 good great", "id": 1}\n"w2 bad awful"\n')
    cli(
        server,
        "predict",
        task,
        "--file",
        str(rows),
        "--out",
        str(tmp_path / "out.jsonl"),
        "--version",
        after.version,
    )
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [w.get("id") for w in written] == [1, None] and written[1]["text"] == "w2 bad awful"
    assert all(w["prediction"]["label"] in {"negative", "positive"} for w in written)


def test_pelt_fuse_trains_a_fusion_of_stored_adapters_pulled_served_and_ranked_by_task_name(
    server, toy_files
):
    client = PeltClient(server.url, token=server.token, settings=server.settings)
    for task in ("fuse-a", "fuse-b", "fuse-t"):
        client.register_task(
            task,
            toy_files["train"],
            toy_files["validation"],
            text_fields=["sentence"],
            label_names=["negative", "positive"],
        )
    sources = [
        client.sweep("fuse-a", ["pfeiffer"], backbone=BACKBONE, hyperparameters=TRAINING),
        client.sweep("fuse-b", ["houlsby", "lora"], backbone=BACKBONE, hyperparameters=TRAINING),
    ]
    ids = [job_id for sweep in sources for job_id in sweep.job_ids]
    ended = client.wait(ids, timeout=300, poll_seconds=0.5, progress=False)
    assert [job.status for job in ended] == ["succeeded"] * 3, [(j.id, j.last_error) for j in ended]
    houlsby = client.delta_info("fuse-b", method="houlsby")

    refused = cli(server, "fuse", "fuse-t", "--from", "fuse-a", "--from", "fuse-b@best-lora", exit_code=1)
    assert "lora" in refused and "merge" in refused and client.jobs(task="fuse-t") == []
    out = cli(
        server,
        "fuse",
        "fuse-t",
        "--from",
        "fuse-a",
        "--from",
        "fuse-b@best-houlsby",
        "--set",
        "lr=5e-3",
        "--watch",
    )
    assert f"fusion of fuse-a v1, fuse-b v{houlsby.version} on {BACKBONE}" in out
    (job,) = client.jobs(task="fuse-t")
    assert (job.status, job.method) == ("succeeded", "fusion"), job.last_error
    assert [(s["task"], s["sha256"]) for s in job.sources] == [
        ("fuse-a", client.delta_info("fuse-a").sha256),
        ("fuse-b", houlsby.sha256),
    ]

    info = client.delta_info("fuse-t")  # its best: the fusion, a version of the task like any delta
    assert (info.kind, info.method, info.job_id) == ("fusion", "fusion", job.id)
    assert '"task":"fuse-a"' in info.tags["pelt.composition.sources"]
    texts = ["w1 w2 w3 good great", "w1 w2 bad awful"]
    pulled = client.pull("fuse-t", device="cpu").predict(texts)
    assert_predictions(pulled, 2)
    served = client.predict("fuse-t", texts)
    assert served.method == "fusion" and [p["label"] for p in served.predictions] == [
        p["label"] for p in pulled
    ]
    assert list(client.leaderboard("fuse-t")["method"]) == ["fusion"]

    refused = cli(server, "fuse", "fuse-a", "--from", "fuse-t", "--from", "fuse-b@best-houlsby", exit_code=1)
    assert "itself a fusion" in refused and len(client.jobs(task="fuse-a")) == 1
