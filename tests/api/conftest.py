"""Fixtures of the API tests: the real app over a real service (SQLite registry and MLflow store in tmp,
fresh per test), called in-process through FastAPI's TestClient, with a token made in the registry.

Ray and the dispatcher are not involved here, except in test_end_to_end.py and test_page.py, which share
one whole service (`service`: `ApiServer` as `pelt serve` runs it), each on tasks of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from services.api.app import create_app
from services.client import PeltClient
from services.delta_store import MlflowDeltaStore
from services.operations import PeltOperations
from services.registry import Registry
from services.registry.testing import write_jsonl
from services.settings import Settings
from tests.data_templates import copy_migrated_data
from tests.workers.conftest import save_tiny_bert, toy_rows

BACKBONE = "tiny-bert"


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT, in a folder of its own: the backbone folder (PELT_BACKBONE_DIRS) of the tests."""
    folder = tmp_path_factory.mktemp("backbones") / "tiny-bert"
    folder.mkdir()
    save_tiny_bert(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_bert_hash(tiny_bert_dir: Path) -> str:
    """The tiny BERT's content hash (what registering it records), computed once."""
    from pelt_core.backbones import Backbone

    return Backbone.load(str(tiny_bert_dir)).content_hash


@pytest.fixture(scope="session")
def toy_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The toy sentiment task as JSON Lines, CSV and Parquet."""
    import pandas as pd

    folder = tmp_path_factory.mktemp("toy")
    train, validation = toy_rows(200, seed=0), toy_rows(40, seed=1)
    files = {
        "train": write_jsonl(folder / "train.jsonl", train),
        "validation": write_jsonl(folder / "validation.jsonl", validation),
    }
    pd.DataFrame(train).to_csv(folder / "train.csv", index=False)
    pd.DataFrame(validation).to_parquet(folder / "validation.parquet")
    files["train_csv"], files["validation_parquet"] = folder / "train.csv", folder / "validation.parquet"
    return files


@pytest.fixture(scope="package")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_bert_dir: Path) -> Iterator[Any]:
    """The whole service in this process (`ApiServer`: API on a loopback port, dispatcher, local Ray), the
    tiny backbone registered; started once for the end-to-end and page tests (each on tasks of its own,
    run one after the other in the cluster group: tests/tiers.py) and stopped when this folder's tests end,
    before another cluster test starts its own Ray."""
    from services.api.server import ApiServer
    from services.dispatcher import DispatcherConfig

    settings = Settings(
        data_dir=copy_migrated_data(tmp_path_factory.mktemp("service") / "data"),
        ray_address=None,
        lease_seconds=20,
        heartbeat_seconds=1,
        retry_backoff_seconds=0.2,
        backbone_dirs=[tiny_bert_dir.parent],
    )
    config = DispatcherConfig(
        namespace="api-service", heartbeat_seconds=1.0, poll_seconds=0.2, max_workers_per_node=2
    )
    running = ApiServer(settings, port=0, num_cpus=2, dispatcher_config=config).start()
    try:
        client = PeltClient(running.url, token=running.token, settings=running.settings)
        client.register_backbone(BACKBONE, str(tiny_bert_dir))
        yield running
    finally:
        running.stop()


@pytest.fixture
def settings(tmp_path: Path, tiny_bert_dir: Path) -> Settings:
    """A data folder of the test's own, copied from a migrated one (tests/data_templates.py)."""
    return Settings(
        data_dir=copy_migrated_data(tmp_path / "data"),
        ray_address=None,
        max_request_bytes=64 * 1024,
        max_upload_bytes=2 * 1024 * 1024,
        backbone_dirs=[tiny_bert_dir.parent],
        # each refusal reaches the test as the service answered it; the client's tries again are specified
        # in test_client_retries.py (and run with their defaults against `pelt serve` in other tests)
        client_retries=0,
    )


@dataclass
class Api:
    """The app under test and what it stands on."""

    app: Any
    operations: PeltOperations
    registry: Registry
    store: MlflowDeltaStore
    token: str
    settings: Settings

    def client(self, token: str | None = None) -> PeltClient:
        return PeltClient(
            "http://testserver", token=token or self.token, http=TestClient(self.app), settings=self.settings
        )

    def files(self) -> list[Path]:
        """Every file under the data folder except the two databases (and their journals)."""
        return sorted(
            p
            for p in self.settings.data_dir.rglob("*")
            if p.is_file() and not p.name.startswith(("registry.db", "mlflow.db"))
        )


@pytest.fixture
def api(settings: Settings, tiny_bert_dir: Path, tiny_bert_hash: str) -> Iterator[Api]:
    registry = Registry(settings=settings, lease_seconds=30, retry_backoff_seconds=0)
    store = MlflowDeltaStore.from_settings(settings, registry=registry)
    operations = PeltOperations(registry, store, settings=settings)
    registry.register_backbone(BACKBONE, str(tiny_bert_dir), tiny_bert_hash)
    _, token = registry.create_api_token("tests", scope="admin")  # like the local token `pelt serve` makes
    try:
        yield Api(create_app(operations, settings), operations, registry, store, token, settings)
    finally:
        registry.close()


@pytest.fixture
def client(api: Api) -> PeltClient:
    return api.client()


@pytest.fixture
def toy_task(client: PeltClient, toy_files: dict[str, Path]) -> str:
    client.register_task("toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    return "toy"
