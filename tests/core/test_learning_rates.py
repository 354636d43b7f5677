"""Per-module learning rates: a module's `lr_multiplier` gives its parameters their own optimizer group at that
multiple of the job's rate, on the job's schedule; UniPELT's modules learn at their own presets' rates; specs
written before the field existed mean and read what they did."""

from __future__ import annotations

import json

import pytest

from pelt_core import MethodSpec, SpecError, TrainConfig, get_method
from pelt_core.model import JobDelta
from pelt_core.pack import Pack

ROWS = [{"sentence": f"{word} film number {i}", "label": i % 2} for i, word in enumerate(["good", "bad"] * 8)]


def groups_by_role(delta: JobDelta, learning_rate: float) -> dict[str, float]:
    """Each role's learning rate in the delta's parameter groups (a role sits in exactly one group)."""
    rates: dict[str, float] = {}
    for group in delta.parameter_groups(learning_rate):
        for role in group["roles"]:
            assert role not in rates, f"{role} is in two groups"
            rates[role] = group["lr"]
    return rates


def test_unipelts_modules_learn_at_their_own_presets_rates_and_the_rest_at_the_jobs(make_backbone):
    backbone = make_backbone("bert")
    method = get_method("unipelt", {"bias": True})
    rates = groups_by_role(JobDelta(method, backbone, num_labels=2), 1e-3)
    assert rates == pytest.approx(
        {
            "adapter": get_method("pfeiffer").defaults["learning_rate"],  # 1e-3
            "prefix": get_method("prefix").defaults["learning_rate"],  # 5e-3, its reparameterisation MLP too
            "lora_q": get_method("lora").defaults["learning_rate"],  # 2e-3
            "lora_v": get_method("lora").defaults["learning_rate"],
            "bitfit": 1e-3,
            "norm": 1e-3,
            "head": 1e-3,
        }
    )
    assert method.defaults["learning_rate"] == 1e-3
    # the job's rate moves them together: twice the job's rate, twice each module's
    assert groups_by_role(JobDelta(method, backbone, num_labels=2), 2e-3)["prefix"] == pytest.approx(1e-2)


def test_every_trainable_parameter_is_in_exactly_one_group(make_backbone, family):
    backbone = make_backbone(family)
    delta = JobDelta(get_method("unipelt", {"bias": True, "layer_norm": True}), backbone, num_labels=2)
    grouped = [id(p) for group in delta.parameter_groups(1e-3) for p in group["params"]]
    assert sorted(grouped) == sorted(id(p) for p in delta.parameters() if p.requires_grad)


def test_a_method_without_multipliers_has_one_group_at_the_jobs_rate(make_backbone):
    delta = JobDelta(get_method("lora"), make_backbone("bert"), num_labels=2)
    (group,) = delta.parameter_groups(2e-3)
    assert group["lr"] == 2e-3 and group["lr_multiplier"] == 1.0 and group["roles"] == ["q", "v", "head"]


def test_training_keeps_each_groups_rate_at_its_multiple_of_the_schedule(make_backbone):
    from datasets import Dataset

    method = get_method("unipelt_ap")
    pack = Pack(make_backbone("bert"))
    member = pack.join(
        method,
        Dataset.from_list(ROWS),
        config=TrainConfig(max_steps=4, batch_size=4, learning_rate=1e-3, warmup_ratio=0.5),
    )
    for _ in range(3):
        pack.step()
        step = member.step - 1  # the step just taken
        rates = {tuple(g["roles"]): g["lr"] for g in member.optimizer.param_groups}
        assert rates == pytest.approx(
            {("adapter", "head"): member.lr_at(step), ("prefix",): 5 * member.lr_at(step)}
        ), step


def test_a_spec_written_before_the_field_reads_and_writes_as_it_did():
    module = {"form": "bottleneck", "representation": "ffn", "size": 8}
    spec = MethodSpec.from_dict({"name": "old", "modules": {"adapter": module}})
    assert spec.modules["adapter"].lr_multiplier == 1.0
    assert "lr_multiplier" not in spec.to_dict()["modules"]["adapter"]  # the same JSON as before
    changed = MethodSpec.from_dict(
        {"name": "new", "modules": {"adapter": {**module, "lr_multiplier": 3}}}  # an integer reads as 3.0
    )
    assert changed.modules["adapter"].lr_multiplier == 3.0
    assert MethodSpec.from_dict(json.loads(changed.to_json())) == changed


@pytest.mark.parametrize("value", [0, -1, 1e4, float("nan"), "fast"])
def test_a_multiplier_out_of_range_is_refused_naming_the_module_and_field(value):
    module = {"form": "bottleneck", "representation": "ffn", "lr_multiplier": value}
    with pytest.raises(SpecError, match=r"mine\.modules\.adapter\.lr_multiplier"):
        MethodSpec.from_dict({"name": "mine", "modules": {"adapter": module}})


def test_an_override_sets_one_modules_multiplier():
    spec = get_method("unipelt").with_overrides({"prefix.lr_multiplier": "2.5"})
    assert spec.modules["prefix"].lr_multiplier == 2.5
    assert spec.modules["lora_q"].lr_multiplier == get_method("unipelt").modules["lora_q"].lr_multiplier
    with pytest.raises(SpecError, match="lr_multiplier"):
        get_method("unipelt").with_overrides({"prefix.lr_multiplier": "0"})


def test_deltas_that_differ_only_in_their_modules_learning_rates_compose(make_backbone):
    from pelt_core.compose import merge

    backbone = make_backbone("bert")
    slow = JobDelta(get_method("unipelt"), backbone, num_labels=2)
    fast = JobDelta(get_method("unipelt", {"prefix.lr_multiplier": 9}), backbone, num_labels=2)
    merged = merge([slow, fast], backbone=backbone)
    assert merged.method.name == "unipelt"
