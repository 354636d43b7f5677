"""LoRA agrees with HF PEFT; deltas (and multi-task bundles) save as safetensors + manifest and load back only
onto their backbone, checked against their sha256."""

from __future__ import annotations

import json
from dataclasses import dataclass

import peft
import pytest
import torch
from safetensors.torch import load_file

from pelt_core import BUILTIN_METHODS, get_method
from pelt_core.delta import export_peft_lora, load_delta, save_bundle, save_delta
from pelt_core.delta_format import BUNDLE_FILE, DeltaError, read_bundle, sha256_file
from pelt_core.model import JobDelta, PeltModel, predict
from pelt_core.pulled import MULTI_TASK, load_pulled

from .conftest import TINY, encode, trained_like


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_lora_equals_peft_lora_given_the_same_weights(family, make_backbone, tmp_path, sentences):
    backbone = make_backbone(family)
    delta = trained_like(JobDelta(get_method("lora", {"r": 4}), backbone, num_labels=2), seed=1)
    ours = PeltModel(backbone, delta).eval()
    input_ids, mask = encode(backbone, sentences)

    reference = TINY[family](str(tmp_path), seed=0).model  # same seed: identical frozen weights
    targets = ["query", "value"] if family == "bert" else ["q_proj", "v_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    peft_model = peft.get_peft_model(reference, config).eval()
    for (layer, concrete), ops in delta.linear_ops.items():
        lora_layer = peft_model.base_model.model.get_submodule(backbone.linear_path(layer, concrete))
        lora_layer.lora_A["default"].weight.data.copy_(ops.parallel_x[0].down.weight)
        lora_layer.lora_B["default"].weight.data.copy_(ops.parallel_x[0].up.weight)
    expected = peft_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(ours(input_ids, mask, return_hidden=True), expected, atol=1e-5, rtol=1e-5)


def test_peft_export_loads_in_peft_with_the_same_logits(make_backbone, tmp_path, sentences):
    backbone = make_backbone("bert")
    delta = trained_like(JobDelta(BUILTIN_METHODS["lora"], backbone, num_labels=3), seed=1)
    ours = PeltModel(backbone, delta).eval()
    input_ids, mask = encode(backbone, sentences)
    export = export_peft_lora(delta, backbone, tmp_path / "peft")

    config = json.loads((export / "adapter_config.json").read_text())
    assert (
        config["peft_type"] == "LORA" and config["r"] == 8 and config["target_modules"] == ["query", "value"]
    )
    base = TINY["bert"](str(tmp_path), seed=0).model
    loaded = peft.PeftModel.from_pretrained(base, str(export)).eval()
    hidden = loaded(input_ids=input_ids, attention_mask=mask).last_hidden_state
    head = delta.head.__class__(backbone.hidden_size, 3, delta.head.pooling).eval()
    head.load_state_dict(load_file(str(export / "head.safetensors")))
    torch.testing.assert_close(head(hidden, mask), ours(input_ids, mask), atol=1e-5, rtol=1e-5)


def test_only_plain_lora_exports_to_peft(make_backbone, tmp_path):
    backbone = make_backbone("bert")
    with pytest.raises(DeltaError, match="only pure LoRA"):
        export_peft_lora(JobDelta(BUILTIN_METHODS["houlsby"], backbone, 2), backbone, tmp_path)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_merged_lora_equals_unmerged_and_leaves_the_backbone_untouched(family, make_backbone, sentences):
    backbone = make_backbone(family)
    before = {k: v.clone() for k, v in backbone.model.state_dict().items()}
    delta = trained_like(JobDelta(get_method("lora", {"bias": "true"}), backbone, num_labels=2), seed=1)
    delta.norm_ops.clear()  # BitFit's norm shifts do not fold; the linear biases do
    model = PeltModel(backbone, delta).eval()
    input_ids, mask = encode(backbone, sentences)
    merged = model.merged_backbone()
    folded = merged(input_ids=input_ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(folded, model(input_ids, mask, return_hidden=True), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in backbone.model.state_dict().items())


def test_adapters_refuse_to_fold(make_backbone):
    backbone = make_backbone("bert")
    with pytest.raises(ValueError, match="do not fold"):
        PeltModel(backbone, JobDelta(BUILTIN_METHODS["pfeiffer"], backbone, 2)).merged_backbone()


@pytest.mark.parametrize("name", sorted(BUILTIN_METHODS))
def test_save_then_load_gives_identical_logits(name, family, make_backbone, tmp_path, sentences):
    backbone = make_backbone(family)
    spec = get_method(name, {"size": 4}) if BUILTIN_METHODS[name].modules else BUILTIN_METHODS[name]
    delta = trained_like(JobDelta(spec, backbone, num_labels=3, label_names=["a", "b", "c"]), seed=1)
    delta.drop_reparameterization()
    input_ids, mask = encode(backbone, sentences)
    expected = PeltModel(backbone, delta).eval()(input_ids, mask)

    saved = save_delta(delta, backbone, tmp_path / "delta", extra={"task": "demo"})
    assert sorted(p.name for p in saved.path.iterdir()) == ["delta.safetensors", "manifest.json"]
    manifest = saved.manifest
    assert manifest["backbone"]["content_hash"] == backbone.content_hash
    assert manifest["head"]["label_names"] == ["a", "b", "c"]
    assert manifest["method"]["name"] == name
    assert "prefix_encoders" not in " ".join(load_file(str(saved.path / "delta.safetensors")))

    fresh = TINY[family](str(tmp_path), seed=0)  # a new process would load the backbone anew
    loaded = load_delta(saved.path, fresh, expected_sha256=saved.sha256)
    assert torch.equal(PeltModel(fresh, loaded).eval()(input_ids, mask), expected)


def test_a_delta_refuses_another_backbone(make_backbone, tmp_path):
    backbone = make_backbone("bert", seed=0)
    saved = save_delta(JobDelta(BUILTIN_METHODS["lora"], backbone, 2), backbone, tmp_path / "d")
    other = make_backbone("bert", seed=1)
    with pytest.raises(DeltaError, match="trained on backbone 'tiny-bert-0'"):
        load_delta(saved.path, other)


def test_a_tampered_delta_is_refused(make_backbone, tmp_path):
    backbone = make_backbone("bert")
    saved = save_delta(JobDelta(BUILTIN_METHODS["lora"], backbone, 2), backbone, tmp_path / "d")
    with open(saved.path / "delta.safetensors", "r+b") as handle:
        handle.seek(-4, 2)
        handle.write(b"\x00\x01\x02\x03")
    with pytest.raises(DeltaError, match="sha256"):
        load_delta(saved.path, backbone, expected_sha256=saved.sha256)


def test_a_saved_model_folder_loads_with_a_stable_content_hash(make_backbone, tmp_path):
    from pelt_core.backbones import Backbone

    backbone = make_backbone("bert")  # saved without BERT's pooler: it must not be filled with random weights
    backbone.model.save_pretrained(tmp_path / "m")
    backbone.tokenizer.save_pretrained(tmp_path / "m")
    first, second = Backbone.load(str(tmp_path / "m")), Backbone.load(str(tmp_path / "m"))
    assert first.content_hash == second.content_hash == backbone.content_hash


@dataclass(frozen=True)
class Version:
    """What a pull knows about a version (pelt_core.pulled.PulledVersion)."""

    kind: str
    sha256: str
    task: str = "demo"
    version: str = "1"
    uri: str = "models:/pelt.demo/1"


def test_a_bundle_saves_each_delta_and_pulls_back_as_a_multi_task_model(make_backbone, tmp_path, sentences):
    backbone = make_backbone("bert")
    deltas = {
        "lora": trained_like(
            JobDelta(get_method("lora", {"r": 2}), backbone, 2, label_names=["n", "p"]), seed=1
        ),
        "bitfit": trained_like(JobDelta(BUILTIN_METHODS["bitfit"], backbone, 3), seed=1),
    }
    saved = save_bundle(deltas, backbone, tmp_path / "b", sources={"lora": {"task": "sst2", "version": "4"}})
    bundle = read_bundle(saved.path)
    assert saved.sha256 == sha256_file(saved.path / BUNDLE_FILE) and bundle == saved.manifest
    assert bundle["tasks"]["lora"]["version"] == "4" and set(bundle["tasks"]) == {"lora", "bitfit"}

    pulled = load_pulled(Version(MULTI_TASK, saved.sha256), saved.path, lambda manifest: backbone)
    assert set(pulled.deltas) == {"lora", "bitfit"} and pulled.manifest["format"] == "pelt-multi-task"
    for name, delta in deltas.items():
        alone = predict(PeltModel(backbone, delta).eval(), sentences)
        served = pulled.predict([(name, s) for s in sentences])
        assert [(row["task"], row["label"]) for row in served] == [(name, row["label"]) for row in alone]
        assert [row["score"] for row in served] == pytest.approx([row["score"] for row in alone], abs=1e-5)
    with pytest.raises(DeltaError, match="multi-task bundle; fold its tasks one by one"):
        load_pulled(Version(MULTI_TASK, saved.sha256), saved.path, lambda manifest: backbone, fold=True)


def test_a_pulled_delta_is_checked_against_its_recorded_sha256(make_backbone, tmp_path, sentences):
    backbone = make_backbone("bert")
    delta = trained_like(JobDelta(get_method("lora", {"r": 2}), backbone, 2), seed=1)
    saved = save_delta(delta, backbone, tmp_path / "d")
    pulled = load_pulled(Version("job", saved.sha256), saved.path, lambda manifest: backbone)
    assert pulled.predict(sentences) == predict(PeltModel(backbone, delta).eval(), sentences)
    with pytest.raises(DeltaError, match="sha256"):
        load_pulled(Version("job", "0" * 64), saved.path, lambda manifest: backbone)
