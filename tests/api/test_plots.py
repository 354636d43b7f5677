"""The leaderboard and its plots through the service, over results recorded in the registry (no training):
rows per method and configuration with intervals and ties (API, client, `pelt leaderboard`), GET
/v1/tasks/{name}/leaderboard/by-k, the SVG and PNG plot routes (read scope, a token like every data call,
inert SVG headers), `PeltClient.plot_leaderboard` and `pelt leaderboard --plot`."""

from __future__ import annotations

import math
import statistics
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from services.commands import deltas
from services.registry.leaderboard import INTERVAL, TIE_TEST
from tests.api.conftest import BACKBONE, Api
from tests.api.helpers import refused

SVG = "{http://www.w3.org/2000/svg}"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T_975_1 = 12.706204736174698  # Student's t, 97.5th percentile, 1 degree of freedom (2 seeds)
PLOTS = ("pareto.svg", "pareto.png", "metric-vs-k.svg", "metric-vs-k.png")
# method: (trainable params of 100,000, {K: accuracy per seed})
RESULTS = {
    "bitfit": (100, {16: [0.60, 0.62], 64: [0.70, 0.72], None: [0.80, 0.82]}),
    "lora": (1_000, {16: [0.65, 0.69], 64: [0.78, 0.80], None: [0.86, 0.88]}),
    "prefix": (5_000, {16: [0.55, 0.57], 64: [0.66, 0.70]}),
}


def record_results(api: Api, task: str) -> None:
    """A succeeded job with a result per method × K × seed, as a worker would have completed it."""
    for method, (params, by_k) in RESULTS.items():
        for k_shot, values in by_k.items():
            for seed, value in enumerate(values):
                job = api.registry.submit_job(task, method, BACKBONE, seed=seed, k_shot=k_shot)
                claimed = api.registry.claim_job("w")
                assert claimed is not None and claimed.id == job.id
                result = {
                    "metrics": {"accuracy": value},
                    "trainable_params": params,
                    "total_params": 100_000,
                    "train_seconds": 1.0,
                }
                api.registry.complete_job(job.id, "w", result)


@pytest.fixture
def trained(api: Api, toy_task: str) -> str:
    record_results(api, toy_task)
    return toy_task


def points(svg: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    return [e for e in root.iter(f"{SVG}circle") if "point" in e.get("class", "").split()]


def test_the_leaderboard_has_a_row_per_method_and_k_ranked_by_mean_with_intervals_and_ties(client, trained):
    board = client.leaderboard_raw(trained)
    assert (board.order_by, board.interval, board.tie_test) == ("mean", INTERVAL, TIE_TEST)
    assert [(row.method, row.k_shot) for row in board.rows] == [
        ("lora", None),
        ("bitfit", None),
        ("lora", 64),
        ("bitfit", 64),
        ("prefix", 64),
        ("lora", 16),
        ("bitfit", 16),
        ("prefix", 16),
    ]
    top, last = board.rows[0], board.rows[-1]
    half = T_975_1 * statistics.stdev([0.86, 0.88]) / math.sqrt(2)
    assert (top.mean, top.seeds, top.ci_low, top.ci_high) == (
        pytest.approx(0.87),
        2,
        pytest.approx(0.87 - half),
        pytest.approx(0.87 + half),
    )
    assert (top.tied_with_top, last.tied_with_top) == (True, False)
    assert all(row.config == {} for row in board.rows)  # one configuration per method and K


def test_the_leaderboard_ranks_by_best_on_request_and_filters_the_full_set(client, trained):
    by_best = client.leaderboard(trained, k_shot=64, order_by="best")
    assert list(by_best["method"]) == ["lora", "bitfit", "prefix"] and by_best.attrs["order_by"] == "best"
    full = client.leaderboard_raw(trained, k_shot="full")
    assert full.k_shot == "full" and [(r.method, r.k_shot) for r in full.rows] == [
        ("lora", None),
        ("bitfit", None),
    ]
    http = client.http
    for params, field in (({"order_by": "median"}, "order_by"), ({"k_shot": "fuller"}, "k_shot")):
        response = http.get(f"/v1/tasks/{trained}/leaderboard", params=params)
        assert response.status_code == 422 and field in response.text, response.text


def test_pelt_leaderboard_prints_k_config_interval_and_ties(api, trained, monkeypatch):
    monkeypatch.setattr(deltas, "PeltClient", api.client)
    result = CliRunner().invoke(deltas.leaderboard_command, [trained])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "ranked by the mean over seeds" in lines[0]
    assert lines[1].split()[:4] == ["rank", "method", "K", "config"]
    assert lines[2].split()[:3] == ["1", "lora", "full"] and "top" in lines[2]
    assert lines[-2].split()[:3] == ["8", "prefix", "16"] and "separable" in lines[-2]
    assert "Welch" in lines[-1]
    result = CliRunner().invoke(
        deltas.leaderboard_command, [trained, "--k-shot", "full", "--order-by", "best"]
    )
    assert result.exit_code == 0 and "ranked by the best run" in result.output, result.output
    assert [line.split()[1] for line in result.output.splitlines()[2:4]] == ["lora", "bitfit"]
    result = CliRunner().invoke(deltas.leaderboard_command, [trained, "--k-shot", "0"])
    assert result.exit_code == 2 and "nor 'full'" in result.output


def test_the_leaderboard_by_k_has_one_board_per_k_with_the_full_training_set_last(client, trained):
    boards = client.leaderboard_by_k(trained)
    assert [board.k_shot for board in boards] == [16, 64, None]
    assert [row.method for row in boards[0].rows] == ["lora", "bitfit", "prefix"]
    assert [row.method for row in boards[2].rows] == ["lora", "bitfit"]
    assert boards[1].rows[0].mean == pytest.approx(0.79) and boards[1].rows[0].runs == 2
    assert {board.metric for board in boards} == {"accuracy"}
    assert client.leaderboard_by_k(trained, backbone=BACKBONE) == boards
    refused(lambda: client.leaderboard_by_k("nope"), 404, "task")
    refused(lambda: client.leaderboard_by_k(trained, backbone="nope"), 404)


def test_the_pareto_svg_has_a_point_per_method_the_frontier_and_inert_headers(api, trained):
    response = api.client().http.get(f"/v1/tasks/{trained}/plots/pareto.svg")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/svg+xml"
    assert response.headers["content-security-policy"] == "default-src 'none'; style-src 'unsafe-inline'"
    assert response.headers["x-content-type-options"] == "nosniff"
    marks = points(response.text)  # every K: a point per method and K
    assert sorted(e.get("data-method") for e in marks) == ["bitfit"] * 3 + ["lora"] * 3 + ["prefix"] * 2
    assert {e.get("data-method") for e in marks if "frontier" in e.get("class")} == {"bitfit", "lora"}
    assert "all K" in response.text


def test_the_pareto_plot_takes_one_k(api, trained):
    svg = api.client().plot_leaderboard(trained, k_shot=16)
    assert sorted(e.get("data-method") for e in points(svg)) == ["bitfit", "lora", "prefix"]
    assert "K=16" in svg and "0.6700" in svg  # lora's mean at K=16


def test_the_metric_vs_k_svg_has_a_point_per_method_and_k(api, trained):
    svg = api.client().plot_leaderboard(trained, view="metric-vs-k")
    marks = points(svg)
    assert len(marks) == 8 and sorted({e.get("data-method") for e in marks}) == ["bitfit", "lora", "prefix"]
    assert ">full<" in svg and ">16<" in svg and ">64<" in svg


def test_the_png_plots_are_pngs(api, trained):
    for plot in ("pareto.png", "metric-vs-k.png"):
        response = api.client().http.get(f"/v1/tasks/{trained}/plots/{plot}")
        assert response.status_code == 200 and response.headers["content-type"] == "image/png"
        assert response.content.startswith(PNG_SIGNATURE)


def test_a_task_without_results_gets_a_no_results_figure(api, toy_task):
    for plot in PLOTS:
        response = api.client().http.get(f"/v1/tasks/{toy_task}/plots/{plot}")
        assert response.status_code == 200, (plot, response.text)
        if plot.endswith(".svg"):
            assert points(response.text) == [] and "no results yet" in response.text
        else:
            assert response.content.startswith(PNG_SIGNATURE)


def test_the_plots_need_a_token_and_a_read_scope_is_enough(api, trained):
    http = TestClient(api.app)
    _, reader = api.registry.create_api_token("reader", scope="read")
    for plot in PLOTS:
        path = f"/v1/tasks/{trained}/plots/{plot}"
        assert http.get(path).status_code == 401
        assert http.get(path, headers={"Authorization": "Bearer pelt_" + "x" * 43}).status_code == 401
        assert http.get(path, headers={"Authorization": f"Bearer {reader}"}).status_code == 200


def test_unknown_tasks_formats_and_bad_k_are_refused(api, client, trained):
    refused(lambda: client.plot_leaderboard("nope"), 404, "task")
    http = client.http
    assert http.get(f"/v1/tasks/{trained}/plots/pareto.gif").status_code == 422
    assert http.get(f"/v1/tasks/{trained}/plots/pareto.svg", params={"k_shot": 0}).status_code == 422
    assert http.get(f"/v1/tasks/{trained}/plots/bars.svg").status_code == 404


def test_the_client_writes_the_plot_in_the_format_of_the_suffix(client, trained, tmp_path):
    svg = client.plot_leaderboard(trained, tmp_path / "pareto.svg")
    assert (tmp_path / "pareto.svg").read_text() == svg and len(points(svg)) == 8
    png = client.plot_leaderboard(trained, tmp_path / "by-k.png", view="metric-vs-k")
    assert (tmp_path / "by-k.png").read_bytes() == png and png.startswith(PNG_SIGNATURE)
    assert client.plot_leaderboard(trained, format="png").startswith(PNG_SIGNATURE)


def test_the_client_refuses_bad_requests_and_writes_nothing(client, trained, tmp_path):
    tmp_path = tmp_path / "plots"
    tmp_path.mkdir()
    with pytest.raises(ValueError, match=r"\.svg or \.png"):
        client.plot_leaderboard(trained, tmp_path / "plot.jpg")
    with pytest.raises(ValueError, match="view"):
        client.plot_leaderboard(trained, tmp_path / "plot.svg", view="bars")
    with pytest.raises(ValueError, match="every K"):
        client.plot_leaderboard(trained, tmp_path / "plot.svg", view="metric-vs-k", k_shot=16)
    refused(lambda: client.plot_leaderboard("nope", tmp_path / "plot.svg"), 404, "task")
    assert list(tmp_path.iterdir()) == []


def test_pelt_leaderboard_plot_writes_the_file(api, trained, tmp_path, monkeypatch):
    monkeypatch.setattr(deltas, "PeltClient", api.client)
    runner = CliRunner()
    target = tmp_path / "pareto.svg"
    result = runner.invoke(deltas.leaderboard_command, [trained, "--plot", str(target), "--k-shot", "64"])
    assert result.exit_code == 0, result.output
    assert f"-> {target}" in result.output and "K=64" in target.read_text()
    assert len(points(target.read_text())) == 3
    target = tmp_path / "by-k.png"
    result = runner.invoke(
        deltas.leaderboard_command, [trained, "--plot", str(target), "--view", "metric-vs-k"]
    )
    assert result.exit_code == 0, result.output
    assert target.read_bytes().startswith(PNG_SIGNATURE)


def test_pelt_leaderboard_refuses_bad_plot_options_and_writes_nothing(api, trained, tmp_path, monkeypatch):
    monkeypatch.setattr(deltas, "PeltClient", api.client)
    out = tmp_path / "plots"
    out.mkdir()
    refusals = [
        (["--plot", f"{out}/plot.jpg"], ".svg or .png"),
        (["--plot", f"{out}/plot.svg", "--view", "metric-vs-k", "--k-shot", "16"], "every K"),
        (["--view", "metric-vs-k"], "--plot"),
        (["--plot", f"{out}/plot.svg", "--json"], "--json"),
    ]
    for arguments, words in refusals:
        result = CliRunner().invoke(deltas.leaderboard_command, [trained, *arguments])
        assert result.exit_code == 2 and words in result.output, result.output
    assert list(out.iterdir()) == []


def test_pelt_leaderboard_plot_of_an_unknown_task_says_so(api, toy_task, tmp_path, monkeypatch):
    monkeypatch.setattr(deltas, "PeltClient", api.client)
    result = CliRunner().invoke(deltas.leaderboard_command, ["nope", "--plot", str(tmp_path / "p.svg")])
    assert result.exit_code == 1 and "nope" in result.output and "HTTP 404" in result.output
    assert not (tmp_path / "p.svg").exists()
