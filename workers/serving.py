"""The prediction endpoint's replicas, on Ray Serve: one application per backbone, each replica holding
one copy of that backbone and a bounded cache of task deltas, answering a mixed stream of requests.

Requests that arrive together (`@serve.batch`) are answered together: their rows, whatever task, version
or method each names, go through one backbone forward per `batch_rows` rows, each row through its own
delta's modules (`pelt_core.serving.MixedPredictor`). A request names a `DeltaKey` (task, version,
sha256) that the service resolved from the registry; a replica loads a key it does not hold through the
`fetch` function it was built with (a download of the version's files) and checks the file against the
key's sha256 before it serves it (`pelt_core.delta.load_delta`): a file that fails the check fails the
requests that named it, and is never held (a download happens before the forward lock: it does not hold
up the answers of deltas already held). Ray Serve bounds each replica's requests in flight and the
requests waiting for one (`max_ongoing_requests`, `max_queued_requests`): beyond that a call is refused
at once (`ray.serve.exceptions.BackPressureError`), never queued without bound.

Torch loads in the replica, not in the process that deploys it.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve

APP_PREFIX = "pelt-predict"  # an application per backbone: pelt-predict-<namespace>-<backbone name>
MAX_BATCH_REQUESTS = 32  # requests answered together (their rows: `batch_rows` per backbone forward)
BATCH_WAIT_SECONDS = 0.0  # a batch is what queued while the replica was busy: no request waits for company


@dataclass(frozen=True)
class ReplicaConfig:
    """What a replica holds: its backbone (the registry's name, the source it loads, the content hash
    the deltas were trained on) and the bounds of its delta cache and its forwards."""

    backbone_name: str
    backbone_source: str
    content_hash: str
    max_deltas: int = 64
    max_delta_bytes: int = 1 << 30
    batch_rows: int = 64
    max_length: int = 128
    threads: int = 1
    device: str = "cpu"


def app_name(namespace: str, backbone: str) -> str:
    """The Serve application of a backbone for the pelt service of a Ray namespace (Serve's application
    names are the cluster's: two services on one cluster keep theirs apart)."""
    return f"{APP_PREFIX}-{namespace}-{backbone}"


class PredictReplica:
    """One replica: a backbone, a delta cache and the batching of requests across tasks."""

    def __init__(self, config: ReplicaConfig, fetch: Callable[[Any, Path], Path]) -> None:
        import torch

        from pelt_core.backbones import Backbone
        from pelt_core.errors import BackboneError
        from pelt_core.serving import DeltaCache, MixedPredictor

        torch.set_num_threads(max(1, config.threads))
        backbone = Backbone.load(config.backbone_source, device=config.device)
        if backbone.content_hash != config.content_hash:
            raise BackboneError(
                f"backbone {config.backbone_name!r} at {config.backbone_source!r} has content hash "
                f"{backbone.content_hash[:12]}…, not the registered {config.content_hash[:12]}…"
            )
        self.config, self.fetch, self.backbone = config, fetch, backbone
        self.cache = DeltaCache(self._load, max_count=config.max_deltas, max_bytes=config.max_delta_bytes)
        self.predictor = MixedPredictor(backbone, self.cache, config.batch_rows, config.max_length)
        # one forward at a time (it takes the replica's threads); loading a delta does not wait for it
        self._forward = threading.Lock()

    def _load(self, key: Any) -> Any:
        from pelt_core.delta import load_delta

        with tempfile.TemporaryDirectory(prefix="pelt-serve-") as scratch:
            folder = self.fetch(key, Path(scratch))
            delta = load_delta(folder, self.backbone, expected_sha256=key.sha256)
        return delta.to(next(self.backbone.model.parameters()).device)

    @serve.batch(max_batch_size=MAX_BATCH_REQUESTS, batch_wait_timeout_s=BATCH_WAIT_SECONDS)
    async def predict(self, requests: list[tuple[Any, list[Any]]]) -> list[dict[str, Any]]:
        """Answer (DeltaKey, texts) requests that arrived together: per request {"rows": predictions} or
        {"failure": {"phase", "type", "error"}} (`pelt_core.serving.describe_failure`)."""
        return await asyncio.to_thread(self._answer, requests)

    def _answer(self, requests: Sequence[tuple[Any, list[Any]]]) -> list[dict[str, Any]]:
        from pelt_core.serving import Request, describe_failure

        answers = self.predictor.predict([Request(key, texts) for key, texts in requests], self._forward)
        return [
            {"rows": answer} if isinstance(answer, list) else {"failure": describe_failure(answer)}
            for answer in answers
        ]

    def held(self) -> list[str]:
        """The versions this replica holds, least recently used first (`task/version`)."""
        return [str(key) for key in self.cache.held_keys()]


def predict_application(
    config: ReplicaConfig,
    fetch: Callable[[Any, Path], Path],
    *,
    replicas: int = 1,
    cpus_per_replica: float = 0.0,
    gpus_per_replica: float = 0.0,
    resource: str | None = None,
    max_ongoing_requests: int = 64,
    max_queued_requests: int = 256,
) -> Any:
    """The Serve application of one backbone, ready for `serve.run(app, name=app_name(...))`; each replica
    takes `cpus_per_replica` CPUs, `gpus_per_replica` of a GPU (its backbone then sits on that GPU: Ray
    shows the replica only the GPU it reserved) and, with `resource`, one unit of that Ray custom resource (only the nodes
    started with it hold replicas)."""
    deployment = serve.deployment(
        PredictReplica,
        name="predict",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        max_queued_requests=max_queued_requests,
        logging_config={"log_level": "WARNING", "enable_access_log": False},  # no line per request
        ray_actor_options={
            "num_cpus": cpus_per_replica,
            "num_gpus": gpus_per_replica,
            **({"resources": {resource: 1}} if resource else {}),
        },
    )
    if bool(gpus_per_replica) != (config.device != "cpu"):
        raise ValueError(
            f"a replica on device {config.device!r} with {gpus_per_replica} GPUs: a replica on a GPU reserves "
            "a share of one, and only such a replica holds its backbone on one"
        )
    return deployment.bind(config, fetch)


__all__ = ["APP_PREFIX", "PredictReplica", "ReplicaConfig", "app_name", "predict_application"]
