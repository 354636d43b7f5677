"""Serving many deltas over one backbone (pelt_core.serving): a mixed stream of requests answers each row
as its delta alone would, one request's failure stays its own, and the cache holds what its bounds allow,
least recently used out first."""

from __future__ import annotations

import random

import pytest

from pelt_core import get_method
from pelt_core.delta_format import DeltaError
from pelt_core.model import JobDelta, PeltModel, predict
from pelt_core.serving import DeltaCache, DeltaKey, MixedPredictor, Request, delta_bytes

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

    assert isinstance(answers[0], DeltaError) and "sha256" in str(answers[0])
    assert [row["label"] for row in answers[1]] == [
        r["label"] for r in predict(PeltModel(backbone, good), ["a film", "another"])
    ]
    assert isinstance(answers[2], ValueError) and "premise, hypothesis" in str(answers[2])
    assert key("tampered") not in predictor.cache  # a delta that failed its check is never held
    predictor.predict([Request(key("tampered"), ["again"])])
    assert loads.loaded.count(key("tampered")) == 2  # and is checked again next time


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


def test_dropping_forgets_the_versions_no_longer_served(make_backbone):
    backbone = make_backbone()
    loads = Loads({key("t", 1): make(backbone, "bitfit", 1), key("u", 1): make(backbone, "bitfit", 2)})
    cache = DeltaCache(loads)
    cache.get(key("t", 1))
    cache.get(key("u", 1))

    assert cache.drop(lambda held: held.task != "t") == [key("t", 1)]
    assert cache.held_keys() == [key("u", 1)]
    with pytest.raises(ValueError, match="positive"):
        DeltaCache(loads, max_count=0)
