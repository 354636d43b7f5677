"""The dispatcher and its worker actors on a local Ray (one node, started the way the service starts it):
jobs, warm workers, a SIGKILLed worker, cancellation, graceful shutdown and a dispatcher restart; and
the same with two job slots per worker process (jobs_per_worker=2). Packs (pack_size > 1): the
dispatcher's side only, without Ray (a fake actor records what it is asked: places, CPUs and claims).

Every test uses its own Ray namespace, registry and delta folder, and stops its workers at the end. A test
that acts while a job runs holds the job in its worker (`tests.workers.hold`: trained, not yet recorded,
still running) until it lets it go, or gives it no end (`UNENDING`) and stops it; waits have deadlines to
fail, never margins to pass.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

from services.dispatcher import WORKER_PREFIX, Dispatcher, DispatcherConfig
from services.dispatcher.config import DEFAULT_PACK_SIZE, MAX_PACK_SIZE, WORKER_ENVIRONMENT
from services.dispatcher.placement import Nodes, start_worker
from services.dispatcher.ray_cluster import local_ray_environment
from services.dispatcher.slots import SlotJob, WorkerSlots
from services.registry import JobStatus, Registry
from services.settings import Settings
from tests.workers.conftest import BACKBONE, SHORT, TASK, UNENDING, ended, step_of, submit, wait_for
from tests.workers.hold import Hold
from workers.job import LocalDeltaSink


def dispatcher_for(
    registry: Registry, tmp_path: Path, namespace: str, hold: Hold | None = None, **config
) -> Dispatcher:
    """A dispatcher storing deltas under tmp_path/deltas; with `hold`, every attempt waits there for the test.
    It leads its namespace if no other dispatcher does (so a test may drive its rounds by hand). The node
    cools down for 1 s after a worker died there, not 10: the tests' one node is not going away, and the
    tests that kill a worker would otherwise wait out the cooldown before the retry can start."""
    settings = Settings(data_dir=tmp_path / "data", ray_address=None)
    values = {
        "namespace": namespace,
        "heartbeat_seconds": 1.0,
        "poll_seconds": 0.2,
        "node_cooldown_seconds": 1.0,
        **config,
    }
    sink = LocalDeltaSink(tmp_path / "deltas")
    dispatcher = Dispatcher(
        registry,
        sink if hold is None else hold.sink(sink),
        config=DispatcherConfig(**values),
        settings=settings,
    )
    dispatcher.lock.try_acquire()
    return dispatcher


def final_progress(registry: Registry, job_id: int) -> dict[str, Any] | None:
    """The job's progress in the registry once it reports its last step (None before)."""
    detail = registry.get_job(job_id).progress_detail
    return detail if detail and detail["step"] == detail["total"] else None


def worker_names(namespace: str) -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith(WORKER_PREFIX)
    ]


def worker_pid(dispatcher: Dispatcher, job_id: int) -> int:
    (worker,) = [w for w in dispatcher.workers.values() if job_id in {j.job_id for j in w.jobs.values()}]
    return ray.get(worker.actor.ping.remote())


def delta_folders(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "deltas").glob("*/job-*"))


def test_embedded_ray_listens_on_loopback_only_and_keeps_token_auth(local_ray):
    from ray._raylet import AuthenticationMode, get_authentication_mode

    assert get_authentication_mode() == AuthenticationMode.TOKEN
    assert local_ray_environment() == WORKER_ENVIRONMENT  # what every process of this Ray inherited
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    listening = {
        (c.laddr.ip, c.pid)
        for c in psutil.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.pid in ours
    }
    assert listening, "found no listening Ray process"
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening


def test_jobs_run_on_warm_workers_that_report_progress_and_store_one_delta_each(
    local_ray, registry, tmp_path, namespace, hold
):
    job_ids = submit(registry, 4)
    dispatcher = dispatcher_for(registry, tmp_path, namespace, hold, max_workers_per_node=2).start()
    try:
        reports = []
        for pair in (job_ids[:2], job_ids[2:]):  # two workers: the oldest two jobs first, then the others
            wait_for(
                lambda pair=pair: hold.holds(pair) and all(final_progress(registry, j) for j in pair),
                90,
                f"jobs {pair} to report their last step (held before recording it)",
            )
            assert all(registry.get_job(j).status == JobStatus.QUEUED for j in job_ids if j > pair[-1])
            reports += [registry.get_job(j).progress_detail for j in pair]
            hold.release(*pair)
        wait_for(lambda: ended(registry, job_ids), 90, "the jobs to finish")
        workers = {ray.get(w.actor.info.remote())["worker_id"]: w for w in dispatcher.workers.values()}
    finally:
        dispatcher.shutdown()

    results = [registry.get_result(j) for j in job_ids]
    assert [registry.get_job(j).status for j in job_ids] == [JobStatus.SUCCEEDED] * 4
    assert [registry.get_job(j).attempts for j in job_ids] == [1] * 4
    assert len(workers) == 2 and {r.worker_id for r in results} == set(workers)  # 4 jobs, 2 warm workers
    for result in results:
        folder = Path(result.delta_uri.removeprefix("file://"))
        assert hashlib.sha256((folder / "delta.safetensors").read_bytes()).hexdigest() == result.delta_sha256
    assert len(delta_folders(tmp_path)) == 4
    assert len(reports) == 4  # every job's progress reached the registry
    assert all(
        {"step", "total", "loss", "tokens_per_second"} <= set(r) and r["total"] == SHORT for r in reports
    )
    assert not worker_names(namespace), "shutdown left workers behind"


def test_a_worker_killed_mid_job_the_job_is_retried_and_completes_once(
    local_ray, registry, tmp_path, namespace, hold
):
    (job_id,) = submit(registry, 1)
    dispatcher = dispatcher_for(registry, tmp_path, namespace, hold, max_workers_per_node=1).start()
    try:
        wait_for(lambda: hold.holds([job_id]), 60, "the job to be held mid-attempt")
        pid = worker_pid(dispatcher, job_id)
        # the local Ray gave its processes the workers' environment: no runtime env needed
        assert psutil.Process(pid).environ().get("MALLOC_ARENA_MAX") == WORKER_ENVIRONMENT["MALLOC_ARENA_MAX"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: hold.holds([job_id], attempt=2), 90, "the job to run again")
        hold.release()
        wait_for(lambda: ended(registry, [job_id]), 90, "the retried job to finish")
    finally:
        dispatcher.shutdown()

    job = registry.get_job(job_id)
    assert (job.status, job.attempts) == (JobStatus.SUCCEEDED, 2)
    assert "died" in (job.last_error or "")
    result = registry.get_result(job_id)
    assert result.attempt == 2 and str(pid) not in result.worker_id
    assert delta_folders(tmp_path) == [tmp_path / "deltas" / "toy" / f"job-{job_id}"]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    statuses = [(e.from_status, e.to_status) for e in registry.job_events(job_id)]
    assert statuses == [
        (None, "queued"),
        ("queued", "running"),
        ("running", "queued"),
        ("queued", "running"),
        ("running", "succeeded"),
    ]


def test_a_pack_worker_killed_mid_pack_every_job_of_the_pack_is_retried_and_completes_once(
    local_ray, registry, tmp_path, namespace, hold
):
    job_ids = submit(registry, 2)
    dispatcher = dispatcher_for(
        registry, tmp_path, namespace, hold, pack_size=2, max_workers_per_node=1
    ).start()
    try:
        wait_for(lambda: hold.holds(job_ids), 60, "both jobs to be held mid-attempt")
        name, pid = one_worker(dispatcher)
        info = ray.get(dispatcher.workers[name].actor.info.remote())
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: hold.holds(job_ids, attempt=2), 120, "both jobs to run again")
        hold.release()
        wait_for(lambda: ended(registry, job_ids), 120, "the retried jobs to finish")
    finally:
        dispatcher.shutdown()

    assert (info["pack_size"], info["slots"], len(info["packs"])) == (2, 2, 1)  # one pack, two places
    assert sorted(j["owner"] for j in info["jobs"]) == [f"{name}#0", f"{name}#1"]
    for job_id in job_ids:
        job, result = registry.get_job(job_id), registry.get_result(job_id)
        assert (job.status, job.attempts, result.attempt) == (JobStatus.SUCCEEDED, 2, 2)
        assert "died" in (job.last_error or "")
    assert sorted(delta_folders(tmp_path)) == [
        tmp_path / "deltas" / "toy" / f"job-{j}" for j in sorted(job_ids)
    ]
    assert not worker_names(namespace)


def test_cancelling_a_running_job_stops_it_and_it_is_never_retried(local_ray, registry, tmp_path, namespace):
    cancelled, follower = submit(registry, 2, steps=UNENDING)
    dispatcher = dispatcher_for(
        registry, tmp_path, namespace, max_workers_per_node=1, heartbeat_seconds=5.0
    ).start()  # the dispatcher's push, not the heartbeat
    try:
        wait_for(lambda: step_of(registry, cancelled) > 0, 60, "the job to be training")
        registry.cancel_job(cancelled)
        wait_for(lambda: registry.get_job(cancelled).status == JobStatus.CANCELLED, 120, "the job to stop")
        # the worker is free again: it takes the next job, never the cancelled one
        wait_for(lambda: step_of(registry, follower) > 0, 120, "the next job to start")
        registry.cancel_job(follower)
        wait_for(lambda: ended(registry, [follower]), 120, "the second job to stop")
        registry.requeue_expired_leases()
    finally:
        dispatcher.shutdown()

    job = registry.get_job(cancelled)
    assert (job.status, job.attempts, registry.get_result(cancelled)) == (JobStatus.CANCELLED, 1, None)
    assert registry.job_events(cancelled)[-1].reason == "cancelled; the worker stopped"
    assert registry.claim_job("anyone") is None
    assert delta_folders(tmp_path) == []


def test_a_graceful_shutdown_returns_unstarted_and_running_jobs_to_the_queue(
    local_ray, registry, tmp_path, namespace
):
    job_ids = submit(registry, 4, steps=UNENDING)
    dispatcher = dispatcher_for(registry, tmp_path, namespace, max_workers_per_node=2).start()

    def two_training() -> list[int] | None:
        training = [j for j in job_ids if step_of(registry, j) > 0]
        return training if len(training) == 2 else None

    running = wait_for(two_training, 60, "two jobs to be training")
    summary = dispatcher.shutdown(timeout=20)

    assert summary["stats"]["released"] == 2 and summary["released_by_dispatcher"] == []
    for job_id in job_ids:
        job = registry.get_job(job_id)
        assert (job.status, job.attempts, job.lease_owner) == (JobStatus.QUEUED, 0, None), job_id
    for job_id in running:
        assert registry.job_events(job_id)[-1].reason.startswith("released by worker")
    assert not worker_names(namespace)


def test_a_restarted_dispatcher_adopts_running_workers_and_loses_nothing(
    local_ray, registry, tmp_path, namespace, hold
):
    # held, neither running job can end (and free a worker the first dispatcher would give the third job to)
    kept, killed, unstarted = submit(registry, 3)
    first = dispatcher_for(registry, tmp_path, namespace, hold, max_workers_per_node=2).start()
    wait_for(lambda: hold.holds([kept, killed]), 60, "two jobs held mid-attempt")
    pid_killed = worker_pid(first, killed)
    kept_owner = registry.get_job(kept).lease_owner
    first.detach()  # the dispatcher goes away; its workers go on

    os.kill(pid_killed, signal.SIGKILL)  # ... and one of them dies while no dispatcher watches
    claimed = registry.claim_job(kept_owner)  # a claim made for a live worker that never got the job
    assert claimed is not None and claimed.id == unstarted

    second = dispatcher_for(registry, tmp_path, namespace, hold, max_workers_per_node=2)
    settled = second.reconcile()
    assert settled == {"adopted": [kept], "released": [unstarted], "left_to_lease_expiry": [killed]}
    second.start()
    try:
        hold.release()
        wait_for(lambda: ended(registry, [kept, killed, unstarted]), 300, "every job to finish")
    finally:
        second.shutdown()

    jobs = {job_id: registry.get_job(job_id) for job_id in (kept, killed, unstarted)}
    assert all(job.status == JobStatus.SUCCEEDED for job in jobs.values())
    assert jobs[kept].attempts == 1  # ran to its end under the new dispatcher, never restarted
    assert registry.get_result(kept).worker_id == kept_owner
    assert jobs[killed].attempts == 2 and "lease" in jobs[killed].last_error  # back through lease expiry
    assert jobs[unstarted].attempts == 1  # the release did not count
    assert len(delta_folders(tmp_path)) == 3


def test_with_the_mlflow_store_a_job_becomes_one_model_version_and_the_aliases_follow(
    local_ray, registry, tmp_path, namespace
):
    from services.delta_store import MlflowDeltaStore

    store = MlflowDeltaStore(
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        tmp_path / "mlartifacts",
        registry=registry,
        namespace="workers-test",
        ensure=True,
    )
    (job_id,) = submit(registry, 1)
    settings = Settings(data_dir=tmp_path / "data", ray_address=None)
    dispatcher = Dispatcher(
        registry,
        store,
        settings=settings,
        config=DispatcherConfig(
            namespace=namespace, heartbeat_seconds=1.0, poll_seconds=0.2, max_workers_per_node=1
        ),
    ).start()
    try:
        wait_for(lambda: ended(registry, [job_id]), 90, "the job to finish")
        wait_for(lambda: dispatcher.stats["succeeded"] == 1, 60, "the dispatcher to see the outcome")
    finally:
        dispatcher.shutdown()

    result = registry.get_result(job_id)
    (version,) = store.list_versions("toy")
    assert (version.job_id, version.run_id, version.sha256) == (
        job_id,
        result.mlflow_run_id,
        result.delta_sha256,
    )
    assert result.mlflow_model_version == version.version and result.delta_uri == version.uri
    assert set(version.aliases) == {
        "best",
        "best-lora",
    }  # moved by the dispatcher once the result was recorded
    assert store.pull("toy").delta is not None


# --- two job slots per worker process ------------------------------------------------------------------


def one_worker(dispatcher: Dispatcher) -> tuple[str, int]:
    """(actor name, pid) of the dispatcher's only worker."""
    (worker,) = dispatcher.workers.values()
    return worker.worker_id, ray.get(worker.actor.ping.remote())


def test_two_slots_train_two_jobs_at_once_in_one_process_each_with_its_own_lease_result_and_delta(
    local_ray, registry, tmp_path, namespace, hold
):
    job_ids = submit(registry, 2)
    worker_env = {**WORKER_ENVIRONMENT, "PELT_TEST_WORKER": "two-slots"}  # one more than the local Ray gave
    dispatcher = dispatcher_for(
        registry, tmp_path, namespace, hold, jobs_per_worker=2, max_workers_per_node=1, worker_env=worker_env
    ).start()
    try:
        wait_for(lambda: hold.holds(job_ids), 60, "both jobs to be held mid-attempt")
        owners = [registry.get_job(j).lease_owner for j in job_ids]
        name, pid = one_worker(dispatcher)
        info = ray.get(dispatcher.workers[name].actor.info.remote())
        environment = psutil.Process(pid).environ()
        hold.release()
        wait_for(lambda: ended(registry, job_ids), 120, "both jobs to finish")
    finally:
        dispatcher.shutdown()

    assert sorted(owners) == [f"{name}#0", f"{name}#1"]  # one process, two leases
    assert {variable: environment.get(variable) for variable in worker_env} == worker_env  # inherited + own
    assert info["pid"] == pid and info["slots"] == 2  # that process runs both jobs
    assert sorted((j["job_id"], j["owner"]) for j in info["jobs"]) == sorted(
        zip(job_ids, owners, strict=True)
    )
    for job_id, owner in zip(job_ids, owners, strict=True):
        job, result = registry.get_job(job_id), registry.get_result(job_id)
        assert (job.status, job.attempts, result.worker_id) == (JobStatus.SUCCEEDED, 1, owner)
        folder = Path(result.delta_uri.removeprefix("file://"))
        assert folder.name == f"job-{job_id}"
        assert hashlib.sha256((folder / "delta.safetensors").read_bytes()).hexdigest() == result.delta_sha256
    assert len(delta_folders(tmp_path)) == 2
    assert not worker_names(namespace)


def test_cancelling_one_of_two_jobs_in_a_process_leaves_the_other_running_to_success(
    local_ray, registry, tmp_path, namespace, hold
):
    (cancelled,) = submit(registry, 1, steps=UNENDING)
    (kept,) = submit(registry, 1, seed0=1)  # held mid-attempt until the other one has stopped
    dispatcher = dispatcher_for(
        registry, tmp_path, namespace, hold, jobs_per_worker=2, max_workers_per_node=1, heartbeat_seconds=5.0
    ).start()  # the dispatcher's push, not the heartbeat
    try:
        wait_for(
            lambda: step_of(registry, cancelled) > 0 and hold.holds([kept]),
            60,
            "one job training and the other held",
        )
        name, _ = one_worker(dispatcher)
        registry.cancel_job(cancelled)
        wait_for(lambda: registry.get_job(cancelled).status == JobStatus.CANCELLED, 120, "the job to stop")
        still = registry.get_job(kept)
        assert still.status == JobStatus.RUNNING
        actor = dispatcher.workers[name].actor
        wait_for(
            lambda: [j["job_id"] for j in ray.get(actor.info.remote())["jobs"]] == [kept],
            60,
            "the worker to free the cancelled job's slot",
        )
        hold.release()
        wait_for(lambda: ended(registry, [kept]), 120, "the other job to finish")
    finally:
        dispatcher.shutdown()

    job = registry.get_job(cancelled)
    assert (job.status, job.attempts, registry.get_result(cancelled)) == (JobStatus.CANCELLED, 1, None)
    job = registry.get_job(kept)
    assert (job.status, job.attempts, registry.get_result(kept).worker_id) == (
        JobStatus.SUCCEEDED,
        1,
        still.lease_owner,
    )
    assert delta_folders(tmp_path) == [tmp_path / "deltas" / "toy" / f"job-{kept}"]


def test_a_process_with_two_jobs_killed_both_go_back_to_the_queue_and_complete_once(
    local_ray, registry, tmp_path, namespace, hold
):
    job_ids = submit(registry, 2)
    dispatcher = dispatcher_for(
        registry, tmp_path, namespace, hold, jobs_per_worker=2, max_workers_per_node=1
    ).start()
    try:
        wait_for(lambda: hold.holds(job_ids), 60, "both jobs to be held mid-attempt")
        owners = {j: registry.get_job(j).lease_owner for j in job_ids}
        _, pid = one_worker(dispatcher)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: hold.holds(job_ids, attempt=2), 120, "both jobs to run again")
        hold.release()
        wait_for(lambda: ended(registry, job_ids), 120, "both retried jobs to finish")
    finally:
        dispatcher.shutdown()

    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert dispatcher.stats["worker_deaths"] == 1
    for job_id in job_ids:
        job, result = registry.get_job(job_id), registry.get_result(job_id)
        assert (job.status, job.attempts) == (JobStatus.SUCCEEDED, 2), (job.status, job.last_error)
        assert result.attempt == 2
        assert "died" in (job.last_error or "") and result.worker_id != owners[job_id]
        events = registry.job_events(job_id)
        assert [(e.from_status, e.to_status) for e in events] == [
            (None, "queued"),
            ("queued", "running"),
            ("running", "queued"),
            ("queued", "running"),
            ("running", "succeeded"),
        ]
        assert events[2].worker_id == owners[job_id]  # failed for the slot that ran it
    assert delta_folders(tmp_path) == sorted(tmp_path / "deltas" / "toy" / f"job-{j}" for j in job_ids)


def test_a_restarted_dispatcher_adopts_both_running_jobs_of_a_two_slot_worker(
    local_ray, registry, tmp_path, namespace, hold
):
    job_ids = submit(registry, 2)
    first = dispatcher_for(
        registry, tmp_path, namespace, hold, jobs_per_worker=2, max_workers_per_node=1
    ).start()
    wait_for(lambda: hold.holds(job_ids), 60, "both jobs held mid-attempt")
    owners = {j: registry.get_job(j).lease_owner for j in job_ids}
    name, pid = one_worker(first)
    first.detach()  # the dispatcher goes away; its worker and both jobs go on

    second = dispatcher_for(registry, tmp_path, namespace, hold, jobs_per_worker=2, max_workers_per_node=1)
    settled = second.reconcile()
    assert settled == {"adopted": sorted(job_ids), "released": [], "left_to_lease_expiry": []}
    (described,) = second.describe()
    assert (described["worker_id"], described["slots"]) == (name, 2)
    assert described["jobs"] == {
        owner: job_id for job_id, owner in sorted(owners.items(), key=lambda i: i[1])
    }
    second.start()
    try:
        hold.release()
        wait_for(lambda: ended(registry, job_ids), 120, "both jobs to finish")
        wait_for(lambda: second.stats["succeeded"] == 2, 60, "the dispatcher to see both outcomes")
        assert one_worker(second) == (name, pid)
    finally:
        second.shutdown()

    for job_id in job_ids:  # ran to their end under the new dispatcher, never restarted
        job, result = registry.get_job(job_id), registry.get_result(job_id)
        assert (job.status, job.attempts, result.worker_id) == (JobStatus.SUCCEEDED, 1, owners[job_id])
    assert len(delta_folders(tmp_path)) == 2


# --- packs: places, CPUs and claims (no Ray: a fake worker actor records what it is asked) -------------


class FakeCall:
    """A remote method of `FakeActor`: records the arguments of every `.remote(...)` call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def remote(self, *args: Any) -> object:
        self.calls.append(args)
        return object()


class FakeActor:
    """A worker actor that runs nothing: the dispatcher's calls are recorded."""

    def __init__(self, *args: Any, **options: Any) -> None:
        self.args, self.options = args, options
        self.run, self.info, self.stop = FakeCall(), FakeCall(), FakeCall()


class FakeActorClass:
    """Stands for `workers.worker.worker_actor_class()`: `.options(...).remote(...)` makes a FakeActor."""

    def options(self, **options: Any) -> Any:
        class Bound:
            @staticmethod
            def remote(*args: Any) -> FakeActor:
                return FakeActor(*args, **options)

        return Bound()


OTHER_BACKBONE = "tiny-bert-b"  # the same model folder under a second registry name


def submit_on_other_backbone(registry: Registry, tiny_backbone: tuple[str, str], seed: int = 0) -> int:
    """Queue one short LoRA job on OTHER_BACKBONE (registered on first use)."""
    registry.register_backbone(OTHER_BACKBONE, *tiny_backbone)
    values = {"max_steps": SHORT, "batch_size": 2}
    return registry.submit_job(TASK, "lora", OTHER_BACKBONE, values, seed=seed).id


def pack_worker(dispatcher: Dispatcher, places: int, packed: bool, running: dict[int, str]) -> WorkerSlots:
    """A ready worker of `places` places added to the dispatcher, with `running` ({job id: backbone})
    claimed in the registry for its first places as the dispatcher would have."""
    worker = WorkerSlots("pelt-worker.fake", "node", FakeActor(), slots=places, packed=packed, ready=True)
    for slot, (job_id, backbone) in enumerate(running.items()):
        claimed = dispatcher.registry.claim_job(worker.owner(slot), backbones=[backbone])
        assert claimed is not None and claimed.id == job_id
        worker.jobs[slot] = SlotJob(job_id, worker.owner(slot), backbone)
    dispatcher.workers[worker.worker_id] = worker
    return worker


def running_on(worker: WorkerSlots) -> dict[str, int]:
    return {job.owner: job.job_id for job in worker.jobs.values()}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"pack_size": 0}, f"--pack-size must be between 1 and {MAX_PACK_SIZE}"),
        ({"pack_size": MAX_PACK_SIZE + 1}, f"--pack-size must be between 1 and {MAX_PACK_SIZE}"),
        ({"pack_size": 2, "jobs_per_worker": 2}, "choose --pack-size or --jobs-per-worker"),
    ],
)
def test_a_pack_size_out_of_range_or_beside_job_slots_is_refused_naming_the_option(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DispatcherConfig(**values)


@pytest.mark.parametrize(
    ("inherited", "worker_env", "runtime_env"),
    [
        (WORKER_ENVIRONMENT, WORKER_ENVIRONMENT, None),  # a local Ray started here: nothing of its own
        ({}, WORKER_ENVIRONMENT, {"env_vars": WORKER_ENVIRONMENT}),  # a cluster joined by address
        (WORKER_ENVIRONMENT, {**WORKER_ENVIRONMENT, "EXTRA": "1"}, {"env_vars": {"EXTRA": "1"}}),
        (WORKER_ENVIRONMENT, {"MALLOC_ARENA_MAX": "2"}, {"env_vars": {"MALLOC_ARENA_MAX": "2"}}),
    ],
)
def test_a_worker_gets_a_runtime_env_only_for_what_its_ray_did_not_give_every_process(
    inherited, worker_env, runtime_env, monkeypatch
):
    import workers.worker
    from services.dispatcher import placement

    monkeypatch.setattr(workers.worker, "worker_actor_class", FakeActorClass)
    monkeypatch.setattr(placement, "local_ray_environment", lambda: dict(inherited))
    config = DispatcherConfig(worker_env=worker_env)
    worker = start_worker("ab" * 28, config, heartbeat_seconds=1.0, lease_seconds=8.0)
    assert worker.actor.options["runtime_env"] == runtime_env


def test_a_pack_worker_of_four_places_reserves_the_cpus_of_one_job(monkeypatch):
    import workers.worker

    node_id = "ab" * 28  # a Ray node id: 28 bytes in hex
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeID": node_id, "Resources": {"CPU": 4.0}}])
    monkeypatch.setattr(workers.worker, "worker_actor_class", FakeActorClass)
    config = DispatcherConfig(pack_size=4, cpus_per_worker=2.0)
    nodes = Nodes(config)
    nodes.refresh()
    worker = start_worker(node_id, config, heartbeat_seconds=1.0, lease_seconds=8.0)

    assert nodes.capacity == {node_id: 2}  # 4 CPUs // 2 per pack worker, not // (2 x 4 places)
    assert (worker.slots, worker.packed) == (4, True)
    assert (worker.actor.options["num_cpus"], worker.actor.options["max_concurrency"]) == (2.0, 4 + 3)
    _, worker_config = worker.actor.args
    assert (worker_config.pack_size, worker_config.slots, worker_config.threads) == (4, 1, 2)


def test_a_pack_running_a_job_claims_only_jobs_on_its_backbone_into_its_free_places(
    registry, tmp_path, namespace, tiny_backbone
):
    (running,) = submit(registry, 1)
    other = submit_on_other_backbone(registry, tiny_backbone)
    (same,) = submit(registry, 1, seed0=1)  # queued after the job on the other backbone
    dispatcher = dispatcher_for(registry, tmp_path, namespace, pack_size=4)
    worker = pack_worker(dispatcher, 4, packed=True, running={running: BACKBONE})

    dispatcher._assign()  # one placement round (no node has room for another worker)

    assert running_on(worker) == {worker.owner(0): running, worker.owner(1): same}
    assert registry.get_job(same).lease_owner == worker.owner(1)
    assert registry.get_job(other).status == JobStatus.QUEUED
    assert len(worker.actor.run.calls) == 1


def test_an_idle_pack_takes_the_oldest_job_then_fills_its_places_on_that_backbone_only(
    registry, tmp_path, namespace, tiny_backbone
):
    first = submit_on_other_backbone(registry, tiny_backbone)
    elsewhere = submit(registry, 2)
    beside = submit_on_other_backbone(registry, tiny_backbone, seed=1)
    dispatcher = dispatcher_for(registry, tmp_path, namespace, pack_size=4)
    worker = pack_worker(dispatcher, 4, packed=True, running={})

    dispatcher._assign()

    assert running_on(worker) == {worker.owner(0): first, worker.owner(1): beside}
    assert all(registry.get_job(j).status == JobStatus.QUEUED for j in elsewhere)


def test_job_slots_without_packs_still_take_the_oldest_job_on_any_backbone(
    registry, tmp_path, namespace, tiny_backbone
):
    (running,) = submit(registry, 1)
    other = submit_on_other_backbone(registry, tiny_backbone)
    dispatcher = dispatcher_for(registry, tmp_path, namespace, jobs_per_worker=2)
    worker = pack_worker(dispatcher, 2, packed=False, running={running: BACKBONE})

    dispatcher._assign()

    assert running_on(worker) == {worker.owner(0): running, worker.owner(1): other}


def test_a_warm_worker_of_job_slots_running_a_job_takes_one_on_another_backbone_when_no_node_has_room(
    registry, tmp_path, namespace, tiny_backbone
):
    (running,) = submit(registry, 1)
    other = submit_on_other_backbone(registry, tiny_backbone)
    dispatcher = dispatcher_for(registry, tmp_path, namespace, jobs_per_worker=2)
    worker = pack_worker(dispatcher, 2, packed=False, running={running: BACKBONE})
    worker.backbones = {BACKBONE}  # warm on the running job's backbone only

    dispatcher._assign()  # no node has room for another worker: its free slot must not idle

    assert running_on(worker) == {worker.owner(0): running, worker.owner(1): other}


@pytest.mark.parametrize("command", ["serve", "dispatcher"])
def test_pelt_serve_and_dispatcher_offer_pack_size_and_refuse_it_beside_job_slots(command, monkeypatch):
    from click.testing import CliRunner

    import services.api.server
    import services.dispatcher.cli
    from services.cli import main

    def never_started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the service started despite the refused options")

    monkeypatch.setattr(services.api.server, "ApiServer", never_started)
    monkeypatch.setattr(services.dispatcher.cli, "serve", never_started)
    runner = CliRunner()
    shown = runner.invoke(main, [command, "--help"])
    refused = runner.invoke(main, [command, "--pack-size", "4", "--jobs-per-worker", "2"])

    assert shown.exit_code == 0 and "--pack-size" in shown.output
    assert f"[default: {DEFAULT_PACK_SIZE}; 1<=x<={MAX_PACK_SIZE}]" in " ".join(shown.output.split())
    assert refused.exit_code == 2 and "choose --pack-size or --jobs-per-worker" in refused.output


def test_a_sweep_of_four_jobs_on_two_cpus_gets_a_pack_worker_per_cpu_before_any_pack_takes_a_second_job(
    registry, tmp_path, namespace, monkeypatch
):
    import workers.worker

    node_id = "cd" * 28
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeID": node_id, "Resources": {"CPU": 2.0}}])
    monkeypatch.setattr(workers.worker, "worker_actor_class", FakeActorClass)
    job_ids = submit(registry, 4)
    dispatcher = dispatcher_for(registry, tmp_path, namespace, pack_size=4)
    dispatcher.nodes.refresh()

    dispatcher._assign()  # round 1: the workers start (none ready yet)
    started = list(dispatcher.workers.values())
    assert len(started) == 2 and not any(w.jobs for w in started)  # one per CPU, not one per 4 jobs

    first, second = started
    first.ready = True
    dispatcher._assign()  # round 2: one is up and takes its even share; the other's share waits for it
    assert (len(first.jobs), len(second.jobs)) == (2, 0)
    assert registry.queued_by_device()["any"] == 2

    second.ready = True
    dispatcher._assign()  # round 3: the other takes its share
    assert (len(first.jobs), len(second.jobs)) == (2, 2)
    assert sorted(j.job_id for w in started for j in w.jobs.values()) == sorted(job_ids)
    assert len(dispatcher.workers) == 2


def test_packs_fill_only_once_no_node_has_room_for_another_worker(registry, tmp_path, namespace, monkeypatch):
    import workers.worker

    node_id = "ef" * 28
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeID": node_id, "Resources": {"CPU": 2.0}}])
    monkeypatch.setattr(workers.worker, "worker_actor_class", FakeActorClass)
    (running,) = submit(registry, 1)
    (queued,) = submit(registry, 1, seed0=1)
    dispatcher = dispatcher_for(registry, tmp_path, namespace, pack_size=4)
    dispatcher.nodes.refresh()
    worker = pack_worker(dispatcher, 4, packed=True, running={running: BACKBONE})
    worker.node_id = node_id

    dispatcher._assign()  # the node has room for a second worker: the queued job waits for it

    assert running_on(worker) == {worker.owner(0): running}
    (other,) = [w for w in dispatcher.workers.values() if w is not worker]
    other.ready = True
    dispatcher._assign()
    assert running_on(other) == {other.owner(0): queued}
