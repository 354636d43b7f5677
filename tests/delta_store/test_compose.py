"""Composition of pulled deltas, registered as new versions and pulled back (the math: tests/core/test_compose.py)."""

from __future__ import annotations

import json

import pytest
import torch

from pelt_core import compose as pelt_compose
from pelt_core.compose import FoldedModel, MultiTaskModel
from services.delta_store import DeltaStoreError
from services.delta_store.values import TAG_OP, TAG_SOURCES

from .conftest import SST2_TEXTS, logits_of, run_job

TOPIC_TEXTS = ["w1 the w10", "w2 a w11", "w3 is w12", "w1 was"]


def lora_delta_weights(delta) -> dict:
    return {key: ops.parallel_x[0].delta_weight().detach() for key, ops in delta.linear_ops.items()}


def test_a_linear_merge_of_two_pulled_loras_is_the_weighted_sum_of_their_delta_w(
    store, registry, trained, backbone
):
    run_job(store, registry, trained["lora-0"], accuracy=0.6)
    run_job(store, registry, trained["lora-1"], accuracy=0.7)
    composed = store.compose("merge", ["sst2/1", "sst2/2"], into="sst2-merged", weights=[0.7, 0.3])

    first, second = (
        lora_delta_weights(store.pull("sst2/1").delta),
        lora_delta_weights(store.pull("sst2/2").delta),
    )
    pulled = store.pull("sst2-merged", version=composed.version)
    for key, delta_w in lora_delta_weights(pulled.delta).items():
        torch.testing.assert_close(delta_w, 0.7 * first[key] + 0.3 * second[key], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pulled.logits(SST2_TEXTS), logits_of(backbone, composed.delta))

    # registered like any other delta, with its provenance
    assert pulled.info.kind == "composed" and pulled.info.tags[TAG_OP] == "merge(linear)"
    sources = json.loads(pulled.info.tags[TAG_SOURCES])
    assert [(s["task"], s["version"]) for s in sources] == [("sst2", "1"), ("sst2", "2")]
    assert [s["sha256"] for s in sources] == [
        registry.get_result(1).delta_sha256,
        registry.get_result(2).delta_sha256,
    ]
    assert pulled.manifest["extra"]["composition"]["weights"] == [0.7, 0.3]
    assert [i["name"] for i in pulled.manifest["extra"]["composition"]["inputs"]] == ["sst2/1", "sst2/2"]
    run = store.client.get_run(pulled.info.run_id)
    assert run.data.params["op"] == "merge" and json.loads(run.data.params["sources"]) == ["sst2/1", "sst2/2"]
    assert store.list_tasks() == ["sst2", "sst2-merged"]
    assert store.reconcile("sst2-merged") == {}  # not a registry task: no best aliases, nothing dropped
    assert [v.version for v in store.list_versions("sst2-merged")] == [composed.version]


@pytest.mark.parametrize(
    ("op", "options"),
    [
        ("merge", {"how": "ties", "density": 0.5}),
        ("merge", {"how": "dare", "density": 0.5, "seed": 3}),
        ("average", {}),
    ],
)
def test_a_composition_round_trips_through_the_store(store, registry, trained, backbone, op, options):
    run_job(store, registry, trained["lora-0"], accuracy=0.6)
    run_job(store, registry, trained["lora-1"], accuracy=0.7)
    composed = store.compose(op, ["sst2@best-lora", "sst2/1"], into="sst2", aliases=["soup"], **options)

    # the store adds nothing to pelt_core's arithmetic on the pulled deltas
    inputs = [store.pull("sst2/2").delta, store.pull("sst2/1").delta]
    function = pelt_compose.merge if op == "merge" else pelt_compose.average
    expected = function(inputs, **options)
    pulled = store.pull("sst2", alias="soup")
    assert pulled.version == composed.version == "3"
    torch.testing.assert_close(pulled.logits(SST2_TEXTS), logits_of(backbone, expected), atol=1e-5, rtol=1e-5)
    assert store.pull("sst2").version == "2"  # the composed version does not take the task's `best`


def test_loras_of_different_ranks_merge_by_svd(store, registry, trained, backbone):
    run_job(store, registry, trained["lora-0"], accuracy=0.6)  # r = 2
    run_job(store, registry, trained["lora-r4"], accuracy=0.7)  # r = 4
    with pytest.raises(pelt_compose.CompositionError, match="merge_lora_svd"):
        store.compose("merge", ["sst2/1", "sst2/2"], into="sst2-svd")
    composed = store.compose(
        "merge_lora_svd", ["sst2/1", "sst2/2"], into="sst2-svd", weights=[0.5, 0.5], rank=6
    )

    pulled = store.pull("sst2-svd", version=composed.version)
    assert pulled.delta.method.modules["q"].size == 6
    small, large = (
        lora_delta_weights(store.pull("sst2/1").delta),
        lora_delta_weights(store.pull("sst2/2").delta),
    )
    for key, delta_w in lora_delta_weights(pulled.delta).items():  # rank 6 >= 2 + 4: exact
        torch.testing.assert_close(delta_w, 0.5 * small[key] + 0.5 * large[key], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pulled.logits(SST2_TEXTS), logits_of(backbone, composed.delta))


def test_a_multi_task_model_answers_each_task_as_its_own_model_does(store, registry, trained):
    run_job(store, registry, trained["lora-0"], accuracy=0.7)
    run_job(store, registry, trained["topic-lora"], accuracy=0.7)
    composed = store.compose("multi_task", {"sst2": "sst2", "topic": "topic"}, into="sst2-topic")

    served = store.pull("sst2-topic", version=composed.version)
    assert isinstance(served.model, MultiTaskModel) and served.info.kind == "multi_task"
    assert set(served.deltas) == {"sst2", "topic"}
    alone = {"sst2": store.pull("sst2"), "topic": store.pull("topic")}
    for task, texts in (("sst2", SST2_TEXTS), ("topic", TOPIC_TEXTS)):
        torch.testing.assert_close(
            served.logits(texts, task=task), alone[task].logits(texts), atol=1e-6, rtol=1e-5
        )

    mixed = [("sst2", SST2_TEXTS[0]), ("topic", TOPIC_TEXTS[0]), ("sst2", SST2_TEXTS[1])]  # one backbone pass
    answers = served.predict(mixed)
    assert [a["task"] for a in answers] == ["sst2", "topic", "sst2"]
    assert [a["label"] for a in answers] == [alone[t].predict([x])[0]["label"] for t, x in mixed]
    with pytest.raises(DeltaStoreError, match="another one"):
        store.compose("multi_task", {"both": f"sst2-topic/{composed.version}", "sst2": "sst2"}, into="nested")


def test_a_folded_lora_gives_the_unfolded_logits(store, registry, trained):
    run_job(store, registry, trained["lora-0"], accuracy=0.7)
    folded, unfolded = store.pull("sst2", fold=True), store.pull("sst2")
    assert isinstance(folded.model, FoldedModel)
    torch.testing.assert_close(folded.logits(SST2_TEXTS), unfolded.logits(SST2_TEXTS), atol=1e-5, rtol=1e-5)
    assert [p["label"] for p in folded.predict(SST2_TEXTS)] == [
        p["label"] for p in unfolded.predict(SST2_TEXTS)
    ]


def test_best_aliases_are_the_registrys_to_set(store, registry, trained):
    run_job(store, registry, trained["lora-0"], accuracy=0.7)
    with pytest.raises(DeltaStoreError, match="sync_aliases"):
        store.compose("average", ["sst2/1", "sst2/1"], into="sst2", aliases=["best"])
