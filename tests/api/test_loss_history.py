"""GET /v1/jobs/{id}/loss: a job's loss curve as the registry keeps it (the points of its current
attempt), for any token that may read jobs; 401 without one, 404 for an unknown job."""

from __future__ import annotations

from fastapi.testclient import TestClient

from services.client import PeltClient
from tests.api.conftest import BACKBONE, Api
from tests.api.helpers import refused


def test_a_jobs_loss_curve_lists_the_step_and_loss_its_worker_reported(
    client: PeltClient, toy_task, api: Api
):
    job = client.submit(toy_task, "lora", backbone=BACKBONE)
    assert client.loss_history(job.id).model_dump() == {"job_id": job.id, "attempt": 0, "points": []}
    api.registry.claim_job("w1")
    for step, loss in [(1, 0.9), (2, 0.7), (2, 0.65), (3, 0.5)]:
        api.registry.heartbeat(job.id, "w1", progress={"step": step, "total": 10, "loss": loss})
    answer = client.http.get(f"/v1/jobs/{job.id}/loss")
    assert answer.status_code == 200
    assert answer.json() == {"job_id": job.id, "attempt": 1, "points": [[1, 0.9], [2, 0.7], [3, 0.5]]}
    assert client.loss_history(job.id).points == [(1, 0.9), (2, 0.7), (3, 0.5)]


def test_a_read_token_may_read_a_loss_curve(api: Api, toy_task):
    job = api.client().submit(toy_task, "lora", backbone=BACKBONE)
    _, reader = api.registry.create_api_token("reader", scope="read")
    assert api.client(reader).loss_history(job.id).job_id == job.id


def test_a_loss_curve_needs_a_valid_token_and_a_known_job(api: Api, client: PeltClient, toy_task):
    job = client.submit(toy_task, "lora", backbone=BACKBONE)
    path = f"/v1/jobs/{job.id}/loss"
    assert TestClient(api.app).get(path).status_code == 401  # no token
    assert api.client("pelt_not-a-token").http.get(path).status_code == 401
    refused(lambda: client.loss_history(999), 404, "job_id", "unknown job 999")
