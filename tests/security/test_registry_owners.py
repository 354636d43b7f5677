"""The registry's side of what a token owns, on SQLite and on PostgreSQL: idempotency keys scoped per
actor (one scope for submits without one, as `pelt train` and scripts on the host make), and cancels
limited to the actor's own when the caller asks (the API does for tokens without the admin scope)."""

from __future__ import annotations

import pytest

from services.registry import IdempotencyConflictError, NotOwnerError, Registry, acting_as
from tests.registry.conftest import (  # noqa: F401 - the registry tests' fixtures, on both databases
    backend,
    clock,
    migrated_url,
    ready,
    registry,
    sst2_file,
    templates,
)


def test_the_registry_scopes_keys_per_actor_and_keeps_one_scope_for_submits_without_one(ready: Registry):  # noqa: F811
    with acting_as("alice"):
        hers = ready.submit_job("sst2", "lora", "tiny-bert", idempotency_key="k")
        her_sweep = ready.submit_sweep("sst2", ["lora"], [0], [None], "tiny-bert", idempotency_key="s")
        her_keyless = ready.submit_sweep("sst2", ["bitfit"], [0], [None], "tiny-bert")
    with acting_as("bob"):
        his = ready.submit_job("sst2", "bitfit", "tiny-bert", idempotency_key="k")
        his_sweep = ready.submit_sweep("sst2", ["bitfit"], [1], [None], "tiny-bert", idempotency_key="s")
        his_keyless = ready.submit_sweep("sst2", ["bitfit"], [0], [None], "tiny-bert")
    local = ready.submit_job("sst2", "lora", "tiny-bert", seed=3, idempotency_key="k")
    local_sweep = ready.submit_sweep("sst2", ["lora"], [0], [None], "tiny-bert", idempotency_key="s")
    assert len({hers.id, his.id, local.id}) == 3 and len({her_sweep.id, his_sweep.id, local_sweep.id}) == 3
    assert her_keyless.id != his_keyless.id and not his_keyless.already_submitted
    assert (his_sweep.submitted_by, local_sweep.submitted_by) == ("bob", None)

    assert ready.submit_job("sst2", "lora", "tiny-bert", seed=3, idempotency_key="k").id == local.id
    with pytest.raises(IdempotencyConflictError):
        ready.submit_job("sst2", "lora", "tiny-bert", seed=4, idempotency_key="k")
    with acting_as("alice"), pytest.raises(IdempotencyConflictError):
        ready.submit_sweep("sst2", ["bitfit"], [0], [None], "tiny-bert", idempotency_key="s")
    assert len(ready.list_jobs()) == 8  # nothing more than the eight submits above made


def test_the_registry_cancels_only_the_actors_own_when_asked_and_changes_nothing_else(ready: Registry):  # noqa: F811
    with acting_as("alice"):
        job = ready.submit_job("sst2", "lora", "tiny-bert")
        sweep = ready.submit_sweep("sst2", ["lora", "bitfit"], [1], [None], "tiny-bert")
    local = ready.submit_job("sst2", "bitfit", "tiny-bert", seed=5)
    trail = ready.audit_events()
    with acting_as("bob"):
        for refused_cancel in (
            lambda: ready.cancel_job(job.id, own_only=True),
            lambda: ready.cancel_job(local.id, own_only=True),
            lambda: ready.cancel_sweep(sweep.id, own_only=True),
        ):
            with pytest.raises(NotOwnerError, match="'admin' scope"):
                refused_cancel()
    assert {j.status for j in ready.list_jobs()} == {"queued"} and ready.audit_events() == trail
    with acting_as("alice"):
        assert ready.cancel_sweep(sweep.id, own_only=True) == 2
    assert ready.cancel_job(job.id).status == "cancelled"  # a library call: no owner asked for
