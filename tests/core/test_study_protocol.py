"""UniPELT's low-resource protocol in the trainer (`dev_rows`, `patience`): a dev split drawn from the
training rows by seed, the best checkpoint by the task's metric, early stopping, and the evaluation data
as the test set, evaluated once with the best checkpoint."""

from __future__ import annotations

import datasets
import pytest
import torch

import pelt_core.pack
from pelt_core import TrainConfig, get_method
from pelt_core.config import ConfigError
from pelt_core.data import DataError, sample_study_split
from pelt_core.pack import Pack
from pelt_core.train import train
from tests.core.test_train import rows


def table(n: int = 48) -> datasets.Dataset:
    return datasets.Dataset.from_list([{**row, "id": i} for i, row in enumerate(rows(n))])


def test_the_study_split_takes_k_rows_then_the_next_dev_rows_by_seed():
    data = table(40)
    train_rows, dev = sample_study_split(data, 10, 12, seed=3)
    assert (len(train_rows), len(dev)) == (10, 12)
    assert not set(train_rows["id"]) & set(dev["id"])
    again = sample_study_split(data, 10, 12, seed=3)
    assert (again[0]["id"], again[1]["id"]) == (train_rows["id"], dev["id"])
    assert sample_study_split(data, 10, 12, seed=4)[1]["id"] != dev["id"]
    everything_else, dev = sample_study_split(data, None, 12, seed=3)  # K None: all rows but the dev split
    assert len(everything_else) == 28 and not set(everything_else["id"]) & set(dev["id"])
    with pytest.raises(DataError, match=r"dev_rows: K=30 training row\(s\) and a dev split of 12 .* 40"):
        sample_study_split(data, 30, 12, seed=0)


def test_patience_needs_a_dev_split():
    with pytest.raises(ConfigError, match="patience: early stopping needs a dev split"):
        TrainConfig(patience=3).validate()
    with pytest.raises(ConfigError, match="dev_rows"):
        TrainConfig.from_dict({"dev_rows": 0})


def protocol_job(backbone, test_data, **config):
    """A LoRA job under the protocol in a pack of one, each epoch's delta kept by its step."""
    settings = {"epochs": 6, "batch_size": 8, "seed": 0, "bf16": "false", "learning_rate": 5e-2}
    settings |= {"k_shot": 24, "dev_rows": 16} | config
    pack = Pack(backbone)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    member = pack.join(
        get_method("lora"),
        table(),
        test_data,
        TrainConfig(**settings),
        on_epoch_end=lambda record: snapshots.update(
            {record["step"]: {k: v.clone() for k, v in member.delta.state_dict().items()}}
        ),
        metric="loss",
    )
    while not member.done:
        pack.step()
    if member.error is not None:
        raise member.error
    return member.result, snapshots


def test_the_best_dev_checkpoint_is_kept_and_the_test_set_is_evaluated_with_it(make_backbone):
    _, dev = sample_study_split(table(), 24, 16, seed=0)  # the test set: the dev rows again
    result, snapshots = protocol_job(make_backbone("bert"), dev)
    losses = [record["loss"] for record in result.history]
    best = result.history[losses.index(min(losses))]
    assert best["step"] < result.history[-1]["step"]  # the last epoch was not the best: a real choice
    assert result.dev_metrics == best and not result.stopped_early
    kept = result.delta.state_dict()
    assert all(torch.equal(kept[name], snapshots[best["step"]][name]) for name in kept)
    # the test set is the dev split here, so its metrics are the best dev evaluation's, not the last one's
    assert result.metrics == pytest.approx({k: v for k, v in best.items() if k not in ("epoch", "step")})


def test_patience_stops_a_job_whose_dev_metric_stops_improving(make_backbone):
    result, _ = protocol_job(make_backbone("bert"), None, learning_rate=1e-9, patience=2)
    assert result.stopped_early
    assert len(result.history) == 3  # the first evaluation, then two without improvement
    assert result.steps == 3 * 3 < 6 * 3  # 24 rows at batch 8: 3 steps an epoch, of 6 epochs
    assert result.dev_metrics == result.history[0]
    # no test set: the result's metrics are the best dev evaluation's
    assert result.metrics == {k: v for k, v in result.history[0].items() if k not in ("epoch", "step")}


def test_a_plain_job_keeps_its_last_evaluation_and_has_no_dev_metrics(make_backbone):
    data = table()
    result = train(
        make_backbone("bert"),
        get_method("lora"),
        data,
        data,
        TrainConfig(epochs=2, batch_size=8, bf16="false", k_shot=24),
    )
    assert result.dev_metrics == {} and not result.stopped_early
    assert result.metrics == {k: v for k, v in result.history[-1].items() if k not in ("epoch", "step")}


def test_the_protocol_evaluates_its_dev_split_every_epoch():
    with pytest.raises(ConfigError, match="eval_every_epoch: the study protocol"):
        TrainConfig(dev_rows=10, eval_every_epoch=False).validate()


def test_a_job_that_leaves_its_test_set_out_trains_the_same_and_reports_only_its_dev_metrics(
    make_backbone, monkeypatch
):
    backbone = make_backbone("bert")
    _, test_set = sample_study_split(table(), 24, 16, seed=0)
    tested, _ = protocol_job(backbone, test_set, epochs=2)
    encoded = {}  # the splits each job encoded: one that leaves its test set out never reads it
    original = pelt_core.pack.encode_split
    monkeypatch.setattr(
        pelt_core.pack, "encode_split", lambda *a: encoded.update({a[-1]: a[-2]}) or original(*a)
    )
    untested, _ = protocol_job(backbone, test_set, epochs=2, evaluate_test=False)
    assert encoded["test data"] is None and untested.metrics == {}
    assert untested.dev_metrics == tested.dev_metrics and untested.history == tested.history
    assert tested.metrics  # the same job with its test set evaluated it
    kept, other = untested.delta.state_dict(), tested.delta.state_dict()
    assert all(torch.equal(kept[name], other[name]) for name in kept)


def test_only_the_protocol_can_leave_a_test_set_out_and_the_switch_is_a_boolean():
    with pytest.raises(ConfigError, match="evaluate_test: only the study protocol has a test set"):
        TrainConfig(evaluate_test=False).validate()
    with pytest.raises(ConfigError, match="evaluate_test: must be true or false"):
        TrainConfig(dev_rows=10, evaluate_test="no").validate()
    assert TrainConfig.from_dict({"dev_rows": 10, "evaluate_test": "false"}).evaluate_test is False
