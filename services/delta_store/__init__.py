"""MLflow as the delta store: every job a run, every delta a model version, pull by task name, compose.

    from services.delta_store import MlflowDeltaStore, ensure_store
    ensure_store()                                   # once, at service start (schema create/upgrade, locked)
    store = MlflowDeltaStore(registry=Registry())    # PELT_MLFLOW_TRACKING_URI, else SQLite under PELT_DATA_DIR
    model = store.pull("sst2")                       # the task's best delta on its backbone
    model.predict(["a great film"])
    store.compose("merge", ["sst2@best-lora", "sst2/7"], into="sst2-soup", how="ties", density=0.5)

Importing this package is light (no mlflow or torch import; pelt_core's pure-Python tables only); it
sets mlflow's quiet defaults (no telemetry) in the environment before anything imports mlflow.
The parts of the store: `services/delta_store/store.py`'s docstring.
"""

from pelt_core.pulled import PulledModel
from services.delta_store.bootstrap import (
    check_store,
    ensure_store,
    is_server_uri,
    quiet_mlflow,
    schema_revisions,
)
from services.delta_store.composing import check_compose_request
from services.delta_store.errors import (
    DeltaIntegrityError,
    DeltaNotFoundError,
    DeltaStoreError,
    StoreNotReadyError,
)
from services.delta_store.store import MlflowDeltaStore
from services.delta_store.values import BEST, Composed, DeltaRef, VersionInfo, method_alias

quiet_mlflow()

__all__ = [
    "BEST",
    "Composed",
    "DeltaIntegrityError",
    "DeltaNotFoundError",
    "DeltaRef",
    "DeltaStoreError",
    "MlflowDeltaStore",
    "PulledModel",
    "StoreNotReadyError",
    "VersionInfo",
    "check_compose_request",
    "check_store",
    "ensure_store",
    "is_server_uri",
    "method_alias",
    "quiet_mlflow",
    "schema_revisions",
]
