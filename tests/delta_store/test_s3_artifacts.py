"""Deltas on S3-compatible object storage (what MLflow advises for artifacts in production), against a local
S3 emulator (moto's server on loopback): through an MLflow server whose artifacts go to a bucket
(`--artifacts-destination s3://...`, the deployment's option) and through the embedded store with
PELT_MLFLOW_ARTIFACT_ROOT=s3://...; a job's delta is stored, its files are in the bucket, it is pulled by task
name and checked against its sha256, and an object changed in the bucket is refused."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.delta_store import DeltaIntegrityError, MlflowDeltaStore
from services.delta_store.bootstrap import ensure_store
from services.delta_store.testing import MlflowServer, free_port
from services.registry.testing import sqlite_url
from tests.delta_store.conftest import run_job

pytestmark = pytest.mark.slow  # an S3 emulator, and an MLflow server process
BUCKET = "pelt-artifacts"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "pelt-test",
    "AWS_SECRET_ACCESS_KEY": "pelt-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """moto's S3 on 127.0.0.1 with an empty bucket; the variables MLflow's S3 client reads to reach it."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    environment = {**CREDENTIALS, "MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    boto3.client("s3", endpoint_url=environment["MLFLOW_S3_ENDPOINT_URL"]).create_bucket(Bucket=BUCKET)
    try:
        yield environment
    finally:
        server.stop()


def bucket_keys(environment: dict[str, str]) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=environment["MLFLOW_S3_ENDPOINT_URL"])
    return [item["Key"] for item in client.list_objects_v2(Bucket=BUCKET).get("Contents", [])]


def change_object(environment: dict[str, str], key: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=environment["MLFLOW_S3_ENDPOINT_URL"])
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=key, Body=body[:-8] + b"changed!")


def stored_pulled_and_checked(store: MlflowDeltaStore, registry, trained, environment) -> None:
    delta = trained["lora-0"]
    run_job(store, registry, delta, accuracy=0.8)
    keys = bucket_keys(environment)
    files = [key for key in keys if key.endswith("/delta.safetensors")]
    assert files, keys
    assert any(key.endswith("/manifest.json") for key in keys)
    model = store.pull("sst2")  # by task name: the best, downloaded from the bucket and sha256-checked
    assert len(model.predict(["good great", "bad awful"])) == 2
    for key in files:  # the run's copy (and the model version's, where MLflow keeps one)
        change_object(environment, key)
    with pytest.raises(DeltaIntegrityError, match="sha256"):
        store.pull("sst2")


def test_an_mlflow_server_with_its_artifacts_in_a_bucket_stores_and_serves_deltas(
    s3, registry, trained, backbone, tmp_path: Path
):
    backend = sqlite_url(tmp_path / "mlflow.db")
    ensure_store(backend, str(tmp_path / "unused"))
    server = MlflowServer(backend, f"s3://{BUCKET}/mlflow", tmp_path / "server.log", environment=s3)
    url = server.start(timeout=150)
    try:
        for name in s3:  # the clients reach the bucket only through the server
            os.environ.pop(name, None)
        store = MlflowDeltaStore(url, None, registry=registry, namespace="s3", backbones=[backbone])
        stored_pulled_and_checked(store, registry, trained, s3)
    finally:
        server.stop()


def test_the_embedded_store_with_an_s3_artifact_root_stores_and_pulls_deltas(
    s3, registry, trained, backbone, tmp_path
):
    backend = sqlite_url(tmp_path / "mlflow.db")
    ensure_store(backend, f"s3://{BUCKET}/embedded")  # `pelt mlflow upgrade` (no folder made for an s3 root)
    store = MlflowDeltaStore(backend, f"s3://{BUCKET}/embedded", registry=registry, backbones=[backbone])
    stored_pulled_and_checked(store, registry, trained, s3)
