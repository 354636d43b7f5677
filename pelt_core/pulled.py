"""A delta fetched from a store, loaded onto its backbone and ready for `predict(texts)`.

Both pull paths end here: the MLflow store's `pull` (services.delta_store) and the HTTP client's `pull`
(services.client) download a version's folder (a delta, or a multi-task bundle: `pelt_core.delta_format`),
then `load_pulled` checks it against the recorded sha256 and loads it. Torch-free at import (torch and the
model code load when a delta does), so importing the store or the client stays light.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pelt_core.delta_format import BUNDLE_FORMAT, DeltaError, read_bundle, read_manifest

if TYPE_CHECKING:
    import torch

    from pelt_core.backbones import Backbone
    from pelt_core.model import JobDelta

MULTI_TASK = "multi_task"  # the kind of a version that holds a multi-task bundle


class PulledVersion(Protocol):
    """What a pull knows about the version it fetched: the store's VersionInfo, the API's VersionOut."""

    task: str
    version: str
    kind: str  # job | composed | multi_task | imported
    sha256: str | None

    @property
    def uri(self) -> str: ...


@dataclass
class PulledModel:
    """A pulled delta loaded onto its backbone, ready for `predict(texts)`.

    `model` is a PeltModel (one delta), a MultiTaskModel (a multi-task bundle; predict takes
    (task, text) items) or a FoldedModel (pulled with fold=True)."""

    info: Any  # a PulledVersion: the store's VersionInfo or the API's VersionOut
    sha256: str
    manifest: dict[str, Any]
    backbone: Backbone
    deltas: dict[str, JobDelta]
    model: Any  # None when loaded with serving=False (for composing)

    @property
    def task(self) -> str:
        return self.info.task

    @property
    def version(self) -> str:
        return self.info.version

    @property
    def delta(self) -> JobDelta:
        """The delta (a multi-task bundle has several: see `deltas`)."""
        if len(self.deltas) != 1:
            raise DeltaError(
                f"{self.info.uri} holds {len(self.deltas)} task deltas: {', '.join(self.deltas)}"
            )
        return next(iter(self.deltas.values()))

    def predict(self, texts: Sequence[Any], batch_size: int = 32, max_length: int = 128) -> list[dict]:
        """pelt_core.model.predict's result format; a multi-task model takes (task, text) items."""
        from pelt_core.compose import FoldedModel, MultiTaskModel
        from pelt_core.model import predict

        if isinstance(self.model, MultiTaskModel | FoldedModel):
            return self.model.predict(list(texts), batch_size=batch_size, max_length=max_length)
        return predict(self.model, list(texts), batch_size=batch_size, max_length=max_length)

    def logits(self, texts: Sequence[str], task: str | None = None) -> torch.Tensor:
        """Logits for a batch of texts (a multi-task model needs `task`, or uses its only task)."""
        import torch

        from pelt_core.compose import MultiTaskModel

        batch = self.backbone.tokenizer(list(texts), padding=True, return_tensors="pt")
        device = next(self.model.parameters()).device
        inputs = {
            k: v.to(device)
            for k, v in batch.items()
            if k in ("input_ids", "attention_mask", "token_type_ids")
        }
        with torch.no_grad():
            if isinstance(self.model, MultiTaskModel):
                name = task or (next(iter(self.deltas)) if len(self.deltas) == 1 else None)
                if name is None:
                    raise DeltaError(f"name the task: this model serves {', '.join(self.deltas)}")
                rows = self.model.forward_tasks(
                    inputs["input_ids"],
                    inputs["attention_mask"],
                    [name] * len(texts),
                    inputs.get("token_type_ids"),
                )
                return torch.stack(rows)
            return self.model(**inputs)


def load_pulled(
    info: PulledVersion,
    folder: Path,
    backbone_for: Callable[[dict[str, Any]], Backbone],
    fold: bool = False,
    serving: bool = True,
) -> PulledModel:
    """Load a downloaded version folder (a delta, or a multi-task bundle when `info.kind` is multi_task)
    onto the backbone that `backbone_for(manifest)` returns, checking the recorded sha256 of every delta
    file: a PulledModel ready to predict. fold: LoRA folded into a copy of the backbone's dense weights.
    serving=False: the deltas alone, on the CPU, with no model (`model` is None), for composing them: the
    backbone may then be a `pelt_core.backbones.ShapeBackbone` (its shapes, no weights)."""
    from pelt_core.compose import fold_lora, multi_task
    from pelt_core.delta import load_delta
    from pelt_core.model import PeltModel

    if info.kind == MULTI_TASK:
        if fold:
            raise DeltaError(f"{info.uri} is a multi-task bundle; fold its tasks one by one")
        bundle = read_bundle(folder)
        manifest = {**bundle, "format": BUNDLE_FORMAT}
        chosen = backbone_for({"backbone": bundle["backbone"]})
        deltas = {
            name: _to_device(load_delta(folder / entry["path"], chosen, entry["sha256"]), chosen, serving)
            for name, entry in bundle["tasks"].items()
        }
        model = multi_task(chosen, deltas) if serving else None
        return PulledModel(info, info.sha256 or "", manifest, chosen, deltas, model)
    manifest = read_manifest(folder)
    chosen = backbone_for(manifest)
    delta = _to_device(load_delta(folder, chosen, expected_sha256=info.sha256), chosen, serving)
    if not serving:
        model = None
    else:
        model = fold_lora(chosen, delta) if fold else PeltModel(chosen, {"delta": delta}).eval()
    return PulledModel(info, info.sha256 or "", manifest, chosen, {"delta": delta}, model)


def _to_device(delta: JobDelta, backbone: Backbone, serving: bool = True) -> JobDelta:
    if not serving:
        return delta.eval()
    device = next(backbone.model.parameters()).device
    return delta.to(device).eval()


__all__ = ["MULTI_TASK", "PulledModel", "PulledVersion", "load_pulled"]
