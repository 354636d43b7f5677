"""The web page (`services/api/routes/page.py`, `services/api/static/`).

Without a browser: the shell (HTML, JS, CSS, no data) is served without a token under a
Content-Security-Policy that allows nothing from outside the service, with no inline script or style and
no HTML-parsing sink in its script; every data call still needs the token; `GET /v1/whoami` names the
token and its scope; `pelt serve` prints the page's URL.

In headless Chromium (`tests/api/browser.py`), against the whole service (`ApiServer` as `pelt serve`
runs it: API, dispatcher, local Ray) with a task trained here: the page loads once a token is entered and
keeps it out of URLs and the DOM; the leaderboard shows the trained methods; the Pareto plot has one point
per method; a running job's progress advances and cancel ends it; a read token sees the data without
write actions; a wrong or revoked token shows the clear message and no data; hostile text stays text; a
method search shows its row and its best-so-far plot.
Screenshots go to PELT_TEST_ARTIFACTS (default: a pytest temporary folder).
"""

from __future__ import annotations

import fnmatch
import html.parser
import os
import re
import subprocess
import sys
import time
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from services.api.routes.page import CONTENT_SECURITY_POLICY, STATIC_DIR, static_files
from services.client import PeltClient
from tests.api.browser import PageSession, launch_chromium, page_session
from tests.api.conftest import BACKBONE, Api
from tests.security.test_server_limits import output_lines, read_line_until
from tests.workers.conftest import LOAD_FACTOR

ROOT = Path(__file__).resolve().parents[2]
REFUSED = "the token was refused (wrong or revoked)"
METHODS = ("bitfit", "lora")
TRAINING = {"epochs": 1, "batch_size": 16, "learning_rate": 5e-3}
LONG_JOB = {"max_steps": 5000, "batch_size": 2}  # runs until cancelled
TASK = "page-toy"  # the service is shared with test_end_to_end.py, whose tasks are its own
COMPOSED = "page-toy-both"
HOSTILE_TASK = "hostile-text"
HOSTILE = '<script>alert("task")</script><img src=x onerror=alert("img")><b>bold?</b>'


# --- the shell, without a browser -----------------------------------------------------------------


def test_the_page_and_its_assets_are_served_without_a_token_with_the_security_headers(api: Api):
    http = TestClient(api.app)
    assets = sorted(static_files())
    assert assets == ["app.css", "app.js", "index.html"]
    for path, media in [
        ("/", "text/html"),
        ("/static/app.js", "text/javascript"),
        ("/static/app.css", "text/css"),
    ]:
        response = http.get(path)  # no Authorization header
        assert response.status_code == 200, (path, response.text)
        assert response.headers["content-type"].startswith(media), path
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY, path
        assert response.headers["x-content-type-options"] == "nosniff", path
        assert response.headers["referrer-policy"] == "no-referrer", path
    assert http.get("/").headers["cache-control"] == "no-store"
    policy = dict(part.strip().split(" ", 1) for part in CONTENT_SECURITY_POLICY.split(";"))
    assert (
        policy["default-src"]
        == policy["script-src"]
        == policy["style-src"]
        == policy["connect-src"]
        == "'self'"
    )
    assert (policy["frame-ancestors"], policy["base-uri"], policy["form-action"]) == ("'none'",) * 3


def test_only_the_pages_own_files_are_served(api: Api):
    http = TestClient(api.app)
    for path in (
        "/static/index.html",
        "/static/page.py",
        "/static/..%2Froutes%2Fpage.py",
        "/static/missing.js",
    ):
        response = http.get(path)
        assert response.status_code == 404, (path, response.status_code)
        assert "import" not in response.text
    assert "/" not in api.app.openapi()["paths"]  # the shell is no API route


def test_data_calls_without_a_token_are_refused(api: Api, toy_task: str):
    http = TestClient(api.app)
    for path in (
        "/v1/whoami",
        "/v1/tasks",
        f"/v1/tasks/{toy_task}/leaderboard",
        "/v1/jobs",
        f"/v1/tasks/{toy_task}/deltas",
    ):
        response = http.get(path)
        assert response.status_code == 401, path
        assert toy_task not in response.text


class ShellParser(html.parser.HTMLParser):
    """What the HTML asks the browser to run, style or load."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.inline_code: list[str] = []
        self.references: list[str] = []
        self.handlers: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag in ("script", "style"):
            self._in = tag
        if tag == "script":
            self.scripts.append(attributes)
        if tag == "style" or "style" in attributes:
            self.inline_code.append(f"<{tag}> style")
        self.handlers += [f"<{tag} {name}>" for name in attributes if name.startswith("on")]
        self.references += [value or "" for name, value in attrs if name in ("src", "href", "action")]

    def handle_endtag(self, tag: str) -> None:
        self._in = None

    def handle_data(self, data: str) -> None:
        if self._in and data.strip():
            self.inline_code.append(data.strip())


def test_the_html_has_no_inline_script_or_style_and_loads_nothing_from_outside():
    shell = ShellParser()
    shell.feed((STATIC_DIR / "index.html").read_text())
    assert shell.scripts == [{"src": "/static/app.js", "defer": None}]
    assert shell.inline_code == [] and shell.handlers == []
    assert shell.references and all(ref.startswith("/static/") or ref == "data:," for ref in shell.references)
    script = (STATIC_DIR / "app.js").read_text()
    sinks = re.findall(
        r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function", script
    )
    assert sinks == [], "user text is set with textContent, never parsed as HTML"
    assert not re.search(r"console\.\w+\(", script), "the page logs nothing (a token must never reach a log)"
    assert not re.search(
        r"https?://", (STATIC_DIR / "app.css").read_text() + script.replace("http://www.w3.org/2000/svg", "")
    )


def test_the_static_files_are_package_data():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["services.api"]
    for name in static_files():
        assert any(fnmatch.fnmatch(f"static/{name}", p) for p in patterns), name


def test_whoami_names_the_token_and_its_scope(api: Api):
    http = TestClient(api.app)
    _, reader = api.registry.create_api_token("viewer", scope="read")
    answers = {
        secret: http.get("/v1/whoami", headers={"Authorization": f"Bearer {secret}"}).json()
        for secret in (api.token, reader)
    }
    assert answers[api.token] == {"name": "tests", "scope": "admin"}
    assert answers[reader] == {"name": "viewer", "scope": "read"}
    assert http.get("/v1/whoami").status_code == 401


def test_pelt_serve_prints_the_pages_url_and_serves_it(tmp_path: Path):
    data, pelt = tmp_path / "pelt", Path(sys.executable).with_name("pelt")  # the installed command
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PELT_")}
    environment.update(PELT_DATA_DIR=str(data), HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    serve = [str(pelt), "serve", "--no-dispatcher", "--port", "0"]
    process = subprocess.Popen(
        serve, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        lines = output_lines(process)
        url = read_line_until(lines, "pelt serving on").split()[3]
        line = read_line_until(lines, "page:")
        assert line.split()[1] == f"{url}/"
        assert f"paste the token from {data / 'api_token'}" in line
        clients = read_line_until(lines, "clients:")
        assert clients.split(maxsplit=1)[1].strip() == f"export PELT_API_URL={url} PELT_DATA_DIR={data}"
        page = httpx.get(f"{url}/")
        assert page.status_code == 200 and page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert "token-input" in page.text
        assert httpx.get(f"{url}/v1/tasks").status_code == 401
    finally:
        process.terminate()
        process.wait(60)


# --- in headless Chromium ---------------------------------------------------------------------------


@dataclass
class Trained:
    """The whole service with the toy task trained (one job per method), a composition of its deltas
    and a task whose description is hostile."""

    url: str
    token: str
    registry: Any
    client: PeltClient


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    yield from launch_chromium()


@pytest.fixture(scope="module")
def trained(browser, service, toy_files) -> Iterator[Trained]:
    """The shared service (tests/api/conftest.py) with this module's tasks: TASK trained (one job per method),
    a composition of its deltas and a task whose description is hostile."""
    client = PeltClient(service.url, token=service.token, settings=service.settings)
    client.register_task(TASK, toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    client.register_task(HOSTILE_TASK, toy_files["train"], text_fields=["sentence"], description=HOSTILE)
    sweep = client.sweep(TASK, list(METHODS), backbone=BACKBONE, seeds=[0], hyperparameters=TRAINING)
    ended = client.wait(sweep, timeout=180 * LOAD_FACTOR, poll_seconds=0.3, progress=False)
    assert [job.status for job in ended] == ["succeeded"] * len(METHODS), [j.last_error for j in ended]
    client.compose("multi_task", {m: f"{TASK}@best-{m}" for m in METHODS}, COMPOSED)
    yield Trained(service.url, service.token, service.registry, client)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("PELT_TEST_ARTIFACTS") or tmp_path_factory.mktemp("page-screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def tab(browser, trained: Trained, artifacts: Path) -> Iterator[PageSession]:
    yield from page_session(browser, trained.url, artifacts)


@pytest.fixture
def long_job(trained: Trained):
    job = trained.client.submit(TASK, "lora", backbone=BACKBONE, hyperparameters=LONG_JOB)
    yield job
    if trained.client.job(job.id).status in ("queued", "running"):
        trained.client.cancel(job.id)


def rows(tab: PageSession, table: str) -> list[str]:
    return tab.page.locator(f"#{table} tbody tr").all_inner_texts()


def test_the_page_shows_the_leaderboard_plots_and_deltas_once_a_token_is_entered(
    tab: PageSession, trained: Trained
):
    page = tab.page
    assert page.locator("#app").is_hidden() and page.locator("#task-list li").count() == 0
    tab.sign_in(trained.token)
    page.locator(f"#task-list button[data-task='{TASK}']").wait_for()
    assert {TASK, HOSTILE_TASK} <= set(page.locator("#task-list button").all_inner_texts())
    assert trained.token not in page.content() and trained.token not in page.url  # only in sessionStorage
    assert page.input_value("#token-input") == ""

    tab.open_task(TASK)
    page.locator("#leaderboard tbody tr").nth(len(METHODS) - 1).wait_for()
    methods = page.locator("#leaderboard tbody td.method").all_inner_texts()
    assert sorted(methods) == sorted(METHODS)
    ties = page.locator("#leaderboard tbody td.tie").all_inner_texts()
    assert ties == ["top", "?"]  # one seed each: no interval, nothing to test against the top
    assert page.locator("#leaderboard tbody td.interval").all_inner_texts() == ["1 seed", "1 seed"]
    assert "Student-t" in page.locator("#leaderboard-note").inner_text()
    assert "full" in page.locator("#k-filter option").all_inner_texts()[-1]  # the full training set
    page.select_option("#order-by", "best")
    page.locator("#leaderboard tbody tr").nth(len(METHODS) - 1).wait_for()
    page.locator("#pareto-plot svg").wait_for()
    points = page.locator("#pareto-plot svg circle.point")
    assert sorted(points.evaluate_all("nodes => nodes.map(n => n.dataset.method)")) == sorted(METHODS)
    page.locator("#metric-vs-k-plot svg").wait_for()
    assert len(rows(tab, "deltas")) == len(METHODS)
    statuses = page.locator("#jobs tbody tr").evaluate_all("rows => rows.map(r => r.dataset.status)")
    assert statuses == ["succeeded"] * len(METHODS)
    tab.screenshot("leaderboard")

    with page.expect_download() as download:  # fetched with the header, saved from a blob
        page.locator("#jobs button.download").first.click()
    assert download.value.suggested_filename.endswith(".zip")
    with zipfile.ZipFile(download.value.path()) as archive:
        assert {"delta.safetensors", "manifest.json"} <= set(archive.namelist())

    page.fill("#deltas-lookup-name", COMPOSED)
    page.click("#deltas-lookup button")
    page.locator("#deltas tbody tr[data-kind='multi_task']").wait_for()
    versions = {v.method: v.version for v in trained.client.versions(TASK)}
    provenance = page.locator("#deltas .provenance li").all_inner_texts()
    assert sorted(provenance) == sorted(f"{method}: {TASK}/{versions[method]}" for method in METHODS)
    tab.screenshot("composed-provenance")
    assert tab.csp_violations() == [] and tab.dialogs == []

    page.click("#forget-token")
    assert page.locator("#login").is_visible() and page.locator("#task-list li").count() == 0
    assert page.evaluate("sessionStorage.length") == 0


def test_a_job_that_ended_before_the_page_opened_shows_its_loss_curve(
    tab: PageSession, trained: Trained, long_job
):
    """The curve is what the registry kept from the job's heartbeats (one point each, every second here):
    the job runs until it has reported three losses, then ends (cancelled) before the page opens."""
    client = trained.client
    deadline = time.monotonic() + 300
    while len(client.loss_history(long_job.id).points) < 3:
        assert time.monotonic() < deadline, "the job reported fewer than three losses in 300 s"
        time.sleep(0.2)
    client.cancel(long_job.id)
    while client.job(long_job.id).status != "cancelled":
        assert time.monotonic() < deadline, "the job did not end within 300 s of its cancel"
        time.sleep(0.2)
    kept = client.loss_history(long_job.id).points
    assert len(kept) >= 3 and [step for step, _ in kept] == sorted({step for step, _ in kept})
    page = tab.page
    tab.sign_in(trained.token)
    tab.open_task(TASK)
    curve = f"#job-{long_job.id} .job-curve svg"
    tab.wait_until(
        "([sel, n]) => Number(document.querySelector(sel)?.dataset.points) === n", [curve, len(kept)]
    )
    assert page.locator(f"{curve} polyline").count() == 1
    tab.screenshot("ended-job-curve")
    assert tab.csp_violations() == []


def test_a_running_jobs_progress_advances_and_cancel_ends_it(tab: PageSession, trained: Trained, long_job):
    page = tab.page
    tab.sign_in(trained.token)
    tab.open_task(TASK)
    step = f"#job-{long_job.id} .job-step .step-text"
    page.locator(step).wait_for()  # the first progress report
    seen = page.inner_text(step)
    tab.wait_until("([sel, before]) => document.querySelector(sel).textContent !== before", [step, seen])
    curve = f"#job-{long_job.id} .job-curve svg"
    tab.wait_until("sel => Number(document.querySelector(sel).dataset.points) >= 2", curve)
    assert page.locator(f"{curve} polyline").count() == 1
    assert page.inner_text(f"#job-{long_job.id} .job-speed") != ""
    tab.screenshot("running-job")

    page.click(f"#job-{long_job.id} button.cancel")
    page.locator(f"#job-{long_job.id}[data-status='cancelled']").wait_for()
    assert trained.client.job(long_job.id).status == "cancelled"
    tab.screenshot("cancelled-job")


def test_a_read_token_sees_the_data_but_no_write_action(tab: PageSession, trained: Trained, long_job):
    _, reader = trained.registry.create_api_token("page-reader", scope="read")
    tab.sign_in(reader)
    tab.open_task(TASK)
    tab.page.locator(f"#job-{long_job.id}").wait_for()
    assert "read scope" in tab.page.inner_text("#who")
    downloads = tab.page.locator("#jobs button.download")  # reading deltas is allowed
    downloads.nth(len(METHODS) - 1).wait_for()  # a row's buttons can come after the row on a loaded machine
    assert downloads.count() == len(METHODS)
    assert tab.page.locator("#jobs button.cancel").count() == 0


def test_a_wrong_or_revoked_token_shows_the_message_and_no_data(tab: PageSession, trained: Trained):
    page = tab.page
    tab.sign_in("pelt_" + "x" * 43)
    page.locator("#auth-message", has_text=REFUSED).wait_for()
    assert page.locator("#app").is_hidden() and page.locator("#task-list li").count() == 0
    tab.screenshot("wrong-token")

    _, secret = trained.registry.create_api_token("soon-revoked", scope="read")
    tab.sign_in(secret)
    tab.open_task(TASK)
    page.locator("#leaderboard tbody tr").first.wait_for()
    assert page.locator("#auth-message").is_hidden()
    trained.registry.revoke_api_token("soon-revoked")
    page.locator("#auth-message", has_text=REFUSED).wait_for()  # at the next poll of the jobs
    assert page.locator("#app").is_hidden() and page.locator("#login").is_visible()
    for table in ("leaderboard", "jobs", "deltas"):
        assert rows(tab, table) == [], table
    assert page.locator("#task-list li").count() == 0 and page.locator(".plot svg").count() == 0
    assert page.evaluate("sessionStorage.length") == 0
    tab.screenshot("revoked-token")


def test_hostile_text_renders_as_text(tab: PageSession, trained: Trained):
    page = tab.page
    tab.sign_in(trained.token)
    tab.open_task(HOSTILE_TASK)
    description = page.locator("#task-description")
    description.wait_for()
    tab.wait_until("text => document.getElementById('task-description').textContent === text", HOSTILE)
    assert description.locator("*").count() == 0  # no element was made from it
    assert page.locator("img").count() == 0 and page.locator("script").count() == 1
    page.locator("#leaderboard-empty").wait_for()
    tab.screenshot("hostile-text")
    assert tab.dialogs == [] and tab.csp_violations() == []


def test_a_method_search_shows_its_row_and_its_best_so_far_plot(tab: PageSession, trained: Trained):
    """Started while the page is open, cancelled at once (its jobs never train): the next poll shows what the
    registry holds of it; signing out leaves none of it on the page."""
    page = tab.page
    tab.sign_in(trained.token)
    tab.open_task(HOSTILE_TASK)
    page.locator("#searches-empty").wait_for()
    search = trained.client.search(HOSTILE_TASK, 4, methods=list(METHODS), backbone=BACKBONE)
    trained.client.cancel_search(search.id)
    row = page.locator(f"#searches tbody tr[data-search='{search.id}'][data-status='cancelled']")
    row.wait_for()
    cells = row.locator("td").all_inner_texts()
    assert cells[2] == f"0.0 of {search.budget:g}" and cells[4] == f"1 of {len(search.schedule['rungs'])}"
    assert page.locator("#searches-empty").is_hidden()
    page.locator("#search-plot svg").wait_for()
    assert "no job of this search has ended" in page.locator("#search-plot svg text.empty").text_content()
    assert f"Search {search.id}" in page.locator("#search-plot-caption").inner_text()
    tab.screenshot("search")
    assert tab.dialogs == [] and tab.csp_violations() == []

    page.click("#forget-token")
    assert page.locator("#searches tbody tr").count() == 0 and page.locator("#search-plot svg").count() == 0
    assert page.locator("#search-plot-caption").inner_text() == ""


def test_the_predict_box_labels_texts_with_the_best_version_and_says_which_answered(
    tab: PageSession, trained: Trained
):
    page = tab.page
    tab.sign_in(trained.token)
    tab.open_task(TASK)
    page.locator("#predict-section").wait_for()
    assert page.locator("#predict-pairs").is_hidden()  # a single-text task: one box
    page.fill("#predict-texts", "w1 w2 good great\n\nw1 w2 bad awful")
    page.click("#predict-button")
    page.locator("#predictions tbody tr").nth(1).wait_for()
    best = trained.client.delta_info(TASK)
    served = trained.client.predict(TASK, ["w1 w2 good great", "w1 w2 bad awful"])
    cells = page.locator("#predictions tbody td").all_inner_texts()
    assert cells[0::2] == ["w1 w2 good great", "w1 w2 bad awful"]  # the blank line is no row
    assert cells[1::2] == [f"{p['label']} ({p['score']:.3f})" for p in served.predictions]
    assert f"version {best.version} ({best.method}) answered" in page.inner_text("#predict-answer")

    page.fill("#predict-version", "99")
    page.click("#predict-button")
    tab.wait_until("() => document.querySelector('#predict-answer').classList.contains('error')")
    assert "99" in page.inner_text("#predict-answer")
    tab.screenshot("predict")
    assert tab.csp_violations() == [] and tab.dialogs == []


def test_a_read_token_gets_no_predict_box_and_a_predict_token_does(tab: PageSession, trained: Trained):
    _, reader = trained.registry.create_api_token("page-dashboard", scope="read")
    tab.sign_in(reader)
    tab.open_task(TASK)
    tab.page.locator("#leaderboard tbody tr").first.wait_for()
    assert tab.page.locator("#predict-section").is_hidden()
    tab.page.click("#forget-token")
    _, app = trained.registry.create_api_token("page-app", scope="predict")
    tab.sign_in(app)
    tab.open_task(TASK)
    tab.page.locator("#predict-section").wait_for()


def test_a_fusion_ranks_on_its_tasks_leaderboard_and_its_version_names_its_sources(
    tab: PageSession, trained: Trained, toy_files
):
    client, target = trained.client, "page-fused"
    client.register_task(target, toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    adapters = client.sweep(TASK, ["pfeiffer", "houlsby"], backbone=BACKBONE, hyperparameters=TRAINING)
    assert {
        j.status for j in client.wait(adapters, timeout=180 * LOAD_FACTOR, poll_seconds=0.3, progress=False)
    } == {"succeeded"}
    sources = {m: client.delta_info(TASK, method=m).version for m in ("pfeiffer", "houlsby")}
    fused = client.fuse(target, [f"{TASK}@best-{m}" for m in sources], hyperparameters=TRAINING)
    (ended,) = client.wait([fused.id], timeout=180 * LOAD_FACTOR, poll_seconds=0.3, progress=False)
    assert ended.status == "succeeded", ended.last_error

    tab.sign_in(trained.token)
    tab.page.locator(f"#task-list button[data-task='{target}']").wait_for()
    tab.open_task(target)
    tab.page.locator("#leaderboard tbody tr").first.wait_for()
    assert tab.page.locator("#leaderboard tbody td.method").all_inner_texts() == ["fusion"]
    tab.page.locator("#pareto-plot svg circle.point[data-method='fusion']").wait_for()
    tab.page.locator("#deltas tbody tr[data-kind='fusion']").wait_for()
    provenance = tab.page.locator("#deltas .provenance li").all_inner_texts()
    assert provenance == [f"{TASK}/{sources['pfeiffer']}", f"{TASK}/{sources['houlsby']}"]
    assert "fusion of" in tab.page.locator("#deltas .provenance").inner_text()
    tab.screenshot("fusion")
    assert tab.csp_violations() == [] and tab.dialogs == []
