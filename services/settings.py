"""The one settings object of the service, read from `PELT_*` environment variables.

PELT_DATA_DIR             where the embedded stores live (default ~/.pelt)
PELT_DATABASE_URL         the registry (default: SQLite file <data_dir>/registry.db)
PELT_MLFLOW_TRACKING_URI  MLflow (default: SQLite file <data_dir>/mlflow.db; http(s)://…: a tracking server)
PELT_MLFLOW_ARTIFACT_ROOT MLflow artifacts of an SQLite/database store (default: <data_dir>/mlartifacts);
                          a tracking server decides where its artifacts go
PELT_RAY_ADDRESS          unset: start a local Ray
PELT_API_URL, PELT_API_TOKEN   client side (the token also from <data_dir>/api_token, which `pelt serve` writes)
PELT_CLIENT_RETRIES, PELT_CLIENT_RETRY_SECONDS   the client's tries again of one request (default 5, 0: none)
                          and the seconds they may wait in all (default 60), after a 503 with Retry-After, a
                          connection that could not be made, and, for requests safe to repeat, a lost answer
PELT_API_HOST, PELT_API_PORT   where `pelt serve` listens (default 127.0.0.1:8000)
PELT_MAX_REQUEST_BYTES, PELT_MAX_UPLOAD_BYTES   bounds on a JSON body and on a dataset upload
PELT_MAX_DATASET_ROWS     rows one split of a task's data may hold (default 5,000,000); beyond: 413
PELT_MAX_DATASET_BYTES    bytes a task's data may decode or unpack to (archives; Parquet with a repeated text
                          counted once per row; default 4 GiB); beyond: 413, and a worker refuses such a split
PELT_MAX_ARCHIVE_ENTRIES  files and folders one dataset archive may hold (default 1,000); beyond: 413
PELT_MAX_ARCHIVE_EXPANSION   unpacked bytes per archive byte (default 50; an archive may always unpack to
                          16 MiB); counted while it unpacks, beyond: 413
PELT_DATASET_PROBE_MEMORY_BYTES, PELT_DATASET_PROBE_TIMEOUT_SECONDS   limits of the child process that reads
                          an uploaded task's data (default PELT_MAX_DATASET_BYTES + 2 GiB, which it must exceed: a
                          split is memory-mapped whole; 300 s); beyond them (or a crash): 422
PELT_DATASET_PROBE_CONCURRENCY   uploads whose data are unpacked and checked at once (each in a child of up to
                          PELT_DATASET_PROBE_MEMORY_BYTES; default: as many as the API's memory holds beside 2 GiB
                          for the API itself, 1 to 2: one in an 8 GiB pod); beyond: 503 with Retry-After
PELT_BACKBONE_DIRS        folders whose model folders may be registered as backbones (os.pathsep-separated
                          or a JSON list; default none: only the packaged backbones); never PELT_DATA_DIR
PELT_MAX_BACKBONE_PARAMETERS   largest backbone registered, in parameters estimated from its config
PELT_BACKBONE_LOAD_MEMORY_BYTES, PELT_BACKBONE_LOAD_TIMEOUT_SECONDS   limits of the child process that
                          loads a backbone being registered
PELT_COMPOSE_MEMORY_BYTES, PELT_COMPOSE_TIMEOUT_SECONDS   a composition's memory for its deltas (default 4 GiB): one
                          estimated above it (its sources' stored sizes x the op's working factor) is refused
                          (413) before anything is loaded; it is computed in a child process whose address
                          space is this + the backbone's weights + 3 GiB of runtime, within the time limit
                          (default 600 s); beyond either: 413 / 422, nothing written
PELT_COMPOSE_CONCURRENCY  compositions computed at once (default 2, each in its own child); beyond: 503 with
                          Retry-After
PELT_SANDBOX_WARM_SECONDS  how long the warm child that forks those checking, loading and composing
                          children stays after its last use (default 300; it holds their kind's imports, up
                          to ~250 MB; 0: a fresh interpreter each time, ~0.3-2 s more per upload or composition)
PELT_API_DOCS             serve /docs and /redoc (assets from a CDN) and an open /openapi.json (default off:
                          /openapi.json then needs a token)
PELT_API_HEADER_TIMEOUT_SECONDS   close a connection whose request head is not complete within this time
PELT_API_BODY_IDLE_TIMEOUT_SECONDS   close a connection whose request body stops arriving: no byte of it for
                          this time (default 60; an idle timeout, not a bound on a whole upload)
PELT_API_MIN_UPLOAD_BYTES_PER_SECOND, PELT_API_MIN_UPLOAD_RATE_WINDOW_SECONDS   close a connection whose
                          request body arrives slower than this rate over the client's last window (default
                          1024 bytes/s over 30 s, judged after the first 30 s; 0: no minimum rate)
PELT_API_SEND_IDLE_TIMEOUT_SECONDS   close a connection whose client stops reading its answer: nothing of
                          it taken for this time while the server has more to send (default 60)
PELT_API_MAX_CONNECTIONS  connections (and requests in progress) `pelt serve` takes; beyond: 503
PELT_API_MAX_UNAUTHENTICATED_CONNECTIONS   of them, connections that have not yet sent a valid token
                          (default 100; keep it well below PELT_API_MAX_CONNECTIONS); a new one beyond closes
                          the oldest idle one
PELT_MAX_QUEUED_JOBS_PER_TOKEN   queued jobs one API token may have at once; a submit beyond: 429
PELT_MAX_SWEEP_JOBS       jobs one sweep may queue (methods x seeds x K values); beyond: 422
PELT_WORKER_MEMORY_BYTES  a worker's memory for one job: a job whose estimate (backbone, parameters with AdamW
                          state, activations; pelt_core.limits.estimate_job_memory) is above it is refused at
                          submission, and failed by a worker whose own budget it exceeds (default: the memory
                          of the process's machine, pelt_core.limits.machine_memory_bytes: the least of physical
                          memory, the cgroup's limit and RLIMIT_AS; each worker reads its own machine's)
PELT_PREDICT_REPLICAS, PELT_PREDICT_CPUS_PER_REPLICA, PELT_PREDICT_THREADS   the prediction endpoint's replicas
                          per backbone (default 1), the CPUs Ray reserves for each (default 0: they share the
                          node with the training workers) and the threads of each (default 1)
PELT_PREDICT_GPUS_PER_REPLICA   the GPU share Ray reserves for each prediction replica (default 0: the replica
                          holds its backbone on the CPU; above 0, at most 1: on its GPU, so replicas land only
                          on GPU nodes; 0.5 puts two replicas on one GPU)
PELT_PREDICT_RESOURCE     a Ray custom resource each prediction replica takes one unit of, so that the replicas
                          run only on the nodes started with it (`ray start --resources '{"pelt_predict": 100}'`:
                          deploy/'s serving nodes); default none: any node
PELT_PREDICT_MAX_DELTAS, PELT_PREDICT_MAX_DELTA_BYTES   the deltas one replica holds at most, by count and by
                          bytes (default 64 and 1 GiB; the least recently used go first)
PELT_PREDICT_MAX_QUEUED   predictions in flight in one API process, and waiting at the replicas (default 256);
                          beyond: 503 with Retry-After
PELT_PREDICT_RESOLVE_SECONDS   how long the version that answered a task (its best, an alias) answers before it
                          is resolved again (default 2; 0: at every request): a new best is served within it
PELT_PREDICT_TIMEOUT_SECONDS   how long a prediction may take (default 120; beyond: 503, the call cancelled); the
                          first request of a backbone waits this long for its replicas to start
PELT_LEASE_SECONDS, PELT_HEARTBEAT_SECONDS, PELT_MAX_ATTEMPTS,
PELT_RETRY_BACKOFF_SECONDS, PELT_RETRY_BACKOFF_MAX_SECONDS, PELT_DB_BUSY_TIMEOUT_SECONDS   queue knobs
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pelt_core import limits
from pelt_core.limits import (
    DEFAULT_COMPOSE_MEMORY_BYTES,
    DEFAULT_MAX_SWEEP_JOBS,
    MAX_BACKBONE_PARAMETERS,
    machine_memory_bytes,
)


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
    client_retries: int = Field(default=5, ge=0, le=100, description="the client's tries again of a request")
    client_retry_seconds: float = Field(
        default=60.0, gt=0, le=3600, description="how long the client's tries again of one request may wait"
    )
    api_token: SecretStr | None = Field(default=None, description="bearer token for the API")
    api_host: str = Field(default="127.0.0.1", description="address `pelt serve` listens on")
    api_port: int = Field(default=8000, ge=0, le=65535, description="port `pelt serve` listens on")
    max_request_bytes: int = Field(default=1 << 20, gt=0, description="largest JSON request body")
    max_upload_bytes: int = Field(default=1 << 30, gt=0, description="largest dataset upload (all files)")
    max_dataset_rows: int = Field(
        default=limits.MAX_DATASET_ROWS, gt=0, description="rows one split of a task's data may hold"
    )
    max_dataset_bytes: int = Field(
        default=limits.MAX_DATASET_BYTES,
        gt=0,
        description="bytes a task's data may decode to: an unpacked archive, decoded Parquet (all splits)",
    )
    max_archive_entries: int = Field(
        default=limits.MAX_ARCHIVE_ENTRIES, gt=0, description="files and folders one dataset archive may hold"
    )
    max_archive_expansion: float = Field(
        default=limits.MAX_ARCHIVE_EXPANSION,
        gt=0,
        description="unpacked bytes per archive byte (an archive may always unpack to "
        "limits.ARCHIVE_EXPANSION_FLOOR_BYTES), counted while it unpacks",
    )
    dataset_probe_memory_bytes: int = Field(
        default=0,
        ge=0,
        description="address-space limit of the child process that reads an uploaded task's data (the probe); "
        "0: max_dataset_bytes + limits.DATASET_PROBE_MEMORY_HEADROOM_BYTES (2 GiB); must exceed max_dataset_bytes "
        "(a split is memory-mapped whole)",
    )
    dataset_probe_concurrency: int = Field(
        default=0,
        ge=0,
        description="uploads whose data are unpacked and checked at once, each with a probe of up to "
        "dataset_probe_memory_bytes; an upload beyond them is a 503 with Retry-After; 0: as many as this "
        "machine's memory (its cgroup limit included) holds beside API_MEMORY_RESERVE_BYTES, 1 to "
        "limits.DEFAULT_DATASET_PROBE_CONCURRENCY",
    )
    dataset_probe_timeout_seconds: float = Field(
        default=300.0, gt=0, description="time limit of the child process that reads an uploaded task's data"
    )
    backbone_dirs: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="folders whose model folders may be registered as backbones (os.pathsep-separated or a JSON "
        "list); nothing under data_dir ever is",
    )
    max_backbone_parameters: int = Field(
        default=MAX_BACKBONE_PARAMETERS,
        ge=1,
        le=MAX_BACKBONE_PARAMETERS,
        description="largest backbone registered, in parameters estimated from its config",
    )
    backbone_load_memory_bytes: int = Field(
        default=8 << 30, gt=0, description="address-space limit of the child process that loads a backbone"
    )
    backbone_load_timeout_seconds: float = Field(
        default=600.0, gt=0, description="time limit of the child process that loads a backbone"
    )
    compose_memory_bytes: int = Field(
        default=DEFAULT_COMPOSE_MEMORY_BYTES,
        ge=1,
        description="memory one composition may use for its deltas: one estimated above it is refused before "
        "anything is loaded; its child process's address space is this + the backbone's weights + the runtime",
    )
    compose_timeout_seconds: float = Field(
        default=600.0, gt=0, description="time limit of the child process that computes a composition"
    )
    compose_concurrency: int = Field(
        default=2,
        ge=1,
        description="compositions computed at once; one beyond them is a 503 with Retry-After",
    )
    predict_replicas: int = Field(default=1, ge=1, le=64, description="prediction replicas per backbone")
    predict_cpus_per_replica: float = Field(
        default=0.0, ge=0, description="CPUs Ray reserves for each prediction replica (0: shared)"
    )
    predict_gpus_per_replica: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="GPU share Ray reserves for each prediction replica (0: the replica runs on the CPU)",
    )
    predict_resource: str | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="a Ray custom resource each prediction replica takes one unit of (the serving nodes')",
    )
    predict_threads: int = Field(
        default=1, ge=1, le=256, description="torch threads of each prediction replica"
    )
    predict_max_deltas: int = Field(
        default=64, ge=1, description="deltas one prediction replica holds at most"
    )
    predict_max_delta_bytes: int = Field(
        default=1 << 30, gt=0, description="bytes of the deltas one prediction replica holds at most"
    )
    predict_max_queued: int = Field(
        default=256, ge=1, description="predictions in flight in an API process and waiting at the replicas"
    )
    predict_resolve_seconds: float = Field(
        default=2.0,
        ge=0,
        le=3600,
        description="how long a resolved version answers a task's predictions before it is resolved again",
    )
    predict_timeout_seconds: float = Field(
        default=120.0, gt=0, description="how long one prediction (or a backbone's replicas' start) may take"
    )
    sandbox_warm_seconds: float = Field(
        default=300.0,
        ge=0,
        description="how long a warm child of each sandboxed kind (dataset check, backbone load, composition) "
        "stays after its last use; 0: a fresh interpreter every time",
    )
    api_docs: bool = Field(
        default=False,
        description="serve /docs and /redoc (assets from a CDN) and /openapi.json without a token",
    )
    api_header_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="close a connection whose request head is not complete within this time",
    )
    api_body_idle_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="close a connection whose request body stops arriving: no byte of it for "
        "this time (an idle timeout between reads: a slow upload whose bytes keep coming is never cut off)",
    )
    api_min_upload_bytes_per_second: float = Field(
        default=1024.0,
        ge=0,
        description="close a connection whose request body arrives slower than this over the client's last "
        "api_min_upload_rate_window_seconds (time the server holds the body back not counted); 0: no minimum",
    )
    api_min_upload_rate_window_seconds: float = Field(
        default=30.0,
        gt=0,
        description="the window of the minimum upload rate, and its grace: a body is judged once awaited this long",
    )
    api_send_idle_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="close a connection whose client reads nothing of its answer for this time while the "
        "server has more to send (an idle timeout: a slow reader that keeps reading is never cut off)",
    )
    api_max_connections: int = Field(
        default=1000, ge=1, description="connections and requests in progress the API takes; beyond them: 503"
    )
    api_max_unauthenticated_connections: int = Field(
        default=100,
        ge=1,
        description="connections that have not yet sent a valid token the API keeps open; a new one beyond "
        "them closes the oldest idle one (keep it well below api_max_connections)",
    )
    max_queued_jobs_per_token: int = Field(
        default=10_000,
        ge=1,
        description="queued jobs one API token may have at once; a submit beyond them: 429",
    )
    max_sweep_jobs: int = Field(
        default=DEFAULT_MAX_SWEEP_JOBS,
        ge=1,
        le=100_000,
        description="jobs one sweep may queue (its insert holds SQLite's write lock: keep it short)",
    )
    worker_memory_bytes: int = Field(
        default_factory=machine_memory_bytes,
        ge=1 << 20,
        description="a worker's memory for one job (default: this machine's memory); a job estimated above "
        "it is refused at submission",
    )

    lease_seconds: float = Field(default=60.0, gt=0, description="how long a claim lasts without a heartbeat")
    heartbeat_seconds: float = Field(default=15.0, gt=0, description="how often a worker renews its lease")
    idle_worker_seconds: float | None = Field(
        default=None,
        gt=0,
        description="the dispatcher stops a worker idle this long while nothing of its kind is queued, so "
        "that an autoscaled node can go (default: workers stay warm; `pelt dispatcher --idle-worker-seconds`)",
    )
    max_attempts: int = Field(default=3, ge=1, description="default attempts per job before it fails")
    retry_backoff_seconds: float = Field(
        default=5.0, ge=0, description="first retry delay; doubles per attempt"
    )
    retry_backoff_max_seconds: float = Field(default=600.0, ge=0, description="cap on the retry delay")
    db_busy_timeout_seconds: float = Field(
        default=30.0, gt=0, description="SQLite: wait this long for a lock"
    )

    @field_validator("backbone_dirs", mode="before")
    @classmethod
    def _split_path_list(cls, value: Any) -> Any:
        """PELT_BACKBONE_DIRS as a path list (`/srv/models:/opt/models`) or a JSON list."""
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            return json.loads(value)
        return [part for part in value.split(os.pathsep) if part.strip()]

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        self.backbone_dirs = [folder.expanduser().resolve() for folder in self.backbone_dirs]
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'registry.db'}"
        if not self.mlflow_tracking_uri:
            self.mlflow_tracking_uri = f"sqlite:///{self.data_dir / 'mlflow.db'}"
        if not self.mlflow_artifact_root:
            self.mlflow_artifact_root = str(self.data_dir / "mlartifacts")
        if not self.dataset_probe_memory_bytes:
            self.dataset_probe_memory_bytes = (
                self.max_dataset_bytes + limits.DATASET_PROBE_MEMORY_HEADROOM_BYTES
            )
        elif self.dataset_probe_memory_bytes <= self.max_dataset_bytes:
            raise ValueError(
                "PELT_DATASET_PROBE_MEMORY_BYTES must exceed PELT_MAX_DATASET_BYTES: the probe "
                "memory-maps a split whole"
            )
        if not self.dataset_probe_concurrency:  # probes that fit beside the API in its memory (its pod's)
            room = (machine_memory_bytes() - API_MEMORY_RESERVE_BYTES) // self.dataset_probe_memory_bytes
            self.dataset_probe_concurrency = max(1, min(limits.DEFAULT_DATASET_PROBE_CONCURRENCY, room))
        return self


API_MEMORY_RESERVE_BYTES = 2 << 30  # what the API process keeps for itself beside its dataset probes


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once; `get_settings.cache_clear()` re-reads the environment)."""
    return Settings()


__all__ = ["Settings", "get_settings"]
