"""The plotting module on its own (services/plots.py): figure data from leaderboard rows, the Pareto
frontier in either direction of the metric, the hand-written SVG (well-formed, one mark per method, hostile
names kept as text, nothing that runs or loads) and the matplotlib PNG of the same figures."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta

import pytest

from services import plots
from services.api.schemas import LeaderboardOut, LeaderboardRowOut, SearchOut, SearchTrialOut
from services.registry.leaderboard import Run, rank_by_k
from services.registry.search_rows import best_so_far

SVG = "{http://www.w3.org/2000/svg}"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HOSTILE = '<script>alert("x")</script>&\'"$x^$'


def row(
    method: str,
    mean: float,
    percent: float,
    *,
    half: float = 0.01,
    seeds: int = 3,
    config: dict | None = None,
    k_shot: int | None = None,
) -> LeaderboardRowOut:
    """A leaderboard row: `half` is its 95% interval's half-width (none with one seed)."""
    one = seeds == 1
    return LeaderboardRowOut(
        rank=1,
        method=method,
        config_id=f"{abs(hash((method, str(config), k_shot))):012x}"[:12],
        k_shot=k_shot,
        backbone="tiny-bert",
        config=config or {},
        mean=mean,
        std=None if one else half,
        ci_low=None if one else mean - half,
        ci_high=None if one else mean + half,
        tied_with_top=True,
        best=mean + (0 if one else half),
        runs=seeds,
        seeds=seeds,
        seed_values=[mean] * seeds,
        trainable_params=round(percent * 1000),
        trainable_percent=percent,
        median_train_seconds=1.0,
        best_job_id=1,
        best_delta_uri=None,
        best_delta_sha256=None,
        k_values=[k_shot],
        best_method_fingerprint=None,
        method_fingerprints=[],
    )


def board(
    rows: list[LeaderboardRowOut], *, k_shot: int | None = None, direction: str = "max", task: str = "sst2"
):
    metric = "accuracy" if direction == "max" else "mse"
    return LeaderboardOut(task=task, metric=metric, metric_direction=direction, k_shot=k_shot, rows=rows)


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    assert root.tag == f"{SVG}svg"
    return root


def points(root: ET.Element) -> list[ET.Element]:
    return [e for e in root.iter(f"{SVG}circle") if "point" in e.get("class", "").split()]


def frontier_methods(root: ET.Element) -> set[str]:
    return {e.get("data-method") for e in points(root) if "frontier" in e.get("class", "").split()}


# Accuracy (higher is better): bitfit is cheapest, lora beats it for more, houlsby beats both for still
# more; prefix costs more than lora for less, mam costs the most for the same as houlsby.
RANKED = [
    row("bitfit", 0.75, 0.1),
    row("lora", 0.80, 0.3),
    row("prefix", 0.78, 0.5),
    row("houlsby", 0.85, 3.0),
    row("mam", 0.85, 6.0),
]


def test_the_pareto_svg_has_one_point_per_method_and_marks_the_frontier_for_higher_is_better():
    root = parse(plots.render_svg(plots.pareto_figure(board(RANKED, k_shot=100))))
    assert sorted(e.get("data-method") for e in points(root)) == sorted(r.method for r in RANKED)
    assert frontier_methods(root) == {"bitfit", "lora", "houlsby"}
    assert len(root.findall(f".//{SVG}path[@class='frontier-line']")) == 1
    assert root.get("viewBox") == "0 0 720 420" and root.get("width") is None
    assert "K=100" in "".join(root.itertext())


def test_for_a_lower_is_better_metric_the_frontier_takes_the_smallest_values():
    errors = [
        row("bitfit", 0.9, 0.1),
        row("lora", 0.5, 0.3),
        row("prefix", 0.7, 0.5),
        row("houlsby", 0.6, 3.0),
    ]
    figure = plots.pareto_figure(board(errors, direction="min"))
    assert frontier_methods(parse(plots.render_svg(figure))) == {"bitfit", "lora"}
    assert "lower is better" in figure.subtitle


def test_the_frontier_keeps_every_point_of_a_tie_and_drops_a_costlier_equal():
    tied = [("a", 1.0, 0.8), ("b", 1.0, 0.8), ("c", 2.0, 0.8), ("d", 0.5, 0.7)]
    assert plots.pareto_frontier(tied, "max") == {"a", "b", "d"}
    assert plots.pareto_frontier(tied, "min") == {"d"}
    with pytest.raises(ValueError, match="direction"):
        plots.pareto_frontier(tied, "up")


def test_a_single_method_is_its_own_frontier_in_both_renderers():
    figure = plots.pareto_figure(board([row("lora", 0.8, 0.3, seeds=1)]))
    root = parse(plots.render_svg(figure))
    assert [e.get("data-method") for e in points(root)] == ["lora"] and frontier_methods(root) == {"lora"}
    assert plots.render_png(figure).startswith(PNG_SIGNATURE)


def test_each_point_carries_its_numbers_as_hover_text():
    root = parse(plots.render_svg(plots.pareto_figure(board(RANKED))))
    (lora,) = [e for e in points(root) if e.get("data-method") == "lora"]
    hover = lora.find(f"{SVG}title").text
    assert "accuracy mean 0.8000, 95% interval 0.7900 to 0.8100 (3 seeds)" in hover and "3 runs" in hover
    assert "0.3% (300 parameters)" in hover
    assert "on the Pareto frontier" in hover
    description = root.find(f"{SVG}desc").text
    assert root.get("aria-labelledby") == "pelt-pareto-title pelt-pareto-desc"
    assert "bitfit" in description and "houlsby" in description


def test_each_configuration_of_a_method_is_its_own_point_with_its_interval_as_the_error_bar():
    rows = [
        row("lora", 0.80, 0.3, config={"learning_rate": 0.005}),
        row("lora", 0.84, 0.6, config={"learning_rate": 0.001}, half=0.02),
        row("bitfit", 0.75, 0.1, seeds=1),
    ]
    figure = plots.pareto_figure(board(rows))
    (lora,) = [series for series in figure.series if series.method == "lora"]
    assert [(p.x, p.mean, p.error) for p in lora.points] == [
        (0.3, 0.80, pytest.approx(0.01)),
        (0.6, 0.84, pytest.approx(0.02)),
    ]
    assert "learning_rate=0.005" in lora.points[0].detail and "learning_rate=0.001" in lora.points[1].detail
    (bitfit,) = [series for series in figure.series if series.method == "bitfit"]
    assert bitfit.points[0].error == 0 and "1 seed: no interval" in bitfit.points[0].detail
    root = parse(plots.render_svg(figure))
    assert sorted(e.get("data-method") for e in points(root)) == ["bitfit", "lora", "lora"]
    assert len(frontier_methods(root)) == 2 and sum("frontier" in e.get("class") for e in points(root)) == 3
    assert "95% interval" in figure.y_label
    assert plots.render_png(figure).startswith(PNG_SIGNATURE)


def test_metric_vs_k_follows_each_methods_top_configuration_at_each_k():
    boards = [
        board([row("lora", 0.7, 0.3, config={"r": 8}), row("lora", 0.6, 0.3, config={"r": 2})], k_shot=100),
        board([row("lora", 0.8, 0.3, config={"r": 2}, seeds=1)], k_shot=1000),
    ]
    (lora,) = plots.metric_vs_k_figure(boards).series
    assert [(p.x, p.mean, p.error) for p in lora.points] == [
        (100.0, 0.7, pytest.approx(0.01)),
        (1000.0, 0.8, 0.0),
    ]


@pytest.mark.parametrize("view", plots.VIEWS)
def test_hostile_task_and_method_names_stay_text(view):
    rows = [row(HOSTILE, 0.8, 0.3), row("lora", 0.7, 0.1)]
    if view == "pareto":
        figure = plots.pareto_figure(board(rows, task=HOSTILE))
    else:
        figure = plots.metric_vs_k_figure([board(rows, k_shot=10, task=HOSTILE), board(rows, task=HOSTILE)])
    svg = plots.render_svg(figure)
    root = parse(svg)
    tags = {element.tag.removeprefix(SVG) for element in root.iter()}
    assert tags <= {
        "svg",
        "title",
        "desc",
        "rect",
        "text",
        "g",
        "line",
        "path",
        "circle",
        "polygon",
        "polyline",
    }
    attributes = {name for element in root.iter() for name in element.attrib}
    assert not any(name.lower().startswith("on") or "href" in name for name in attributes), attributes
    assert "<script" not in svg and "&lt;script&gt;" in svg
    assert HOSTILE in root.find(f"{SVG}title").text
    assert HOSTILE in {e.get("data-method") for e in points(root)}
    assert plots.render_png(figure).startswith(PNG_SIGNATURE)  # "$" and "_" are no markup to matplotlib


def test_characters_xml_forbids_are_dropped_rather_than_breaking_the_document():
    figure = plots.pareto_figure(board([row("bad\x00\x1bname", 0.8, 0.3)], task="t\x07"))
    assert [e.get("data-method") for e in points(parse(plots.render_svg(figure)))] == ["badname"]


@pytest.mark.parametrize("view", plots.VIEWS)
def test_an_empty_leaderboard_draws_a_no_results_figure(view):
    empty = board([], task="fresh")
    figure = plots.pareto_figure(empty) if view == "pareto" else plots.metric_vs_k_figure([empty])
    root = parse(plots.render_svg(figure))
    assert points(root) == []
    (message,) = [e for e in root.iter(f"{SVG}text") if e.get("class") == "empty"]
    assert message.text.startswith("no results yet")
    assert "fresh" in root.find(f"{SVG}title").text
    assert plots.render_png(figure).startswith(PNG_SIGNATURE)
    with pytest.raises(ValueError, match="empty"):
        plots.metric_vs_k_figure([])


def test_metric_vs_k_has_a_line_per_method_a_point_per_k_and_the_full_data_point_last():
    boards = [
        board([row("lora", 0.6, 0.3), row("bitfit", 0.55, 0.1)], k_shot=100),
        board([row("lora", 0.7, 0.3)], k_shot=1000),
        board([row("lora", 0.9, 0.3), row("bitfit", 0.85, 0.1)], k_shot=None),
    ]
    figure = plots.metric_vs_k_figure(boards)
    lora = next(series for series in figure.series if series.method == "lora")
    assert [(p.x, p.full_data) for p in lora.points] == [(100.0, False), (1000.0, False), (4000.0, True)]
    assert [label for _, label in figure.x_ticks] == ["100", "1000", "full"]
    root = parse(plots.render_svg(figure))
    assert sorted(e.get("data-method") for e in points(root)) == ["bitfit", "bitfit", "lora", "lora", "lora"]
    groups = [g.get("data-method") for g in root.iter(f"{SVG}g") if g.get("class") == "series"]
    assert groups == ["bitfit", "lora"]
    assert len(root.findall(f".//{SVG}polygon")) == 2  # an interval band per method
    assert "full" in [e.text for e in root.iter(f"{SVG}text")]
    assert plots.render_png(figure).startswith(PNG_SIGNATURE)


def test_numbers_that_are_not_finite_are_refused_naming_the_method():
    with pytest.raises(ValueError, match="'lora'"):
        plots.metric_vs_k_from_values("t", "accuracy", "max", {"lora": {10: (math.nan, 0.0, 1)}})


def test_each_method_keeps_one_color_within_a_figure():
    many = [row(f"method{i}", 0.5 + i / 100, 0.1 * (i + 1)) for i in range(10)]
    root = parse(plots.render_svg(plots.pareto_figure(board(many))))
    assert len({e.get("fill") for e in points(root)}) == 10


def test_formats_and_views_are_checked_with_clear_errors():
    assert plots.format_of("out/plot.SVG") == "svg" and plots.format_of("p.png") == "png"
    with pytest.raises(ValueError, match=r"\.svg or \.png, not \.jpg"):
        plots.format_of("plot.jpg")
    with pytest.raises(ValueError, match="no suffix"):
        plots.format_of("plot")
    with pytest.raises(ValueError, match="pareto, metric-vs-k"):
        plots.check_view("bars")
    with pytest.raises(ValueError, match="every K"):
        plots.check_view("metric-vs-k", k_shot=100)
    with pytest.raises(ValueError, match="svg, png"):
        plots.render(plots.pareto_figure(board([])), "gif")


def test_rank_by_k_groups_the_runs_by_k_with_the_full_training_set_last():
    def run(method: str, k: int | None, value: float, job: int) -> Run:
        return Run(method, job, 0, k, value, 10, 0.1, 1.0)

    runs = [
        run("lora", None, 0.9, 1),
        run("lora", 100, 0.6, 2),
        run("bitfit", 100, 0.7, 3),
        run("lora", 16, 0.5, 4),
    ]
    by_k = rank_by_k(runs, "max")
    assert list(by_k) == [16, 100, None]
    assert [r.method for r in by_k[100]] == ["bitfit", "lora"] and by_k[None][0].best == 0.9


def test_png_requests_beyond_two_at_once_get_a_busy_answer_instead_of_a_server_thread_each():
    from services.errors import ServiceError

    figure = plots.pareto_figure(board([row("lora", 0.8, 0.3)]))
    taken = [plots._PNG_SLOTS.acquire(blocking=False) for _ in range(2)]  # two renders in progress
    try:
        with pytest.raises(ServiceError) as busy:
            plots.render_png(figure)
    finally:
        for _ in taken:
            plots._PNG_SLOTS.release()
    assert (busy.value.status, busy.value.retry_after) == (503, 2)
    assert plots.render_png(figure).startswith(PNG_SIGNATURE)  # free again


def test_a_png_legend_names_at_most_a_fixed_number_of_methods():
    many = [row(f"m{i}", 0.5 + i / 1000, 0.1 + i / 100) for i in range(plots.PNG_LEGEND_ENTRIES + 5)]

    assert plots.render_png(plots.pareto_figure(board(many))).startswith(PNG_SIGNATURE)


# --- a method search's best dev score against the budget -------------------------------------------------


def search_of(trials: list[tuple], direction: str = "max") -> SearchOut:
    """A search whose trials are (method, status, dev, cost) in the order they ended."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    trials_out = [
        SearchTrialOut(
            configuration=number,
            method=method,
            hyperparameters={"learning_rate": 0.001},
            rung=0,
            epochs=1.0,
            seed=0,
            job_id=100 + number,
            status=status,
            dev=dev,
            test=None if dev is None else dev - 0.01,
            cost=cost,
            finished_at=None if status in ("queued", "running") else start + timedelta(seconds=number),
        )
        for number, (method, status, dev, cost) in enumerate(trials)
    ]
    return SearchOut(
        id=7,
        task="toy",
        metric="accuracy",
        metric_direction=direction,
        backbone="tiny-bert",
        status="running",
        budget=12,
        k_shot=100,
        dev_rows=100,
        methods=sorted({t[0] for t in trials}),
        hyperparameters={},
        schedule={"rungs": []},
        space={},
        configurations=len(trials),
        rung=0,
        planned_cost=12,
        spent=sum(t[3] for t in trials),
        chosen=None,
        last_error=None,
        submitted_by=None,
        created_at=start,
        finished_at=None,
        trials=trials_out,
        best_so_far=best_so_far(trials_out, direction),  # as the registry reads it
    )


def test_a_search_figure_puts_each_ended_job_at_the_budget_spent_and_steps_through_each_new_best():
    search = search_of(
        [
            ("lora", "succeeded", 0.70, 0.5),
            ("bitfit", "failed", None, 0.5),  # costs budget, draws no point
            ("bitfit", "succeeded", 0.65, 0.5),
            ("lora", "succeeded", 0.80, 1.0),
            ("lora", "running", None, 1.0),  # not ended: neither spent nor drawn
        ]
    )
    figure = plots.search_figure(search)
    drawn = {(p.method, p.x, p.mean, p.on_frontier) for s in figure.series for p in s.points}
    assert drawn == {("lora", 0.5, 0.70, True), ("bitfit", 1.5, 0.65, False), ("lora", 2.5, 0.80, True)}
    assert [(p.x, p.mean) for p in figure.frontier] == [(0.5, 0.70), (2.5, 0.80)]
    assert not figure.log_x and figure.x_label == "budget spent (full-job equivalents)"
    svg = plots.render_svg(figure)
    root = ET.fromstring(svg)
    assert len(points(root)) == 3 and len(root.findall(f".//{SVG}path[@class='frontier-line']")) == 1
    legend = [e.text for e in root.iter(f"{SVG}text")]
    assert "best so far" in legend and "Pareto frontier" not in legend
    assert legend[legend.index("budget spent (full-job equivalents)") - 3 :][:3] == [
        "0",
        "1",
        "2",
    ]  # linear, from 0
    assert plots.render_png(figure).startswith(PNG_SIGNATURE)


def test_for_a_lower_is_better_metric_the_best_so_far_follows_the_smallest_dev_score():
    figure = plots.search_figure(
        search_of(
            [
                ("lora", "succeeded", 0.5, 1.0),
                ("lora", "succeeded", 0.7, 1.0),
                ("lora", "succeeded", 0.2, 1.0),
            ],
            "min",
        )
    )
    assert [(p.x, p.mean) for p in figure.frontier] == [(1.0, 0.5), (3.0, 0.2)]


def test_a_search_without_an_ended_job_draws_a_no_results_figure():
    figure = plots.search_figure(search_of([("lora", "running", None, 1.0)]))
    assert figure.series == ()
    for text in (plots.render_svg(figure), plots.render_png(figure)):
        assert text  # both renderers draw it
    assert plots.NO_SEARCH_RESULTS in plots.render_svg(figure)
