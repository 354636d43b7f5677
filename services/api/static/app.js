// The pelt page: tasks, leaderboards, plots, live jobs and delta versions, read from the /v1 API with the
// token the user pastes. Plain JavaScript, no build step.
//
// Rules this file keeps:
// - the token lives in sessionStorage (this tab only) and travels only in the Authorization header:
//   never in a URL, the DOM (past the password field it was typed in) or a log;
// - every text that comes from the service (task names, methods, errors, descriptions) is set with
//   textContent or setAttribute, never parsed as HTML;
// - plots are SVG documents from the service, parsed with DOMParser and stripped of anything active
//   (scripts, event handlers, outside links) before they are imported into the page.
"use strict";

(() => {
  const TOKEN_KEY = "pelt.api-token";
  const POLL_MS = 2000;
  const LOSS_FETCHES_AT_ONCE = 6; // loss curves fetched in parallel when a view opens
  const ACTIVE = new Set(["queued", "running"]);
  const REFUSED = "the token was refused (wrong or revoked)";
  const SVG_NS = "http://www.w3.org/2000/svg";
  const SOURCES_TAG = "pelt.composition.sources";
  const OP_TAG = "pelt.composition.op";
  const JOB_KINDS = new Set(["job", "fusion"]); // versions a job trained (a fusion job's: kind fusion)

  const state = {
    scope: null, // the token's scope: read, predict, write or admin
    name: null, // the token's name: a write token cancels only the jobs it submitted
    task: null, // the name in view
    deltasOnly: false, // the view shows only the delta versions of a name (no task behind it)
    kShot: "", // the leaderboard's K filter ("" = every K, "full" = the full training set)
    orderBy: "mean", // the leaderboard's ranking: "mean" over seeds or "best" run
    sweep: "", // the jobs' sweep filter ("" = every job)
    searchRunning: false, // a search of the task in view is running: the poll reloads the searches too
    searchPlot: "", // what the search plot shows (search id, budget spent, status): redrawn when it changes
    generation: 0, // bumps on every change of view: answers for an older view are dropped
    pollTimer: null,
    jobs: new Map(), // job id -> the job as last seen
    rows: new Map(), // job id -> its table row's cells
    losses: new Map(), // job id -> [{step, loss}]: its curve, from /v1/jobs/{id}/loss
    lossesFinal: new Set(), // ended jobs whose curve was fetched after they ended: not fetched again
    versionsByJob: new Map(), // job id -> the delta version it made
  };

  const byId = (id) => document.getElementById(id);
  const enc = encodeURIComponent;

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // --- talking to the API ------------------------------------------------------------------------

  function storedToken() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  // A fetch with the token in the Authorization header. A 401 ends the session (the token is dropped,
  // the data cleared) and throws; any other refusal throws an ApiError with the service's message.
  async function request(path, { method = "GET", json = undefined } = {}) {
    const token = storedToken();
    if (!token) {
      refuse();
      throw new ApiError(401, REFUSED);
    }
    let response;
    try {
      const headers = { Authorization: `Bearer ${token}`, Accept: "application/json, image/svg+xml, */*" };
      if (json !== undefined) headers["Content-Type"] = "application/json";
      response = await fetch(path, {
        method,
        headers,
        body: json === undefined ? undefined : JSON.stringify(json),
        cache: "no-store",
        credentials: "omit",
        referrerPolicy: "no-referrer",
      });
    } catch (error) {
      throw new ApiError(0, `the service did not answer (${error.message})`);
    }
    if (response.ok) return response;
    if (response.status === 401) {
      refuse();
      throw new ApiError(401, REFUSED);
    }
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch {
      // not JSON: keep the status line
    }
    throw new ApiError(response.status, message);
  }

  async function getJson(path) {
    return (await request(path)).json();
  }

  // --- signing in and out --------------------------------------------------------------------------

  async function signIn() {
    hideMessage(byId("auth-message"));
    let who;
    try {
      who = await getJson("/v1/whoami");
    } catch (error) {
      if (error.status !== 401) showLogin(`Could not sign in: ${error.message}`);
      return;
    }
    state.scope = who.scope;
    state.name = who.name;
    document.body.dataset.scope = who.scope;
    byId("who").textContent =
      `token “${who.name}”, ${who.scope} scope` + (canWrite() ? "" : " (read only: no cancel buttons)");
    byId("login").hidden = true;
    byId("forget-token").hidden = false;
    byId("app").hidden = false;
    await loadTasks();
  }

  function canWrite() {
    return state.scope === "write" || state.scope === "admin";
  }

  function canPredict() {
    return state.scope === "predict" || canWrite();
  }

  // An admin token cancels any job; a write token the jobs it submitted.
  function canCancel(job) {
    return state.scope === "admin" || (state.scope === "write" && job.submitted_by === state.name);
  }

  // The service refused the token: forget it, show no data, say why.
  function refuse() {
    sessionStorage.removeItem(TOKEN_KEY);
    clearData();
    showLogin(`Signed out: ${REFUSED}.`);
  }

  function forgetToken() {
    sessionStorage.removeItem(TOKEN_KEY);
    clearData();
    showLogin(null);
  }

  function showLogin(message) {
    byId("login").hidden = false;
    byId("forget-token").hidden = true;
    const box = byId("auth-message");
    if (message) showMessage(box, message, true);
    else hideMessage(box);
    byId("token-input").focus();
  }

  // Empty every view of data: nothing the last token could read stays on the page.
  function clearData() {
    stopPolling();
    state.generation += 1;
    state.scope = null;
    state.name = null;
    state.task = null;
    state.jobs.clear();
    state.rows.clear();
    state.losses.clear();
    state.lossesFinal.clear();
    state.versionsByJob.clear();
    delete document.body.dataset.scope;
    byId("who").textContent = "";
    byId("app").hidden = true;
    byId("task-view").hidden = true;
    for (const id of ["task-list", "task-title", "task-description", "task-facts", "pareto-plot", "metric-vs-k-plot", "search-plot", "search-plot-caption"]) {
      byId(id).replaceChildren();
    }
    for (const table of ["leaderboard", "searches", "jobs", "deltas"]) byId(table).tBodies[0].replaceChildren();
    byId("search-plot-figure").hidden = true;
    resetPredict(null);
    for (const id of ["predict-texts", "predict-pairs", "predict-version"]) byId(id).value = "";
    state.searchRunning = false;
    state.searchPlot = "";
    resetSelect(byId("k-filter"), "all K");
    resetSelect(byId("sweep-filter"), "all jobs");
    hideMessage(byId("action-message"));
  }

  // --- messages ---------------------------------------------------------------------------------------

  function showMessage(box, text, isError) {
    box.textContent = text;
    box.classList.toggle("error", Boolean(isError));
    box.hidden = false;
  }

  function hideMessage(box) {
    box.textContent = "";
    box.hidden = true;
  }

  function reportError(error) {
    if (error instanceof ApiError && error.status === 401) return; // already shown by refuse()
    showMessage(byId("action-message"), error.message, true);
  }

  // --- tasks -------------------------------------------------------------------------------------------

  async function loadTasks() {
    const tasks = await getJson("/v1/tasks");
    const list = byId("task-list");
    list.replaceChildren(
      ...tasks.map((task) => {
        const button = element("button", task.name, "task-button");
        button.type = "button";
        button.dataset.task = task.name;
        button.addEventListener("click", () => selectTask(task.name).catch(reportError));
        const item = document.createElement("li");
        item.append(button);
        return item;
      }),
    );
    byId("tasks-empty").hidden = tasks.length > 0;
  }

  function markSelected(name) {
    for (const button of byId("task-list").querySelectorAll("button")) {
      if (button.dataset.task === name) button.setAttribute("aria-current", "true");
      else button.removeAttribute("aria-current");
    }
  }

  // Switch the view to `name`: a registered task (leaderboard, plots, jobs, deltas) or, with
  // `deltasOnly`, any name the delta store holds versions of (e.g. a composition's target).
  function openView(name, deltasOnly) {
    stopPolling();
    state.generation += 1;
    state.task = name;
    state.deltasOnly = deltasOnly;
    state.kShot = "";
    state.sweep = "";
    state.jobs.clear();
    state.rows.clear();
    state.losses.clear();
    state.lossesFinal.clear();
    state.versionsByJob.clear();
    markSelected(deltasOnly ? null : name);
    hideMessage(byId("action-message"));
    byId("task-title").textContent = name;
    byId("task-description").textContent = "";
    byId("task-facts").replaceChildren();
    for (const table of ["leaderboard", "searches", "jobs", "deltas"]) byId(table).tBodies[0].replaceChildren();
    state.searchRunning = false;
    state.searchPlot = "";
    byId("search-plot").replaceChildren();
    byId("search-plot-figure").hidden = true;
    byId("pareto-plot").replaceChildren();
    byId("metric-vs-k-plot").replaceChildren();
    resetSelect(byId("k-filter"), "all K");
    resetSelect(byId("sweep-filter"), "all jobs");
    for (const id of ["leaderboard-section", "plots-section", "searches-section", "jobs-section"]) byId(id).hidden = deltasOnly;
    resetPredict(deltasOnly ? null : undefined);
    byId("task-view").hidden = false;
    return state.generation;
  }

  async function selectTask(name) {
    const generation = openView(name, false);
    const task = await getJson(`/v1/tasks/${enc(name)}`);
    if (generation !== state.generation) return;
    byId("task-description").textContent = task.description || "";
    renderFacts(task);
    resetPredict(task);
    await Promise.all([
      loadLeaderboard(generation),
      loadPlots(generation),
      loadSearches(generation),
      loadDeltas(generation),
      refreshJobs(generation),
    ]);
    schedulePoll(generation);
  }

  async function showDeltasOf(name) {
    const generation = openView(name, true);
    byId("task-description").textContent = "Delta versions stored under this name.";
    await loadDeltas(generation);
  }

  function renderFacts(task) {
    const facts = [
      ["metric", `${task.metric} (${task.metric_direction} is better)`],
      ["problem", task.problem_type],
      ["training rows", String(task.train_size)],
      ["text fields", task.text_fields.join(", ")],
    ];
    if (task.label_names) facts.push(["labels", task.label_names.join(", ")]);
    byId("task-facts").replaceChildren(
      ...facts.flatMap(([term, value]) => [element("dt", term), element("dd", value)]),
    );
  }

  // --- leaderboard and plots ------------------------------------------------------------------------

  async function loadLeaderboard(generation) {
    const query = new URLSearchParams({ order_by: state.orderBy });
    if (state.kShot) query.set("k_shot", state.kShot);
    const board = await getJson(`/v1/tasks/${enc(state.task)}/leaderboard?${query}`);
    if (generation !== state.generation) return;
    byId("leaderboard-metric").textContent = `${board.metric} mean`;
    byId("leaderboard").tBodies[0].replaceChildren(...board.rows.map(leaderboardRow));
    byId("leaderboard-empty").hidden = board.rows.length > 0;
    byId("leaderboard-note").hidden = board.rows.length === 0;
    byId("leaderboard-note").textContent =
      `Each row is a method in one configuration (K and the settings that differ), its seeds pooled. ` +
      `Interval: ${board.interval}. vs top: ${board.tie_test}; "?" when a side has one seed.`;
    if (!state.kShot) fillKFilter(board.rows);
  }

  function leaderboardRow(row) {
    const tr = document.createElement("tr");
    tr.dataset.method = row.method;
    tr.dataset.config = row.config_id;
    const interval = row.ci_low === null ? "1 seed" : `${formatMetric(row.ci_low)} to ${formatMetric(row.ci_high)}`;
    tr.append(
      element("td", String(row.rank)),
      element("td", row.method, "method"),
      element("td", kLabel(row.k_shot)),
      element("td", configText(row.config), "config"),
      element("td", formatMetric(row.mean)),
      element("td", interval, "interval"),
      element("td", tieText(row), "tie"),
      element("td", formatMetric(row.best)),
      element("td", `${row.seeds} (${row.runs} run${row.runs === 1 ? "" : "s"})`),
      element("td", formatPercent(row.trainable_percent)),
      element("td", formatSeconds(row.median_train_seconds)),
    );
    return tr;
  }

  function configText(config) {
    return Object.entries(config)
      .map(([name, value]) => `${name}=${Array.isArray(value) ? value.join(",") : value}`)
      .join(" ");
  }

  function tieText(row) {
    if (row.rank === 1) return "top";
    if (row.tied_with_top === null) return "?";
    return row.tied_with_top ? "tied" : "separable";
  }

  function fillKFilter(rows) {
    const values = new Set();
    let full = false;
    for (const row of rows) {
      if (row.k_shot === null) full = true;
      else values.add(row.k_shot);
    }
    const select = byId("k-filter");
    resetSelect(select, "all K");
    for (const k of [...values].sort((a, b) => a - b)) select.append(option(String(k), `K = ${k}`));
    if (full) select.append(option("full", "full training set"));
    select.disabled = values.size === 0 && !full;
  }

  async function loadPlots(generation) {
    const task = enc(state.task);
    const query = state.kShot ? `?k_shot=${enc(state.kShot)}` : "";
    await Promise.all([
      loadPlot(byId("pareto-plot"), `/v1/tasks/${task}/plots/pareto.svg${query}`, generation),
      loadPlot(byId("metric-vs-k-plot"), `/v1/tasks/${task}/plots/metric-vs-k.svg`, generation),
    ]);
  }

  // Fetch an SVG plot with the token, parse it, strip anything active and put it in `box`.
  async function loadPlot(box, path, generation) {
    let text;
    try {
      text = await (await request(path)).text();
    } catch (error) {
      if (generation === state.generation && error.status !== 401) {
        box.replaceChildren(element("p", `plot unavailable: ${error.message}`, "muted"));
      }
      return;
    }
    if (generation !== state.generation) return;
    const parsed = new DOMParser().parseFromString(text, "image/svg+xml");
    const root = parsed.documentElement;
    if (root.namespaceURI !== SVG_NS || root.localName !== "svg" || parsed.querySelector("parsererror")) {
      box.replaceChildren(element("p", "plot unavailable: the service sent no SVG", "muted"));
      return;
    }
    box.replaceChildren(document.importNode(inert(root), true));
  }

  // elements that run code, embed other documents or change attributes over time
  const ACTIVE_ELEMENTS = new Set(["script", "foreignobject", "iframe", "object", "embed", "style", "animate", "animatemotion", "animatetransform", "set"]);

  // The SVG without scripts, event handlers, links or inline styles (the page's CSP would refuse those
  // anyway; removing them keeps the plot quiet and safe whatever a future renderer writes).
  function inert(root) {
    for (const node of [...root.querySelectorAll("*")]) {
      if (ACTIVE_ELEMENTS.has(node.localName.toLowerCase())) {
        node.remove();
        continue;
      }
      for (const attribute of [...node.attributes]) {
        const name = attribute.name.toLowerCase();
        const link = name === "href" || name.endsWith(":href");
        if (name.startsWith("on") || name === "style" || (link && !attribute.value.startsWith("#"))) {
          node.removeAttribute(attribute.name);
        }
      }
    }
    for (const attribute of [...root.attributes]) {
      if (attribute.name.toLowerCase().startsWith("on") || attribute.name === "style") root.removeAttribute(attribute.name);
    }
    return root;
  }

  // --- method searches -----------------------------------------------------------------------------

  // The task's searches, newest first, and the newest one's best dev score against the budget it spent
  // (fetched again only when that search's spending or status changed, so a hover tooltip stays put).
  async function loadSearches(generation) {
    const searches = await getJson(`/v1/searches?task=${enc(state.task)}`);
    if (generation !== state.generation) return;
    byId("searches").tBodies[0].replaceChildren(...searches.map(searchRow));
    byId("searches-empty").hidden = searches.length > 0;
    state.searchRunning = searches.some((search) => search.status === "running");
    const newest = searches[0];
    byId("search-plot-figure").hidden = !newest;
    if (!newest) {
      state.searchPlot = "";
      byId("search-plot").replaceChildren();
      return;
    }
    const shown = `${newest.id}:${newest.spent}:${newest.status}`;
    if (shown === state.searchPlot) return;
    state.searchPlot = shown;
    byId("search-plot-caption").textContent =
      `Search ${newest.id}: best dev ${newest.metric} against the budget spent (full-job equivalents)`;
    await loadPlot(byId("search-plot"), `/v1/searches/${newest.id}/plot.svg`, generation);
  }

  function searchRow(search) {
    const tr = document.createElement("tr");
    tr.dataset.search = String(search.id);
    tr.dataset.status = search.status;
    const chosen = search.chosen;
    const status = search.last_error ? `${search.status}: ${search.last_error}` : search.status;
    tr.append(
      element("td", String(search.id)),
      element("td", status, "status"),
      element("td", `${search.spent.toFixed(1)} of ${search.budget}`),
      element("td", String(search.configurations)),
      element("td", `${search.rung + 1} of ${search.schedule.rungs.length}`),
      element("td", chosen ? `${chosen.method} ${configText(chosen.hyperparameters)}`.trim() : "", "chosen"),
      element("td", chosen ? chosenScore(chosen) : "", "score"),
    );
    return tr;
  }

  function chosenScore(chosen) {
    const interval =
      chosen.ci_low === null ? "no interval" : `${formatMetric(chosen.ci_low)} to ${formatMetric(chosen.ci_high)}`;
    return `${formatMetric(chosen.test_mean)} (${interval}, ${chosen.seeds} seeds)`;
  }

  // --- jobs -----------------------------------------------------------------------------------------

  function schedulePoll(generation) {
    stopPolling();
    state.pollTimer = setTimeout(async () => {
      if (generation !== state.generation) return;
      try {
        const changed = await refreshJobs(generation);
        // a search queues jobs when it starts and at each rung: reload when they come or change
        if (state.searchRunning || changed) await loadSearches(generation);
      } catch (error) {
        reportError(error);
      }
      if (generation === state.generation) schedulePoll(generation);
    }, POLL_MS);
  }

  function stopPolling() {
    if (state.pollTimer !== null) clearTimeout(state.pollTimer);
    state.pollTimer = null;
  }

  // The task's jobs shown afresh; true when a job appeared or changed its status since the last poll.
  async function refreshJobs(generation) {
    const jobs = await getJson(`/v1/jobs?task=${enc(state.task)}&limit=1000`);
    if (generation !== state.generation) return false;
    let finished = false;
    let changed = false;
    for (const job of jobs) {
      const before = state.jobs.get(job.id);
      if (before && before.status !== job.status && job.status === "succeeded") finished = true;
      if (!before || before.status !== job.status) changed = true;
      state.jobs.set(job.id, job);
    }
    renderJobs(jobs);
    await refreshLosses(jobs, generation);
    if (generation !== state.generation) return false;
    if (finished) {
      // a job just ended well: its result is on the leaderboard, its delta in the store
      await Promise.all([loadLeaderboard(generation), loadPlots(generation), loadDeltas(generation)]);
    }
    return changed;
  }

  // Each shown job's loss curve as the service keeps it: a running job's at every poll, an ended job's
  // once (a queued job keeps what is shown).
  async function refreshLosses(jobs, generation) {
    const due = jobs.filter(
      (job) => job.status === "running" || (!ACTIVE.has(job.status) && !state.lossesFinal.has(job.id)),
    );
    for (let start = 0; start < due.length; start += LOSS_FETCHES_AT_ONCE) {
      await Promise.all(due.slice(start, start + LOSS_FETCHES_AT_ONCE).map((job) => loadLoss(job, generation)));
      if (generation !== state.generation) return;
    }
  }

  async function loadLoss(job, generation) {
    let history;
    try {
      history = await getJson(`/v1/jobs/${Number(job.id)}/loss`);
    } catch {
      return; // not fetched this time: the next poll asks again (a refused token signs out in request)
    }
    if (generation !== state.generation) return;
    const points = history.points
      .filter((point) => typeof point[0] === "number" && typeof point[1] === "number")
      .map(([step, loss]) => ({ step, loss }));
    state.losses.set(job.id, points);
    if (!ACTIVE.has(job.status)) state.lossesFinal.add(job.id);
    const cells = state.rows.get(job.id);
    if (cells) cells.curve.replaceChildren(sparkline(points));
  }

  function renderJobs(jobs) {
    const body = byId("jobs").tBodies[0];
    const sweeps = new Set();
    const newestFirst = [...jobs].sort((a, b) => b.id - a.id);
    for (const job of newestFirst) {
      if (job.sweep_id !== null) sweeps.add(job.sweep_id);
      let cells = state.rows.get(job.id);
      if (!cells) {
        cells = jobRow(job);
        state.rows.set(job.id, cells);
      }
      updateJobRow(cells, job);
      cells.row.hidden = state.sweep !== "" && String(job.sweep_id) !== state.sweep;
      body.append(cells.row); // in order: newest first
    }
    const seen = new Set(jobs.map((job) => job.id));
    for (const [id, cells] of state.rows) {
      if (!seen.has(id)) {
        cells.row.remove();
        state.rows.delete(id);
      }
    }
    fillSweepFilter(sweeps);
    byId("jobs-empty").hidden = jobs.length > 0;
  }

  function jobRow(job) {
    const row = document.createElement("tr");
    row.id = `job-${Number(job.id)}`;
    const cell = (name) => element("td", "", name);
    const cells = {
      row,
      id: cell("job-id"),
      method: cell("job-method"),
      k: cell("job-k"),
      seed: cell("job-seed"),
      sweep: cell("job-sweep"),
      status: cell("job-status"),
      step: cell("job-step"),
      loss: cell("job-loss"),
      speed: cell("job-speed"),
      curve: cell("job-curve"),
      actions: cell("job-actions"),
    };
    row.append(cells.id, cells.method, cells.k, cells.seed, cells.sweep, cells.status, cells.step, cells.loss, cells.speed, cells.curve, cells.actions);
    cells.id.textContent = `#${job.id}`;
    cells.method.textContent = job.method;
    cells.k.textContent = kLabel(job.k_shot);
    cells.seed.textContent = String(job.seed);
    cells.sweep.textContent = job.sweep_id === null ? "" : `#${job.sweep_id}`;
    return cells;
  }

  function updateJobRow(cells, job) {
    const detail = job.progress_detail || {};
    cells.row.dataset.status = job.status;
    const status = element("span", job.status, `status status-${job.status}`);
    const parts = [status];
    if (job.cancel_requested && ACTIVE.has(job.status)) parts.push(element("span", " (cancelling)", "muted"));
    if (job.last_error) parts.push(element("div", job.last_error, "job-error"));
    cells.status.replaceChildren(...parts);

    if (typeof detail.step === "number" && typeof detail.total === "number") {
      const bar = document.createElement("progress");
      bar.max = Math.max(detail.total, 1);
      bar.value = Math.min(detail.step, bar.max);
      cells.step.replaceChildren(element("span", `${detail.step} / ${detail.total}`, "step-text"), bar);
    } else {
      cells.step.replaceChildren();
    }
    cells.loss.textContent = typeof detail.loss === "number" ? detail.loss.toFixed(4) : "";
    cells.speed.textContent =
      typeof detail.tokens_per_second === "number" ? Math.round(detail.tokens_per_second).toLocaleString("en") : "";
    cells.curve.replaceChildren(sparkline(state.losses.get(job.id) || []));
    updateJobActions(cells, job);
  }

  function updateJobActions(cells, job) {
    const buttons = [];
    if (ACTIVE.has(job.status) && canCancel(job) && !job.cancel_requested) {
      const cancel = element("button", "Cancel", "cancel write-action");
      cancel.type = "button";
      cancel.addEventListener("click", () => cancelJob(job.id, cancel));
      buttons.push(cancel);
    }
    const version = state.versionsByJob.get(job.id);
    if (job.status === "succeeded" && version !== undefined) {
      buttons.push(downloadButton(state.task, version, "Download delta"));
    }
    cells.actions.replaceChildren(...buttons);
  }

  function fillSweepFilter(sweeps) {
    const select = byId("sweep-filter");
    const known = new Set([...select.options].map((o) => o.value));
    for (const id of [...sweeps].sort((a, b) => a - b)) {
      if (!known.has(String(id))) select.append(option(String(id), `sweep #${id}`));
    }
  }

  async function cancelJob(id, button) {
    button.disabled = true;
    try {
      await request(`/v1/jobs/${Number(id)}/cancel`, { method: "POST" });
      showMessage(byId("action-message"), `Job #${id}: cancel requested.`, false);
      await refreshJobs(state.generation);
    } catch (error) {
      button.disabled = false;
      if (error.status === 403) {
        showMessage(byId("action-message"), `The token may not cancel this job: ${error.message}`, true);
      } else {
        reportError(error);
      }
    }
  }

  // A small SVG of the job's loss over its steps (its current attempt's).
  function sparkline(points) {
    const width = 120;
    const height = 32;
    const svg = document.createElementNS(SVG_NS, "svg");
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("width", String(width));
    svg.setAttribute("height", String(height));
    svg.setAttribute("class", "sparkline");
    svg.dataset.points = String(points.length);
    const title = document.createElementNS(SVG_NS, "title");
    svg.append(title);
    if (points.length < 2) {
      title.textContent = "no loss curve yet: the job has reported fewer than two losses";
      const none = document.createElementNS(SVG_NS, "text");
      none.setAttribute("x", "2");
      none.setAttribute("y", String(height / 2 + 4));
      none.textContent = "–";
      svg.append(none);
      return svg;
    }
    const steps = points.map((p) => p.step);
    const losses = points.map((p) => p.loss);
    const [x0, x1] = [Math.min(...steps), Math.max(...steps)];
    const [y0, y1] = [Math.min(...losses), Math.max(...losses)];
    const x = (step) => 2 + ((step - x0) / Math.max(x1 - x0, 1e-12)) * (width - 4);
    const y = (loss) => height - 2 - ((loss - y0) / Math.max(y1 - y0, 1e-12)) * (height - 4);
    const line = document.createElementNS(SVG_NS, "polyline");
    line.setAttribute("points", points.map((p) => `${x(p.step).toFixed(1)},${y(p.loss).toFixed(1)}`).join(" "));
    svg.append(line);
    const last = points[points.length - 1];
    title.textContent = `loss ${points[0].loss.toFixed(4)} at step ${points[0].step} → ${last.loss.toFixed(4)} at step ${last.step} (${points.length} points)`;
    return svg;
  }

  // --- predictions -----------------------------------------------------------------------------------

  // The predict box of the task in view: hidden for a read token and for a name without a task behind
  // it; a second text box for a task trained on pairs. `task` undefined: keep the box as it is, empty.
  function resetPredict(task) {
    const section = byId("predict-section");
    if (task !== undefined) {
      section.hidden = task === null || !canPredict();
      const pairs = task !== null && task.text_fields.length === 2;
      byId("predict-pairs").hidden = !pairs;
      byId("predict-pairs-label").hidden = !pairs;
      byId("predict-texts-label").textContent = pairs ? `${task.text_fields[0]}, one per line` : "texts, one per line";
      if (pairs) byId("predict-pairs-label").textContent = `${task.text_fields[1]}, line by line`;
    }
    byId("predict-answer").hidden = true;
    byId("predictions").hidden = true;
    byId("predictions").tBodies[0].replaceChildren();
  }

  async function predict() {
    const lines = (id) => byId(id).value.split("\n").map((line) => line.trim());
    const firsts = lines("predict-texts");
    const pairs = byId("predict-pairs").hidden ? null : lines("predict-pairs");
    const texts = [];
    firsts.forEach((text, i) => {
      if (!text) return;
      texts.push(pairs ? [text, pairs[i] || ""] : text);
    });
    const answer = byId("predict-answer");
    if (texts.length === 0) {
      showMessage(answer, "Type a text to predict.", true);
      return;
    }
    const version = byId("predict-version").value.trim();
    const generation = state.generation;
    const button = byId("predict-button");
    button.disabled = true;
    try {
      const response = await request(`/v1/tasks/${enc(state.task)}/predict`, {
        method: "POST",
        json: { texts, version: version || null },
      });
      const body = await response.json();
      if (generation !== state.generation) return;
      showMessage(answer, `version ${body.version} (${body.method || body.kind}) answered`, false);
      byId("predictions").tBodies[0].replaceChildren(
        ...texts.map((text, i) => {
          const tr = document.createElement("tr");
          tr.append(element("td", Array.isArray(text) ? text.join(" | ") : text), element("td", predictionText(body.predictions[i])));
          return tr;
        }),
      );
      byId("predictions").hidden = false;
    } catch (error) {
      if (generation === state.generation) showMessage(answer, error.message, true);
    } finally {
      button.disabled = false;
    }
  }

  function predictionText(prediction) {
    if ("label" in prediction) return `${prediction.label} (${prediction.score.toFixed(3)})`;
    if ("labels" in prediction) return prediction.labels.join(", ") || "(none)";
    return formatMetric(prediction.value);
  }

  // --- delta versions -------------------------------------------------------------------------------

  async function loadDeltas(generation) {
    const name = state.task;
    let versions;
    try {
      versions = await getJson(`/v1/tasks/${enc(name)}/deltas`);
    } catch (error) {
      if (generation === state.generation) reportError(error);
      return;
    }
    if (generation !== state.generation) return;
    state.versionsByJob.clear();
    for (const version of versions) {
      if (version.job_id !== null && JOB_KINDS.has(version.kind)) state.versionsByJob.set(version.job_id, version.version);
    }
    byId("deltas").tBodies[0].replaceChildren(...versions.map((version) => deltaRow(name, version)));
    byId("deltas-empty").hidden = versions.length > 0;
    for (const [id, cells] of state.rows) updateJobActions(cells, state.jobs.get(id));
  }

  function deltaRow(name, version) {
    const tr = document.createElement("tr");
    tr.dataset.version = version.version;
    tr.dataset.kind = version.kind;
    const metric = version.metric_value === null ? "" : `${version.metric || "metric"} ${formatMetric(version.metric_value)}`;
    const files = document.createElement("td");
    files.append(downloadButton(name, version.version, "Download"));
    tr.append(
      element("td", version.version),
      element("td", version.kind),
      element("td", version.method || ""),
      element("td", metric),
      element("td", version.aliases.join(", ")),
      element("td", version.job_id === null ? "" : `#${version.job_id}`),
      provenanceCell(version),
      files,
    );
    return tr;
  }

  // Where a composed or fused version came from: its operation (a fusion's: "fusion") and its sources
  // (task/version), from the tags the delta store wrote when it composed or fused them.
  function provenanceCell(version) {
    const cell = element("td", "", "provenance");
    const sources = version.tags[SOURCES_TAG];
    if (sources === undefined) return cell;
    const op = version.tags[OP_TAG] || version.kind;
    let listed;
    try {
      listed = JSON.parse(sources).map((s) => `${!s.name || s.name === s.task ? "" : `${s.name}: `}${s.task}/${s.version}`);
    } catch {
      listed = [sources]; // clipped by the store: show it as it is
    }
    const list = document.createElement("ul");
    list.append(...listed.map((text) => element("li", text)));
    cell.append(element("span", `${op} of`), list);
    return cell;
  }

  function downloadButton(name, version, label) {
    const button = element("button", label, "download");
    button.type = "button";
    button.dataset.version = String(version);
    button.addEventListener("click", () => download(name, version, button));
    return button;
  }

  // Fetch the version's zip with the token in the header, then save it from a blob: no token in a URL.
  async function download(name, version, button) {
    button.disabled = true;
    try {
      const response = await request(`/v1/tasks/${enc(name)}/deltas/download?version=${enc(version)}`);
      const blob = await response.blob();
      const disposition = response.headers.get("Content-Disposition") || "";
      const match = /filename="([^"]+)"/.exec(disposition);
      const filename = (match ? match[1] : `${name}-v${version}.zip`).replace(/[^A-Za-z0-9._-]/g, "_");
      const url = URL.createObjectURL(blob);
      const link = document.createElement("a");
      link.href = url;
      link.download = filename;
      link.hidden = true;
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (error) {
      reportError(error);
    } finally {
      button.disabled = false;
    }
  }

  // --- small helpers --------------------------------------------------------------------------------

  function element(tag, text, className) {
    const node = document.createElement(tag);
    if (text) node.textContent = text;
    if (className) node.className = className;
    return node;
  }

  function option(value, text) {
    const node = document.createElement("option");
    node.value = value;
    node.textContent = text;
    return node;
  }

  function resetSelect(select, allLabel) {
    select.replaceChildren(option("", allLabel));
    select.value = "";
  }

  function kLabel(k) {
    return k === null || k === undefined ? "full" : String(k); // null: the full training set
  }

  function formatMetric(value) {
    return typeof value === "number" ? value.toFixed(4) : "";
  }

  function formatPercent(value) {
    return `${value < 0.1 ? value.toPrecision(2) : value.toFixed(2)} %`;
  }

  function formatSeconds(seconds) {
    return seconds < 120 ? `${seconds.toFixed(1)} s` : `${(seconds / 60).toFixed(1)} min`;
  }

  // --- wiring ----------------------------------------------------------------------------------------

  function start() {
    byId("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = byId("token-input");
      const token = input.value.trim();
      input.value = ""; // the secret leaves the DOM at once
      if (!token) return;
      sessionStorage.setItem(TOKEN_KEY, token);
      signIn().catch(reportError);
    });
    byId("forget-token").addEventListener("click", forgetToken);
    byId("k-filter").addEventListener("change", (event) => {
      state.kShot = event.target.value;
      const generation = state.generation;
      Promise.all([loadLeaderboard(generation), loadPlots(generation)]).catch(reportError);
    });
    byId("order-by").addEventListener("change", (event) => {
      state.orderBy = event.target.value;
      loadLeaderboard(state.generation).catch(reportError);
    });
    byId("sweep-filter").addEventListener("change", (event) => {
      state.sweep = event.target.value;
      renderJobs([...state.jobs.values()]);
    });
    byId("predict-form").addEventListener("submit", (event) => {
      event.preventDefault();
      predict().catch(reportError);
    });
    byId("deltas-lookup").addEventListener("submit", (event) => {
      event.preventDefault();
      const name = byId("deltas-lookup-name").value.trim();
      if (name) showDeltasOf(name).catch(reportError);
    });
    if (storedToken()) signIn().catch(reportError);
    else showLogin(null);
  }

  start();
})();
