"""`pelt methods` and `pelt train`: a single local job from the command line, no service."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pelt_core import get_method
from services.cli import main

from .test_train import rows


@pytest.fixture
def model_dir(tmp_path, make_backbone):
    backbone = make_backbone("bert")
    path = tmp_path / "tiny-model"
    backbone.model.config._attn_implementation = "sdpa"
    backbone.model.save_pretrained(path)
    backbone.tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def data_files(tmp_path):
    train, validation = tmp_path / "train.jsonl", tmp_path / "validation.csv"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows(32)))
    validation.write_text("sentence,label\n" + "".join(f"{r['sentence']},{r['label']}\n" for r in rows(12)))
    return train, validation


def test_methods_lists_every_preset_with_its_parameter_share(model_dir):
    result = CliRunner().invoke(main, ["methods", "--backbone", str(model_dir), "--json"])
    assert result.exit_code == 0, result.output
    listing = json.loads(result.output)
    by_name = {row["method"]: row for row in listing["methods"]}
    assert {"bitfit", "lora", "prefix", "unipelt", "mam"} <= set(by_name)
    assert by_name["lora"]["parameters"] == 2 * 2 * (2 * 32 * 8)  # 2 layers × (q, v) × 2·d·r
    assert 0 < by_name["lora"]["percent"] < 100
    assert by_name["prefix"]["learning_rate"] == get_method("prefix").defaults["learning_rate"]


def test_the_methods_table_shows_each_presets_default_learning_rate(model_dir):
    result = CliRunner().invoke(main, ["methods", "--backbone", str(model_dir)])
    assert result.exit_code == 0, result.output
    header, *lines = result.output.splitlines()[1:]
    assert header.split()[:4] == ["method", "parameters", "%", "lr"]
    lora = next(line for line in lines if line.split()[0] == "lora")
    assert f"{get_method('lora').defaults['learning_rate']:.0e}" in lora.split()


def test_train_writes_the_delta_and_prints_metrics_json_last(model_dir, data_files, tmp_path):
    train, validation = data_files
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        [
            "train",
            "--backbone",
            str(model_dir),
            "--train",
            str(train),
            "--validation",
            str(validation),
            "--method",
            "lora",
            "--set",
            "r=4",
            "--set",
            "epochs=2",
            "--set",
            "lr=1e-2",
            "--set",
            "bf16=false",
            "--out",
            str(out),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["method"] == "lora" and 0.0 <= summary["metrics"]["accuracy"] <= 1.0
    assert summary["pelt_parameters"] == 2 * 2 * (2 * 32 * 4)
    assert (out / "delta.safetensors").exists() and (out / "manifest.json").exists()
    assert (out / "peft" / "adapter_config.json").exists()
    assert json.loads((out / "manifest.json").read_text())["method"]["modules"]["q"]["size"] == 4


def test_a_user_defined_method_from_a_json_file(model_dir, data_files, tmp_path):
    spec = tmp_path / "my_method.json"
    spec.write_text(
        json.dumps(
            {
                "name": "ffn_lora_gated",
                "modules": {
                    "m": {
                        "form": "bottleneck",
                        "representation": "ffn.in",
                        "insertion": "parallel",
                        "composition": "scaled",
                        "size": 2,
                        "alpha": 4,
                        "nonlinearity": "identity",
                        "proj_bias": False,
                        "init": "lora",
                        "gate": True,
                    }
                },
            }
        )
    )
    train, _ = data_files
    result = CliRunner().invoke(
        main,
        [
            "train",
            "--backbone",
            str(model_dir),
            "--train",
            str(train),
            "--method",
            str(spec),
            "--set",
            "epochs=1",
            "--out",
            str(tmp_path / "o"),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["method"] == "ffn_lora_gated"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "lorra"], "unknown method 'lorra'"),
        (
            ["--method", "lora", "--set", "lr=-1"],
            "lr: must be in (0, 10], got -1.0",
        ),  # the table of limits' range
        (["--method", "lora", "--set", "r=0"], "r: must be in [1, 16384], got 0"),
        (["--method", "lora", "--label-field", "stars"], "label field 'stars' is not in the data"),
        (["--method", "lora", "--set", "k_shot=1000"], "K=1000 is larger than the training set"),
        (
            ["--method", "lora", "--set", "epoch=2"],
            "epoch: not a training hyperparameter and not a field of any module; did you mean epochs?",
        ),
    ],
)
def test_bad_input_fails_with_a_message_naming_what_is_wrong(args, message, model_dir, data_files, tmp_path):
    train, _ = data_files
    out = tmp_path / "never"
    result = CliRunner().invoke(
        main,
        ["train", "--backbone", str(model_dir), "--train", str(train), *args, "--out", str(out), "--quiet"],
    )
    assert result.exit_code != 0
    assert message in result.output
    assert not out.exists()


def test_an_unknown_backbone_names_the_packaged_ones(data_files, tmp_path):
    train, _ = data_files
    result = CliRunner().invoke(
        main,
        [
            "train",
            "--backbone",
            "gpt-17",
            "--train",
            str(train),
            "--method",
            "lora",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code != 0 and "all-minilm-l6-v2" in result.output


def test_train_on_float_labelled_sentence_pairs_trains_a_regression_job_and_prints_pearson(
    model_dir, tmp_path
):
    from .test_train import similarity_pairs

    train, validation = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    first = [{"sentence1": "good good", "sentence2": "good", "label": score} for score in (5.0, 3.8, 3.8)]
    train.write_text("".join(json.dumps(r) + "\n" for r in first + similarity_pairs(45, 0)))
    validation.write_text("".join(json.dumps(r) + "\n" for r in similarity_pairs(16, 1)))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        [
            "train",
            "--backbone",
            str(model_dir),
            "--train",
            str(train),
            "--validation",
            str(validation),
            "--method",
            "lora",
            "--set",
            "epochs=1",
            "--out",
            str(out),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert -1.0 <= summary["metrics"]["pearson"] <= 1.0
    head = json.loads((out / "manifest.json").read_text())["head"]
    assert head["problem_type"] == "regression" and head["text_fields"] == ["sentence1", "sentence2"]
