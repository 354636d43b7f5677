"""The one-job trainer: reproducible, K-shot, progress and stop flag, clear errors; data in any common format."""

from __future__ import annotations

import json

import pytest
import torch

from pelt_core import TrainConfig, get_method
from pelt_core.config import ConfigError
from pelt_core.data import DataError, infer_task_fields, load_table, sample_k_shot
from pelt_core.methods import list_methods
from pelt_core.train import TrainingCancelled, TrainingError, train

POSITIVE = ["good movie", "great film", "a very good film", "fun movie", "great fun", "the film is good"]
NEGATIVE = ["bad movie", "awful film", "a very bad film", "boring movie", "not fun", "the film is awful"]


def rows(n: int = 48):
    data = [{"sentence": t, "label": 1} for t in POSITIVE] + [{"sentence": t, "label": 0} for t in NEGATIVE]
    return (data * (n // len(data) + 1))[:n]


def write(path, records, fmt):
    import pandas as pd

    frame = pd.DataFrame(records)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif fmt == "csv":
        frame.to_csv(path, index=False)
    elif fmt == "parquet":
        frame.to_parquet(path)
    elif fmt == "datasets":
        import datasets

        datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "datasets"])
def test_every_supported_format_loads_the_same_rows(fmt, tmp_path):
    path = write(tmp_path / f"train.{fmt}", rows(12), fmt)
    table = load_table(path)
    assert table.num_rows == 12 and set(table.column_names) == {"sentence", "label"}


def test_unreadable_and_unknown_files_are_named_in_the_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_table(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"sentence": "ok", "label": 1}\n{not json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl"):
        load_table(bad)
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(DataError, match=r"unsupported file type '\.txt'"):
        load_table(notes)


def test_fields_are_detected_from_glue_names_or_named_explicitly(tmp_path):
    pair = load_table(
        write(tmp_path / "p.jsonl", [{"sentence1": "a", "sentence2": "b", "label": 1}] * 3, "jsonl")
    )
    assert infer_task_fields(pair).text_fields == ("sentence1", "sentence2")
    odd = load_table(write(tmp_path / "o.jsonl", [{"body": "a", "stars": "good"}] * 3, "jsonl"))
    with pytest.raises(DataError, match="which column holds the text"):
        infer_task_fields(odd)
    with pytest.raises(DataError, match="label field 'rating'"):
        infer_task_fields(odd, text_fields=["body"], label_field="rating")
    task = infer_task_fields(odd, text_fields=["body"], label_field="stars")
    assert task.label_names == ["good"] and task.problem_type == "single_label_classification"


def test_k_shot_sampling_is_seeded_and_bounded(tmp_path):
    table = load_table(write(tmp_path / "t.jsonl", rows(40), "jsonl"))
    assert sample_k_shot(table, 8, seed=1)["sentence"] == sample_k_shot(table, 8, seed=1)["sentence"]
    assert sample_k_shot(table, 8, seed=1)["sentence"] != sample_k_shot(table, 8, seed=2)["sentence"]
    with pytest.raises(DataError, match="k_shot"):
        sample_k_shot(table, 41, seed=0)


def fit(backbone, method="lora", **config):
    import datasets

    data = datasets.Dataset.from_list(rows())
    settings = {"epochs": 3, "batch_size": 8, "seed": 0, "bf16": "false", "learning_rate": 5e-3} | config
    return train(backbone, get_method(method), data, data, TrainConfig(**settings))


def test_training_is_reproducible_by_seed(make_backbone):
    first = fit(make_backbone("bert"))
    second = fit(make_backbone("bert"))
    assert first.metrics == second.metrics
    assert all(
        torch.equal(a, b)
        for a, b in zip(first.delta.state_dict().values(), second.delta.state_dict().values(), strict=True)
    )
    third = fit(make_backbone("bert"), seed=1)
    assert third.metrics != first.metrics


# UniPELT's gates start half-open over three modules, so its mixture learns this task later than a single
# method: at 8 epochs its seed 0 stayed at chance on one thread of an AVX2-only EPYC and learned on two;
# at 16 epochs seeds 0, 1 and 2 all reached accuracy 1.0 (loss < 0.01) on either thread count
EPOCHS_TO_LEARN = {"unipelt": 16}


@pytest.mark.parametrize(
    ("family", "method"),
    [("bert", m) for m in ("lora", "pfeiffer", "prefix", "unipelt", "bitfit")] + [("llama", "lora")],
)
def test_a_few_epochs_learn_a_separable_toy_task(method, family, make_backbone):
    epochs = EPOCHS_TO_LEARN.get(method, 8)
    result = fit(make_backbone(family), method, epochs=epochs, learning_rate=1e-2)
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert result.metrics["accuracy"] >= 0.75
    assert len(result.history) == epochs and result.steps == epochs * 6


def test_progress_reports_every_step_and_the_stop_flag_stops(make_backbone):
    import datasets

    seen = []
    data = datasets.Dataset.from_list(rows())
    config = TrainConfig(epochs=2, batch_size=8, bf16="false")
    train(make_backbone("bert"), get_method("lora"), data, None, config, progress=seen.append)
    assert [p.step for p in seen] == list(range(1, 13))
    assert all(p.total_steps == 12 and p.tokens_per_second > 0 for p in seen)
    with pytest.raises(TrainingCancelled, match="step 3"):
        train(
            make_backbone("bert"),
            get_method("lora"),
            data,
            None,
            config,
            should_stop=lambda: len(seen) >= 15,
            progress=seen.append,
        )


def test_a_nan_loss_ends_the_job_with_a_clear_error(make_backbone, monkeypatch):
    import datasets

    import pelt_core.pack

    data = datasets.Dataset.from_list([{"text": "good", "label": 1}, {"text": "bad", "label": 0}])
    monkeypatch.setattr(
        pelt_core.pack, "loss_fn", lambda *args: torch.tensor(float("nan"), requires_grad=True)
    )
    with pytest.raises(TrainingError, match="loss became nan at step 0"):
        train(make_backbone("bert"), get_method("lora"), data, None, TrainConfig(batch_size=2, bf16="false"))
    with pytest.raises(ConfigError, match="learning_rate"):
        fit(make_backbone("bert"), "lora", learning_rate=float("nan"))


def test_a_regression_label_that_is_not_a_finite_number_is_refused_naming_it_before_any_step(make_backbone):
    import datasets

    data = datasets.Dataset.from_list(
        [{"text": "good", "score": 0.5}, {"text": "bad", "score": float("nan")}, {"text": "ok", "score": 2.5}]
    )
    with pytest.raises(
        DataError, match=r"label field 'score': regression labels must be finite numbers; 1 of"
    ):
        train(make_backbone("bert"), get_method("lora"), data, None, TrainConfig(batch_size=2, bf16="false"))


def test_regression_and_multi_label_heads_train(make_backbone):
    import datasets

    regression = datasets.Dataset.from_list(
        [{"text": t, "score": float(i % 5) + 0.5} for i, t in enumerate(POSITIVE + NEGATIVE)]
    )
    result = train(
        make_backbone("bert"),
        get_method("lora"),
        regression,
        regression,
        TrainConfig(epochs=1, batch_size=4, bf16="false"),
    )
    assert {"pearson", "spearman", "mse"} <= set(result.metrics)
    multi = datasets.Dataset.from_list(
        [
            {"text": t, "labels": ["pos", "fun"] if i % 2 else ["neg"]}
            for i, t in enumerate(POSITIVE + NEGATIVE)
        ]
    )
    result = train(
        make_backbone("bert"),
        get_method("lora"),
        multi,
        multi,
        TrainConfig(epochs=1, batch_size=4, bf16="false"),
    )
    assert result.task.problem_type == "multi_label_classification"
    assert result.task.label_names == ["fun", "neg", "pos"] and "micro_f1" in result.metrics


def test_bf16_backbone_trains_fp32_pelt_parameters(make_backbone):
    backbone = make_backbone("bert")
    backbone.model.to(torch.bfloat16)
    result = fit(backbone, "lora", bf16="true", epochs=1)
    assert all(p.dtype == torch.float32 for p in result.delta.parameters())
    assert result.bf16


def similarity_pairs(n: int, seed: int) -> list[dict]:
    """A sentence-pair similarity task on a 0–5 scale: the label counts the word "good" in the pair, give
    or take a fraction (so that it reads as regression)."""
    import random

    rng = random.Random(seed)
    fillers = ["movie", "film", "the", "a", "is", "w1", "w2", "w3"]
    data = []
    for _ in range(n):
        count = rng.randint(0, 5)
        words = ["good"] * count + [rng.choice(fillers) for _ in range(6 - count)]
        rng.shuffle(words)
        data.append(
            {
                "sentence1": " ".join(words[:3]),
                "sentence2": " ".join(words[3:]),
                "label": round(count * 0.9 + rng.random() / 2, 1),
            }
        )
    return data


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "datasets"])
def test_float_labels_with_a_fraction_anywhere_are_regression_in_every_format(fmt, tmp_path):
    records = [
        {"sentence1": "a", "sentence2": "b", "label": label} for label in (5.0, 3.8, 3.8, 0.0, 2.0, 0.5)
    ]
    task = infer_task_fields(load_table(write(tmp_path / f"t.{fmt}", records, fmt)))
    assert task.problem_type == "regression" and task.num_labels == 1 and task.label_names == []
    whole = [{"sentence": "a", "label": label} for label in (5.0, 1.0, 3.0)]
    task = infer_task_fields(load_table(write(tmp_path / f"w.{fmt}", whole, fmt)))
    assert task.problem_type == "single_label_classification" and task.label_names == ["1", "3", "5"]


def test_labels_mixing_strings_and_fractional_numbers_ask_for_the_problem_type(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"sentence": "a", "label": "pos"}\n{"sentence": "b", "label": 0.5}\n')
    with pytest.raises(DataError, match="--problem-type"):
        infer_task_fields(load_table(path))
    with pytest.raises(DataError, match="label field 'label'"):  # named: a 0.5 is still no class name
        infer_task_fields(load_table(path), problem_type="single_label_classification")


@pytest.mark.parametrize("method", list_methods())
def test_every_preset_learns_a_regression_task_in_the_labels_units(method, make_backbone):
    """Each preset, at its own learning rate, correlates with the labels and beats predicting their mean
    (its mean squared error, in the labels' units, is below their variance)."""
    import datasets

    train_rows = datasets.Dataset.from_list(similarity_pairs(256, 0))
    test_rows = datasets.Dataset.from_list(similarity_pairs(96, 1))
    result = train(
        make_backbone("bert"),
        get_method(method),
        train_rows,
        test_rows,
        TrainConfig(epochs=8, batch_size=8, bf16="false"),
    )
    variance = float(torch.tensor(test_rows["label"]).var(unbiased=False))
    assert result.task.problem_type == "regression"
    assert result.metrics["pearson"] > 0.5, result.metrics
    assert result.metrics["mse"] < variance, (result.metrics, variance)


def test_a_regression_head_starts_at_the_training_labels_mean_and_keeps_their_units(make_backbone, tmp_path):
    """Barely trained, it predicts the training labels' mean; finished, the scaling is folded into its plain
    weights (none is left on the side or in the manifest), so a saved delta, a merge or a PEFT export of its
    head predicts in the labels' units."""
    import datasets
    from safetensors.torch import load_file

    from pelt_core.delta import export_peft_lora, load_delta, save_delta
    from pelt_core.delta_format import read_manifest
    from pelt_core.model import PeltModel, predict

    backbone = make_backbone("bert")
    rows = [r | {"label": 1000.25 + 300 * r["label"]} for r in similarity_pairs(64, 0)]
    labels = torch.tensor([r["label"] for r in rows], dtype=torch.float64)
    result = train(
        backbone,
        get_method("lora"),
        datasets.Dataset.from_list(rows),
        None,
        TrainConfig(epochs=1, batch_size=8, bf16="false", max_steps=1, learning_rate=1e-9),
    )
    head = result.delta.head
    assert result.task.problem_type == "regression"
    assert (head.target_shift, head.target_scale) == (0.0, 1.0)  # folded
    assert float(head.classifier.bias[0]) == pytest.approx(float(labels.mean()), abs=1.0)
    pairs = [(r["sentence1"], r["sentence2"]) for r in rows[:8]]
    before = predict(PeltModel(backbone, {"job": result.delta}), pairs)
    assert all(abs(p["value"] - float(labels.mean())) < 0.5 * float(labels.std()) for p in before)
    saved = save_delta(result.delta, backbone, tmp_path / "d")
    assert not {"target_shift", "target_scale"} & set(read_manifest(saved.path)["head"])
    after = predict(PeltModel(backbone, {"job": load_delta(saved.path, backbone)}), pairs)
    assert [p["value"] for p in after] == pytest.approx([p["value"] for p in before], rel=1e-6)
    exported = load_file(
        str(export_peft_lora(result.delta, backbone, tmp_path / "peft") / "head.safetensors")
    )
    bias = next(tensor for name, tensor in exported.items() if name.endswith("bias"))
    assert float(bias[0]) == pytest.approx(float(labels.mean()), abs=1.0)


def test_a_regression_loss_is_measured_in_standardized_units_whatever_the_labels_scale(make_backbone):
    """Labels around 1e6 with a spread of 1e5 train with a loss of about 1 at the start (the variance of
    standardized targets), not 1e10: gradient clipping and AdamW see the same problem at any scale."""
    import datasets

    rows = [r | {"label": 1e6 + 0.5 + 1e5 * r["label"]} for r in similarity_pairs(64, 0)]
    seen = []
    result = train(
        make_backbone("bert"),
        get_method("lora"),
        datasets.Dataset.from_list(rows),
        None,
        TrainConfig(epochs=1, batch_size=8, bf16="false", max_steps=2),
        progress=seen.append,
    )
    assert result.task.problem_type == "regression"
    assert seen and all(0.05 < p.loss < 20 for p in seen), [p.loss for p in seen]
