"""What the service tells a token holder about its own machine (issue #11, finding 8): nothing.

Error messages name fields and user-visible names, never a server path or a store URI; a failed job's
`last_error` is the exception's message on one line, without a traceback or paths (the traceback is in
the service log and, for admin tokens only, in the job's events); /docs and /redoc are off unless the
operator turns them on, and the OpenAPI schema needs a token.
"""

from __future__ import annotations

import io
import json
import tempfile
import traceback
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.api.app import create_app
from tests.api.conftest import BACKBONE, Api


def secrets_of_the_machine(api: Api) -> list[str]:
    """What no answer may contain: the data folder, the temporary folder, the stores' URIs and files."""
    return [
        str(api.settings.data_dir),
        str(api.settings.data_dir.parent),
        tempfile.gettempdir() + "/",
        api.settings.mlflow_tracking_uri,
        api.settings.database_url,
        "mlflow.db",
        "registry.db",
        "mlartifacts",
        "Traceback",
        'File "',
    ]


def assert_tells_nothing(api: Api, text: str) -> None:
    for secret in secrets_of_the_machine(api):
        assert secret not in text, (secret, text)


def error_responses(api: Api, toy_task: str, tiny_bert_dir: Path) -> dict[str, object]:
    """A set of refused requests, one per kind of error a route can give."""
    http = TestClient(api.app)
    auth = {"Authorization": f"Bearer {api.token}"}
    missing = api.settings.data_dir / "models" / "nowhere"
    bad_rows = io.BytesIO(b'{"sentence": "fine", "label": 1}\n{"sentence": \n')
    return {
        "deltas of a task without versions": http.get("/v1/tasks/toy/deltas/info", headers=auth),
        "deltas of an unknown task": http.get("/v1/tasks/nope/deltas", headers=auth),
        "download of an unknown version": http.get("/v1/tasks/toy/deltas/download?version=7", headers=auth),
        "compose of unknown deltas": http.post(
            "/v1/compose", headers=auth, json={"op": "merge", "sources": ["nope/1", "toy/3"], "into": "x"}
        ),
        "a backbone from a missing folder": http.post(
            "/v1/backbones", headers=auth, json={"name": "mine", "source": str(missing)}
        ),
        "a backbone from the data folder": http.post(
            "/v1/backbones", headers=auth, json={"name": "mine2", "source": str(api.settings.data_dir)}
        ),
        "a job on an unknown backbone": http.post(
            "/v1/jobs", headers=auth, json={"task": toy_task, "method": "lora", "backbone": "nope"}
        ),
        "a job on an unknown task": http.post(
            "/v1/jobs", headers=auth, json={"task": "nope", "method": "lora"}
        ),
        "a broken data file": http.post(
            "/v1/tasks",
            headers=auth,
            data={"name": "broken", "definition": json.dumps({"text_fields": ["sentence"]})},
            files={"train": ("train.jsonl", bad_rows)},
        ),
        "an unknown job's result": http.get("/v1/jobs/77/result", headers=auth),
        "a method spec that does not build": http.post(
            "/v1/methods", headers=auth, json={"spec": {"name": "odd", "modules": {"x": {"form": "cube"}}}}
        ),
    }


def test_error_responses_name_no_server_path_or_store_uri(api: Api, toy_task: str, tiny_bert_dir: Path):
    for what, response in error_responses(api, toy_task, tiny_bert_dir).items():
        assert 400 <= response.status_code < 500, (what, response.status_code, response.text)
        assert_tells_nothing(api, response.text)
        assert response.json()["error"]["message"], what


def test_the_delta_stores_404_names_the_task_not_the_store(api: Api):
    from services.delta_store import DeltaNotFoundError

    with pytest.raises(DeltaNotFoundError) as missing:
        api.store.get_version("nope")
    assert "nope" in str(missing.value) and api.settings.mlflow_tracking_uri not in str(missing.value)
    assert "sqlite" not in str(missing.value)


def fail_with_a_traceback(api: Api, task: str, *, retryable: bool = False) -> int:
    job = api.client().submit(task, "lora", backbone=BACKBONE)
    assert api.registry.claim_job("worker-1") is not None
    try:
        with open(api.settings.data_dir / "datasets" / "0123abcd" / "train.jsonl"):
            pass
    except OSError:
        api.registry.fail_job(job.id, "worker-1", traceback.format_exc(), retryable=retryable)
    return job.id


def test_a_failed_jobs_error_is_the_exceptions_message_on_one_line_without_paths(api: Api, toy_task: str):
    job_id = fail_with_a_traceback(api, toy_task)
    job = api.registry.get_job(job_id)
    assert job.status == "failed"
    assert job.last_error is not None and "\n" not in job.last_error
    assert job.last_error.startswith("FileNotFoundError: [Errno 2] No such file or directory")
    assert job.last_error.endswith("…/train.jsonl'")
    _, reader = api.registry.create_api_token("reader", scope="read")
    client = api.client(reader)
    for text in (
        job.last_error,
        client.http.get(f"/v1/jobs/{job_id}/progress").text,
        client.http.get(f"/v1/jobs/{job_id}/events").text,
        client.http.get("/v1/jobs").text,
    ):
        assert_tells_nothing(api, text)


def test_a_retried_jobs_events_keep_the_traceback_for_admins(api: Api, toy_task: str):
    job_id = fail_with_a_traceback(api, toy_task, retryable=True)
    event = api.registry.job_events(job_id)[-1]
    assert event.to_status == "queued" and "FileNotFoundError" in event.reason
    assert_tells_nothing(api, event.reason)
    assert event.detail is not None and event.detail.startswith("Traceback (most recent call last)")


def test_a_one_line_error_without_paths_is_kept_as_it_is(api: Api, toy_task: str):
    job = api.client().submit(toy_task, "lora", backbone=BACKBONE)
    api.registry.claim_job("worker-1")
    failed = api.registry.fail_job(job.id, "worker-1", "CUDA out of memory", retryable=False)
    assert failed.last_error == "CUDA out of memory"
    assert api.registry.job_events(job.id)[-1].detail is None


def test_docs_and_redoc_are_off_by_default_and_the_schema_needs_a_token(api: Api):
    http = TestClient(api.app)
    assert http.get("/docs").status_code == 404 and http.get("/redoc").status_code == 404
    refused = http.get("/openapi.json")
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
    schema = http.get("/openapi.json", headers={"Authorization": f"Bearer {api.token}"})
    assert schema.status_code == 200 and "/v1/jobs" in schema.json()["paths"]
    assert http.get("/health").status_code == 200


def test_the_operator_can_turn_the_docs_on(api: Api):
    settings = api.settings.model_copy(update={"api_docs": True})
    http = TestClient(create_app(api.operations, settings))
    assert http.get("/docs").status_code == 200 and http.get("/redoc").status_code == 200
    assert http.get("/openapi.json").status_code == 200
    assert http.get("/v1/tasks").status_code == 401


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("no such file: '/srv/pelt/datasets/ab12/train.jsonl'", "no such file: '…/train.jsonl'"),
        (
            "no task 'x' in the MLflow store sqlite:////srv/pelt/mlflow.db",
            "no task 'x' in the MLflow store sqlite://…",
        ),
        (
            "the MLflow server http://mlflow:5000 does not answer",
            "the MLflow server http://… does not answer",
        ),
        (
            "version models:/pelt.toy/3 (runs:/abc/delta), lr 1/2, attn/ffn, GET /v1/tasks/x",
            "version models:/pelt.toy/3 (runs:/abc/delta), lr 1/2, attn/ffn, GET /v1/tasks/x",
        ),
    ],
)
def test_redaction_cuts_paths_and_uris_and_keeps_what_users_named(text: str, shown: str):
    from services.redaction import redact

    assert redact(text) == shown


def test_the_summary_of_a_chained_traceback_is_its_last_exception():
    from services.redaction import error_summary

    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise ValueError("outer\nsecond line at /srv/pelt/x/y.py") from inner
    except ValueError:
        summary = error_summary(traceback.format_exc())
    assert summary == "ValueError: outer second line at …/y.py"


def test_a_delta_kept_in_a_local_folder_is_not_shown_by_its_server_path(api: Api, toy_task: str):
    job = api.client().submit(toy_task, "lora", backbone=BACKBONE)
    api.registry.claim_job("worker-1")
    folder = api.settings.data_dir / "deltas" / toy_task / f"job-{job.id}"  # where `pelt dispatcher` keeps it
    api.registry.complete_job(
        job.id,
        "worker-1",
        {
            "metrics": {"accuracy": 0.5},
            "trainable_params": 10,
            "total_params": 1000,
            "train_seconds": 1.0,
            "delta_uri": folder.as_uri(),
            "delta_sha256": "0" * 64,
        },
    )
    http, auth = TestClient(api.app), {"Authorization": f"Bearer {api.token}"}
    result = http.get(f"/v1/jobs/{job.id}/result", headers=auth)
    board = http.get(f"/v1/tasks/{toy_task}/leaderboard", headers=auth)
    assert result.status_code == 200 and board.status_code == 200
    assert result.json()["delta_uri"] == f"file://…/job-{job.id}"
    assert board.json()["rows"][0]["best_delta_uri"] == f"file://…/job-{job.id}"
    for response in (result, board):
        assert_tells_nothing(api, response.text)
