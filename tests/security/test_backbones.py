"""Backbones a token holder can register (issue #11, findings 3 and 8).

A backbone comes only from a packaged alias or a model folder inside an allowed folder
(PELT_BACKBONE_DIRS), never from the data directory where uploads land; its config is checked against
size limits before anything is built; it is loaded off the API's request path, in a child process with
a memory limit; the API never shows the server path it was loaded from. Every refusal is a 4xx that
writes nothing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.client import PeltAPIError
from services.settings import Settings
from tests.api.conftest import BACKBONE, Api

LIMIT_AS_BYTES = 3 << 29  # 1.5 GiB: enough to import torch and build a tiny model, far from a 10**6-wide one


@pytest.fixture
def models(tmp_path: Path) -> Path:
    """The allowed folder of these tests (next to, never inside, the service's data directory)."""
    folder = tmp_path / "models"
    folder.mkdir()
    return folder


@pytest.fixture
def settings(settings: Settings, models: Path) -> Settings:
    return settings.model_copy(update={"backbone_dirs": [*settings.backbone_dirs, models.resolve()]})


def refused(call, status: int, field: str | None = "source") -> PeltAPIError:
    with pytest.raises(PeltAPIError) as caught:
        call()
    assert caught.value.status == status, caught.value
    assert caught.value.field == field, caught.value
    return caught.value


def snapshot(api: Api) -> tuple:
    """What a refused registration must leave as it was: the backbones and the files of the data folder."""
    return api.registry.list_backbones(), api.files()


def model_folder(tiny_bert_dir: Path, where: Path, *, weights: bool = True, **config: object) -> Path:
    """A copy of the tiny BERT at `where`, its config.json changed by `config`."""
    shutil.copytree(tiny_bert_dir, where)
    path = where / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if not weights:
        for weight_file in where.glob("*.safetensors"):
            weight_file.unlink()
    return where


def no_server_path_in(text: str, *paths: Path) -> None:
    for path in paths:
        assert str(path) not in text and str(path.resolve()) not in text, text


# --- where a backbone may come from ----------------------------------------------------------------


def test_a_folder_of_an_uploaded_dataset_archive_is_refused_even_inside_an_allowed_folder(
    api, client, tiny_bert_dir, tmp_path
):
    from datasets import Dataset

    folder = tmp_path / "upload"
    Dataset.from_dict({"text": ["good", "bad"] * 4, "label": [1, 0] * 4}).save_to_disk(folder)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if (tiny_bert_dir / name).exists():
            shutil.copy(tiny_bert_dir / name, folder / name)  # extra files ride along in the archive
    client.register_task("uploaded", dataset=folder, text_fields=["text"])
    kept = Path(api.registry.get_task("uploaded").source["path"])
    assert kept.is_relative_to(api.settings.data_dir)
    api.settings.backbone_dirs = [tmp_path.resolve()]  # an allowed folder that holds the data directory
    before = snapshot(api)

    for source in (str(kept), str(kept.relative_to(tmp_path.resolve())), str(kept.parent)):
        error = refused(lambda source=source: client.register_backbone("from-upload", source), 422)
        no_server_path_in(error.message, tmp_path, api.settings.data_dir)
    assert snapshot(api) == before


def test_a_model_folder_in_an_allowed_folder_registers_by_its_name_or_its_absolute_path(
    api, client, models, tiny_bert_dir
):
    model_folder(tiny_bert_dir, models / "my-bert")
    tiny_hash = api.registry.get_backbone(BACKBONE).content_hash

    mine = client.register_backbone("my-bert", "my-bert")
    assert (mine.source, mine.content_hash) == ("my-bert", tiny_hash)
    assert mine.facts is not None and mine.facts["hidden_size"] == 32 and mine.facts["num_layers"] == 2
    assert mine.facts["num_heads"] == 4 and mine.facts["intermediate_size"] == 64
    assert mine.facts["max_positions"] == 64 and mine.facts["num_parameters"] > 0
    assert api.registry.get_backbone("my-bert").facts == mine.facts
    again = client.register_backbone("my-bert-again", str(models / "my-bert"))
    assert (again.source, again.content_hash) == ("my-bert", tiny_hash)


def test_a_folder_outside_every_allowed_folder_is_refused_the_same_whether_it_exists_or_not(
    api, client, models, tiny_bert_dir, tmp_path
):
    outside = model_folder(tiny_bert_dir, tmp_path / "elsewhere" / "bert")
    before = snapshot(api)
    messages = set()
    for source in (
        str(outside),
        "../elsewhere/bert",
        "/etc",
        "/etc/passwd",
        ".",
        "no-such-model",
        "/no/such",
    ):
        error = refused(lambda source=source: client.register_backbone("outside", source), 422)
        no_server_path_in(error.message, models, api.settings.data_dir)
        messages.add(re.sub(r"^source: '[^']*'", "source: SOURCE", error.message))
    assert len(messages) == 1, messages  # the same words for every source: nothing of the filesystem shows
    assert snapshot(api) == before


def test_a_symlink_from_an_allowed_folder_to_outside_is_refused(api, client, models, tiny_bert_dir, tmp_path):
    outside = model_folder(tiny_bert_dir, tmp_path / "elsewhere" / "bert")
    (models / "link").symlink_to(outside, target_is_directory=True)
    before = snapshot(api)
    for source in ("link", str(models / "link")):
        error = refused(lambda source=source: client.register_backbone("linked", source), 422)
        no_server_path_in(error.message, outside, models)
    assert snapshot(api) == before


def test_a_name_taken_by_another_source_is_a_conflict_that_names_no_path(api, client, models, tiny_bert_dir):
    model_folder(tiny_bert_dir, models / "other-bert")
    before = snapshot(api)
    error = refused(lambda: client.register_backbone(BACKBONE, "other-bert"), 409)
    no_server_path_in(error.message, tiny_bert_dir, models)
    assert snapshot(api) == before


# --- configs checked before anything is built ------------------------------------------------------


def test_a_config_out_of_range_is_refused_through_the_api(api, client, models, tiny_bert_dir):
    model_folder(tiny_bert_dir, models / "huge", hidden_size=10**6)
    before = snapshot(api)
    error = refused(lambda: client.register_backbone("huge", str(models / "huge")), 422)
    assert "hidden_size" in error.message and "16384" in error.message, error.message
    no_server_path_in(error.message, models)
    assert snapshot(api) == before


def load_under_memory_limit(source: Path, **load_arguments: object) -> str:
    """`Backbone.load(source)` in a child process under RLIMIT_AS; the error it raised, or "loaded"."""
    code = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, ({LIMIT_AS_BYTES}, {LIMIT_AS_BYTES}))
        from pelt_core.backbones import Backbone, BackboneError
        try:
            Backbone.load({str(source)!r}, **{load_arguments!r})
            print("loaded")
        except BackboneError as exc:
            print("BackboneError:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"hidden_size": 10**6}, "config.hidden_size: must be in [1, 16384], got 1000000"),
        ({"num_hidden_layers": 0}, "config.num_hidden_layers: must be in [1, 256], got 0"),
        ({"vocab_size": 2.5}, "config.vocab_size: must be a whole number"),
        (
            {
                "hidden_size": 16_384,
                "intermediate_size": 131_072,
                "num_hidden_layers": 256,
                "num_attention_heads": 128,
            },
            "parameters, more than",
        ),
    ],
)
def test_backbone_load_refuses_a_config_out_of_range_before_building_anything(
    tiny_bert_dir, tmp_path, config, words
):
    folder = model_folder(tiny_bert_dir, tmp_path / "bad", **config)  # the tiny weights: the config decides
    outcome = load_under_memory_limit(folder)
    assert outcome.startswith("BackboneError:") and words in outcome, outcome


def test_backbone_load_takes_a_lower_parameter_bound_and_weights_are_required(tiny_bert_dir, tmp_path):
    assert "parameters, more than the limit 1,000" in load_under_memory_limit(
        tiny_bert_dir, max_parameters=1000
    )
    assert "no weights" in load_under_memory_limit(
        model_folder(tiny_bert_dir, tmp_path / "bare", weights=False)
    )
    assert load_under_memory_limit(tiny_bert_dir) == "loaded"


# --- loading off the request path ----------------------------------------------------------------------


def test_a_loader_that_runs_out_of_its_memory_limit_is_a_422_and_the_api_stays_up(
    api, client, models, tiny_bert_dir
):
    model_folder(tiny_bert_dir, models / "my-bert")
    api.settings.backbone_load_memory_bytes = 64 << 20  # below what torch alone maps: no model loads in it
    before = snapshot(api)
    error = refused(lambda: client.register_backbone("starved", "my-bert"), 422)
    assert "PELT_BACKBONE_LOAD_MEMORY_BYTES" in error.message, error.message
    no_server_path_in(error.message, models)
    assert snapshot(api) == before
    assert [b.name for b in client.backbones()] == [BACKBONE]


def test_a_loader_past_its_time_limit_is_a_422(api, client, models, tiny_bert_dir):
    model_folder(tiny_bert_dir, models / "my-bert")
    api.settings.backbone_load_timeout_seconds = 0.001  # no model loads in a millisecond, forked or fresh
    before = snapshot(api)
    error = refused(lambda: client.register_backbone("slow", "my-bert"), 422)
    assert "PELT_BACKBONE_LOAD_TIMEOUT_SECONDS" in error.message, error.message
    assert snapshot(api) == before


# --- what the API shows --------------------------------------------------------------------------------


def test_backbones_are_shown_by_alias_or_relative_folder_never_an_absolute_path(
    api, client, models, tiny_bert_dir, tmp_path
):
    api.registry.register_backbone("packaged", "all-minilm-l6-v2", "sha256:" + "0" * 64)
    api.registry.register_backbone("nested", str(models / "team" / "bert"), "sha256:" + "1" * 64)
    api.registry.register_backbone("legacy", str(tmp_path / "gone" / "old-bert"), "sha256:" + "2" * 64)
    shown = {b.name: b.source for b in client.backbones()}
    assert shown == {
        BACKBONE: "tiny-bert",
        "packaged": "all-minilm-l6-v2",
        "nested": "team/bert",
        "legacy": "old-bert",
    }
    assert client.http.get(f"/v1/backbones/{BACKBONE}").json()["source"] == "tiny-bert"
    listing = client.http.get("/v1/backbones").text
    no_server_path_in(listing, tmp_path, tiny_bert_dir, models)
    assert '"/' not in listing


def test_backbone_dirs_are_read_from_the_environment_as_a_path_list(monkeypatch, tmp_path):
    monkeypatch.setenv("PELT_BACKBONE_DIRS", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert Settings(data_dir=tmp_path / "data").backbone_dirs == [tmp_path / "a", tmp_path / "b"]
    monkeypatch.setenv("PELT_BACKBONE_DIRS", json.dumps([str(tmp_path / "c")]))
    assert Settings(data_dir=tmp_path / "data").backbone_dirs == [tmp_path / "c"]
    monkeypatch.delenv("PELT_BACKBONE_DIRS")
    assert Settings(data_dir=tmp_path / "data").backbone_dirs == []
