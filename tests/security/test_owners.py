"""What a token owns (issue "Harden, second round"): its idempotency keys and its jobs and sweeps.

An idempotency key names a job or sweep of the token that submitted under it: another token's use of the
same text (a study's predictable key, taken first) neither answers for nor blocks this token's submit,
while the same token reusing its key for another request is still a 409. Submits without a token share
one scope of their own.

A write token cancels the jobs and sweeps it submitted; another token's (or one submitted without a
token) needs the admin scope: a 403 naming the scope and whose it is, and nothing is cancelled, not even
part of a sweep. Every cancel that happens is in the audit trail, with whose it was when it was not the
canceller's own.

Over HTTP, on SQLite (the API fixtures); test_registry_owners.py checks the registry on both databases.
"""

from __future__ import annotations

from services.client import PeltClient
from services.study.plan import StudyPlan, submit_study
from tests.api.conftest import BACKBONE, Api
from tests.api.helpers import refused
from tests.security.test_scopes import audit_actions, row_counts


def writers(api: Api) -> tuple[PeltClient, PeltClient]:
    """Two write tokens, `alice` and `bob`."""
    alice, bob = (api.registry.create_api_token(name, scope="write")[1] for name in ("alice", "bob"))
    return api.client(alice), api.client(bob)


# --- idempotency keys -----------------------------------------------------------------------------------


def test_another_tokens_idempotency_key_gets_this_token_its_own_job(api: Api, toy_task: str):
    alice, bob = writers(api)
    hers = {
        key: alice.submit(toy_task, "lora", backbone=BACKBONE, seed=7, idempotency_key=key)
        for key in ("nightly", "weekly")
    }
    other_request = bob.submit(toy_task, "bitfit", backbone=BACKBONE, idempotency_key="nightly")
    same_request = bob.submit(toy_task, "lora", backbone=BACKBONE, seed=7, idempotency_key="weekly")
    for his, key in ((other_request, "nightly"), (same_request, "weekly")):
        assert his.id != hers[key].id and his.submitted_by == "bob" and his.status == "queued"
    assert bob.submit(toy_task, "bitfit", backbone=BACKBONE, idempotency_key="nightly").id == other_request.id
    assert alice.submit(toy_task, "lora", backbone=BACKBONE, seed=7, idempotency_key="weekly").id == (
        hers["weekly"].id
    )
    assert len(api.registry.list_jobs()) == 4


def test_the_same_token_reusing_its_key_for_another_request_is_409_and_writes_nothing(
    api: Api, toy_task: str
):
    alice, _ = writers(api)
    alice.submit(toy_task, "lora", backbone=BACKBONE, idempotency_key="nightly")
    alice.sweep(toy_task, ["lora"], seeds=[0, 1], backbone=BACKBONE, idempotency_key="grid")
    before = row_counts(api), audit_actions(api)
    refused(
        lambda: alice.submit(toy_task, "lora", backbone=BACKBONE, seed=1, idempotency_key="nightly"),
        409,
        "idempotency_key",
        "'nightly' was already used for a different job",
    )
    refused(
        lambda: alice.sweep(toy_task, ["bitfit"], backbone=BACKBONE, idempotency_key="grid"),
        409,
        "idempotency_key",
        "'grid' was already used for a different sweep",
    )
    assert (row_counts(api), audit_actions(api)) == before


def test_another_tokens_sweep_key_or_identical_keyless_sweep_is_not_this_tokens_sweep(
    api: Api, toy_task: str
):
    alice, bob = writers(api)
    keyed = alice.sweep(toy_task, ["lora"], seeds=[0, 1], backbone=BACKBONE, idempotency_key="grid")
    keyless = alice.sweep(toy_task, ["bitfit"], seeds=[0, 1], backbone=BACKBONE)
    his_keyed = bob.sweep(toy_task, ["lora"], seeds=[0, 1], backbone=BACKBONE, idempotency_key="grid")
    his_keyless = bob.sweep(toy_task, ["bitfit"], seeds=[0, 1], backbone=BACKBONE)
    for hers, his in ((keyed, his_keyed), (keyless, his_keyless)):
        assert not his.already_submitted and his.id != hers.id and his.submitted_by == "bob"
        assert {bob.job(job_id).submitted_by for job_id in his.job_ids} == {"bob"}
    again = alice.sweep(toy_task, ["bitfit"], seeds=[0, 1], backbone=BACKBONE)
    assert again.already_submitted and again.id == keyless.id  # her own sweep is still hers


def test_a_study_is_not_blocked_by_another_token_taking_its_predictable_key(api: Api, toy_task: str):
    """The finding: a study's sweep keys are predictable from its plan; another token submitted a sweep
    under one first, and the study failed with a 409 (or would have been handed that token's sweep)."""
    alice, bob = writers(api)
    plan = StudyPlan(
        tasks=(toy_task,), k_values=(16,), seeds=(0,), methods=("lora",), backbone=BACKBONE, dev_rows=20
    )
    taken = plan.key(toy_task, 16, ["lora"], (0,))
    squatted = alice.sweep(
        toy_task, ["bitfit"], seeds=[3], k_values=[16], backbone=BACKBONE, idempotency_key=taken
    )

    job_ids, queued = submit_study(bob, plan)
    assert queued == 1 and squatted.job_ids[0] not in job_ids
    (job,) = (bob.job(job_id) for job_id in job_ids)
    assert (job.method, job.seed, job.k_shot, job.submitted_by) == ("lora", 0, 16, "bob")
    assert submit_study(bob, plan) == (job_ids, 0)  # a repeat finds bob's own sweep: nothing new


# --- cancel ---------------------------------------------------------------------------------------------


def test_a_write_token_cannot_cancel_another_tokens_job_the_owner_and_an_admin_can(api: Api, toy_task: str):
    alice, bob = writers(api)
    running = alice.submit(toy_task, "bitfit", backbone=BACKBONE)
    assert api.registry.claim_job("worker-1").id == running.id
    queued = alice.submit(toy_task, "lora", backbone=BACKBONE)
    own = alice.submit(toy_task, "lora", backbone=BACKBONE, seed=1)
    before = row_counts(api), audit_actions(api)
    for job in (queued, running):
        error = refused(lambda job=job: bob.cancel(job.id), 403, "Authorization", "'admin' scope")
        assert f"job {job.id} was submitted by token 'alice'" in error.message and "'bob'" in error.message
    assert (api.registry.get_job(queued.id).status, api.registry.get_job(running.id).status) == (
        "queued",
        "running",
    )
    assert not api.registry.get_job(running.id).cancel_requested
    assert (row_counts(api), audit_actions(api)) == before

    assert alice.cancel(own.id).status == "cancelled"  # the owner
    assert api.client().cancel(queued.id).status == "cancelled"  # an admin
    assert api.client().cancel(running.id).cancel_requested
    trail = [(e.actor, e.action, e.target, e.detail) for e in api.registry.audit_events(limit=3)]
    assert trail == [
        ("tests", "job.cancel", f"job {running.id}", {"submitted_by": "alice"}),
        ("tests", "job.cancel", f"job {queued.id}", {"submitted_by": "alice"}),
        ("alice", "job.cancel", f"job {own.id}", {}),
    ]


def test_a_job_submitted_without_a_token_needs_an_admin_to_cancel_it(api: Api, toy_task: str):
    local = api.registry.submit_job(toy_task, "lora", BACKBONE)  # `pelt train`, a script on the host
    _, bob = writers(api)
    error = refused(lambda: bob.cancel(local.id), 403, "Authorization", "'admin' scope")
    assert "submitted by no token" in error.message
    assert api.registry.get_job(local.id).status == "queued"
    assert api.client().cancel(local.id).status == "cancelled"


def test_a_sweep_cancel_by_another_write_token_is_refused_as_a_whole(api: Api, toy_task: str):
    alice, bob = writers(api)
    sweep = alice.sweep(toy_task, ["lora", "bitfit"], seeds=[0, 1], backbone=BACKBONE)
    api.registry.claim_job("worker-1")  # one of its jobs runs
    statuses = {job_id: api.registry.get_job(job_id).status for job_id in sweep.job_ids}
    before = row_counts(api), audit_actions(api)

    error = refused(lambda: bob.cancel_sweep(sweep.id), 403, "Authorization", "'admin' scope")
    assert f"sweep {sweep.id} was submitted by token 'alice'" in error.message
    assert {job_id: api.registry.get_job(job_id).status for job_id in sweep.job_ids} == statuses
    assert not any(api.registry.get_job(job_id).cancel_requested for job_id in sweep.job_ids)
    assert (row_counts(api), audit_actions(api)) == before

    assert alice.cancel_sweep(sweep.id) == 4
    other = alice.sweep(toy_task, ["lora"], seeds=[5], backbone=BACKBONE)
    assert api.client().cancel_sweep(other.id) == 1
    cancels = [e for e in api.registry.audit_events() if e.action == "sweep.cancel"]
    assert [(e.actor, e.target, e.detail) for e in cancels] == [
        ("tests", f"sweep {other.id}", {"jobs": 1, "submitted_by": "alice"}),
        ("alice", f"sweep {sweep.id}", {"jobs": 4}),
    ]


def test_a_cancel_of_an_unknown_job_or_sweep_is_still_404(api: Api):
    _, bob = writers(api)
    refused(lambda: bob.cancel(999), 404, "job_id")
    refused(lambda: bob.cancel_sweep(999), 404, "sweep_id")
