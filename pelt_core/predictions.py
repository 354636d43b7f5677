"""From texts to model inputs and from logits to predictions: the one result format of every pelt model.

`decode_predictions` turns a (rows, labels) logits tensor into one dict per row, by problem type:
- single_label_classification: {"label": name, "score": softmax probability of that label} (argmax);
- multi_label_classification: {"labels": [names with sigmoid > 0.5], "scores": {name: sigmoid}};
- regression: {"value": float}.
Label names default to "0", "1", … when the delta has none. `pelt_core.model.predict`,
`MultiTaskModel.predict` and `FoldedModel.predict` all decode through it, read their inputs through
`tokenize_texts`, and run inside `evaluating` (eval mode for the block, the model's own mode after).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # what a pelt model's forward takes

Text = str | tuple[str, str]  # a text, or a (text, text_pair) pair


def decode_predictions(problem_type: str, label_names: list[str] | None, logits: torch.Tensor) -> list[dict]:
    """One prediction per row of a (rows, labels) float logits tensor (the format: the module docstring)."""
    if problem_type == "regression":
        return [{"value": float(v)} for v in logits.squeeze(-1)]
    names = label_names or [str(i) for i in range(logits.shape[-1])]
    if problem_type == "multi_label_classification":
        return [
            {
                "labels": [names[i] for i, p in enumerate(row) if p > 0.5],
                "scores": {names[i]: float(p) for i, p in enumerate(row)},
            }
            for row in torch.sigmoid(logits)
        ]
    results = []
    for row in torch.softmax(logits, -1):
        best = int(row.argmax())
        results.append({"label": names[best], "score": float(row[best])})
    return results


def _is_pair(text: Any) -> bool:
    return isinstance(text, tuple | list) and len(text) == 2 and all(isinstance(t, str) for t in text)


def check_text_form(texts: Sequence[Any], text_fields: Sequence[str] | None, where: str = "text") -> None:
    """A model trained on sentence pairs takes (text, text_pair) pairs, one trained on single texts takes
    strings: a ValueError naming the task's text fields for the first text of the other form. No
    `text_fields` (a delta saved before they were recorded): anything goes."""
    if not text_fields:
        return
    pairs = len(text_fields) == 2
    for position, text in enumerate(texts):
        if pairs and isinstance(text, str):
            raise ValueError(
                f"{where} {position}: this model was trained on sentence pairs ({', '.join(text_fields)}); "
                f"give each input as a ({text_fields[0]}, {text_fields[1]}) pair, not a single text"
            )
        if not pairs and _is_pair(text):
            raise ValueError(
                f"{where} {position}: this model was trained on single texts ({text_fields[0]}); "
                "give each input as one string, not a pair"
            )


def tokenize_texts(
    tokenizer, texts: Sequence[Text], max_length: int, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Model inputs for single texts, (text, text_pair) pairs, or a mix of both (rows encoded one by one,
    then padded), truncated to `max_length`, on `device`. Anything else is refused with its position."""
    for position, text in enumerate(texts):
        if not (isinstance(text, str) or _is_pair(text)):
            raise ValueError(f"text {position}: expected a string or a (text, text_pair) pair, got {text!r}")
    options = {"truncation": True, "max_length": max_length}
    if all(isinstance(t, str) for t in texts):
        batch = tokenizer(list(texts), padding=True, return_tensors="pt", **options)
    elif all(_is_pair(t) for t in texts):
        batch = tokenizer(
            [a for a, _ in texts], [b for _, b in texts], padding=True, return_tensors="pt", **options
        )
    else:
        rows = [
            dict(tokenizer(t, **options) if isinstance(t, str) else tokenizer(t[0], t[1], **options))
            for t in texts
        ]
        batch = tokenizer.pad(rows, padding=True, return_tensors="pt")
    return {k: v.to(device) for k, v in batch.items() if k in MODEL_INPUTS}


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) inside the block; afterwards the mode the model had, even on an error."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
