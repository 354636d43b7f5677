"""One prediction format: a single model, a multi-task model and a folded LoRA decode logits the same way."""

from __future__ import annotations

import math

import pytest
import torch

from pelt_core import get_method
from pelt_core.compose import fold_lora, multi_task
from pelt_core.model import JobDelta, PeltModel, predict
from pelt_core.predictions import decode_predictions, tokenize_texts

from .conftest import trained_like

TEXTS = ["the movie was good", "bad film", ("a film", "a movie"), "great fun , not boring"]


def trained(delta: JobDelta, seed: int) -> JobDelta:
    """Trained-like tensors, large enough that predictions differ from row to row; in eval mode."""
    return trained_like(delta, seed, std=0.5).eval()


def test_decode_predictions_by_problem_type():
    logits = torch.tensor([[2.0, 0.0, -1.0], [-3.0, 1.0, 4.0]])
    total = math.exp(2.0) + 1.0 + math.exp(-1.0)
    single = decode_predictions("single_label_classification", ["a", "b", "c"], logits)
    assert [r["label"] for r in single] == ["a", "c"]
    assert single[0]["score"] == pytest.approx(math.exp(2.0) / total)

    multi = decode_predictions("multi_label_classification", None, logits)
    assert [r["labels"] for r in multi] == [["0"], ["1", "2"]]  # sigmoid(0) = 0.5 is not above 0.5
    assert multi[0]["scores"] == pytest.approx(
        {"0": 1 / (1 + math.exp(-2.0)), "1": 0.5, "2": 1 / (1 + math.e)}
    )

    values = decode_predictions("regression", None, torch.tensor([[1.5], [-0.25]]))
    assert values == [{"value": 1.5}, {"value": -0.25}]


@pytest.mark.parametrize(
    ("problem_type", "num_labels", "label_names"),
    [
        ("single_label_classification", 3, ["neg", "neutral", "pos"]),
        ("multi_label_classification", 3, ["sports", "politics", "film"]),
        ("regression", 1, None),
    ],
)
def test_a_multi_task_model_decodes_the_logits_of_a_single_model_the_same_way(
    problem_type, num_labels, label_names, make_backbone
):
    backbone = make_backbone("bert")
    method = get_method("lora", {"r": 2})
    delta = trained(JobDelta(method, backbone, num_labels, problem_type, label_names=label_names), 1)
    other = trained(JobDelta(get_method("bitfit"), backbone, 2), 2)
    single = PeltModel(backbone, delta).eval()

    alone = predict(single, TEXTS)
    for text, result in zip(TEXTS, alone, strict=True):  # the decoder applied to the model's own logits
        batch = tokenize_texts(backbone.tokenizer, [text], 128, "cpu")
        with torch.no_grad():
            expected = decode_predictions(problem_type, label_names, single(**batch).float())[0]
        assert result == _approx(expected)

    served = multi_task(backbone, {"task": delta, "other": other})
    items = [item for text in TEXTS for item in (("other", text), ("task", text))]  # mixed batches
    mixed = [r for r in served.predict(items, batch_size=3) if r.pop("task") == "task"]
    assert mixed == [_approx(r) for r in alone]

    folded = fold_lora(backbone, delta)
    assert folded.predict(TEXTS) == [_approx(r) for r in alone]


def _approx(result: dict) -> dict:
    """A prediction with its numbers compared to 1e-5 (mixed batches and folded weights round differently)."""
    return {
        key: value if isinstance(value, str | list) else pytest.approx(value, abs=1e-5)
        for key, value in result.items()
    }


def test_predict_takes_texts_and_text_pairs_mixed_in_one_batch(make_backbone):
    """A text after a pair failed the batch (zip of unequal lengths), or at two characters was read as a
    pair of characters ("ok" -> ("o", "k")); now each row is encoded as what it is."""
    backbone = make_backbone("bert")
    model = PeltModel(backbone, trained(JobDelta(get_method("lora", {"r": 2}), backbone, 3), 1)).eval()
    texts = [("a film", "a movie"), "ok", "bad film"]
    one_by_one = [predict(model, [text])[0] for text in texts]
    assert predict(model, texts) == [_approx(r) for r in one_by_one]
    with pytest.raises(ValueError, match="text 1: expected a string or a"):
        predict(model, ["fine", 3])


def test_a_model_trained_on_sentence_pairs_refuses_a_single_sentence_naming_the_text_fields(
    make_backbone, tmp_path
):
    from pelt_core import TrainConfig
    from pelt_core.data import TaskFields
    from pelt_core.delta import load_delta, save_delta
    from pelt_core.train_setup import new_delta

    backbone = make_backbone("bert")
    pairs = TaskFields(("sentence1", "sentence2"), "label", "single_label_classification", ["0", "1"])
    saved = save_delta(
        new_delta(backbone, get_method("lora"), pairs, TrainConfig()), backbone, tmp_path / "d"
    )
    delta = load_delta(saved.path, backbone)  # as a pull loads it: the text fields come from the manifest
    assert delta.text_fields == ("sentence1", "sentence2")
    model = PeltModel(backbone, {"job": delta})
    for serve in (
        lambda texts: predict(model, texts),
        lambda texts: fold_lora(backbone, delta).predict(texts),
        lambda texts: multi_task(backbone, {"stsb": delta}).predict([("stsb", t) for t in texts]),
    ):
        assert len(serve([("a film", "a movie")])) == 1
        with pytest.raises(ValueError, match=r"trained on sentence pairs \(sentence1, sentence2\)"):
            serve([("a film", "a movie"), "a film"])
    single = TaskFields(("sentence",), "label", "single_label_classification", ["0", "1"])
    single_model = PeltModel(
        backbone, {"job": new_delta(backbone, get_method("lora"), single, TrainConfig())}
    )
    with pytest.raises(ValueError, match=r"trained on single texts \(sentence\)"):
        predict(single_model, [("a film", "a movie")])
