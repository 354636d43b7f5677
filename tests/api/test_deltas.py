"""/v1/tasks/{name}/deltas and /v1/compose as a specification: a composition goes into a name of its own
(or a task among its sources, or another task only when asked), is pulled by that name, an admin archives a
version so that no name or alias answers with it again, and a method's best names a method that exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.client import PeltAPIError
from tests.api.conftest import BACKBONE, Api
from tests.api.helpers import refused


@pytest.fixture
def two_loras(api: Api, toy_task: str, tmp_path: Path) -> str:
    """Versions 1 and 2 of task "toy": random rank-2 LoRA deltas on the tiny backbone (no training)."""
    import torch

    from pelt_core.backbones import Backbone
    from pelt_core.delta import save_delta
    from pelt_core.methods import get_method
    from pelt_core.model import JobDelta

    backbone = Backbone.load(api.registry.get_backbone(BACKBONE).source)
    for seed in (0, 1):
        torch.manual_seed(seed)
        delta = JobDelta(get_method("lora", {"r": 2}), backbone, num_labels=2, label_names=["0", "1"])
        api.store.register(toy_task, save_delta(delta, backbone, tmp_path / f"lora-{seed}").path)
    return toy_task


def audit_actions(api: Api) -> list[str]:
    return [event.action for event in api.registry.audit_events()]


def test_a_composition_into_a_registered_task_none_of_its_sources_comes_from_is_refused_and_writes_nothing(
    api: Api, two_loras: str, toy_files: dict[str, Path]
):
    client = api.client()
    client.register_task("rte", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    stored, audit = api.store.list_tasks(), audit_actions(api)
    error = refused(lambda: client.compose("merge", ["toy/1", "toy/2"], "rte"), 409, "into")
    assert "'rte' is a registered task" in error.message and "allow_existing" in error.message
    assert (api.store.list_tasks(), audit_actions(api)) == (stored, audit)

    asked = client.compose("merge", ["toy/1", "toy/2"], "rte", allow_existing=True)
    assert (asked.task, asked.version) == ("rte", "1")
    among_sources = client.compose("merge", ["toy/1", "toy/2"], "toy")  # a task among its sources
    assert (among_sources.task, among_sources.version) == ("toy", "3")


def test_pelt_compose_refuses_into_another_task_unless_into_existing(
    api: Api, two_loras: str, toy_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
):
    from click.testing import CliRunner

    from services.commands import deltas

    api.client().register_task("rte", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    monkeypatch.setattr(deltas, "PeltClient", api.client)
    arguments = ["merge", "toy/1", "toy/2", "--into", "rte"]
    answer = CliRunner().invoke(deltas.compose_command, arguments)
    assert answer.exit_code != 0 and "'rte' is a registered task" in answer.output
    answer = CliRunner().invoke(deltas.compose_command, [*arguments, "--into-existing"])
    assert answer.exit_code == 0 and answer.output.startswith("rte version 1: merge"), answer.output


def test_a_composition_is_pulled_by_its_own_name_as_its_latest_version_not_archived(api: Api, two_loras: str):
    client = api.client()
    first = client.compose("merge", ["toy/1", "toy/2"], "toy-soup", weights=[0.5, 0.5])
    assert client.delta_info("toy-soup").version == first.version == "1"
    second = client.compose("merge", ["toy/1", "toy/2"], "toy-soup", weights=[0.7, 0.3])
    assert client.delta_info("toy-soup").version == second.version == "2"
    assert client.pull("toy-soup").info.version == "2"

    archived = client.archive_version("toy-soup", 2)
    assert archived.archived and archived.version == "2"
    assert client.delta_info("toy-soup").version == "1"  # its name: the latest version not archived
    by_number = client.delta_info("toy-soup", version=2)  # its number still answers
    assert by_number.archived and by_number.sha256 == second.sha256
    assert [(v.version, v.archived) for v in client.versions("toy-soup")] == [("1", False), ("2", True)]


def test_an_archived_version_loses_its_aliases_and_no_alias_or_name_answers_with_it(api: Api, two_loras: str):
    client = api.client()
    client.compose("merge", ["toy/1", "toy/2"], "toy-soup", aliases=["soup"])
    assert client.delta_info("toy-soup", alias="soup").version == "1"
    client.archive_version("toy-soup", 1)
    refused(lambda: client.delta_info("toy-soup", alias="soup"), 404, words="no alias 'soup'")
    refused(lambda: client.delta_info("toy-soup"), 404, words="no alias 'best'")
    assert client.delta_info("toy-soup", version=1).aliases == []


def test_archiving_a_version_is_an_admins_audited_act_and_an_unknown_version_is_404(api: Api, two_loras: str):
    _, secret = api.registry.create_api_token("writer", scope="write")
    with pytest.raises(PeltAPIError) as denied:
        api.client(secret).archive_version(two_loras, 1)
    assert denied.value.status == 403 and not api.client().delta_info(two_loras, version=1).archived

    refused(lambda: api.client().archive_version(two_loras, 7), 404, words="no version '7'")
    assert "delta.archive" not in audit_actions(api)
    api.client().archive_version(two_loras, 1)
    api.client().archive_version(two_loras, 1)  # archived already: nothing changes, nothing recorded
    events = [e for e in api.registry.audit_events() if e.action == "delta.archive"]
    assert [(e.target, e.actor) for e in events] == [(f"{two_loras} version 1", "tests")]


def test_pelt_versions_archive_archives_and_pelt_versions_list_shows_it(
    api: Api, two_loras: str, monkeypatch: pytest.MonkeyPatch
):
    from click.testing import CliRunner

    from services.commands import deltas

    monkeypatch.setattr(deltas, "PeltClient", api.client)
    answer = CliRunner().invoke(deltas.versions_group, ["archive", two_loras, "2"])
    assert answer.exit_code == 0 and "toy version 2 archived" in answer.output, answer.output
    listing = CliRunner().invoke(deltas.versions_group, ["list", two_loras])
    assert listing.exit_code == 0, listing.output
    rows = {line.split()[0]: line.split() for line in listing.output.splitlines()[1:]}
    assert "yes" in rows["2"] and "yes" not in rows["1"]


def test_pulling_the_best_of_an_unknown_method_names_it_and_lists_the_known_methods_nearest_first(
    api: Api, two_loras: str
):
    error = refused(lambda: api.client().delta_info(two_loras, method="lorra"), 404, "method")
    assert error.message.startswith("method: unknown method 'lorra'; known methods: lora, ")
    assert "alias" not in error.message
    # a known method without a best version of this task is told apart
    refused(lambda: api.client().delta_info(two_loras, method="bitfit"), 404, words="no method 'bitfit'")


def test_pelt_pull_peft_writes_a_pulled_lora_as_a_peft_adapter_and_refuses_what_peft_cannot_load(
    api: Api, two_loras: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from click.testing import CliRunner

    from services.commands import deltas

    downloads = []

    def counting_client():
        client = api.client()
        request = client._request

        def counted(method, path, **options):
            downloads.extend([path] if path.endswith("/deltas/download") else [])
            return request(method, path, **options)

        client._request = counted
        return client

    monkeypatch.setattr(deltas, "PeltClient", counting_client)
    out = tmp_path / "pulled"
    answer = CliRunner().invoke(deltas.pull_command, ["toy", "--version", "1", "-o", str(out), "--peft"])
    assert answer.exit_code == 0, answer.output
    assert downloads == ["/v1/tasks/toy/deltas/download"]  # the PEFT export reads what pull downloaded
    assert f"PEFT adapter -> {out / 'peft'}" in answer.output
    assert {"adapter_config.json", "adapter_model.safetensors", "head.safetensors"} <= {
        p.name for p in (out / "peft").iterdir()
    }
    without = CliRunner().invoke(
        deltas.pull_command, ["toy", "--version", "2", "-o", str(tmp_path / "plain")]
    )
    assert without.exit_code == 0 and not (tmp_path / "plain" / "peft").exists()

    api.client().compose("multi_task", {"a": "toy/1", "b": "toy/2"}, "toy-pair")
    bundle = CliRunner().invoke(deltas.pull_command, ["toy-pair", "-o", str(tmp_path / "pair"), "--peft"])
    assert bundle.exit_code != 0 and "--peft: toy-pair version 1" in bundle.output
