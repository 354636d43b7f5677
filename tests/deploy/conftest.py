"""Fixtures of tests/deploy: compose.yaml as Compose reads it, and deploy/k8s as kustomize builds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.deploy.deployment_files import K8S, SECRETS, load_compose, overlay_copy, render


@pytest.fixture(scope="package")
def overlays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "example": overlay_copy(tmp_path_factory.mktemp("example")),
        "external-database": overlay_copy(tmp_path_factory.mktemp("external"), external_database=True),
        "s3-artifacts": overlay_copy(tmp_path_factory.mktemp("s3"), s3_artifacts=True),
    }


@pytest.fixture(scope="package")
def builds(overlays: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """The rendered objects: the example overlay, the same with an external database, and the base."""
    return {name: render(folder) for name, folder in overlays.items()} | {"base": render(K8S / "base")}


@pytest.fixture(scope="package")
def cluster(builds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return builds["example"]


@pytest.fixture(scope="package")
def compose() -> dict[str, Any]:
    return load_compose(SECRETS, gpu_worker=True)
