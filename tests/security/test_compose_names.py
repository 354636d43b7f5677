"""Names in compositions and the audit trail's text (issue "Harden, second round", finding 2): a composition's
`into` and its sources' names follow the registry's rule for task names (no `.`, `..`, `-rf`, newline or 1 MB
name: a 422 naming the field, nothing written); the audit trail stores bounded, structured fields; and
`pelt audit` prints every stored value on its own line, so none can forge another event."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from services.api.app import create_app
from services.client import PeltClient
from services.registry.rows import MAX_AUDIT_ITEMS, MAX_AUDIT_TEXT_CHARS
from tests.api.helpers import refused
from tests.security.conftest import versions

FORGED_LINE = "2026-01-01T00:00:00  admin  token.revoke  ci-deploy  -"
BAD_NAMES = {
    "dot-dot": "..",
    "dot": ".",
    "dash-rf": "-rf",
    "one-megabyte": "x" * (1 << 20),
    "newline": f"soup\n{FORGED_LINE}",
    "html": "<script>alert(1)</script>",
}


@pytest.fixture
def big_client(api) -> PeltClient:
    """A client of the same service whose app takes bodies of up to 4 MiB (a 1 MB name fits)."""
    settings = api.settings.model_copy(update={"max_request_bytes": 4 << 20})
    app = create_app(api.operations, settings)
    return PeltClient("http://testserver", token=api.token, http=TestClient(app), settings=settings)


def nothing_written(api, before: dict[str, list[str]]) -> None:
    """No new task or version in the delta store, and no composition in the audit trail."""
    assert {task: versions(api, task) for task in api.store.list_tasks()} == before
    assert [e for e in api.registry.audit_events() if e.action == "delta.compose"] == []


def stored(api) -> dict[str, list[str]]:
    return {task: versions(api, task) for task in api.store.list_tasks()}


@pytest.mark.parametrize("name", BAD_NAMES.values(), ids=BAD_NAMES.keys())
def test_a_bad_into_name_is_422_naming_into_and_writes_nothing(big_client, api, loras, name):
    before = stored(api)
    for op in ("merge", "average"):
        refused(lambda op=op: big_client.compose(op, loras, name), 422, "into")
    refused(lambda: big_client.compose("multi_task", {"a": loras[0], "b": loras[1]}, name), 422, "into")
    nothing_written(api, before)


@pytest.mark.parametrize("name", BAD_NAMES.values(), ids=BAD_NAMES.keys())
def test_a_bad_source_name_is_422_naming_sources_and_writes_nothing(big_client, api, loras, name):
    before = stored(api)
    for op in ("merge", "multi_task"):
        error = refused(lambda op=op: big_client.compose(op, {name: loras[0], "b": loras[1]}, "soup"), 422)
        assert error.field == "sources", error
        assert len(error.message) < 400, "the message quotes a bad name cut short"
    nothing_written(api, before)


def test_a_source_reference_that_is_not_one_is_422_naming_it(big_client, api, loras):
    before = stored(api)
    for ref in (f"toy@{'x' * (1 << 20)}", f"toy/1\n{FORGED_LINE}", "../toy"):
        refused(lambda ref=ref: big_client.compose("merge", [loras[0], ref], "soup"), 422, "sources[1]")
        refused(
            lambda ref=ref: big_client.compose("merge", {"a": loras[0], "b": ref}, "soup"), 422, "sources.b"
        )
    nothing_written(api, before)


def test_names_that_follow_the_rule_compose_and_the_audit_records_them_as_fields(client, api, loras):
    composed = client.compose("multi_task", {"Sst2-a": loras[0], "b_2": loras[1]}, "pair.v2")
    assert composed.task == "pair.v2"
    event = api.registry.audit_events()[0]
    assert (event.action, event.target) == ("delta.compose", "pair.v2 version 1")
    assert event.detail == {
        "op": "multi_task",
        "sources": {"Sst2-a": loras[0], "b_2": loras[1]},
        "aliases": [],
    }


def test_an_audit_events_fields_are_bounded(api):
    huge = "<p>" + "x" * (1 << 20)
    api.registry.record_audit(
        "delta.compose",
        huge,
        {
            "sources": {huge: huge, **{f"s{i}": "t" for i in range(200)}},
            "aliases": [huge] * (MAX_AUDIT_ITEMS + 10),
        },
    )
    event = api.registry.audit_events()[0]
    assert len(event.target) <= 300
    assert len(event.detail["sources"]) == MAX_AUDIT_ITEMS and len(event.detail["aliases"]) == MAX_AUDIT_ITEMS
    texts = [*event.detail["sources"], *event.detail["sources"].values(), *event.detail["aliases"]]
    assert max(len(text) for text in texts) <= MAX_AUDIT_TEXT_CHARS


def test_no_stored_audit_value_can_forge_a_line_in_pelt_audit(api, monkeypatch):
    from services.commands import admin

    # written past the API's checks (a direct library call, an older pelt): the printing is what must hold
    target = f"soup version 1\n{FORGED_LINE}\r\x1b[2K\u2028\u202e"
    api.registry.record_audit("delta.compose", target, {"sources": {"a\nb": "toy/1"}})
    monkeypatch.setattr(admin, "PeltClient", api.client)
    result = CliRunner().invoke(admin.audit_command, [])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 + len(api.registry.audit_events()), lines  # the header, then one line per event
    assert lines[1].split()[2] == "delta.compose"
    assert f"soup version 1\\n{FORGED_LINE}\\r\\x1b[2K\\u2028\\u202e" in lines[1]
    assert not any(char in result.output for char in "\r\x1b\u2028\u202e")


def test_a_jobs_stored_error_cannot_forge_a_line_in_pelt_watch(capsys):
    from types import SimpleNamespace

    from services.commands import jobs

    error = f"RuntimeError: boom\n{FORGED_LINE}\r\x1b[2K\u2028\u202e"
    failed = SimpleNamespace(id=7, method="lora", status="failed", last_error=error)
    watching = SimpleNamespace(wait=lambda ids: [failed])
    with pytest.raises(SystemExit):
        jobs._watch(watching, [7])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"job 7 lora: failed: RuntimeError: boom\\n{FORGED_LINE}\\r\\x1b[2K\\u2028\\u202e"]


def test_a_refused_requests_message_cannot_forge_a_line_in_any_pelt_command():
    import click

    from services.client import PeltAPIError
    from services.commands.common import client_errors

    @click.command()
    @client_errors
    def refused_command() -> None:  # a service quoting uploaded text (a column name, a label) in its refusal
        raise PeltAPIError(422, f"label field 'x\n{FORGED_LINE}\r\x1b[2K\u2028\u202e' is not a column")

    result = CliRunner().invoke(refused_command, [])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f"Error: label field 'x\\n{FORGED_LINE}\\r\\x1b[2K\\u2028\\u202e' is not a column (HTTP 422)"
    ]


def test_the_store_names_new_things_by_the_registrys_rule_for_task_names():
    from services.delta_store.values import NEW_NAME_PATTERN
    from services.registry.validation import NAME_PATTERN

    assert NEW_NAME_PATTERN.pattern == NAME_PATTERN.pattern
