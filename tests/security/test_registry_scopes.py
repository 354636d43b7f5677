"""The registry's side of who-may-do-what, on SQLite and on PostgreSQL: the cap on queued jobs counts each
actor's own queued jobs inside the submit's transaction, and every write records its actor in the same
transaction (a refused write records nothing)."""

from __future__ import annotations

import pytest

from services.registry import QuotaExceededError, Registry, acting_as
from tests.registry.conftest import (  # noqa: F401 - the registry tests' fixtures, on both databases
    backend,
    clock,
    migrated_url,
    ready,
    registry,
    sst2_file,
    templates,
)


def test_the_queued_job_cap_counts_each_actors_queued_jobs_and_a_refusal_writes_nothing(ready: Registry):  # noqa: F811
    ready.max_queued_jobs_per_token = 2
    with acting_as("alice"):
        first = ready.submit_job("sst2", "lora", "tiny-bert")
        audit_before = ready.audit_events()
        with pytest.raises(QuotaExceededError, match="PELT_MAX_QUEUED_JOBS_PER_TOKEN"):
            ready.submit_sweep("sst2", ["lora", "bitfit"], [0], [None], "tiny-bert")
        assert [job.id for job in ready.list_jobs()] == [first.id] and ready.audit_events() == audit_before
        assert ready.submit_job("sst2", "bitfit", "tiny-bert").submitted_by == "alice"
        ready.claim_job("worker-1")  # a running job no longer waits in the queue
        assert ready.submit_job("sst2", "lora", "tiny-bert", seed=1).status == "queued"
    with acting_as("bob"):
        sweep = ready.submit_sweep("sst2", ["lora", "bitfit"], [0], [None], "tiny-bert")
    assert {ready.get_job(job_id).submitted_by for job_id in sweep.job_ids} == {"bob"}
    assert ready.submit_job("sst2", "lora", "tiny-bert", seed=5).submitted_by is None  # no actor: not capped


def test_every_registry_write_records_its_actor(ready: Registry):  # noqa: F811
    with acting_as("carol"):
        job = ready.submit_job("sst2", "lora", "tiny-bert")
        sweep = ready.submit_sweep("sst2", ["bitfit"], [0, 1], [None], "tiny-bert")
        ready.cancel_job(job.id)
        ready.cancel_sweep(sweep.id)
        ready.register_method({"name": "mine", "modules": {"q": {
            "form": "bottleneck", "representation": "attn.q", "insertion": "parallel", "composition": "scaled",
            "size": 2, "alpha": 4, "nonlinearity": "identity", "proj_bias": False, "init": "lora"}}})
        ready.create_api_token("dave", scope="read")
        ready.revoke_api_token("dave")
        ready.record_audit("delta.compose", "sst2 version 3", {"op": "merge"})
    trail = [(e.actor, e.action, e.target) for e in reversed(ready.audit_events())]
    assert trail == [
        (None, "task.register", "sst2"), (None, "backbone.register", "tiny-bert"),
        ("carol", "job.submit", f"job {job.id}"), ("carol", "sweep.submit", f"sweep {sweep.id}"),
        ("carol", "job.cancel", f"job {job.id}"), ("carol", "sweep.cancel", f"sweep {sweep.id}"),
        ("carol", "method.register", "mine"), ("carol", "token.create", "dave"),
        ("carol", "token.revoke", "dave"), ("carol", "delta.compose", "sst2 version 3"),
    ]
    assert ready.audit_events()[0].detail == {"op": "merge"}
