"""The one settings object of the service, read from `PELT_*` environment variables.

PELT_DATA_DIR             where the embedded stores live (default ~/.pelt)
PELT_DATABASE_URL         the registry (default: SQLite file <data_dir>/registry.db)
PELT_MLFLOW_TRACKING_URI  MLflow (default: SQLite file <data_dir>/mlflow.db; http(s)://…: a tracking server)
PELT_MLFLOW_ARTIFACT_ROOT MLflow artifacts of an SQLite/database store (default: <data_dir>/mlartifacts);
                          a tracking server decides where its artifacts go
PELT_RAY_ADDRESS          unset: start a local Ray
PELT_API_URL, PELT_API_TOKEN   client side (the token also from <data_dir>/api_token, which `pelt serve` writes)
PELT_API_HOST, PELT_API_PORT   where `pelt serve` listens (default 127.0.0.1:8000)
PELT_MAX_REQUEST_BYTES, PELT_MAX_UPLOAD_BYTES   bounds on a JSON body and on a dataset upload
PELT_LEASE_SECONDS, PELT_HEARTBEAT_SECONDS, PELT_MAX_ATTEMPTS,
PELT_RETRY_BACKOFF_SECONDS, PELT_RETRY_BACKOFF_MAX_SECONDS, PELT_DB_BUSY_TIMEOUT_SECONDS   queue knobs
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Service configuration; every field can be set by the environment variable PELT_<FIELD>."""

    model_config = SettingsConfigDict(env_prefix="PELT_", extra="ignore")

    data_dir: Path = Field(default=Path("~/.pelt"), description="where the embedded stores live")
    database_url: str = Field(default="", description="registry database; empty: SQLite under data_dir")
    mlflow_tracking_uri: str = Field(
        default="", description="MLflow tracking URI; empty: SQLite under data_dir"
    )
    mlflow_artifact_root: str = Field(
        default="",
        description="MLflow artifact root of a database store; empty: data_dir/mlartifacts (unused with a server)",
    )
    ray_address: str | None = Field(default=None, description="Ray cluster address; None starts a local Ray")
    api_url: str = Field(default="http://127.0.0.1:8000", description="the API's base URL (client side)")
    api_token: SecretStr | None = Field(default=None, description="bearer token for the API")
    api_host: str = Field(default="127.0.0.1", description="address `pelt serve` listens on")
    api_port: int = Field(default=8000, ge=0, le=65535, description="port `pelt serve` listens on")
    max_request_bytes: int = Field(default=1 << 20, gt=0, description="largest JSON request body")
    max_upload_bytes: int = Field(default=1 << 30, gt=0, description="largest dataset upload (all files)")

    lease_seconds: float = Field(default=60.0, gt=0, description="how long a claim lasts without a heartbeat")
    heartbeat_seconds: float = Field(default=15.0, gt=0, description="how often a worker renews its lease")
    max_attempts: int = Field(default=3, ge=1, description="default attempts per job before it fails")
    retry_backoff_seconds: float = Field(
        default=5.0, ge=0, description="first retry delay; doubles per attempt"
    )
    retry_backoff_max_seconds: float = Field(default=600.0, ge=0, description="cap on the retry delay")
    db_busy_timeout_seconds: float = Field(
        default=30.0, gt=0, description="SQLite: wait this long for a lock"
    )

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'registry.db'}"
        if not self.mlflow_tracking_uri:
            self.mlflow_tracking_uri = f"sqlite:///{self.data_dir / 'mlflow.db'}"
        if not self.mlflow_artifact_root:
            self.mlflow_artifact_root = str(self.data_dir / "mlartifacts")
        return self


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once; `get_settings.cache_clear()` re-reads the environment)."""
    return Settings()


__all__ = ["Settings", "get_settings"]
