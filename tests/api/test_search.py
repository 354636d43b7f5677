"""Method searches through the service: POST/GET /v1/searches and cancel, `PeltClient.search`, and `pelt search`
(start, show, list, cancel), the best-so-far plot (GET /v1/searches/{id}/plot.svg|png,
`PeltClient.plot_search`, `pelt search show --plot`), `pelt search report`; a refused search queues nothing. The rungs advance here by the registry's
own call, as the dispatcher makes it on a timer (the whole loop through a real dispatcher:
tests/api/test_end_to_end.py)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from click.testing import CliRunner

from services import plots
from services.api.schemas import SearchOut
from services.commands import search as search_commands
from tests.api.conftest import BACKBONE, Api
from tests.api.helpers import refused

SVG = "{http://www.w3.org/2000/svg}"


def finish_rung(api: Api, search_id: int, dev: float = 0.8) -> None:
    """Complete the search's queued jobs as a worker would, each with a dev score and, in the last rung
    (the only one that evaluates its test set), a test score."""
    search = api.registry.get_search(search_id)
    queued = {t.job_id: t for t in search.trials if t.status == "queued"}
    for number in range(len(queued)):
        claimed = api.registry.claim_job("w")
        assert claimed is not None and claimed.id in queued
        trial = queued[claimed.id]
        score = dev + 0.01 * ((trial.configuration + number) % 3)
        result = {
            "metrics": {"accuracy": score - 0.05} if claimed.train_config["evaluate_test"] else {},
            "dev_metrics": {"accuracy": score},
            "trainable_params": 10,
            "total_params": 1000,
            "train_seconds": 1.0,
        }
        api.registry.complete_job(trial.job_id, "w", result)


def test_a_search_is_planned_queued_advanced_and_answers_with_its_choice(api, client, toy_task):
    search = client.search(
        toy_task, 4, methods=["lora", "bitfit"], backbone=BACKBONE, hyperparameters={"epochs": 1}
    )
    assert (search.status, search.k_shot, search.dev_rows, search.configurations) == ("running", 100, 100, 3)
    assert [r["configurations"] for r in search.schedule["rungs"]] == [3, 1]
    assert {job.status for job in client.jobs(task=toy_task)} == {"queued"}
    finish_rung(api, search.id)
    api.registry.advance_search(search.id)
    finish_rung(api, search.id)
    api.registry.advance_search(search.id)
    done = client.get_search(search.id)
    assert done.status == "succeeded" and done.chosen["seeds"] == 3
    assert done.chosen["ci_low"] <= done.chosen["test_mean"] <= done.chosen["ci_high"]
    assert [s.id for s in client.searches(task=toy_task)] == [search.id]
    assert client.searches(status="running") == []
    assert client.wait_search(search.id, timeout=5).status == "succeeded"


def test_a_search_that_cannot_run_is_refused_naming_the_field_and_queues_nothing(api, client, toy_task):
    refused(lambda: client.search(toy_task, 2, backbone=BACKBONE), 422, "budget", "too small")
    refused(lambda: client.search(toy_task, 4, backbone=BACKBONE, k_shot=200), 422, "k_shot")
    refused(lambda: client.search(toy_task, 4, backbone=BACKBONE, methods=["nope"]), 404, "method")
    refused(lambda: client.search("missing", 4, backbone=BACKBONE), 404, "task")
    refused(lambda: client.search(toy_task, -1, backbone=BACKBONE), 422, "budget")
    assert client.jobs() == [] and client.searches() == []
    refused(lambda: client.get_search(99), 404, "search_id")


def test_a_read_token_reads_searches_and_only_their_owner_or_an_admin_cancels(api, client, toy_task):
    search = client.search(toy_task, 4, methods=["lora", "bitfit"], backbone=BACKBONE)
    _, reader = api.registry.create_api_token("reader", scope="read")
    _, writer = api.registry.create_api_token("writer", scope="write")
    assert api.client(reader).get_search(search.id).id == search.id
    refused(lambda: api.client(reader).search(toy_task, 4, backbone=BACKBONE), 403)
    refused(lambda: api.client(writer).cancel_search(search.id), 403)
    cancelled = client.cancel_search(search.id)  # the admin token that started it
    assert cancelled.status == "cancelled"
    assert {job.status for job in client.jobs(task=toy_task)} == {"cancelled"}


def test_pelt_search_starts_shows_lists_and_cancels(api, toy_task, monkeypatch):
    monkeypatch.setattr(search_commands, "PeltClient", api.client)
    runner = CliRunner()
    started = runner.invoke(
        search_commands.search_group,
        [toy_task, "--budget", "4", "--methods", "lora,bitfit", "--backbone", BACKBONE, "--set", "epochs=1"],
    )
    assert started.exit_code == 0, started.output
    first, rungs, *spaces = started.output.splitlines()
    assert first.startswith(f"search 1 of {toy_task} (running): 3 configurations of lora, bitfit")
    assert rungs.startswith("rungs: 3 × 0.333 epochs; 1 × 1 epochs × 3 seeds; 4.0 of 4 full-job")
    assert any(line.strip().startswith("lora: learning_rate: log-uniform") for line in spaces)

    finish_rung(api, 1)
    api.registry.advance_search(1)
    finish_rung(api, 1)
    api.registry.advance_search(1)
    shown = runner.invoke(search_commands.search_group, ["show", "1"])
    assert shown.exit_code == 0, shown.output
    assert "chosen: " in shown.output and "95% interval" in shown.output and "3 seeds" in shown.output
    listed = runner.invoke(search_commands.search_group, ["list"])
    assert listed.exit_code == 0 and listed.output.splitlines()[1].split()[:3] == ["1", toy_task, "succeeded"]

    too_small = runner.invoke(
        search_commands.search_group, [toy_task, "--budget", "1", "--backbone", BACKBONE]
    )
    assert too_small.exit_code == 1 and "too small for one rung" in too_small.output
    second = runner.invoke(
        search_commands.search_group,
        [toy_task, "--budget", "4", "--methods", "lora,bitfit", "--backbone", BACKBONE],
    )
    assert second.exit_code == 0, second.output
    cancelled = runner.invoke(search_commands.search_group, ["cancel", "2"])
    assert cancelled.exit_code == 0 and cancelled.output.strip() == "search 2: cancelled"


def test_a_searchs_best_so_far_is_drawn_by_the_api_the_client_and_pelt_search_show(
    api, client, toy_task, tmp_path, monkeypatch
):
    search = client.search(
        toy_task, 4, methods=["lora", "bitfit"], backbone=BACKBONE, hyperparameters={"epochs": 1}
    )
    empty = client.plot_search(search.id)
    assert "no job of this search has ended" in empty  # nothing ended yet: a figure that says so
    finish_rung(api, search.id)
    api.registry.advance_search(search.id)
    finish_rung(api, search.id)
    api.registry.advance_search(search.id)

    done = client.get_search(search.id)
    improved = [
        (point["spent"], point["dev"])
        for before, point in zip([None, *done.best_so_far], done.best_so_far, strict=False)
        if before is None or point["dev"] != before["dev"]
    ]
    frontier = [(round(p.x, 6), p.mean) for p in plots.search_figure(done).frontier]
    assert frontier == improved and len(improved) >= 1  # the plot's steps are the search's own best_so_far

    svg = client.plot_search(search.id)
    root = ET.fromstring(svg)
    drawn = [e for e in root.iter(f"{SVG}circle") if "point" in e.get("class", "").split()]
    assert len(drawn) == len(client.get_search(search.id).trials) == 6  # 3 on the first rung, 1 x 3 seeds
    assert root.findall(f".//{SVG}path[@class='frontier-line']")
    http = api.client().http
    answer = http.get(f"/v1/searches/{search.id}/plot.svg")
    assert answer.headers["content-type"].startswith("image/svg+xml")
    assert "default-src 'none'" in answer.headers["content-security-policy"]
    assert client.plot_search(search.id, tmp_path / "best.png") == (tmp_path / "best.png").read_bytes()
    assert (tmp_path / "best.png").read_bytes().startswith(b"\x89PNG")
    _, reader = api.registry.create_api_token("reader", scope="read")
    assert api.client(reader).plot_search(search.id).startswith("<svg")
    refused(lambda: client.plot_search(99), 404, "search_id")
    assert http.get(f"/v1/searches/{search.id}/plot.gif").status_code == 422

    monkeypatch.setattr(search_commands, "PeltClient", api.client)
    runner = CliRunner()
    shown = runner.invoke(
        search_commands.search_group, ["show", str(search.id), "--plot", str(tmp_path / "s.svg")]
    )
    assert shown.exit_code == 0, shown.output
    assert shown.output.strip().endswith(f"best dev score against budget -> {tmp_path / 's.svg'}")
    assert (tmp_path / "s.svg").read_text() == svg
    wrong = runner.invoke(
        search_commands.search_group, ["show", str(search.id), "--plot", str(tmp_path / "s.txt")]
    )
    assert wrong.exit_code == 2 and "--plot" in wrong.output and not (tmp_path / "s.txt").exists()


def test_pelt_search_report_writes_the_plan_the_trials_the_answer_and_the_plot(
    api, client, toy_task, tmp_path, monkeypatch
):
    search = client.search(
        toy_task, 4, methods=["lora", "bitfit"], backbone=BACKBONE, hyperparameters={"epochs": 1}
    )
    monkeypatch.setattr(search_commands, "PeltClient", api.client)
    runner = CliRunner()
    running = runner.invoke(
        search_commands.search_group, ["report", str(search.id), "--out", str(tmp_path / "early")]
    )
    assert running.exit_code == 0, running.output
    assert "no answer: the search is running" in (tmp_path / "early" / "report.md").read_text()

    for _ in range(2):
        finish_rung(api, search.id)
        api.registry.advance_search(search.id)
    done = client.get_search(search.id)
    written = runner.invoke(
        search_commands.search_group, ["report", str(search.id), "--out", str(tmp_path / "r")]
    )
    assert written.exit_code == 0, written.output
    assert [line.split()[-1] for line in written.output.splitlines()] == [
        str(tmp_path / "r" / name) for name in ("report.md", "report.json", "best-so-far.svg")
    ]
    report = (tmp_path / "r" / "report.md").read_text()
    chosen = done.chosen
    assert (
        f"test accuracy {chosen['test_mean']:.4f} (95% interval {chosen['ci_low']:.4f} to {chosen['ci_high']:.4f}"
        in report
    )
    assert f"its leaderboard row {chosen['config_id']}" in report
    assert all(f"| {t.job_id} |" in report for t in done.trials)  # every trial in the table
    assert "| 1 | 3 | 0.333 | 1 | 3 | 3 |" in report and "| 2 | 1 | 1 | 3 | 3 | 3 |" in report  # per rung
    assert "![best dev score against the budget spent](best-so-far.svg)" in report
    assert (tmp_path / "r" / "best-so-far.svg").read_text() == client.plot_search(search.id)
    assert SearchOut.model_validate_json((tmp_path / "r" / "report.json").read_text()) == done

    missing = runner.invoke(search_commands.search_group, ["report", "99", "--out", str(tmp_path / "none")])
    assert missing.exit_code == 1 and "search_id" in missing.output and not (tmp_path / "none").exists()
