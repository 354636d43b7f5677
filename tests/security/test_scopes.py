"""Who may do what (issue #11, "Also"): token scopes, a cap on queued jobs per token, and the audit trail.

A token is `read` (every GET), `write` (read + submit, cancel, register tasks and methods, compose) or
`admin` (write + register backbones, full job errors, the audit trail). A request beyond its token's
scope is a 403 naming the scope it needs and writes nothing; a submit past the token's cap on queued
jobs is a 429 naming the cap and writes nothing; every write records who did it, in the same
transaction, readable by admins only.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from sqlalchemy import text

from services.api.server import ensure_local_token
from services.client import PeltAPIError
from services.registry import Registry, RegistryValidationError, db, upgrade
from services.registry.testing import sqlite_url
from services.settings import Settings, get_settings
from tests.api.conftest import BACKBONE, Api
from tests.api.helpers import tiny_lora_spec

ADMIN_ROUTES = {
    ("post", "/v1/backbones"),
    ("get", "/v1/audit"),
    ("post", "/v1/tasks/{name}/deltas/{version}/archive"),
}
PREDICT_ROUTES = {("post", "/v1/tasks/{name}/predict")}
SCOPES = ("read", "predict", "write", "admin")  # each includes the ones before it
SET_UP = [
    (None, "backbone.register", BACKBONE),
    (None, "token.create", "tests"),
]  # the `api` fixture's writes


def needed_scope(method: str, path: str) -> str:
    """What each route should need: GETs read, prediction predict, other methods write, and the admin
    routes admin."""
    if (method, path) in ADMIN_ROUTES:
        return "admin"
    if (method, path) in PREDICT_ROUTES:
        return "predict"
    return "read" if method == "get" else "write"


def api_routes(api: Api) -> list[tuple[str, str]]:
    schema = api.app.openapi()
    found = [
        (method, path)
        for path, item in schema["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete") and path.startswith("/v1/")
    ]
    assert len(found) >= 20, found
    return found


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", lambda m: "1" if m.group(0).endswith("_id}") else "toy", path)


def tokens(api: Api) -> dict[str, str]:
    return {
        scope: api.registry.create_api_token(f"{scope}-user", scope=scope)[1]
        for scope in ("read", "predict", "write")
    } | {"admin": api.token}


def audit_actions(api: Api) -> list[tuple[str | None, str, str]]:
    return [(e.actor, e.action, e.target) for e in reversed(api.registry.audit_events(limit=1000))]


def row_counts(api: Api) -> dict[str, int]:
    with api.registry.engine.connect() as connection:
        return {
            table: connection.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
            for table in ("tasks", "methods", "backbones", "jobs", "sweeps", "job_events")
        }


# --- scopes ---------------------------------------------------------------------------------------------


def test_a_token_is_write_by_default_and_an_unknown_scope_is_refused(api: Api):
    record, _ = api.registry.create_api_token("colleague")
    assert record.scope == "write"
    with pytest.raises(RegistryValidationError, match="scope"):
        api.registry.create_api_token("root", scope="root")
    assert [t.name for t in api.registry.list_api_tokens()] == ["colleague", "tests"]


def test_every_route_needs_the_scope_it_declares_and_a_403_names_it_and_writes_nothing(
    api: Api, toy_task: str
):
    secrets = tokens(api)
    http = TestClient(api.app)
    api.registry.list_methods()  # built-in presets newer than the schema get their rows on the first read
    before = row_counts(api)
    checked = 0
    for method, path in api_routes(api):
        needed = needed_scope(method, path)
        for scope, secret in secrets.items():
            response = http.request(
                method.upper(),
                concrete(path),
                headers={"Authorization": f"Bearer {secret}"},
                **({"json": {}} if method == "post" else {}),
            )
            allowed = SCOPES.index(scope) >= SCOPES.index(needed)
            if allowed:
                assert response.status_code != 403, (scope, method, path, response.text)
            else:
                assert response.status_code == 403, (scope, method, path, response.status_code, response.text)
                error = response.json()["error"]
                assert error["field"] == "Authorization" and f"'{needed}' scope" in error["message"], error
                checked += 1
    assert checked >= 10
    assert row_counts(api) == before  # the empty bodies of the allowed calls are 422s: nothing written either


def test_a_read_token_reads_everything_and_can_change_nothing(api: Api, toy_task: str):
    _, secret = api.registry.create_api_token("reader", scope="read")
    reader = api.client(secret)
    assert [t.name for t in reader.tasks()] == ["toy"]
    assert reader.leaderboard_raw("toy").rows == []
    assert reader.jobs() == [] and {m.name for m in reader.methods()} >= {"lora"}
    for call in (
        lambda: reader.submit("toy", "lora", backbone=BACKBONE),
        lambda: reader.sweep("toy", ["lora"], backbone=BACKBONE),
        lambda: reader.register_method({"name": "mine", "modules": {}}),
        lambda: reader.cancel(1),
        lambda: reader.compose("merge", ["toy/1", "toy/2"], "soup"),
    ):
        with pytest.raises(PeltAPIError) as refused:
            call()
        assert refused.value.status == 403 and "'write' scope" in refused.value.message
    assert api.registry.list_jobs() == [] and api.registry.list_methods(builtin=False) == []


def test_registering_a_backbone_needs_an_admin_token(api: Api, tiny_bert_dir: Path):
    _, secret = api.registry.create_api_token("writer")
    with pytest.raises(PeltAPIError) as refused:
        api.client(secret).register_backbone("another-bert", str(tiny_bert_dir))
    assert refused.value.status == 403 and "'admin' scope" in refused.value.message
    assert [b.name for b in api.registry.list_backbones()] == [BACKBONE]


def test_a_write_tokens_submit_registers_nothing_but_a_packaged_backbone(
    api: Api, toy_task: str, tiny_bert_dir: Path
):
    """A submit naming an unregistered packaged backbone registers it on first use, with any write token
    (packaged backbones ship with pelt); a model folder, even one an admin may register, is a 404."""
    from pelt_core.backbones import BackboneError

    loaded: list[str] = []

    def spy_loader(source: str) -> None:
        loaded.append(source)
        raise BackboneError("not loaded in this test")

    api.operations._backbone_loader = spy_loader
    _, secret = api.registry.create_api_token("writer", scope="write")
    writer = api.client(secret)
    rows, files, audit = row_counts(api), api.files(), audit_actions(api)
    for folder in (str(tiny_bert_dir), str(tiny_bert_dir.parent), "../backbones/tiny-bert", "tiny-bert/."):
        with pytest.raises(PeltAPIError) as refused:
            writer.submit(toy_task, "lora", backbone=folder)
        assert (refused.value.status, refused.value.field) == (404, "backbone"), (folder, refused.value)
        with pytest.raises(PeltAPIError) as refused:
            writer.sweep(toy_task, ["lora"], backbone=folder)
        assert refused.value.status == 404, (folder, refused.value)
    assert loaded == []
    with pytest.raises(PeltAPIError) as refused:
        writer.submit(toy_task, "lora", backbone="minilm")  # packaged: loaded for registering, here refused
    assert refused.value.status == 422 and loaded == ["all-minilm-l6-v2"]
    assert (row_counts(api), api.files(), audit_actions(api)) == (rows, files, audit)


def test_tokens_made_before_scopes_existed_become_admin(tmp_path: Path):
    url = sqlite_url(tmp_path / "registry.db")
    upgrade(url, "0006")
    with db.connect(url) as engine, engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO api_tokens (name, token_hash, prefix, created_at) "
                "VALUES ('old', :hash, 'pelt_abcdef', '2026-01-01 00:00:00')"
            ),
            {"hash": "0" * 64},
        )
    upgrade(url)
    with Registry(url) as registry:
        assert [(t.name, t.scope) for t in registry.list_api_tokens()] == [("old", "admin")]
        assert registry.create_api_token("new")[0].scope == "write"


def test_the_local_token_pelt_serve_makes_is_admin(tmp_path: Path):
    settings = Settings(data_dir=tmp_path / "pelt", ray_address=None)
    upgrade(settings.database_url)
    with Registry(settings=settings) as registry:
        secret = ensure_local_token(registry, settings)
        assert secret is not None and registry.authenticate(secret).scope == "admin"


def test_pelt_token_create_takes_a_scope_and_list_shows_it(api: Api, monkeypatch):
    from services.commands.admin import token_group

    monkeypatch.setenv("PELT_DATA_DIR", str(api.settings.data_dir))
    monkeypatch.setenv("PELT_DATABASE_URL", api.settings.database_url)
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        created = runner.invoke(token_group, ["create", "viewer", "--scope", "read"])
        assert created.exit_code == 0, created.output
        assert api.registry.authenticate(created.stdout.strip()).scope == "read"
        refused = runner.invoke(token_group, ["create", "boss", "--scope", "root"])
        assert refused.exit_code != 0 and "root" in refused.output
        listing = runner.invoke(token_group, ["list"])
        assert listing.exit_code == 0
        rows = {line.split()[0]: line.split()[1] for line in listing.stdout.splitlines()[1:]}
        assert rows == {"tests": "admin", "viewer": "read"}
        assert runner.invoke(token_group, ["revoke", "viewer"]).exit_code == 0
    finally:
        get_settings.cache_clear()
    trail = audit_actions(api)
    assert trail[: len(SET_UP)] == SET_UP
    assert [(action, target) for _, action, target in trail[len(SET_UP) :]] == [
        ("token.create", "viewer"),
        ("token.revoke", "viewer"),
    ]
    assert all(actor.startswith("cli") for actor, _, _ in trail[len(SET_UP) :])


# --- job errors: the traceback is for admins ------------------------------------------------------------


def failed_job(api: Api, task: str) -> int:
    """A job whose worker failed with a traceback that names a file under the data folder."""
    job = api.client().submit(task, "lora", backbone=BACKBONE)
    claimed = api.registry.claim_job("worker-1")
    assert claimed is not None and claimed.id == job.id
    try:
        open(api.settings.data_dir / "datasets" / "gone" / "train.jsonl")  # noqa: SIM115
    except OSError:
        api.registry.fail_job(job.id, "worker-1", traceback.format_exc(), retryable=False)
    return job.id


def test_job_events_show_the_traceback_to_admin_tokens_only(api: Api, toy_task: str):
    job_id = failed_job(api, toy_task)
    _, secret = api.registry.create_api_token("reader", scope="read")
    seen_by_reader = api.client(secret).events(job_id)
    seen_by_admin = api.client().events(job_id)
    assert [e.detail for e in seen_by_reader] == [None, None, None]
    assert seen_by_admin[-1].detail is not None and seen_by_admin[-1].detail.startswith("Traceback")
    assert str(api.settings.data_dir) in seen_by_admin[-1].detail  # the admin sees where it happened
    assert seen_by_reader[-1].reason == seen_by_admin[-1].reason
    assert "FileNotFoundError" in seen_by_reader[-1].reason and "Traceback" not in seen_by_reader[-1].reason


# --- the cap on queued jobs per token -------------------------------------------------------------------


def test_the_cap_on_queued_jobs_is_an_operator_setting(settings: Settings):
    assert Settings().max_queued_jobs_per_token == 10_000
    with Registry(settings=settings.model_copy(update={"max_queued_jobs_per_token": 3})) as registry:
        assert registry.max_queued_jobs_per_token == 3


def test_a_submit_past_the_tokens_queued_job_cap_is_429_naming_it_and_writes_nothing(api: Api, toy_task: str):
    api.registry.max_queued_jobs_per_token = 3
    writer = api.client(api.registry.create_api_token("writer")[1])
    first = writer.submit(toy_task, "lora", backbone=BACKBONE)
    writer.sweep(toy_task, ["bitfit"], seeds=[0, 1], backbone=BACKBONE)
    before = row_counts(api), audit_actions(api)
    for call in (
        lambda: writer.submit(toy_task, "lora", backbone=BACKBONE, seed=9),
        lambda: writer.sweep(toy_task, ["lora", "bitfit"], seeds=[5], backbone=BACKBONE),
    ):
        with pytest.raises(PeltAPIError) as refused:
            call()
        assert refused.value.status == 429, refused.value
        assert "PELT_MAX_QUEUED_JOBS_PER_TOKEN" in refused.value.message and "3" in refused.value.message
    assert (row_counts(api), audit_actions(api)) == before
    assert (
        api.client().submit(toy_task, "lora", backbone=BACKBONE, seed=9).submitted_by == "tests"
    )  # not capped
    writer.cancel(first.id)  # a cancelled job no longer waits: there is room for one more
    assert writer.submit(toy_task, "lora", backbone=BACKBONE, seed=10).submitted_by == "writer"
    assert {job.submitted_by for job in api.registry.list_jobs()} == {"writer", "tests"}


def test_the_same_idempotent_submit_again_is_not_counted_against_the_cap(api: Api, toy_task: str):
    api.registry.max_queued_jobs_per_token = 3
    writer = api.client(api.registry.create_api_token("writer")[1])
    jobs = [
        writer.submit(toy_task, "lora", backbone=BACKBONE, seed=seed, idempotency_key=f"k{seed}")
        for seed in range(3)
    ]
    again = writer.submit(toy_task, "lora", backbone=BACKBONE, seed=0, idempotency_key="k0")
    assert again.id == jobs[0].id and len(api.registry.list_jobs()) == 3


# --- the audit trail ------------------------------------------------------------------------------------


def test_the_audit_trail_records_who_did_what_and_only_admins_read_it(
    api: Api, toy_files: dict[str, Path], tmp_path: Path
):
    writer = api.client(api.registry.create_api_token("writer")[1])
    writer.register_task("toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    writer.register_task(
        "toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"]
    )  # no-op
    writer.register_method(tiny_lora_spec("tiny_lora"))
    job = writer.submit("toy", "lora", backbone=BACKBONE)
    sweep = writer.sweep("toy", ["lora", "bitfit"], backbone=BACKBONE)
    writer.cancel(job.id)
    writer.cancel(job.id)  # already cancelled: nothing changes, nothing recorded
    writer.cancel_sweep(sweep.id)
    for seed in (0, 1):
        api.store.register("toy", lora_delta(api, tmp_path / f"delta-{seed}", seed))
    composed = writer.compose("average", ["toy/1", "toy/2"], "soup")
    with pytest.raises(PeltAPIError):
        writer.submit("nope", "lora", backbone=BACKBONE)  # refused: not recorded
    assert audit_actions(api) == [
        *SET_UP,
        (None, "token.create", "writer"),
        ("writer", "task.register", "toy"),
        ("writer", "method.register", "tiny_lora"),
        ("writer", "job.submit", f"job {job.id}"),
        ("writer", "sweep.submit", f"sweep {sweep.id}"),
        ("writer", "job.cancel", f"job {job.id}"),
        ("writer", "sweep.cancel", f"sweep {sweep.id}"),
        ("writer", "delta.compose", f"soup version {composed.version}"),
    ]
    newest = api.client().audit(limit=2)
    assert [e.action for e in newest] == ["delta.compose", "sweep.cancel"]
    assert newest[0].detail["op"] == "average" and newest[1].detail == {"jobs": 2}
    assert [e.action for e in api.client().audit(limit=1, offset=1)] == ["sweep.cancel"]
    with pytest.raises(PeltAPIError) as refused:
        writer.audit()
    assert refused.value.status == 403 and "'admin' scope" in refused.value.message


def test_a_registration_the_registry_refuses_leaves_no_audit_event(api: Api, toy_files: dict[str, Path]):
    from services.registry.actor import acting_as

    writer = api.client(api.registry.create_api_token("writer")[1])
    before = audit_actions(api)
    with pytest.raises(PeltAPIError):
        writer.register_task(
            "toy", toy_files["train"], toy_files["validation"], text_fields=["no_such_column"]
        )
    with acting_as("someone"), pytest.raises(RegistryValidationError):
        api.registry.register_backbone("x", "", "sha256:0")
    assert audit_actions(api) == before


def lora_delta(api: Api, folder: Path, seed: int) -> Any:
    """A random rank-2 LoRA delta on the tiny backbone, saved to `folder`."""
    import torch

    from pelt_core.backbones import Backbone
    from pelt_core.delta import save_delta
    from pelt_core.methods import get_method
    from pelt_core.model import JobDelta

    backbone = Backbone.load(api.registry.get_backbone(BACKBONE).source)
    torch.manual_seed(seed)
    delta = JobDelta(get_method("lora", {"r": 2}), backbone, num_labels=2, label_names=["0", "1"])
    return save_delta(delta, backbone, folder).path
