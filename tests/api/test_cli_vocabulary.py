"""The CLI speaks the client's and the API's words: `pelt task|method|backbone register|list|show` call
`register_task|register_method|register_backbone` (`POST /v1/tasks|methods|backbones`) and their readers;
the service's refusals end a command with its message and a non-zero exit; `pelt task add`, the old name of
`pelt task register`, still works for existing scripts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.api.conftest import BACKBONE, Api
from tests.api.helpers import tiny_lora_spec


@pytest.fixture
def cli(api: Api, monkeypatch: pytest.MonkeyPatch):
    """`cli("method", "register", "spec.json")`: `pelt …` as a user types it, against the app under test."""
    from services.cli import main
    from services.commands import backbones, methods, tasks

    for module in (tasks, methods, backbones):
        monkeypatch.setattr(module, "PeltClient", api.client)

    def run(*args: str) -> Result:
        return CliRunner().invoke(main, list(args))

    return run


def write_json(path: Path, value: object) -> Path:
    path.write_text(json.dumps(value))
    return path


# --- one vocabulary ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("resource", ["task", "method", "backbone"])
def test_each_resource_the_client_registers_has_register_list_and_show(cli, resource):
    shown = cli(resource, "--help")
    assert shown.exit_code == 0, shown.output
    listed = [line.split()[0] for line in shown.output.split("Commands:")[1].splitlines() if line.strip()]
    assert {"register", "list", "show"} <= set(listed)
    assert "add" not in listed  # one verb in the help: `register`


# --- tasks -----------------------------------------------------------------------------------------------


def test_pelt_task_register_registers_a_task_and_the_old_pelt_task_add_still_does(cli, api, toy_files):
    splits = ["--train", str(toy_files["train"]), "--validation", str(toy_files["validation"])]
    registered = cli("task", "register", "toy", *splits, "--text-field", "sentence")
    added = cli("task", "add", "toy-again", *splits, "--text-field", "sentence")

    assert registered.exit_code == 0, registered.output
    assert added.exit_code == 0, added.output
    assert registered.output.startswith("task toy: 200 training rows")
    assert added.output.startswith("task toy-again: 200 training rows")
    assert sorted(t.name for t in api.registry.list_tasks()) == ["toy", "toy-again"]


# --- methods ---------------------------------------------------------------------------------------------


def test_pelt_method_register_sends_a_spec_file_and_the_method_is_listed_and_shown(cli, tmp_path):
    spec = write_json(tmp_path / "tiny_lora.json", tiny_lora_spec("tiny_lora"))

    registered = cli("method", "register", str(spec))
    assert registered.exit_code == 0, registered.output
    assert registered.output.startswith("method tiny_lora registered (fingerprint ")

    mine = cli("method", "list", "--user")
    assert mine.exit_code == 0, mine.output
    header, *rows = mine.output.splitlines()
    assert header.split()[:3] == ["name", "builtin", "fingerprint"]
    assert [row.split()[:2] for row in rows] == [["tiny_lora", "no"]]
    every = cli("method", "list").output.split()
    assert {"lora", "bitfit", "tiny_lora"} <= set(every)

    shown = cli("method", "show", "tiny_lora")
    assert shown.exit_code == 0, shown.output
    body = json.loads(shown.output)
    assert body["builtin"] is False and body["spec"]["modules"]["q"]["size"] == 2


def test_pelt_method_register_changes_a_registered_spec_only_with_replace(cli, api, tmp_path):
    spec = tiny_lora_spec("tiny_lora")
    assert cli("method", "register", str(write_json(tmp_path / "v1.json", spec))).exit_code == 0
    spec["modules"]["q"]["size"] = 4
    changed = write_json(tmp_path / "v2.json", spec)

    refused = cli("method", "register", str(changed))
    assert refused.exit_code == 1
    assert "already exists with a different spec" in refused.output and "(HTTP 409)" in refused.output
    assert "pelt method register --replace" in refused.output  # what to type, in every interface's words
    assert api.registry.get_method("tiny_lora").spec["modules"]["q"]["size"] == 2

    replaced = cli("method", "register", str(changed), "--replace")
    assert replaced.exit_code == 0, replaced.output
    assert api.registry.get_method("tiny_lora").spec["modules"]["q"]["size"] == 4


def test_a_bad_method_spec_ends_pelt_method_register_with_the_services_message(cli, api, tmp_path):
    broken = {"name": "broken", "modules": {"ffn": {"form": "cube", "representation": "ffn", "size": 4}}}
    result = cli("method", "register", str(write_json(tmp_path / "broken.json", broken)))

    assert result.exit_code == 1
    assert "cube" in result.output and "(HTTP 422)" in result.output
    assert "Traceback" not in result.output
    assert "broken" not in cli("method", "list").output.split()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (None, "cannot read it: No such file"),
        ("{not json", "not a JSON method spec"),
        ("NaN", "NaN is not a number JSON allows"),
        ('["lora"]', "a method spec is a JSON object"),
    ],
)
def test_a_spec_file_that_is_no_json_object_is_refused_before_any_request(cli, api, tmp_path, text, words):
    path = tmp_path / "spec.json"
    if text is not None:
        path.write_text(text)
    result = cli("method", "register", str(path))

    assert result.exit_code == 2  # a bad argument, named
    assert "SPEC.json" in result.output and words in result.output
    assert api.registry.list_methods(builtin=False) == []


# --- backbones -------------------------------------------------------------------------------------------


def test_pelt_backbone_register_loads_a_folder_and_the_backbone_is_listed_and_shown(cli, tiny_bert_dir):
    registered = cli("backbone", "register", "tiny-again", str(tiny_bert_dir))
    assert registered.exit_code == 0, registered.output
    assert registered.output.startswith("backbone tiny-again registered from tiny-bert, content hash ")

    listed = cli("backbone", "list")
    assert listed.exit_code == 0, listed.output
    header, *rows = listed.output.splitlines()
    assert header.split() == ["name", "source", "parameters", "model_type", "content_hash"]
    assert sorted(row.split()[0] for row in rows) == sorted([BACKBONE, "tiny-again"])

    shown = {name: json.loads(cli("backbone", "show", name).output) for name in (BACKBONE, "tiny-again")}
    assert shown["tiny-again"]["content_hash"] == shown[BACKBONE]["content_hash"]  # the same weights
    assert registered.output.split()[-1] == shown["tiny-again"]["content_hash"]


def test_pelt_backbone_register_ends_with_the_services_refusal(
    cli, api, tiny_bert_dir, tmp_path, monkeypatch
):
    from services.commands import backbones

    missing = cli("backbone", "register", "nothing", str(tmp_path / "missing"))
    assert missing.exit_code == 1 and "(HTTP 422)" in missing.output

    _, secret = api.registry.create_api_token("writer", scope="write")
    monkeypatch.setattr(backbones, "PeltClient", lambda: api.client(secret))
    not_admin = cli("backbone", "register", "tiny-again", str(tiny_bert_dir))
    assert not_admin.exit_code == 1 and "(HTTP 403)" in not_admin.output
    assert [b.name for b in api.registry.list_backbones()] == [BACKBONE]
