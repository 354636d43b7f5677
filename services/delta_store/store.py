"""MLflow as the delta store: every job a run, every delta a model version, pull by task name, compose.

Layout in MLflow (namespace `pelt` by default, so several installations can share one server):

    experiment  pelt/<task>    one run per job: params (method, backbone, training config, method spec),
                               per-epoch metrics (step = epoch), final metrics (`final/<name>`), sizes and
                               times, tags pelt.job_id / task / method / backbone / sweep_id / attempt, and
                               the artifacts delta/ (delta.safetensors + manifest.json), job.json, history.json
    model       pelt.<task>    one version per successful job (source runs:/<run>/delta), tagged with the
                               job id, method, kind and the sha256 of delta.safetensors; composed deltas are
                               versions too (kind composed / multi_task, with provenance tags)
    aliases     best, best-<method>   the task's best version on its primary metric, overall and per method

`MlflowDeltaStore` is the one class users call; its parts live in modules of one subject each:

    base.py       the connection, pickling for Ray, names, the MLflow look-ups every part shares
    sink.py       the DeltaSink: store, complete_job, finalize_job, reconcile (idempotency: its docstring)
    aliases.py    sync_aliases: best / best-<method> as a projection of the registry's leaderboard
    reading.py    list_versions, get_version, download (sha256-checked), pull (onto the backbone)
    composing.py  compose (merge, average, merge_lora_svd, multi_task), register
    compose_child.py  the service's compositions: refused from an estimate, computed in a child process
    values.py     tags, name rules and the values handed out: DeltaRef, VersionInfo, Composed

The files of a delta and of a multi-task bundle are `pelt_core.delta_format`'s; a pulled version is a
`pelt_core.pulled.PulledModel`. Everything torch-related is imported inside functions: importing
`services.delta_store` stays light.
"""

from __future__ import annotations

from services.delta_store.composing import ComposeMixin


class MlflowDeltaStore(ComposeMixin):
    """The `DeltaSink` of the service, plus pull by task name, aliases and composition (module docstring).

    tracking_uri: PELT_MLFLOW_TRACKING_URI by default (SQLite under PELT_DATA_DIR); an `http(s)://` URI is an
    MLflow server, which decides where artifacts go; for a database URI they go under `artifact_root`
    (default PELT_MLFLOW_ARTIFACT_ROOT). registry: the registry whose result rows seal jobs and drive
    the aliases. namespace: prefix of experiment and model names. ensure: create/upgrade MLflow's
    schema now (the service start does it once; by default the store only checks it). backbones:
    already loaded backbones to reuse; backbone_loader: name -> Backbone for the others
    (default `Backbone.load`), each loaded once per store.
    """


__all__ = ["MlflowDeltaStore"]
