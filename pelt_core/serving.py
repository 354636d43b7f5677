"""Serving many tasks' deltas over one frozen backbone: a bounded cache of loaded deltas, and a predictor
that answers a mixed stream of requests (different tasks, versions and methods) with one backbone forward
per batch of rows, each row through its own delta's modules (`MultiTaskModel`'s routed forward, the one
the training packs use).

A request names a `DeltaKey`: a task's version as the registry resolved it, with the sha256 it recorded.
A new version of a task (a new best) is a new key, so it is served from its first request while the old
one ages out of the cache. The cache loads a key on its first use through the `load` function it is given
(which checks the file against the key's sha256: a delta that fails the check raises, is never cached,
and fails only the requests that named it) and evicts the least recently used deltas beyond a count and
a byte bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pelt_core.backbones import Backbone
from pelt_core.compose_serving import MultiTaskModel
from pelt_core.model import JobDelta
from pelt_core.predictions import Text, check_text_form


@dataclass(frozen=True)
class DeltaKey:
    """One servable delta: a task's version and the sha256 the registry recorded for its file."""

    task: str
    version: int
    sha256: str

    def __str__(self) -> str:
        return f"{self.task}/{self.version}"


def delta_bytes(delta: JobDelta) -> int:
    """The bytes of a delta's tensors (parameters and buffers)."""
    tensors = [*delta.parameters(), *delta.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class CacheStats:
    hits: int = 0
    loads: int = 0
    evictions: int = 0
    failed_loads: int = 0


class DeltaCache:
    """Loaded deltas by key, the least recently used evicted past `max_count` deltas or `max_bytes` bytes
    (a delta larger than `max_bytes` alone is still served, as the only one held). Thread-safe: loads are
    serialized, so two requests for a new key load it once."""

    def __init__(
        self, load: Callable[[DeltaKey], JobDelta], max_count: int = 64, max_bytes: int = 1 << 30
    ) -> None:
        if max_count < 1 or max_bytes < 1:
            raise ValueError(f"max_count and max_bytes must be positive, got {max_count} and {max_bytes}")
        self._load, self.max_count, self.max_bytes = load, max_count, max_bytes
        self._held: OrderedDict[DeltaKey, tuple[JobDelta, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self._held.values())

    def held_keys(self) -> list[DeltaKey]:
        """Held keys, least recently used first."""
        return list(self._held)

    def get(self, key: DeltaKey) -> JobDelta:
        """The delta of `key`, loaded on its first use; raises what `load` raised (nothing is cached)."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
                self.stats.hits += 1
                return held[0]
            try:
                delta = self._load(key).eval()
            except Exception:
                self.stats.failed_loads += 1
                raise
            self.stats.loads += 1
            self._held[key] = (delta, delta_bytes(delta))
            self._evict()
            return delta

    def drop(self, keep: Callable[[DeltaKey], bool]) -> list[DeltaKey]:
        """Forget every held key for which `keep(key)` is false (a version archived or deleted)."""
        with self._lock:
            gone = [key for key in self._held if not keep(key)]
            for key in gone:
                del self._held[key]
            return gone

    def _evict(self) -> None:
        while len(self._held) > 1 and (len(self._held) > self.max_count or self.bytes > self.max_bytes):
            self._held.popitem(last=False)
            self.stats.evictions += 1


@dataclass
class Request:
    """Rows to predict for one delta: single texts, or (text, text_pair) pairs for a pair task."""

    key: DeltaKey
    texts: Sequence[Text]


class MixedPredictor:
    """Answers requests for any mix of deltas on one backbone: every row of a call goes through the one
    backbone, `batch_rows` rows per forward, whatever delta each row names."""

    def __init__(
        self, backbone: Backbone, cache: DeltaCache, batch_rows: int = 64, max_length: int = 128
    ) -> None:
        self.backbone, self.cache, self.batch_rows, self.max_length = backbone, cache, batch_rows, max_length

    def predict(self, requests: Sequence[Request]) -> list[list[dict] | Exception]:
        """Per request, in order: its rows' predictions (`pelt_core.predictions`' format), or the error
        that stopped it (its delta failed to load or its texts do not fit its task); one request's error
        never fails another's rows."""
        routes: dict[DeltaKey, str] = {}
        deltas: dict[str, JobDelta] = {}
        answers: list[list[dict] | Exception] = [[] for _ in requests]
        items: list[tuple[str, Text]] = []
        owners: list[int] = []
        for position, request in enumerate(requests):
            try:
                if request.key not in routes:
                    delta = self.cache.get(request.key)
                    routes[request.key] = f"d{len(routes)}"
                    deltas[routes[request.key]] = delta
                delta = deltas[routes[request.key]]
                check_text_form(request.texts, delta.text_fields, f"{request.key} text")
            except Exception as exc:  # this request's own failure
                answers[position] = exc
                continue
            items.extend((routes[request.key], text) for text in request.texts)
            owners.extend([position] * len(request.texts))
        if items:
            model = MultiTaskModel(self.backbone, deltas).eval()
            rows = model.predict(items, batch_size=self.batch_rows, max_length=self.max_length)
            for owner, row in zip(owners, rows, strict=True):
                row.pop("task")
                answer = answers[owner]
                assert isinstance(answer, list)
                answer.append(row)
        return answers


__all__ = ["CacheStats", "DeltaCache", "DeltaKey", "MixedPredictor", "Request", "delta_bytes"]
