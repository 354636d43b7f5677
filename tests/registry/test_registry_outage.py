"""A registry whose database goes away (a PostgreSQL restart, a cut network): every call fails with
RegistryUnavailableError, which says whether the write may have landed and keeps the server's address to the
log; the API answers it with a 503 the client knows how to try again; the calls that are safe to repeat (an
attempt's end, a sink's read) ride the outage out; expired leases wait a grace after it, so that heartbeats
that failed meanwhile renew them first; and the dispatcher settles again what the delta store could not, and gives up (for its supervisor to
restart it) when its rounds keep failing for another reason, as on a Ray cluster that restarted."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

import services.dispatcher.lease as lease_module
import services.registry.db as db_module
from services.delta_store.testing import free_port
from services.dispatcher.config import DispatcherConfig
from services.dispatcher.dispatcher import Dispatcher
from services.dispatcher.lease import RegistryLease
from services.errors import classify
from services.registry import JobStateError, Registry, RegistryUnavailableError
from services.registry.db import call_through_outage, unavailable
from services.registry.testing import FakeClock
from tests.registry.test_registry_queue import submit


class ConnectionLost(Exception):
    """What a driver raises when the server closed the connection."""


def dropped_connection() -> OperationalError:
    return OperationalError(
        "COMMIT", None, ConnectionLost("server closed the connection"), connection_invalidated=True
    )


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(db_module.time, "sleep", slept.append)
    return slept


def test_a_database_that_does_not_answer_is_unavailable_nothing_written_and_its_address_not_told() -> None:
    port = free_port()  # nothing listens there
    with Registry(f"postgresql+psycopg://pelt@127.0.0.1:{port}/pelt", check_schema=False) as registry:
        with pytest.raises(RegistryUnavailableError) as reading:
            registry.list_jobs()
        with pytest.raises(RegistryUnavailableError) as writing:
            registry.register_backbone("tiny-bert", "hf:prajjwal1/bert-tiny", "sha256:" + "ab" * 32)
    for error in (reading.value, writing.value):
        assert error.maybe_written is False and "nothing was written" in str(error)
        assert str(port) not in str(error) and "127.0.0.1" not in str(error)


def test_a_connection_lost_during_the_commit_may_have_written(ready: Registry) -> None:
    def lose(session) -> None:
        raise dropped_connection()

    event.listen(ready._write_sessions, "before_commit", lose)
    try:
        with pytest.raises(RegistryUnavailableError) as error:
            submit(ready)
    finally:
        event.remove(ready._write_sessions, "before_commit", lose)
    assert error.value.maybe_written is True and "it may have been written" in str(error.value)


def test_only_errors_of_a_server_that_is_away_count_as_unavailable() -> None:
    assert unavailable(dropped_connection())
    refused = OperationalError("SELECT 1", None, SimpleNamespace(sqlstate="08006"))
    restarting = OperationalError("SELECT 1", None, SimpleNamespace(sqlstate="57P03"))
    wrong = OperationalError("SELECT 1", None, SimpleNamespace(sqlstate="42P01"))  # no such table
    locked = OperationalError("BEGIN", None, Exception("database is locked"))  # SQLite's: local, not away
    assert [unavailable(e) for e in (refused, restarting, wrong, locked)] == [True, True, False, False]
    assert not unavailable(ValueError("not a database error"))


def test_the_api_answers_unavailable_with_a_503_tried_again_only_where_nothing_was_written() -> None:
    nothing = classify(RegistryUnavailableError("no connection"))
    maybe = classify(RegistryUnavailableError("the connection broke during the commit", maybe_written=True))
    assert (nothing.status, nothing.headers) == (503, {"Retry-After": "5"})
    assert (maybe.status, maybe.headers) == (503, None)  # the client repeats only what does nothing twice


def test_a_call_safe_to_repeat_rides_out_an_outage_and_gives_up_after_its_time(sleeps: list[float]) -> None:
    answers = iter([RegistryUnavailableError("no connection")] * 3 + ["done"])

    def call() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert call_through_outage(call, 60, "a test call") == "done"
    assert sleeps == [0.2, 0.4, 0.8]

    def never() -> None:
        raise RegistryUnavailableError("no connection")

    sleeps.clear()
    with pytest.raises(RegistryUnavailableError):
        call_through_outage(never, 0, "a test call")  # no time to wait: the first failure stands
    assert sleeps == []


def test_an_attempt_ends_through_an_outage_of_less_than_a_lease(monkeypatch, sleeps: list[float]) -> None:
    calls: list[str] = []

    class Restarting:
        def complete_job(self, job_id: int, worker_id: str, result: dict) -> None:
            calls.append("complete")
            if len(calls) < 3:
                raise RegistryUnavailableError("no connection")

    monkeypatch.setattr(lease_module, "_worker_registry", lambda *args: Restarting())
    lease = RegistryLease("postgresql://db/pelt", 7, "w1", 60.0, 1.0, 10.0)
    lease.complete({"metrics": {"accuracy": 1.0}})
    assert calls == ["complete"] * 3 and len(sleeps) == 2


def test_expired_leases_wait_a_grace_after_the_database_was_away(ready: Registry, clock: FakeClock) -> None:
    job_id = submit(ready)
    ready.claim_job("w1")  # a 60 s lease
    ready.reap_grace_seconds = 3600  # the grace is ended by hand below: no race with a slow machine

    def lose(session) -> None:
        raise dropped_connection()

    clock.advance(61)  # the worker's heartbeats failed all along
    event.listen(ready._write_sessions, "before_commit", lose)
    try:
        with pytest.raises(RegistryUnavailableError):
            ready.heartbeat(job_id, "w1")
    finally:
        event.remove(ready._write_sessions, "before_commit", lose)
    assert ready.requeue_expired_leases() == []  # the database just came back: the heartbeat goes first
    assert ready.heartbeat(job_id, "w1") is False  # and renews the lease
    clock.advance(61)  # then the worker dies
    assert ready.requeue_expired_leases() == []  # within the grace
    ready._reap_paused_until = 0.0  # the grace has passed: its job is taken back
    assert [job.id for job in ready.requeue_expired_leases()] == [job_id]


class FlakySink:
    """A delta store that cannot settle anything while `away`."""

    def __init__(self) -> None:
        self.away = True
        self.settled: list[int] = []

    def finalize_job(self, task: str, job_id: int, registry: Registry) -> None:
        if self.away:
            raise ConnectionError("the MLflow server is restarting")
        self.settled.append(job_id)

    def store(self, *args, **kwargs):  # pragma: no cover - no job trains here
        raise AssertionError("not used")


def test_the_dispatcher_settles_again_what_the_store_could_not_and_resettles_recent_tasks_on_taking_over(
    ready: Registry, clock: FakeClock
) -> None:
    sink = FlakySink()
    dispatcher = Dispatcher(ready, sink)
    dispatcher._settle_sink("sst2", 5)  # the store is away: the job waits
    assert sink.settled == [] and dispatcher._unsettled == {5: "sst2"}
    sink.away = False
    dispatcher._settle_again()
    assert sink.settled == [5] and dispatcher._unsettled == {}

    job_id = submit(ready)
    ready.claim_job("w1")
    ready.fail_job(job_id, "w1", "a permanent error", retryable=False)  # it ended within the last hour
    clock.advance(3601)
    old_job = submit(ready)
    ready.claim_job("w1")
    ready.fail_job(old_job, "w1", "a permanent error", retryable=False)
    clock.advance(1800)  # the first job ended 90 minutes ago, the second 30
    dispatcher._resettle_store()  # a new leader: what ended lately is settled again, a few per round
    assert dispatcher._unsettled == {old_job: "sst2"}
    dispatcher._settle_again()
    assert sink.settled == [5, old_job] and dispatcher._unsettled == {}


def test_a_job_the_store_never_settles_neither_blocks_the_others_nor_is_tried_forever(
    ready: Registry,
) -> None:
    sink = FlakySink()
    dispatcher = Dispatcher(ready, sink)
    dispatcher._unsettled = {1: "sst2", 2: "sst2"}
    calls: list[int] = []

    def finalize(task: str, job_id: int, registry: Registry) -> None:
        calls.append(job_id)
        if job_id == 1:
            raise ConnectionError("this one's versions cannot be read")

    sink.finalize_job = finalize
    dispatcher._settle_again()
    assert dispatcher._unsettled == {1: "sst2"}  # the second settled, though the first failed
    for _ in range(20):
        dispatcher._settle_again()
    assert dispatcher._unsettled == {} and calls.count(1) == 10  # left to `pelt mlflow reconcile`


def test_a_dispatcher_whose_rounds_keep_failing_gives_up_the_lead_and_says_why(ready: Registry, monkeypatch):
    dispatcher = Dispatcher(
        ready, FlakySink(), config=DispatcherConfig(give_up_seconds=0.2, poll_seconds=0.05)
    )
    monkeypatch.setattr(dispatcher, "reconcile", lambda: setattr(dispatcher, "_reconciled", True))

    def step(wait: float = 0.0) -> None:  # what every call says once the Ray head restarted without Redis
        raise RuntimeError(
            "RPC error: WrongClusterID: Perhaps the client is accessing GCS after it has restarted"
        )

    monkeypatch.setattr(dispatcher, "step", step)
    loop = threading.Thread(target=dispatcher._loop, daemon=True)
    loop.start()
    assert dispatcher.stopped.wait(60), "the dispatcher never gave up"
    loop.join(60)
    assert not loop.is_alive() and "WrongClusterID" in dispatcher.broken
    assert ready.leader(dispatcher.config.namespace) is None  # a standby may lead at once


def test_a_dispatcher_never_gives_up_because_the_registry_was_away(ready: Registry) -> None:
    dispatcher = Dispatcher(ready, FlakySink(), config=DispatcherConfig(give_up_seconds=0.2))
    dispatcher._failing_since = time.monotonic() - 3600  # failing for an hour, then the database went away
    assert dispatcher._given_up(RegistryUnavailableError("no connection")) is False
    assert dispatcher._failing_since is None  # the outage does not count towards giving up
    assert dispatcher.broken is None and not dispatcher.stopped.is_set()
    dispatcher._failing_since = time.monotonic() - 3600
    assert dispatcher._given_up(JobStateError(7, "is cancelled")) is True  # any other registry error counts


@pytest.mark.postgres
def test_registry_connections_to_postgresql_give_up_on_a_stalled_peer_and_probe_idle_ones() -> None:
    """A cut-off database host resets nothing: without these a query in flight waits out the kernel's
    retransmissions (about 15 minutes) and a worker's heartbeat hangs instead of failing as an outage."""
    from tests.registry.conftest import postgres_base_url

    def parameters(url: str) -> dict[str, str]:
        engine = db_module.make_engine(url)
        try:
            with engine.connect() as connection:
                return connection.connection.driver_connection.info.get_parameters()
        finally:
            engine.dispose()

    url = postgres_base_url()
    given = parameters(url)
    assert given["tcp_user_timeout"] == "30000" and given["connect_timeout"] == "10"
    assert (given["keepalives"], given["keepalives_idle"]) == ("1", "30")
    chosen = parameters(url + ("&" if "?" in url else "?") + "tcp_user_timeout=5000")
    assert chosen["tcp_user_timeout"] == "5000"  # a URL's own value stays
