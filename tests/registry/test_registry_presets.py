"""Built-in presets come from pelt_core.methods at run time: an edit or a new preset there reaches the
registry's next job with no migration; every job records which version of its preset it ran."""

from __future__ import annotations

import dataclasses

import pytest

import pelt_core
from pelt_core.spec import MethodSpec
from services.registry import AlreadyExistsError, Registry, presets


def put_preset(monkeypatch: pytest.MonkeyPatch, spec: MethodSpec) -> None:
    """Edit (or add) a preset in pelt_core's registry of presets, for this test only."""
    monkeypatch.setitem(pelt_core.methods.BUILTIN_METHODS, spec.name, spec)


def lora_with(rank: int, learning_rate: float, name: str = "lora") -> MethodSpec:
    edited = pelt_core.get_method("lora", {"r": rank})
    return dataclasses.replace(edited, name=name, defaults={"learning_rate": learning_rate})


def test_a_preset_edited_in_pelt_core_reaches_the_next_service_job_with_no_migration(
    ready: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = ready.submit_job("sst2", "lora", "tiny-bert", seed=0)
    edited = lora_with(rank=4, learning_rate=4e-3)
    put_preset(monkeypatch, edited)

    job = ready.submit_job("sst2", "lora", "tiny-bert", seed=1)
    (sweep_job,) = ready.list_jobs(sweep_id=ready.submit_sweep("sst2", ["lora"], [2], [None], "tiny-bert").id)
    for after in (job, sweep_job):
        assert after.method_spec == edited.to_dict()
        assert after.method_spec["modules"]["q"]["size"] == 4
        assert after.method_spec["defaults"] == {"learning_rate": 4e-3}
        assert after.method_fingerprint == presets.fingerprint(edited.to_dict()) != before.method_fingerprint
    assert ready.get_method("lora").spec == edited.to_dict()
    assert ready.get_method("lora").fingerprint == job.method_fingerprint
    kept = ready.get_job(before.id)  # an older job keeps the spec it was queued with
    assert (kept.method_spec["modules"]["q"]["size"], kept.method_fingerprint) == (
        8,
        before.method_fingerprint,
    )


def test_a_job_records_the_fingerprint_of_its_base_preset_before_overrides(ready: Registry) -> None:
    plain = ready.submit_job("sst2", "lora", "tiny-bert")
    ranked = ready.submit_job("sst2", "lora", "tiny-bert", {"r": 2}, seed=1)
    assert ranked.method_spec != plain.method_spec
    assert (
        ranked.method_fingerprint
        == plain.method_fingerprint
        == presets.fingerprint(pelt_core.builtin_specs()["lora"])
    )


def test_a_preset_added_to_pelt_core_is_listed_and_can_be_submitted_with_no_migration(
    ready: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    added = lora_with(rank=2, learning_rate=1e-3, name="lora_r2")
    put_preset(monkeypatch, added)
    assert ready.list_methods(builtin=True)[-1].name == "lora_r2"
    assert ready.get_method("lora_r2").builtin
    job = ready.submit_job("sst2", "lora_r2", "tiny-bert")
    assert (job.method, job.method_spec) == ("lora_r2", added.to_dict())
    assert [j.id for j in ready.list_jobs(method="lora_r2")] == [job.id]


def test_a_user_preset_named_like_a_built_in_is_refused_unless_it_is_the_built_in_itself(
    ready: Registry,
) -> None:
    with pytest.raises(AlreadyExistsError, match="'lora' is a built-in method") as refused:
        ready.register_method(lora_with(rank=2, learning_rate=1e-3).to_dict())
    assert refused.value.field == "name"
    assert ready.register_method(pelt_core.builtin_specs()["lora"]) == ready.get_method("lora")
    assert ready.list_methods(builtin=False) == []


def test_a_user_preset_keeps_its_name_when_a_later_pelt_core_adds_a_preset_of_that_name(
    ready: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = ready.register_method(lora_with(rank=2, learning_rate=1e-3, name="lora_r2").to_dict())
    put_preset(monkeypatch, lora_with(rank=16, learning_rate=1e-3, name="lora_r2"))
    assert ready.get_method("lora_r2") == mine
    assert "lora_r2" not in [m.name for m in ready.list_methods(builtin=True)]
    assert ready.submit_job("sst2", "lora_r2", "tiny-bert").method_spec["modules"]["q"]["size"] == 2


def test_replacing_a_user_preset_changes_the_fingerprint_of_later_jobs_only(ready: Registry) -> None:
    first = ready.register_method(lora_with(rank=2, learning_rate=1e-3, name="mine").to_dict())
    old = ready.submit_job("sst2", "mine", "tiny-bert")
    second = ready.register_method(lora_with(rank=4, learning_rate=1e-3, name="mine").to_dict(), replace=True)
    new = ready.submit_job("sst2", "mine", "tiny-bert", seed=1)
    assert (old.method_fingerprint, new.method_fingerprint) == (first.fingerprint, second.fingerprint)
    assert first.fingerprint != second.fingerprint
