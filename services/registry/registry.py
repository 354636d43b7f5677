"""`Registry`: the only code that speaks SQL. Everything else calls it.

It is put together from one part per subject, each a module of its own:

    core.py        RegistryCore: the engine, sessions and write turns, clock, settings, name caches
    catalog.py     Catalog: tasks, method presets (built-ins from pelt_core, see presets.py), backbones
    submitting.py  Submissions: submit_job, submit_sweep (validated, idempotent, capped per actor)
    queue.py       JobQueue: claim, heartbeat, complete, fail, release, cancel, reap expired leases
    results.py     JobResults: jobs, counts, events, results and leaderboards
    tokens.py      TokensAndAudit: API tokens and the audit trail
    leadership.py  Leadership: which dispatcher leads a Ray namespace (the others stand by)
    searches.py    Searches: budget-aware method searches (successive halving over the queue)
    rows.py        the row-level helpers they share (look-ups, get-or-create, queue_jobs, transition)

Job lifecycle (every status change writes a job event in the same transaction):

    submit ──▶ queued ──claim──▶ running ──complete──▶ succeeded (one result row, ever)
                 ▲                 │ fail (retryable, attempts left) / lease expired / release
                 └─────────────────┤
                                   ├─ fail (not retryable, or attempts used up) ──▶ failed
                                   └─ cancel (a flag the worker sees at heartbeat) ──▶ cancelled

`attempts` counts the times a job was started; a job fails for good once `max_attempts` starts have
failed. A retry waits `retry_backoff_seconds * 2**(attempts-1)` (capped). Claims are atomic:
`SELECT … FOR UPDATE SKIP LOCKED` on PostgreSQL, a `BEGIN IMMEDIATE` transaction on SQLite.
"""

from __future__ import annotations

from services.registry.catalog import Catalog
from services.registry.leadership import Leadership
from services.registry.queue import JobQueue
from services.registry.results import JobResults
from services.registry.searches import Searches
from services.registry.submitting import Submissions
from services.registry.tokens import TokensAndAudit


class Registry(Catalog, Submissions, JobQueue, JobResults, Searches, TokensAndAudit, Leadership):
    """Tasks, methods, backbones, the durable job queue, results and leaderboards.

    `Registry(url)` opens (and owns) an engine; `Registry(engine)` uses the caller's. Start-up refuses
    a database whose schema is behind the code (SchemaOutOfDateError naming `pelt db upgrade`).
    Queue knobs default to the settings (PELT_LEASE_SECONDS, PELT_MAX_ATTEMPTS, …); `clock` returns
    the current timezone-aware time and exists for tests. Claims take back expired leases at most
    once per `reap_interval_seconds` (`requeue_expired_leases` does it at once).

    Who acts is `services.registry.actor.current_actor()` (the API sets it to the request's token):
    jobs record it as `submitted_by`, and every write of a registration, submit, cancel or token change
    adds an audit event in its own transaction (`audit_events`). One actor may have at most
    PELT_MAX_QUEUED_JOBS_PER_TOKEN queued jobs; a submit beyond is a QuotaExceededError, nothing written.
    """


__all__ = ["Registry"]
