"""Serving composed deltas: several task deltas on one backbone (`multi_task`, one backbone forward per
mixed batch), and a LoRA delta folded into a copy of the backbone's dense weights (`fold_lora`, no
per-token overhead). Both predict in the one result format of `pelt_core.predictions`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from pelt_core.backbones import Backbone
from pelt_core.compose_inputs import check_on_backbone
from pelt_core.compose_options import CompositionError
from pelt_core.model import JobDelta, PeltModel
from pelt_core.predictions import Text, check_text_form, decode_predictions, evaluating, tokenize_texts


class MultiTaskModel(PeltModel):
    """Several task deltas on one shared backbone; a batch of mixed tasks runs in one backbone forward."""

    @property
    def tasks(self) -> list[str]:
        return list(self.deltas)

    def forward_tasks(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        tasks: Sequence[str],
        token_type_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Per-row logits (one 1-D tensor per row, in input order); row i goes through task tasks[i]."""
        if len(tasks) != input_ids.shape[0]:
            raise ValueError(f"{len(tasks)} task names for a batch of {input_ids.shape[0]} rows")
        groups: dict[str, list[int]] = {}
        for row, task in enumerate(tasks):
            if task not in self.deltas:
                raise KeyError(f"no task named {task!r}; this model serves {', '.join(self.deltas)}")
            groups.setdefault(task, []).append(row)
        order = [row for rows in groups.values() for row in rows]
        index = torch.tensor(order, device=input_ids.device)
        outputs = self(
            input_ids[index],
            attention_mask[index],
            None if token_type_ids is None else token_type_ids[index],
            routes=[(task, len(rows)) for task, rows in groups.items()],
        )
        if isinstance(outputs, torch.Tensor):
            outputs = [outputs]
        per_row: list[torch.Tensor] = [None] * len(order)  # type: ignore[list-item]
        for row, logits in zip(order, (r for block in outputs for r in block), strict=True):
            per_row[row] = logits
        return per_row

    @torch.no_grad()
    def predict(
        self, items: Sequence[tuple[str, Text]], batch_size: int = 32, max_length: int = 128
    ) -> list[dict]:
        """Predictions for (task, text) or (task, (text, text_pair)) items, in input order; each chunk of
        `batch_size` items is one backbone forward. Same result format as `pelt_core.model.predict`
        (`pelt_core.predictions`), plus "task"."""
        for position, item in enumerate(items):
            if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError(
                    f"item {position}: expected (task, text) or (task, (text, text_pair)), got {item!r}"
                )
        for position, (task, text) in enumerate(items):
            if task in self.deltas:  # an unknown task: forward_tasks names it
                check_text_form([text], self.deltas[task].text_fields, f"item {position} ({task})")
        device = next(self.deltas.parameters()).device
        results: list[dict] = []
        with evaluating(self):
            for start in range(0, len(items), batch_size):
                chunk = items[start : start + batch_size]
                tasks = [task for task, _ in chunk]
                batch = tokenize_texts(
                    self.backbone.tokenizer, [text for _, text in chunk], max_length, device
                )
                rows = self.forward_tasks(
                    batch["input_ids"], batch["attention_mask"], tasks, batch.get("token_type_ids")
                )
                for task, logits in zip(tasks, rows, strict=True):
                    delta = self.deltas[task]
                    (result,) = decode_predictions(
                        delta.problem_type, delta.label_names, logits.float()[None]
                    )
                    results.append({"task": task, **result})
        return results


def multi_task(backbone: Backbone, deltas: Mapping[str, JobDelta]) -> MultiTaskModel:
    """A model serving several task deltas on one backbone, in eval mode (the deltas are shared, not
    copied)."""
    check_multi_task(backbone, deltas)
    return MultiTaskModel(backbone, dict(deltas)).eval()


def check_multi_task(backbone: Backbone, deltas: Mapping[str, JobDelta]) -> None:
    """What `multi_task` checks, without building the model: a non-empty {task name: JobDelta} mapping,
    names without '.', every delta on `backbone` (CompositionError naming the one at fault)."""
    if not isinstance(deltas, Mapping) or not deltas:
        raise CompositionError("multi_task: give a non-empty {task name: JobDelta} mapping")
    for task, delta in deltas.items():
        if not isinstance(task, str) or not task or "." in task:
            raise CompositionError(f"multi_task: task name {task!r} must be a non-empty string without '.'")
        check_on_backbone(task, delta, backbone, "multi_task")


class FoldedModel(nn.Module):
    """A standalone transformers model with LoRA folded into its dense weights, plus the task head."""

    def __init__(
        self, model: nn.Module, head: nn.Module, tokenizer, problem_type: str, label_names: list[str] | None
    ):
        super().__init__()
        self.model = model
        self.head = head
        self.text_fields: tuple[str, ...] | None = None  # the task's, when its delta recorded them
        self.tokenizer = tokenizer
        self.problem_type = problem_type
        self.label_names = label_names

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = self.model(**kwargs).last_hidden_state
        return hidden if return_hidden else self.head(hidden, attention_mask)

    @torch.no_grad()
    def predict(self, texts: Sequence[Text], batch_size: int = 32, max_length: int = 128) -> list[dict]:
        """Same result format as `pelt_core.model.predict` (`pelt_core.predictions`)."""
        check_text_form(texts, self.text_fields)
        device = next(self.head.parameters()).device
        results: list[dict] = []
        with evaluating(self):
            for start in range(0, len(texts), batch_size):
                batch = tokenize_texts(self.tokenizer, texts[start : start + batch_size], max_length, device)
                logits = self(
                    batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")
                ).float()
                results.extend(decode_predictions(self.problem_type, self.label_names, logits))
        return results


def fold_lora(backbone: Backbone, delta: JobDelta) -> FoldedModel:
    """Fold a LoRA delta's ΔW (and BitFit linear biases) into a copy of the backbone: zero-overhead inference,
    same logits. Adapters, prefixes, gated LoRA and norm deltas do not fold and are refused."""
    check_on_backbone("delta", delta, backbone, "fold_lora")
    try:
        merged = PeltModel(backbone, {"job": delta}).merged_backbone("job")
    except ValueError as exc:
        raise CompositionError(f"fold_lora: {exc}") from exc
    head = copy.deepcopy(delta.head)
    folded = FoldedModel(merged, head, backbone.tokenizer, delta.problem_type, delta.label_names)
    folded.text_fields = delta.text_fields
    return folded.eval()
