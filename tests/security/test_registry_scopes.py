"""The registry's side of who-may-do-what, on SQLite and on PostgreSQL: the cap on queued jobs counts each
actor's own queued jobs inside the submit's transaction, and every write records its actor in the same
transaction (a refused write records nothing)."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text

from services.registry import QuotaExceededError, Registry, acting_as, db
from tests.api.helpers import tiny_lora_spec
from tests.registry.conftest import (  # noqa: F401 - the registry tests' fixtures, on both databases
    backend,
    clock,
    db_url,
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
        ready.register_method(tiny_lora_spec("mine"))
        ready.create_api_token("dave", scope="read")
        ready.revoke_api_token("dave")
        ready.record_audit("delta.compose", "sst2 version 3", {"op": "merge"})
    trail = [(e.actor, e.action, e.target) for e in reversed(ready.audit_events())]
    assert trail == [
        (None, "task.register", "sst2"),
        (None, "backbone.register", "tiny-bert"),
        ("carol", "job.submit", f"job {job.id}"),
        ("carol", "sweep.submit", f"sweep {sweep.id}"),
        ("carol", "job.cancel", f"job {job.id}"),
        ("carol", "sweep.cancel", f"sweep {sweep.id}"),
        ("carol", "method.register", "mine"),
        ("carol", "token.create", "dave"),
        ("carol", "token.revoke", "dave"),
        ("carol", "delta.compose", "sst2 version 3"),
    ]
    assert ready.audit_events()[0].detail == {"op": "merge"}


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_on_postgresql_a_submit_waits_for_the_other_submits_of_its_token_before_it_counts(ready: Registry):  # noqa: F811
    """Counting queued jobs and inserting one is not atomic under READ COMMITTED: two submits of one token
    could both count below the cap. Each submit first locks its token's row, so the second one waits."""
    from sqlalchemy import text

    ready.create_api_token("alice")
    ready.max_queued_jobs_per_token = 1
    submitted: list[object] = []

    def submit() -> None:
        with acting_as("alice"):
            try:
                submitted.append(ready.submit_job("sst2", "lora", "tiny-bert"))
            except Exception as exc:  # the main thread asserts on it
                submitted.append(exc)

    with ready.engine.connect() as other, ready.engine.connect() as watcher:
        other.begin()  # another submit of alice's, in progress: it holds her row
        other.execute(text("SELECT id FROM api_tokens WHERE name = 'alice' FOR UPDATE"))
        worker = threading.Thread(target=submit)
        worker.start()
        deadline = time.monotonic() + 60
        waiting = 0
        while not waiting and worker.is_alive() and time.monotonic() < deadline:
            worker.join(0.02)
            waiting = watcher.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"
                )
            ).scalar()
            watcher.rollback()  # a fresh snapshot of the activity each time
        assert waiting and not submitted, (
            f"the submit did not wait for the other one of its token: {submitted}"
        )
        other.rollback()
    worker.join(60)
    assert len(submitted) == 1 and getattr(submitted[0], "submitted_by", None) == "alice", submitted


def test_downgrading_below_token_scopes_revokes_every_token_that_was_not_admin(db_url: str):  # noqa: F811
    """Before revision 0007 every token could do everything: a read or write token kept by a downgrade
    would become a full-power one. The downgrade revokes them; admin tokens keep working."""
    db.upgrade(db_url)
    with Registry(db_url) as migrated:
        secrets = {
            scope: migrated.create_api_token(f"{scope}-user", scope=scope)[1]
            for scope in ("read", "write", "admin")
        }
        migrated.revoke_api_token("admin-user")
        _, kept = migrated.create_api_token("operator", scope="admin")
    db.downgrade(db_url, "0006")
    with db.connect(db_url) as engine, engine.connect() as connection:
        active = connection.execute(text("SELECT name FROM api_tokens WHERE revoked_at IS NULL")).scalars()
        assert sorted(active) == ["operator"]  # what a pelt before 0007 lets in
    db.upgrade(db_url)
    with Registry(db_url) as migrated:
        assert [scope for scope, secret in secrets.items() if migrated.authenticate(secret)] == []
        assert migrated.authenticate(kept) is not None
