"""The one settings object: PELT_* environment variables, defaults under the data directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.settings import Settings


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "DATA_DIR",
        "DATABASE_URL",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_ARTIFACT_ROOT",
        "RAY_ADDRESS",
        "API_URL",
        "API_TOKEN",
        "LEASE_SECONDS",
        "MAX_ATTEMPTS",
        "RETRY_BACKOFF_SECONDS",
    ):
        monkeypatch.delenv(f"PELT_{name}", raising=False)


def test_the_stores_default_to_files_under_the_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PELT_DATA_DIR", str(tmp_path))
    settings = Settings()
    assert settings.data_dir == tmp_path.resolve()
    assert settings.database_url == f"sqlite:///{tmp_path.resolve()}/registry.db"
    assert settings.mlflow_tracking_uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert settings.mlflow_artifact_root == str(tmp_path.resolve() / "mlartifacts")
    assert settings.ray_address is None


def test_the_data_dir_defaults_to_dot_pelt_in_the_home_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Settings().data_dir == (tmp_path / ".pelt").resolve()


def test_environment_variables_override_every_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PELT_DATABASE_URL", "postgresql+psycopg://pelt@db.internal/pelt")
    monkeypatch.setenv("PELT_RAY_ADDRESS", "ray://head:10001")
    monkeypatch.setenv("PELT_API_TOKEN", "s3cret")
    monkeypatch.setenv("PELT_LEASE_SECONDS", "120")
    monkeypatch.setenv("PELT_MAX_ATTEMPTS", "5")
    monkeypatch.setenv("PELT_RETRY_BACKOFF_SECONDS", "2.5")
    settings = Settings()
    assert settings.database_url == "postgresql+psycopg://pelt@db.internal/pelt"
    assert settings.ray_address == "ray://head:10001"
    assert settings.api_token is not None and settings.api_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)
    assert (settings.lease_seconds, settings.max_attempts, settings.retry_backoff_seconds) == (120.0, 5, 2.5)


def test_the_queue_knobs_have_the_documented_defaults() -> None:
    settings = Settings()
    assert (settings.lease_seconds, settings.max_attempts, settings.retry_backoff_seconds) == (60.0, 3, 5.0)


def test_a_nonsensical_queue_knob_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PELT_LEASE_SECONDS", "0")
    with pytest.raises(ValidationError, match="lease_seconds"):
        Settings()
