"""Serving many tasks' deltas over one frozen backbone: a bounded cache of loaded deltas, and a predictor
that answers a mixed stream of requests (different tasks, versions and methods) with one backbone forward
per batch of rows, each row through its own delta's modules (`MultiTaskModel`'s routed forward, the one
the training packs use).

A request names a `DeltaKey`: a task's version as the registry resolved it, with the sha256 it recorded.
A new version of a task (a new best) is a new key, so it is served from its first request while the old
one ages out of the cache. The cache loads a key on its first use through the `load` function it is given
(which checks the file against the key's sha256: a delta that fails the check raises, is never cached,
and fails only the requests that named it; the failure is remembered for `retry_seconds`, so a bad
version is not downloaded again at every request) and evicts the least recently used deltas beyond a
count and a byte bound.

Torch-free at import (the model code loads when a predictor runs): the service names keys without
loading torch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pelt_core.backbones import Backbone
    from pelt_core.model import JobDelta

Text = str | tuple[str, str]  # a text, or a (text, text_pair) pair (as pelt_core.predictions)
LOAD, INPUT, FORWARD = "load", "input", "forward"  # where a request failed
PADDING_SLACK = 1.25  # a forward's padded tokens at most this times its rows' own (the packs' rule, pack.py)


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
    (a delta larger than `max_bytes` alone is still served, as the only one held). A key whose load failed
    raises the same error again for `retry_seconds` without loading. Thread-safe: loads are serialized,
    so two requests for a new key load it once."""

    def __init__(
        self,
        load: Callable[[DeltaKey], JobDelta],
        max_count: int = 64,
        max_bytes: int = 1 << 30,
        retry_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_count < 1 or max_bytes < 1:
            raise ValueError(f"max_count and max_bytes must be positive, got {max_count} and {max_bytes}")
        self._load, self.max_count, self.max_bytes = load, max_count, max_bytes
        self.retry_seconds, self._clock = retry_seconds, clock
        self._held: OrderedDict[DeltaKey, tuple[JobDelta, int]] = OrderedDict()
        self._failed: dict[DeltaKey, tuple[float, Exception]] = {}
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._held

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes()

    def held_keys(self) -> list[DeltaKey]:
        """Held keys, least recently used first."""
        with self._lock:
            return list(self._held)

    def get(self, key: DeltaKey) -> JobDelta:
        """The delta of `key`, loaded on its first use; raises what `load` raised (nothing is cached)."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
                self.stats.hits += 1
                return held[0]
            failed = self._failed.get(key)
            if failed is not None and self._clock() < failed[0]:
                raise failed[1]
            try:
                delta = self._load(key).eval()
            except Exception as exc:
                self.stats.failed_loads += 1
                self._failed[key] = (self._clock() + self.retry_seconds, exc)
                raise
            self._failed.pop(key, None)
            self.stats.loads += 1
            self._held[key] = (delta, delta_bytes(delta))
            while len(self._held) > 1 and (
                len(self._held) > self.max_count or self._bytes() > self.max_bytes
            ):
                self._held.popitem(last=False)
                self.stats.evictions += 1
            return delta

    def _bytes(self) -> int:
        return sum(size for _, size in self._held.values())


@dataclass
class Request:
    """Rows to predict for one delta: single texts, or (text, text_pair) pairs for a pair task."""

    key: DeltaKey
    texts: Sequence[Text]


@dataclass(frozen=True)
class Failure:
    """Why a request got no predictions: where it failed (`LOAD`, `INPUT` or `FORWARD`) and the error."""

    phase: str
    error: Exception


class MixedPredictor:
    """Answers requests for any mix of deltas on one backbone: every row of a call goes through the one
    backbone, `batch_rows` rows per forward (rows of similar length together), whatever delta each row
    names."""

    def __init__(
        self, backbone: Backbone, cache: DeltaCache, batch_rows: int = 64, max_length: int = 128
    ) -> None:
        self.backbone, self.cache, self.batch_rows, self.max_length = backbone, cache, batch_rows, max_length

    def predict(
        self, requests: Sequence[Request], forward_lock: threading.Lock | None = None
    ) -> list[list[dict] | Failure]:
        """Per request, in order: its rows' predictions (`pelt_core.predictions`' format), or the Failure
        that stopped it: its delta failed to load, its texts do not fit its task, or its own rows failed
        in the forward (a shared forward that fails is run again request by request, so one request's
        failure never fails another's rows). Deltas load before `forward_lock` is taken: a download does
        not hold up the forwards of deltas already loaded."""
        from pelt_core.predictions import check_text_form

        answers: list[list[dict] | Failure] = [[] for _ in requests]
        deltas: dict[DeltaKey, JobDelta] = {}
        for position, request in enumerate(requests):
            try:
                if request.key not in deltas:
                    deltas[request.key] = self.cache.get(request.key)
                delta = deltas[request.key]
            except Exception as exc:
                answers[position] = Failure(LOAD, exc)
                continue
            try:
                check_text_form(request.texts, delta.text_fields, f"{request.key} text")
            except ValueError as exc:
                answers[position] = Failure(INPUT, exc)
        ready = [p for p, answer in enumerate(answers) if isinstance(answer, list)]
        with forward_lock or contextlib.nullcontext():
            try:
                rows = self._forward([requests[p] for p in ready], deltas)
            except Exception:
                rows = None
            if rows is None:  # again one request at a time: the failure is that request's own
                rows = []
                for position in ready:
                    try:
                        rows.append(self._forward([requests[position]], deltas)[0])
                    except Exception as exc:
                        answers[position] = Failure(FORWARD, exc)
                ready = [p for p in ready if isinstance(answers[p], list)]
        for position, predictions in zip(ready, rows, strict=True):
            answers[position] = predictions
        return answers

    def _lengths(self, texts: Sequence[Text]) -> list[int]:
        """Tokens of each row as the model will see it (truncated to `max_length`): one tokenizer call for
        the single texts and one for the pairs."""
        tokenizer, options = self.backbone.tokenizer, {"truncation": True, "max_length": self.max_length}
        lengths = [0] * len(texts)
        singles = [i for i, t in enumerate(texts) if isinstance(t, str)]
        pairs = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if singles:
            encoded = tokenizer([texts[i] for i in singles], **options)["input_ids"]
            for i, ids in zip(singles, encoded, strict=True):
                lengths[i] = len(ids)
        if pairs:
            encoded = tokenizer([texts[i][0] for i in pairs], [texts[i][1] for i in pairs], **options)[
                "input_ids"
            ]
            for i, ids in zip(pairs, encoded, strict=True):
                lengths[i] = len(ids)
        return lengths

    def _forward(self, requests: Sequence[Request], deltas: dict[DeltaKey, JobDelta]) -> list[list[dict]]:
        from pelt_core.compose_serving import MultiTaskModel

        if not requests:
            return []
        routes = {key: f"d{index}" for index, key in enumerate(dict.fromkeys(r.key for r in requests))}
        model = MultiTaskModel(self.backbone, {routes[key]: deltas[key] for key in routes}).eval()
        items = [(routes[request.key], text) for request in requests for text in request.texts]
        # forwards of rows of similar length: a short row padded to a long pair's length would cost as much
        # as the pair; the answers go back in the requests' order
        rows: list[dict] = [{}] * len(items)
        for group in length_groups(self._lengths([text for _, text in items]), self.batch_rows):
            answered = model.predict(
                [items[i] for i in group], batch_size=len(group), max_length=self.max_length
            )
            for position, row in zip(group, answered, strict=True):
                rows[position] = row
        answers, start = [], 0
        for request in requests:
            block = rows[start : start + len(request.texts)]
            answers.append([{k: v for k, v in row.items() if k != "task"} for row in block])
            start += len(request.texts)
        return answers


def length_groups(lengths: Sequence[int], max_rows: int, slack: float = PADDING_SLACK) -> list[list[int]]:
    """Indices of rows in groups that share one forward: longest first, a row joins the group while padding
    the group to its longest costs at most `slack` x the group's own tokens, up to `max_rows` rows."""
    groups: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            group = groups[-1]
            padded = lengths[group[0]] * (len(group) + 1)
            if len(group) < max_rows and padded <= slack * (tokens + lengths[i]):
                group.append(i)
                tokens += lengths[i]
                continue
        groups.append([i])
        tokens = lengths[i]
    return groups


def describe_failure(failure: Failure) -> dict[str, Any]:
    """A failure as plain data (it crosses processes): {"phase", "type", "error"}."""
    return {"phase": failure.phase, "type": type(failure.error).__name__, "error": str(failure.error)}


__all__ = [
    "FORWARD",
    "INPUT",
    "LOAD",
    "CacheStats",
    "DeltaCache",
    "DeltaKey",
    "Failure",
    "MixedPredictor",
    "Request",
    "delta_bytes",
    "describe_failure",
    "length_groups",
]
