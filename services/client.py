"""The Python client of the pelt service (httpx). One import:

    from services.client import PeltClient
    client = PeltClient()                                   # PELT_API_URL, PELT_API_TOKEN (or PELT_DATA_DIR/api_token)
    client.register_task("sentiment", train="train.jsonl", validation="dev.jsonl", text_fields=["sentence"])
    sweep = client.sweep("sentiment", ["lora", "bitfit", "prefix"], seeds=[0, 1], k_values=[100])
    client.wait(sweep)                                      # progress bars until every job has ended
    client.leaderboard("sentiment")                         # a pandas DataFrame, best mean over seeds first
    client.plot_leaderboard("sentiment", "pareto.svg")      # or .png; view="metric-vs-k"
    model = client.pull("sentiment")                        # the best delta on its backbone
    model.predict(["a great film"])

Results are the API's typed response models (`services.api.schemas`); errors are `PeltAPIError` with
the HTTP status, the offending field and the service's message.
"""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from pelt_core.delta_format import sha256_mismatch
from pelt_core.limits import MAX_PAGE_LIMIT
from pelt_core.pulled import MULTI_TASK, PulledModel, load_pulled
from services.api.schemas import (
    DEFAULT_BACKBONE,
    AuditEventOut,
    BackboneOut,
    ComposeOut,
    EventOut,
    JobOut,
    LossHistoryOut,
    MethodOut,
    PredictOut,
    ResultOut,
    SweepCheckOut,
    SweepOut,
    TaskOut,
    VersionOut,
)
from services.client_leaderboards import LeaderboardsClient
from services.client_progress import draw_progress
from services.client_retries import retry_wait, rewind_files
from services.client_searches import SearchesClient
from services.settings import Settings, get_settings

TERMINAL = ("succeeded", "failed", "cancelled")
PREDICT_WAIT_SECONDS = (
    300.0  # how long `predict` waits for an answer (a backbone's first one starts its replicas)
)


class PeltAPIError(Exception):
    """The service refused a request: `status` (HTTP), `type`, `field` (the offending input) and message."""

    def __init__(self, status: int, message: str, *, type: str = "", field: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.type, self.field = status, message, type, field


class JobsFailed(Exception):
    """`wait(..., raise_on_failure=True)` saw jobs end without success; `jobs` holds them."""

    def __init__(self, jobs: list[JobOut]) -> None:
        super().__init__(
            "; ".join(f"job {j.id} ({j.method}) {j.status}: {j.last_error or ''}"[:500] for j in jobs)
        )
        self.jobs = jobs


class PeltClient(LeaderboardsClient, SearchesClient):
    """A session with a pelt service. url: PELT_API_URL (default http://127.0.0.1:8000); token:
    PELT_API_TOKEN, else the secret `pelt serve` left in PELT_DATA_DIR/api_token. `http` replaces the
    underlying httpx.Client (tests pass FastAPI's TestClient)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 120.0,
        http: httpx.Client | None = None,
        settings: Settings | None = None,
    ) -> None:
        settings = settings or get_settings()
        self.url = (url or settings.api_url).rstrip("/")
        token = token or _default_token(settings, self.url)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if http is None:
            http = httpx.Client(base_url=self.url, timeout=timeout)
        http.headers.update(headers)
        self.http = http
        self.retries, self.retry_seconds = settings.client_retries, settings.client_retry_seconds
        self._reached = False  # whether the service ever answered this client
        self._backbones: dict[str, Any] = {}

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> PeltClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- plumbing --------------------------------------------------------------------------------

    def _request(
        self, method: str, path: str, *, repeatable: bool | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One request, tried again (`retry_wait`) while the service refuses it for now or cannot be reached
        (a refused connection only once the service has answered this client: before, nothing is there to
        wait for). `repeatable`: whether sending it twice does what sending it once does (default: GET and
        HEAD)."""
        if repeatable is None:
            repeatable = method in ("GET", "HEAD")
        # seconds slept before tries again (the time the requests themselves took is not counted)
        waited = 0.0
        for attempt in range(self.retries + 1):
            rewind_files(kwargs.get("files"))  # an upload tried again sends its files from the start
            try:
                response = self.http.request(method, path, **kwargs)
                failure = None
            except httpx.TransportError as exc:
                response, failure = None, exc
            if response is not None:
                self._reached = True
            wait = retry_wait(response, failure, repeatable, attempt)
            if not self._reached and isinstance(failure, httpx.ConnectError | httpx.ConnectTimeout):
                wait = None  # never reached: no service there (a restart of one reached before is waited out)
            if wait is None or attempt == self.retries or waited + wait > self.retry_seconds:
                break
            time.sleep(wait)
            waited += wait
        if response is None:
            raise PeltAPIError(
                0,
                f"cannot reach the pelt service at {self.url} ({failure}); is `pelt serve` "
                "running? (PELT_API_URL)",
            ) from None
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                raise PeltAPIError(
                    response.status_code,
                    error["message"],
                    type=error.get("type", ""),
                    field=error.get("field"),
                )
            except (ValueError, KeyError, TypeError):
                raise PeltAPIError(response.status_code, response.text[:500]) from None
        return response

    def _get(self, path: str, **params: Any) -> Any:
        clean = {k: v for k, v in params.items() if v is not None}
        return self._request("GET", path, params=clean).json()

    def _pages(self, path: str, limit: int | None, offset: int, **params: Any) -> list[Any]:
        """`limit` rows (None: every one) of a list route from `offset` on, a page of at most
        MAX_PAGE_LIMIT rows a request (the most the service answers), until a page comes back short."""
        rows: list[Any] = []
        while True:
            size = MAX_PAGE_LIMIT if limit is None else min(MAX_PAGE_LIMIT, limit - len(rows))
            page = self._get(path, **params, limit=size, offset=offset + len(rows))
            rows += page
            if len(page) < size or (limit is not None and len(rows) >= limit):
                return rows

    def _post(self, path: str, body: Mapping[str, Any] | None = None, *, repeatable: bool = False) -> Any:
        return self._request("POST", path, json=body or {}, repeatable=repeatable).json()

    def health(self) -> dict[str, Any]:
        return self._get("/health")

    # --- tasks, methods, backbones ---------------------------------------------------------------

    def register_task(
        self,
        name: str,
        train: str | Path | None = None,
        validation: str | Path | None = None,
        test: str | Path | None = None,
        *,
        dataset: str | Path | None = None,
        text_fields: Sequence[str] | str | None = None,
        label_field: str = "label",
        problem_type: str | None = None,
        metric: str | None = None,
        metric_direction: str | None = None,
        label_names: Sequence[str] | None = None,
        max_length: int = 128,
        description: str = "",
    ) -> TaskOut:
        """Upload a task's data and register it: split files (JSON Lines, CSV/TSV, Parquet) or `dataset`,
        a folder written by `datasets`' save_to_disk (sent as a tar.gz). `metric`: the primary metric
        (its name or an alias, see README's metric table); None: the problem type's default. No
        `text_fields` or `problem_type`: the server detects them from the data as `pelt train` does."""
        definition = {
            "text_fields": None
            if text_fields is None
            else [text_fields]
            if isinstance(text_fields, str)
            else list(text_fields),
            "label_field": label_field,
            "problem_type": problem_type,
            "metric": metric,
            "metric_direction": metric_direction,
            "max_length": max_length,
            "description": description,
            "label_names": None if label_names is None else list(label_names),
        }
        definition = {k: v for k, v in definition.items() if v is not None}
        with ExitStack() as stack:
            files: dict[str, tuple[str, Any]] = {}
            for split, path in (("train", train), ("validation", validation), ("test", test)):
                if path is not None:
                    files[split] = (Path(path).name, stack.enter_context(Path(path).open("rb")))
            if dataset is not None:
                files["dataset"] = (Path(dataset).name + ".tar.gz", _tar_folder(Path(dataset)))
            data = {"name": name, "definition": json.dumps(definition)}
            return TaskOut.model_validate(self._request("POST", "/v1/tasks", data=data, files=files).json())

    def tasks(self) -> list[TaskOut]:
        return [TaskOut.model_validate(t) for t in self._get("/v1/tasks")]

    def task(self, name: str) -> TaskOut:
        return TaskOut.model_validate(self._get(f"/v1/tasks/{name}"))

    def methods(self, builtin: bool | None = None) -> list[MethodOut]:
        return [MethodOut.model_validate(m) for m in self._get("/v1/methods", builtin=builtin)]

    def method(self, name: str) -> MethodOut:
        return MethodOut.model_validate(self._get(f"/v1/methods/{name}"))

    def register_method(self, spec: Mapping[str, Any], replace: bool = False) -> MethodOut:
        """A user preset: a method spec as data ({"name": ..., "modules": [...]}; see `pelt methods`)."""
        return MethodOut.model_validate(self._post("/v1/methods", {"spec": dict(spec), "replace": replace}))

    def backbones(self) -> list[BackboneOut]:
        return [BackboneOut.model_validate(b) for b in self._get("/v1/backbones")]

    def backbone(self, name: str) -> BackboneOut:
        return BackboneOut.model_validate(self._get(f"/v1/backbones/{name}"))

    def register_backbone(self, name: str, source: str | None = None) -> BackboneOut:
        return BackboneOut.model_validate(self._post("/v1/backbones", {"name": name, "source": source}))

    # --- jobs ------------------------------------------------------------------------------------

    def submit(
        self,
        task: str,
        method: str,
        *,
        backbone: str = DEFAULT_BACKBONE,
        hyperparameters: Mapping[str, Any] | None = None,
        seed: int = 0,
        k_shot: int | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        device: str = "any",
    ) -> JobOut:
        """Queue one job. hyperparameters: training settings (lr, epochs, batch_size, ...) and method
        overrides (r, bottleneck, prefix_length, q.size, ...). device: where it may run, "any" (whichever
        worker is free), "cpu" or "gpu"; another value is a 422 naming `device`."""
        body = {
            "task": task,
            "method": method,
            "backbone": backbone,
            "hyperparameters": dict(hyperparameters or {}),
            "seed": seed,
            "k_shot": k_shot,
            "priority": priority,
            "max_attempts": max_attempts,
            # a key of the client's own when none is given: a submit tried again never queues twice
            "idempotency_key": idempotency_key or f"client-{uuid.uuid4().hex}",
            **_placement(device),
        }
        return JobOut.model_validate(self._post("/v1/jobs", body, repeatable=True))

    def fuse(
        self,
        task: str,
        sources: Sequence[str],
        *,
        own_adapter: bool = False,
        backbone: str | None = None,
        hyperparameters: Mapping[str, Any] | None = None,
        seed: int = 0,
        k_shot: int | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        device: str = "any",
    ) -> JobOut:
        """Queue an AdapterFusion job: learn, for `task`, how to combine the stored adapters `sources`
        ("sst2" for its best, "sst2@best-pfeiffer", "sst2/3"), frozen; `own_adapter` trains the task's own
        adapter alongside. A job like any other (wait, cancel, its delta pulled by task name)."""
        body = {
            "task": task,
            "sources": list(sources),
            "own_adapter": own_adapter,
            "backbone": backbone,
            "hyperparameters": dict(hyperparameters or {}),
            "seed": seed,
            "k_shot": k_shot,
            "priority": priority,
            "max_attempts": max_attempts,
            "idempotency_key": idempotency_key or f"client-{uuid.uuid4().hex}",
            **_placement(device),
        }
        return JobOut.model_validate(self._post("/v1/fusions", body, repeatable=True))

    def sweep(
        self,
        task: str,
        methods: Sequence[str],
        *,
        backbone: str = DEFAULT_BACKBONE,
        seeds: Sequence[int] = (0,),
        k_values: Sequence[int | None] = (None,),
        hyperparameters: Mapping[str, Any] | None = None,
        method_hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        device: str = "any",
        again: bool = False,
    ) -> SweepOut:
        """Queue methods × seeds × K values (None: the full training set) in one go; `device` ("any",
        "cpu" or "gpu") applies to every job. The same sweep as one already queued, running or done
        returns that sweep's jobs (`already_submitted` true, nothing queued) unless `again=True`."""
        body = _sweep_body(
            task, methods, backbone, seeds, k_values, hyperparameters, method_hyperparameters, device
        )
        body |= {"priority": priority, "max_attempts": max_attempts, "idempotency_key": idempotency_key}
        # without `again`, the same sweep again answers with the one queued (its key derived from its jobs):
        # a sweep sent again after its answer was lost comes back `already_submitted`, as the sweep it queued
        return SweepOut.model_validate(
            self._post("/v1/sweeps", body | ({"again": True} if again else {}), repeatable=not again)
        )

    def check_sweep(
        self,
        task: str,
        methods: Sequence[str],
        *,
        backbone: str = DEFAULT_BACKBONE,
        seeds: Sequence[int] = (0,),
        k_values: Sequence[int | None] = (None,),
        hyperparameters: Mapping[str, Any] | None = None,
        method_hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
        device: str = "any",
    ) -> int:
        """Check a sweep as `sweep` would submit it, queueing nothing: the number of jobs it holds, or the
        PeltAPIError its submission would get (a K beyond the task's rows, an unknown method, a range)."""
        body = _sweep_body(
            task, methods, backbone, seeds, k_values, hyperparameters, method_hyperparameters, device
        )
        return SweepCheckOut.model_validate(self._post("/v1/sweeps/check", body, repeatable=True)).jobs

    def job(self, job_id: int) -> JobOut:
        return JobOut.model_validate(self._get(f"/v1/jobs/{int(job_id)}"))

    def jobs(
        self,
        *,
        task: str | None = None,
        status: str | Sequence[str] | None = None,
        method: str | None = None,
        backbone: str | None = None,
        sweep_id: int | None = None,
        limit: int | None = 100,
        offset: int = 0,
    ) -> list[JobOut]:
        """Jobs matching every filter given, oldest first: `limit` of them (None: every one) from `offset`
        on, fetched a page of at most MAX_PAGE_LIMIT at a time."""
        statuses = [status] if isinstance(status, str) else status
        found = self._pages(
            "/v1/jobs",
            limit,
            offset,
            task=task,
            status=statuses,
            method=method,
            backbone=backbone,
            sweep_id=sweep_id,
        )
        return [JobOut.model_validate(j) for j in found]

    def cancel(self, job_id: int) -> JobOut:
        """Cancel a job this token submitted (any job, with an admin token; else a 403)."""
        return JobOut.model_validate(self._post(f"/v1/jobs/{int(job_id)}/cancel", repeatable=True))

    def cancel_sweep(self, sweep_id: int) -> int:
        """Cancel the unfinished jobs of a sweep this token submitted (any, with an admin token); returns
        how many were cancelled or asked to stop."""
        return int(self._post(f"/v1/sweeps/{int(sweep_id)}/cancel", repeatable=True)["cancelled"])

    def events(self, job_id: int) -> list[EventOut]:
        return [EventOut.model_validate(e) for e in self._get(f"/v1/jobs/{int(job_id)}/events")]

    def loss_history(self, job_id: int) -> LossHistoryOut:
        """The loss curve of the job's current attempt: `.points` are [step, loss], steps increasing."""
        return LossHistoryOut.model_validate(self._get(f"/v1/jobs/{int(job_id)}/loss"))

    def predict(
        self, task: str, texts: Sequence[str | tuple[str, str]], *, version: str | int | None = None
    ) -> PredictOut:
        """Predictions from a task's stored delta, served by the service (`best` by default; an alias
        such as best-lora, or a version number): `.predictions` holds one per text, in order ({label,
        score}, {labels, scores} or {value}); `.version` and `.method` say which version answered. A task
        trained on pairs takes (text, text_pair) tuples. At most 256 texts per call (a 413 beyond)."""
        if isinstance(texts, str):
            raise TypeError(f"texts: give a list of texts, e.g. [{texts[:40]!r}], not one string")
        body = {
            "texts": [text if isinstance(text, str) else list(text) for text in texts],
            "version": None if version is None else str(version),
        }
        # the service answers within its PELT_PREDICT_TIMEOUT_SECONDS (120 s by default, a 503 then): wait longer
        answer = self._request(
            "POST", f"/v1/tasks/{task}/predict", json=body, timeout=PREDICT_WAIT_SECONDS, repeatable=True
        )
        return PredictOut.model_validate(answer.json())

    def result(self, job_id: int) -> ResultOut:
        return ResultOut.model_validate(self._get(f"/v1/jobs/{int(job_id)}/result"))

    def wait(
        self,
        jobs: SweepOut | JobOut | int | Iterable[JobOut | int],
        *,
        timeout: float | None = None,
        poll_seconds: float = 1.0,
        progress: bool = True,
        raise_on_failure: bool = False,
    ) -> list[JobOut]:
        """Wait until every job has ended (succeeded, failed or cancelled), showing a progress bar per job
        (step/total, loss, tokens/s). Returns the jobs as they ended; TimeoutError after `timeout` s."""
        ids = _job_ids(jobs)
        sweep_id = jobs.id if isinstance(jobs, SweepOut) else None
        deadline = None if timeout is None else time.monotonic() + timeout
        bars: dict[int, Any] = {}
        try:
            while True:
                if sweep_id is not None:  # a request per poll for the whole sweep (per 1,000 jobs)
                    found = {job.id: job for job in self.jobs(sweep_id=sweep_id, limit=None)}
                    current = {job_id: found[job_id] for job_id in ids}
                else:
                    current = {job_id: self.job(job_id) for job_id in ids}
                if progress:
                    draw_progress(bars, current)
                if all(job.status in TERMINAL for job in current.values()):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    pending = [j for j, job in current.items() if job.status not in TERMINAL]
                    raise TimeoutError(f"jobs {pending} had not ended after {timeout} s")
                time.sleep(poll_seconds)
        finally:
            for bar in bars.values():
                if hasattr(bar, "close"):
                    bar.close()
        ended = [current[job_id] for job_id in ids]
        failed = [job for job in ended if job.status != "succeeded"]
        if raise_on_failure and failed:
            raise JobsFailed(failed)
        return ended

    # --- deltas (leaderboards and their plots: services/client_leaderboards.py) --------------------

    def versions(self, task: str) -> list[VersionOut]:
        """Every stored delta version of the task, newest first."""
        return [VersionOut.model_validate(v) for v in self._get(f"/v1/tasks/{task}/deltas")]

    def archive_version(self, task: str, version: str | int) -> VersionOut:
        """Archive a version of a task (an admin token; audited): its aliases go, and no pull by name or
        alias answers with it again; `version=` still pulls it."""
        # by number it is repeatable; an alias tried again would archive the version that took its place
        repeatable = str(version).strip().isdigit()
        return VersionOut.model_validate(
            self._post(f"/v1/tasks/{task}/deltas/{version}/archive", repeatable=repeatable)
        )

    def delta_info(
        self,
        task: str,
        *,
        version: str | int | None = None,
        alias: str | None = None,
        method: str | None = None,
    ) -> VersionOut:
        """Which version a reference resolves to (the task's best by default)."""
        return VersionOut.model_validate(
            self._get(f"/v1/tasks/{task}/deltas/info", version=version, alias=alias, method=method)
        )

    def download(
        self,
        task: str,
        dest: str | Path,
        *,
        version: str | int | None = None,
        alias: str | None = None,
        method: str | None = None,
    ) -> VersionOut:
        """Download a delta version's files into `dest` (checked against its sha256); returns its info."""
        info = self.delta_info(task, version=version, alias=alias, method=method)
        response = self._request("GET", f"/v1/tasks/{task}/deltas/download", params={"version": info.version})
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
            for member in archive.namelist():
                target = (dest / member).resolve()
                if not target.is_relative_to(dest.resolve()):
                    raise PeltAPIError(0, f"the archive names a path outside {dest}: {member!r}")
            archive.extractall(dest)
        _check_sha256(dest, info)
        return info

    def pull(
        self,
        task: str,
        *,
        version: str | int | None = None,
        alias: str | None = None,
        method: str | None = None,
        backbone: Any = None,
        fold: bool = False,
        device: str = "auto",
    ) -> PulledModel:
        """Download a delta (the task's best by default) and load it onto its backbone, here: a
        PulledModel ready for `predict(texts)`, its `info` the version's VersionOut. backbone: a loaded
        pelt_core Backbone to reuse, else the manifest's backbone is loaded by name (a packaged alias, or
        a folder that exists here too) onto `device` (auto: a GPU when torch sees one; cpu, cuda, cuda:N).
        Deltas are stored as fp32 CPU tensors: one trained on any device loads on any other."""
        with tempfile.TemporaryDirectory(prefix="pelt-pull-") as scratch:
            info = self.download(task, scratch, version=version, alias=alias, method=method)
            return load_pulled(
                info, Path(scratch), lambda manifest: self._backbone(manifest, backbone, device), fold=fold
            )

    def _backbone(self, manifest: Mapping[str, Any], given: Any, device: str) -> Any:
        if given is not None:
            return given
        from pelt_core.backbones import Backbone
        from pelt_core.devices import resolve_device

        wanted = manifest["backbone"]
        key = f"{wanted['content_hash']}@{resolve_device(device)}"
        if key not in self._backbones:
            self._backbones[key] = Backbone.load(wanted["name"], device=device)
        return self._backbones[key]

    def compose(
        self,
        op: str,
        sources: Sequence[str] | Mapping[str, str],
        into: str,
        *,
        aliases: Sequence[str] = (),
        description: str = "",
        allow_existing: bool = False,
        **options: Any,
    ) -> ComposeOut:
        """Compose stored deltas into a new version of `into`: a new name (pulled by that name, its latest
        version), or a registered task among the sources; another registered task only with
        `allow_existing=True` (else a 409 naming `into`). op: merge (weights, how=linear|ties|dare,
        density, seed, ...), average, merge_lora_svd (rank), multi_task (sources: {route: ref}).
        References: "task" (its best), "task@best-lora", "task/3"."""
        body = {
            "op": op,
            "sources": sources if isinstance(sources, Mapping) else list(sources),
            "into": into,
            "options": options,
            "aliases": list(aliases),
            "description": description,
            **({"allow_existing": True} if allow_existing else {}),
        }
        return ComposeOut.model_validate(self._post("/v1/compose", body))

    def audit(self, limit: int | None = 100, offset: int = 0) -> list[AuditEventOut]:
        """Who registered, submitted, cancelled, composed, created or revoked what, newest first (an admin
        token): `limit` events (None: every one) from `offset` on, a page of at most MAX_PAGE_LIMIT at a
        time."""
        return [AuditEventOut.model_validate(e) for e in self._pages("/v1/audit", limit, offset)]


# --- helpers --------------------------------------------------------------------------------------


def _default_token(settings: Settings, url: str) -> str | None:
    """PELT_API_TOKEN; else, for a service on this machine only, the token `pelt serve` left in the data dir."""
    if settings.api_token is not None:
        return settings.api_token.get_secret_value()
    if httpx.URL(url).host not in ("127.0.0.1", "localhost", "::1"):
        return None
    path = settings.data_dir / "api_token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _sweep_body(
    task: str,
    methods: Sequence[str],
    backbone: str,
    seeds: Sequence[int],
    k_values: Sequence[int | None],
    hyperparameters: Mapping[str, Any] | None,
    method_hyperparameters: Mapping[str, Mapping[str, Any]] | None,
    device: str,
) -> dict[str, Any]:
    """What a sweep is, as /v1/sweeps and /v1/sweeps/check take it."""
    return {
        "task": task,
        "methods": list(methods),
        "backbone": backbone,
        "seeds": list(seeds),
        "k_values": list(k_values),
        "hyperparameters": dict(hyperparameters or {}),
        "method_hyperparameters": {k: dict(v) for k, v in (method_hyperparameters or {}).items()},
        **_placement(device),
    }


def _placement(device: str) -> dict[str, str]:
    """A submit's `device`, left out when it is the default ("any"), so that the request also suits a
    service older than devices (it refuses unknown fields)."""
    return {} if device == "any" else {"device": device}


def _job_ids(jobs: Any) -> list[int]:
    if isinstance(jobs, SweepOut):
        return list(jobs.job_ids)
    if isinstance(jobs, JobOut | int):
        jobs = [jobs]
    return [job.id if isinstance(job, JobOut) else int(job) for job in jobs]


def _tar_folder(folder: Path) -> io.BytesIO:
    if not folder.is_dir():
        raise FileNotFoundError(f"dataset: {folder} is not a folder (a `datasets` save_to_disk folder)")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(folder, arcname=folder.name)
    buffer.seek(0)
    return buffer


def _check_sha256(folder: Path, info: VersionOut) -> None:
    """The downloaded files against the version's recorded sha256 (a bundle: every part, too)."""
    if not info.sha256:
        return
    problem = sha256_mismatch(folder, info.sha256, bundle=info.kind == MULTI_TASK)
    if problem is not None:
        raise PeltAPIError(0, f"{info.task}/{info.version}: downloaded {problem}")


__all__ = ["JobsFailed", "PeltAPIError", "PeltClient"]
