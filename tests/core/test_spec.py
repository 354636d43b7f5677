"""Every method is a preset of one modification spec; a new method is data."""

from __future__ import annotations

import json

import pytest

from pelt_core import BUILTIN_METHODS, MethodSpec, SpecError, TrainConfig, get_method
from pelt_core.config import ConfigError, parse_assignments, split_overrides

REQUIRED_PRESETS = {
    "bitfit",
    "houlsby",
    "pfeiffer",
    "prefix",
    "lora",
    "parallel_adapter",
    "scaled_parallel_adapter",
    "lora_ffn",
    "mam",
    "unipelt",
    "unipelt_ap",
    "unipelt_apl",
}


def test_all_presets_of_the_seed_papers_exist_and_validate():
    assert set(BUILTIN_METHODS) >= REQUIRED_PRESETS
    for spec in BUILTIN_METHODS.values():
        spec.validate()
        assert spec.reference, f"{spec.name} must cite its paper"


@pytest.mark.parametrize("name", sorted(REQUIRED_PRESETS))
def test_preset_round_trips_through_json(name):
    spec = BUILTIN_METHODS[name]
    assert MethodSpec.from_dict(json.loads(spec.to_json())) == spec


def test_user_defined_method_is_plain_data():
    spec = get_method(
        {
            "name": "gated_ffn_lora",
            "modules": {
                "ffn": {
                    "form": "bottleneck",
                    "representation": "ffn.in",
                    "insertion": "parallel",
                    "composition": "scaled",
                    "size": 4,
                    "alpha": 8,
                    "nonlinearity": "identity",
                    "proj_bias": False,
                    "init": "lora",
                    "gate": True,
                }
            },
            "bias": True,
        }
    )
    assert spec.modules["ffn"].effective_scale == 2.0
    assert spec.bias


def test_overrides_address_modules_by_role_or_alias():
    spec = get_method(
        "unipelt", {"lora_q.size": "4", "prefix_length": "5", "bottleneck": "16", "bias": "true"}
    )
    assert spec.modules["lora_q"].size == 4 and spec.modules["lora_v"].size == 8
    assert spec.modules["prefix"].size == 5
    assert spec.modules["adapter"].size == 16
    assert spec.bias
    assert get_method("lora", {"r": 2}).modules["q"].effective_scale == 4.0  # α/r follows the rank


@pytest.mark.parametrize(
    ("method", "overrides", "names"),
    [
        ("lora", {"r": "0"}, "size"),
        ("lora", {"rank": "two"}, "rank"),
        ("lora", {"nope.size": "2"}, "nope"),
        ("lora", {"colour": "red"}, "colour"),
        ("prefix", {"composition": "add"}, "composition"),
        ("pfeiffer", {"nonlinearity": "cubic"}, "nonlinearity"),
    ],
)
def test_bad_overrides_name_the_field(method, overrides, names):
    with pytest.raises(SpecError, match=names):
        get_method(method, overrides)


def test_unknown_method_lists_the_builtins():
    with pytest.raises(SpecError, match="lora"):
        get_method("lorra")


def test_a_method_must_train_something():
    with pytest.raises(SpecError, match="must train something"):
        MethodSpec.from_dict({"name": "nothing", "modules": {}})


def test_train_config_validates_and_names_the_field():
    assert TrainConfig.from_dict({"learning_rate": "1e-3", "k_shot": "8", "epochs": "2"}).k_shot == 8
    for bad, field in [
        ({"learning_rate": 0}, "learning_rate"),
        ({"batch_size": 0}, "batch_size"),
        ({"k_shot": 0}, "k_shot"),
        ({"epochs": "many"}, "epochs"),
        ({"warmup": 1}, "warmup"),
    ]:
        with pytest.raises(ConfigError, match=field):
            TrainConfig.from_dict(bad)


def test_cli_assignments_split_into_training_and_spec_overrides():
    train, spec = split_overrides(parse_assignments(["lr=1e-3", "r=4", "k=100", "bias=true"]))
    assert train == {"learning_rate": "1e-3", "k_shot": "100"}
    assert spec == {"r": "4", "bias": "true"}
    with pytest.raises(SpecError, match="key=value"):
        parse_assignments(["oops"])
