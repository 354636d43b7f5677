"""A backbone's shapes without its weights (`ShapeBackbone`, what the service's composition child uses): every
linear map has the sizes transformers builds, every method's delta loads onto it, and a composition on it
saves the same file (sha256) as one on the loaded backbone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pelt_core.backbones import Backbone, BackboneError, ShapeBackbone
from pelt_core.compose import merge, save_composed
from pelt_core.delta import load_delta, save_delta
from pelt_core.methods import BUILTIN_METHODS, get_method
from pelt_core.model import JobDelta
from pelt_core.testing import tiny_bert, tiny_llama

BUILDERS = {
    "bert": lambda folder: tiny_bert(folder),
    "llama": lambda folder: tiny_llama(folder),
    "llama-head-dim": lambda folder: tiny_llama(folder, head_dim=4),  # q and o narrower than hidden
}


@pytest.fixture(params=list(BUILDERS))
def saved_backbone(request, tmp_path: Path) -> Backbone:
    """A tiny backbone saved as a model folder; its name is the folder (as a registered one's)."""
    built = BUILDERS[request.param](str(tmp_path / "tokenizer"))
    folder = tmp_path / "model"
    built.model.save_pretrained(folder)
    built.tokenizer.save_pretrained(folder)
    return Backbone.load(str(folder))


def recorded(backbone: Backbone) -> dict:
    """The backbone entry a delta's manifest records."""
    return save_delta(
        JobDelta(get_method("bitfit"), backbone, num_labels=2), backbone, Path(backbone.source) / "probe"
    ).manifest["backbone"]


def test_the_shapes_are_the_loaded_models_read_from_config_json_alone(
    saved_backbone: Backbone, monkeypatch: pytest.MonkeyPatch
):
    def no_transformers(*args, **kwargs):
        raise AssertionError("a config.json that names every size is read without transformers")

    monkeypatch.setattr("pelt_core.backbones.read_backbone_config", no_transformers)
    shapes = ShapeBackbone.from_manifest(recorded(saved_backbone))
    assert shapes.content_hash == saved_backbone.content_hash and shapes.name == saved_backbone.name
    assert shapes.facts == saved_backbone.facts and shapes.num_parameters == saved_backbone.num_parameters
    for layer in range(saved_backbone.num_layers):
        for concrete in saved_backbone.arch.linear_paths:
            real = saved_backbone.linear(layer, concrete)
            shape = shapes.linear(layer, concrete)
            assert (shape.in_features, shape.out_features) == (real.in_features, real.out_features), concrete


def test_every_methods_delta_loads_onto_the_shapes_and_composes_to_the_same_file(
    saved_backbone: Backbone, tmp_path: Path
):
    shapes = ShapeBackbone.from_manifest(recorded(saved_backbone))
    for name in BUILTIN_METHODS:
        folders = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            delta = JobDelta(get_method(name), saved_backbone, num_labels=3)
            with torch.no_grad():
                for parameter in delta.parameters():
                    parameter.normal_(std=0.1)
            folders.append(save_delta(delta, saved_backbone, tmp_path / f"{name}-{seed}").path)
        on_weights = [load_delta(folder, saved_backbone) for folder in folders]
        on_shapes = [load_delta(folder, shapes) for folder in folders]
        expected = save_composed(merge(on_weights), saved_backbone, tmp_path / f"{name}-weights")
        composed = save_composed(merge(on_shapes), shapes, tmp_path / f"{name}-shapes")
        assert composed.sha256 == expected.sha256, name
        assert composed.manifest["backbone"] == expected.manifest["backbone"], name


def test_a_config_that_no_longer_matches_what_the_deltas_record_is_refused(saved_backbone: Backbone):
    entry = {**recorded(saved_backbone), "num_layers": saved_backbone.num_layers + 1}
    with pytest.raises(BackboneError, match="num_layers"):
        ShapeBackbone.from_manifest(entry)


def test_the_shapes_cannot_run(saved_backbone: Backbone):
    shapes = ShapeBackbone.from_manifest(recorded(saved_backbone))
    with pytest.raises(BackboneError, match="shapes alone"):
        shapes.layers()
    assert shapes.model is None and shapes.tokenizer is None
