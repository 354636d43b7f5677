"""Serving many deltas over one backbone (pelt_core.serving): a mixed stream of requests answers each row
as its delta alone would, one request's failure stays its own, and the cache holds what its bounds allow,
least recently used out first."""

from __future__ import annotations

import random

import pytest

from pelt_core import get_method
from pelt_core.delta_format import DeltaError
from pelt_core.model import JobDelta, PeltModel, predict
from pelt_core.serving import (
    FORWARD,
    INPUT,
    LOAD,
    DeltaCache,
    DeltaKey,
    Failure,
    MixedPredictor,
    Request,
    delta_bytes,
)

from .conftest import trained_like


def make(backbone, method, seed, num_labels=2, text_fields=("sentence",), **kwargs) -> JobDelta:
    spec = get_method(*method) if isinstance(method, tuple) else get_method(method)
    delta = trained_like(JobDelta(spec, backbone, num_labels=num_labels, **kwargs), seed)
    delta.text_fields = tuple(text_fields)
    return delta


def key(task: str, version: int = 1) -> DeltaKey:
    return DeltaKey(task, version, f"{task}-{version}-sha")


class Loads:
    """A `load` for the cache over a dict of deltas, counting what it loaded."""

    def __init__(self, deltas: dict[DeltaKey, JobDelta]):
        self.deltas, self.loaded = deltas, []

    def __call__(self, wanted: DeltaKey) -> JobDelta:
        self.loaded.append(wanted)
        if wanted not in self.deltas:
            raise DeltaError(f"{wanted}: sha256 does not match the recorded {wanted.sha256}")
        return self.deltas[wanted]


def assert_same(result: dict, alone: dict) -> None:
    assert result.keys() == alone.keys()
    for name, value in result.items():
        assert (
            value == alone[name] if isinstance(value, str) else value == pytest.approx(alone[name], abs=1e-5)
        )


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_requests_for_mixed_methods_are_answered_as_each_delta_alone_would(family, make_backbone):
    backbone = make_backbone(family)
    deltas = {
        key("sentiment"): make(backbone, ("lora", {"r": 2}), 1, label_names=["neg", "pos"]),
        key("topic"): make(backbone, ("pfeiffer", {"size": 4}), 2, num_labels=3),
        key("nli"): make(
            backbone, ("prefix", {"size": 3, "reparam_hidden": "none"}), 3, 3, ("premise", "hypothesis")
        ),
        key("score"): make(backbone, "bitfit", 4, num_labels=1, problem_type="regression"),
        key("mixture"): make(backbone, "unipelt", 5),
    }
    requests = [
        Request(key("sentiment"), ["the movie was good", "bad film , not fun"]),
        Request(key("topic"), ["a film"]),
        Request(key("nli"), [("the film", "a movie"), ("good", "bad")]),
        Request(key("score"), ["great fun", "awful"]),
        Request(key("mixture"), ["the very boring movie"]),
        Request(key("sentiment"), ["great"]),
    ]
    random.Random(0).shuffle(requests)
    predictor = MixedPredictor(backbone, DeltaCache(Loads(deltas)), batch_rows=4)  # forwards of mixed rows

    answers = predictor.predict(requests)

    for request, answer in zip(requests, answers, strict=True):
        alone = predict(PeltModel(backbone, deltas[request.key]).eval(), list(request.texts))
        assert len(answer) == len(alone)
        for result, expected in zip(answer, alone, strict=True):
            assert_same(result, expected)


def test_a_request_whose_delta_fails_to_load_or_whose_texts_do_not_fit_fails_alone(make_backbone):
    backbone = make_backbone()
    good = make(backbone, "bitfit", 1)
    pairs = make(backbone, "bitfit", 2, text_fields=("premise", "hypothesis"))
    loads = Loads({key("good"): good, key("pairs"): pairs})
    predictor = MixedPredictor(backbone, DeltaCache(loads))

    answers = predictor.predict(
        [
            Request(key("tampered"), ["a film"]),
            Request(key("good"), ["a film", "another"]),
            Request(key("pairs"), ["a single text"]),
        ]
    )

    assert answers[0].phase == LOAD and isinstance(answers[0].error, DeltaError)
    assert "sha256" in str(answers[0].error)
    assert [row["label"] for row in answers[1]] == [
        r["label"] for r in predict(PeltModel(backbone, good), ["a film", "another"])
    ]
    assert answers[2].phase == INPUT and "premise, hypothesis" in str(answers[2].error)
    assert key("tampered") not in predictor.cache  # a delta that failed its check is never held


def test_a_failed_load_is_not_tried_again_until_its_retry_time(make_backbone):
    backbone = make_backbone()
    now = [0.0]
    loads = Loads({key("good"): make(backbone, "bitfit", 1)})
    cache = DeltaCache(loads, retry_seconds=30, clock=lambda: now[0])
    for _ in range(3):
        with pytest.raises(DeltaError, match="sha256"):
            cache.get(key("tampered"))
    assert loads.loaded.count(key("tampered")) == 1  # not downloaded again at every request
    now[0] = 31.0
    with pytest.raises(DeltaError):
        cache.get(key("tampered"))
    assert loads.loaded.count(key("tampered")) == 2 and cache.stats.failed_loads == 2


def test_a_request_whose_rows_fail_in_the_forward_fails_alone(make_backbone, monkeypatch):
    backbone = make_backbone()
    good, broken = make(backbone, "bitfit", 1), make(backbone, "lora", 2)
    predictor = MixedPredictor(backbone, DeltaCache(Loads({key("good"): good, key("broken"): broken})))

    def fail(*args, **kwargs):
        raise RuntimeError("bad head")

    monkeypatch.setattr(broken.head, "forward", fail)
    answers = predictor.predict(
        [Request(key("broken"), ["a film"]), Request(key("good"), ["a film", "more"])]
    )

    assert (
        isinstance(answers[0], Failure)
        and answers[0].phase == FORWARD
        and "bad head" in str(answers[0].error)
    )
    alone = predict(PeltModel(backbone, good), ["a film", "more"])
    assert [r["label"] for r in answers[1]] == [r["label"] for r in alone]


def test_naming_a_delta_loads_no_torch():
    import subprocess
    import sys

    code = "import sys, pelt_core.serving; assert 'torch' not in sys.modules, 'torch loaded'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_cache_loads_once_and_evicts_the_least_recently_used_beyond_its_count(make_backbone):
    backbone = make_backbone()
    deltas = {key(task): make(backbone, "bitfit", seed) for seed, task in enumerate("abc")}
    loads = Loads(deltas)
    cache = DeltaCache(loads, max_count=2)

    cache.get(key("a"))
    cache.get(key("b"))
    cache.get(key("a"))  # a is now the most recently used
    cache.get(key("c"))  # evicts b

    assert cache.held_keys() == [key("a"), key("c")]
    assert loads.loaded == [key("a"), key("b"), key("c")]
    assert (cache.stats.hits, cache.stats.loads, cache.stats.evictions) == (1, 3, 1)
    assert cache.get(key("b")) is deltas[key("b")] and loads.loaded[-1] == key("b")


def test_the_cache_keeps_within_its_bytes_and_a_new_version_is_a_new_entry(make_backbone):
    backbone = make_backbone()
    first, second = make(backbone, "lora", 1), make(backbone, "lora", 2)
    size = delta_bytes(first)
    loads = Loads({key("t", 1): first, key("t", 2): second})
    cache = DeltaCache(loads, max_bytes=size + size // 2)  # room for one

    assert cache.get(key("t", 1)) is first
    assert cache.get(key("t", 2)) is second  # the new best: a new key, loaded at its first request
    assert cache.held_keys() == [key("t", 2)] and cache.bytes == size
    assert DeltaCache(loads, max_bytes=1).get(key("t", 1)) is first  # too big alone: served, held alone


def test_the_cache_bounds_are_positive():
    with pytest.raises(ValueError, match="positive"):
        DeltaCache(lambda key: None, max_count=0)


def test_rows_share_a_forward_only_while_padding_them_to_the_longest_stays_within_the_slack():
    from pelt_core.serving import length_groups

    lengths = [10, 100, 12, 98, 11, 30]
    groups = length_groups(lengths, max_rows=64)
    assert groups == [[1, 3], [5], [2, 4, 0]]  # the long pairs together, the short texts together
    assert all(len(group) <= 2 for group in length_groups(lengths, max_rows=2))
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
