"""One worker, in this process (no Ray): how an attempt runs and how it ends, through its lease.

The lease here is a recorder; the registry-backed one (services.dispatcher.RegistryLease) is exercised
by the dispatcher tests. A job that must be stopped has no end of its own (`UNENDING`).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pelt_core.delta import load_delta
from pelt_core.delta_format import read_manifest
from pelt_core.devices import DeviceError, DeviceOutOfMemory
from tests.workers.conftest import UNENDING, wait_for
from workers.attempt import OUTAGE_LEASES, Heartbeat
from workers.backbone_store import LocalBackbones
from workers.job import JobSpec, LeaseLost, LocalDeltaSink, TaskSpec
from workers.worker import PeltWorker, WorkerConfig


class RecordingLease:
    """Records every call; `cancel_after` heartbeats report a cancel request, `lost_after` raise LeaseLost."""

    def __init__(self, job_id: int, cancel_after: int | None = None, lost_after: int | None = None) -> None:
        self.job_id, self.worker_id = job_id, "w1"
        self.cancel_after, self.lost_after = cancel_after, lost_after
        self.calls: list[tuple[str, Any]] = []
        self.reports: list[dict[str, Any]] = []

    def heartbeat(self, progress: dict[str, Any] | None = None) -> bool:
        beats = sum(1 for name, _ in self.calls if name == "heartbeat")
        self.calls.append(("heartbeat", progress))
        if progress is not None:
            self.reports.append(progress)
        if self.lost_after is not None and beats >= self.lost_after and self.reports:
            raise LeaseLost("taken back")
        return self.cancel_after is not None and beats >= self.cancel_after and bool(self.reports)

    def complete(self, result: dict[str, Any]) -> None:
        self.calls.append(("complete", result))

    def fail(self, error: str, retryable: bool) -> None:
        self.calls.append(("fail", (error, retryable)))

    def cancelled(self) -> None:
        self.calls.append(("cancelled", None))

    def release(self, reason: str) -> None:
        self.calls.append(("release", reason))

    def ends(self) -> list[str]:
        return [name for name, _ in self.calls if name != "heartbeat"]


class CountingBackbones(LocalBackbones):
    def __init__(self) -> None:
        self.loads: list[str] = []

    def __call__(self, name: str, dtype: str = "float32"):
        self.loads.append(name)
        return super().__call__(name, dtype)


def job_spec(
    tiny_backbone: tuple[str, str],
    toy_data: dict[str, Path],
    job_id: int = 1,
    steps: int = 30,
    **overrides: Any,
) -> JobSpec:
    from pelt_core import get_method

    task = TaskSpec(
        name="toy",
        train_path=str(toy_data["train"]),
        validation_path=str(toy_data["validation"]),
        text_fields=("sentence",),
        label_field="label",
        problem_type="single_label_classification",
        label_names=("0", "1"),
        metric="accuracy",
    )
    values: dict[str, Any] = {
        "job_id": job_id,
        "task": task,
        "method": "lora",
        "method_spec": get_method("lora").to_dict(),
        "train_config": {"max_steps": steps, "batch_size": 2, "seed": job_id, "bf16": "false"},
        "backbone": tiny_backbone[0],
        "backbone_hash": tiny_backbone[1],
    }
    values.update(overrides)
    return JobSpec(**values)


@pytest.fixture
def worker() -> PeltWorker:
    return PeltWorker(
        "w1",
        WorkerConfig(threads=None, heartbeat_seconds=0.02, lease_seconds=5),
        backbones=CountingBackbones(),
    )


class StoreAfterLastReport:
    """A sink that stores only once the lease has seen the job's last step: the heartbeat goes on while a
    delta is stored, so the report comes whatever the job's speed (a deadline fails the test if it does not)."""

    def __init__(self, lease: RecordingLease, inner: LocalDeltaSink) -> None:
        self.lease, self.inner = lease, inner

    def store(self, job: JobSpec, *args: Any) -> Any:
        def last_step_reported() -> bool:
            return (
                bool(self.lease.reports) and self.lease.reports[-1]["step"] == job.train_config["max_steps"]
            )

        wait_for(last_step_reported, 60, "the last step's progress to reach the lease")
        return self.inner.store(job, *args)


def test_a_job_reports_progress_stores_its_delta_and_records_the_result(
    worker, tiny_backbone, toy_data, tmp_path
):
    lease = RecordingLease(1)
    sink = StoreAfterLastReport(lease, LocalDeltaSink(tmp_path / "deltas"))
    outcome = worker.run(job_spec(tiny_backbone, toy_data, steps=60), lease, sink)

    assert (outcome.status, outcome.job_id, outcome.worker_id) == ("succeeded", 1, "w1")
    assert lease.ends() == ["complete"]
    assert lease.reports, "no progress was reported"
    last = lease.reports[-1]
    assert set(last) >= {"step", "total", "loss", "tokens_per_second"}
    assert (last["step"], last["total"]) == (60, 60) and last["tokens_per_second"] > 0
    result = lease.calls[-1][1]
    assert result["metrics"]["accuracy"] >= 0 and result["total_params"] > result["trainable_params"] > 0
    assert result["device"] == "cpu" and result["job_memory_bytes"] > 0
    folder = Path(result["delta_uri"].removeprefix("file://"))
    assert folder == (tmp_path / "deltas" / "toy" / "job-1").resolve()
    assert hashlib.sha256((folder / "delta.safetensors").read_bytes()).hexdigest() == result["delta_sha256"]
    assert read_manifest(folder)["extra"]["job_id"] == 1
    backbone, _ = LocalBackbones()(tiny_backbone[0])
    load_delta(folder, backbone, expected_sha256=result["delta_sha256"])  # loads onto that backbone


def test_a_warm_worker_loads_a_backbone_once_for_many_jobs(worker, tiny_backbone, toy_data, tmp_path):
    sink = LocalDeltaSink(tmp_path)
    for job_id in (1, 2):
        assert (
            worker.run(
                job_spec(tiny_backbone, toy_data, job_id, steps=5), RecordingLease(job_id), sink
            ).status
            == "succeeded"
        )
    assert worker._source.loads == [tiny_backbone[0]]
    assert worker.info()["jobs_done"] == 2 and worker.info()["job_id"] is None


def test_a_cancel_seen_at_heartbeat_stops_the_job_and_nothing_is_stored(
    worker, tiny_backbone, toy_data, tmp_path
):
    lease = RecordingLease(1, cancel_after=2)
    outcome = worker.run(job_spec(tiny_backbone, toy_data, steps=UNENDING), lease, LocalDeltaSink(tmp_path))
    assert outcome.status == "cancelled"
    assert lease.ends() == ["cancelled"]
    assert lease.reports[-1]["step"] < UNENDING
    assert not (tmp_path / "toy").exists()


def test_heartbeats_that_fail_give_up_after_a_lease_or_after_two_while_the_registry_is_away():
    stopped: list[str] = []
    attempt = SimpleNamespace(
        job_id=1,
        curve=SimpleNamespace(restore=lambda points: None),
        stop=lambda reason, detail: stopped.append(reason),
    )
    beat = Heartbeat(RecordingLease(1), attempt, 1.0, 10.0)  # a 10 s lease
    silent_for = lambda seconds: time.monotonic() - seconds  # noqa: E731 - when the last beat got through
    away = ConnectionError("the registry's database did not answer")  # as RegistryUnavailableError is
    assert beat._gave_up(away, None, silent_for(15)) is False  # past the lease, but the database is away
    assert beat._gave_up(RuntimeError("a bug"), None, silent_for(15)) is True  # anything else: one lease
    assert beat._gave_up(away, None, silent_for(10 * OUTAGE_LEASES + 5)) is True
    assert stopped == ["lease_lost", "lease_lost"]


def test_a_lost_lease_stops_the_job_and_records_nothing(worker, tiny_backbone, toy_data, tmp_path):
    lease = RecordingLease(1, lost_after=2)
    outcome = worker.run(job_spec(tiny_backbone, toy_data, steps=UNENDING), lease, LocalDeltaSink(tmp_path))
    assert outcome.status == "lease_lost"
    assert lease.ends() == []
    assert not (tmp_path / "toy").exists()


def test_stop_release_gives_the_job_back_and_stop_cancel_ends_it(worker, tiny_backbone, toy_data, tmp_path):
    for reason, end in (("release", "release"), ("cancel", "cancelled")):
        lease = RecordingLease(7)
        outcome: list[Any] = []
        thread = threading.Thread(
            target=lambda lease=lease, outcome=outcome: outcome.append(
                worker.run(
                    job_spec(tiny_backbone, toy_data, 7, steps=UNENDING), lease, LocalDeltaSink(tmp_path)
                )
            )
        )
        thread.start()
        wait_for(lambda lease=lease: lease.reports, 60, "training to start")
        assert worker.stop(8, reason) is False  # not the job it runs
        assert worker.stop(7, reason) is True
        thread.join(120)
        assert not thread.is_alive(), f"stop({reason!r}) did not end the job"
        assert lease.ends() == [end]
        assert outcome[0].status == ("released" if reason == "release" else "cancelled")


def test_bad_data_fails_the_job_without_a_retry(worker, tiny_backbone, toy_data, tmp_path):
    spec = job_spec(tiny_backbone, toy_data)
    bad = JobSpec(**{**spec.__dict__, "task": TaskSpec(**{**spec.task.__dict__, "text_fields": ("review",)})})
    lease = RecordingLease(1)
    outcome = worker.run(bad, lease, LocalDeltaSink(tmp_path))
    assert (outcome.status, outcome.retryable) == ("failed", False)
    ((error, retryable),) = [args for name, args in lease.calls if name == "fail"]
    assert "review" in error and retryable is False


def test_a_job_out_of_device_memory_goes_back_to_the_queue_with_the_reason_not_a_traceback(
    worker, tiny_backbone, toy_data, tmp_path, monkeypatch
):
    import workers.worker

    def runs_out_of_memory(*args: Any, **kwargs: Any) -> None:
        raise DeviceOutOfMemory("out of memory on cuda:0 in a training step of its own (pack of 9 job(s))")

    monkeypatch.setattr(workers.worker, "train", runs_out_of_memory)
    lease = RecordingLease(1)
    outcome = worker.run(job_spec(tiny_backbone, toy_data), lease, LocalDeltaSink(tmp_path))

    assert (outcome.status, outcome.retryable) == ("failed", True)
    ((error, retryable),) = [args for name, args in lease.calls if name == "fail"]
    assert retryable is True
    assert (
        error == "DeviceOutOfMemory: out of memory on cuda:0 in a training step of its own (pack of 9 job(s))"
    )
    assert worker.info()["device"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_a_gpu_worker_started_where_no_gpu_is_visible_fails_at_once_saying_so():
    with pytest.raises(DeviceError, match="no CUDA GPU is visible"):
        PeltWorker("w1", WorkerConfig(device="cuda"), backbones=LocalBackbones())


def test_a_different_backbone_than_the_registered_one_fails_the_job(
    worker, tiny_backbone, toy_data, tmp_path
):
    lease = RecordingLease(1)
    spec = job_spec(tiny_backbone, toy_data, backbone_hash="sha256:" + "0" * 64)
    outcome = worker.run(spec, lease, LocalDeltaSink(tmp_path))
    assert (outcome.status, outcome.retryable) == ("failed", False)
    assert "content hash" in lease.calls[-1][1][0]


def test_a_failing_delta_store_is_a_retryable_failure(worker, tiny_backbone, toy_data, tmp_path):
    class BrokenSink:
        def store(self, *args: Any) -> Any:
            raise OSError("artifact store unreachable")

    lease = RecordingLease(1)
    outcome = worker.run(job_spec(tiny_backbone, toy_data, steps=5), lease, BrokenSink())
    assert (outcome.status, outcome.retryable) == ("failed", True)
    error, retryable = lease.calls[-1][1]
    assert "artifact store unreachable" in error and retryable is True


def test_a_worker_runs_one_job_at_a_time(worker, tiny_backbone, toy_data, tmp_path):
    from workers.worker import WorkerBusyError

    lease, second = RecordingLease(1), RecordingLease(2)
    outcome: list[Any] = []
    thread = threading.Thread(
        target=lambda: outcome.append(
            worker.run(job_spec(tiny_backbone, toy_data, steps=UNENDING), lease, LocalDeltaSink(tmp_path))
        )
    )
    thread.start()
    wait_for(lambda: lease.reports, 60, "training to start")
    with pytest.raises(WorkerBusyError):
        worker.run(job_spec(tiny_backbone, toy_data, 2), second, LocalDeltaSink(tmp_path))
    assert second.calls == []  # the refused job was never started
    assert worker.stop(1, "cancel") is True
    thread.join(120)
    assert not thread.is_alive(), "the cancelled job did not end"
    assert outcome[0].status == "cancelled" and lease.ends() == ["cancelled"]
    assert worker.info()["job_id"] is None  # the one slot is free again


def test_a_worker_with_two_slots_trains_two_jobs_at_once_and_stops_one_only(
    tiny_backbone, toy_data, tmp_path
):
    from workers.worker import WorkerBusyError

    source = CountingBackbones()
    worker = PeltWorker(
        "w2", WorkerConfig(threads=None, slots=2, heartbeat_seconds=0.02, lease_seconds=5), backbones=source
    )
    sink = LocalDeltaSink(tmp_path / "deltas")
    finish = threading.Event()

    class HeldSink:  # job 2 cannot end (store, then complete) before the test lets it
        def store(self, *args: Any) -> Any:
            assert finish.wait(120), "the test never let job 2 finish"
            return sink.store(*args)

    sinks = {1: sink, 2: HeldSink()}
    leases = {job_id: RecordingLease(job_id) for job_id in (1, 2)}
    leases[1].worker_id, leases[2].worker_id = "w2#0", "w2#1"
    outcomes: dict[int, Any] = {}
    steps = {1: UNENDING, 2: 40}
    threads = [
        threading.Thread(
            target=lambda j=j: outcomes.__setitem__(
                j, worker.run(job_spec(tiny_backbone, toy_data, j, steps=steps[j]), leases[j], sinks[j])
            )
        )
        for j in (1, 2)
    ]
    for thread in threads:
        thread.start()
    wait_for(lambda: leases[1].reports and leases[2].reports, 60, "both jobs to be training")
    running = worker.info()["jobs"]
    assert sorted((j["job_id"], j["owner"]) for j in running) == [(1, "w2#0"), (2, "w2#1")]
    with pytest.raises(WorkerBusyError):  # two slots, both taken
        worker.run(job_spec(tiny_backbone, toy_data, 3), RecordingLease(3), sink)
    assert worker.stop(1, "cancel") is True
    threads[0].join(120)
    assert not threads[0].is_alive(), "the cancelled job did not end"
    assert outcomes[1].status == "cancelled" and leases[1].ends() == ["cancelled"]
    assert 2 not in outcomes and leases[2].ends() == []  # the other job goes on
    finish.set()
    threads[1].join(120)
    assert not threads[1].is_alive(), "the other job did not end"
    assert (outcomes[2].status, outcomes[2].worker_id) == ("succeeded", "w2#1")
    assert leases[2].ends() == ["complete"] and leases[2].reports[-1]["total"] == 40
    assert source.loads == [tiny_backbone[0]]  # one mapping of the backbone for both jobs
    assert sorted(p.name for p in (tmp_path / "deltas" / "toy").iterdir()) == ["job-2"]
    assert worker.info()["jobs"] == [] and worker.info()["outcomes"] == {1: "cancelled", 2: "succeeded"}


def test_a_replica_shares_every_tensor_of_its_backbone(tiny_backbone):
    from workers.backbone_store import backbone_tensors, replicate

    backbone, _ = LocalBackbones()(tiny_backbone[0])
    twin = replicate(backbone)
    ours, theirs = backbone_tensors(backbone.model), backbone_tensors(twin.model)
    assert set(ours) == set(theirs)
    assert all(ours[name].data_ptr() == theirs[name].data_ptr() for name in ours)
    assert twin.model is not backbone.model and twin.content_hash == backbone.content_hash


def test_a_packing_worker_trains_its_jobs_through_shared_steps_and_ends_each_on_its_own(
    tiny_backbone, toy_data, tmp_path
):
    """Pack places: jobs of mixed methods share the worker's backbone passes; a job that cannot start fails
    alone; a cancel ends one job; its pack-mates go on and succeed, each through its own lease."""
    from pelt_core import get_method

    worker = PeltWorker(
        "wp",
        WorkerConfig(threads=None, pack_size=4, heartbeat_seconds=0.02, lease_seconds=5),
        backbones=CountingBackbones(),
    )
    sink = LocalDeltaSink(tmp_path / "deltas")
    leases = {job_id: RecordingLease(job_id) for job_id in (1, 2, 3, 4)}
    specs = {
        1: job_spec(tiny_backbone, toy_data, 1, steps=UNENDING),
        2: job_spec(
            tiny_backbone, toy_data, 2, method="pfeiffer", method_spec=get_method("pfeiffer").to_dict()
        ),
        3: job_spec(tiny_backbone, toy_data, 3, method="prefix", method_spec=get_method("prefix").to_dict()),
        4: job_spec(tiny_backbone, toy_data, 4, train_config={"max_steps": 30, "batch_size": 0}),
    }
    outcomes: dict[int, Any] = {}

    def run(job_id: int) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: outcomes.__setitem__(job_id, worker.run(specs[job_id], leases[job_id], sink))
        )
        thread.start()
        return thread

    first = run(1)
    wait_for(lambda: leases[1].reports and (leases[1].reports[-1] or {}).get("step"), 60, "job 1 to train")
    others = [run(job_id) for job_id in (2, 3, 4)]
    for thread in others:
        thread.join(120)
        assert not thread.is_alive(), "a job beside the unending one did not end"
    assert outcomes[4].status == "failed" and "batch_size" in outcomes[4].error
    assert not outcomes[4].retryable and leases[4].ends() == ["fail"]
    assert [outcomes[2].status, outcomes[3].status] == ["succeeded", "succeeded"]
    info = worker.info()
    assert (info["slots"], info["pack_size"], [j["job_id"] for j in info["jobs"]]) == (4, 4, [1])
    [pack] = info["packs"]
    assert pack["jobs"] == 1
    assert pack["job_steps"] - pack["steps"] >= 2 * 30  # every step of jobs 2 and 3 shared job 1's pass
    assert worker.stop(1, "cancel") is True
    first.join(120)
    assert outcomes[1].status == "cancelled" and leases[1].ends() == ["cancelled"]
    assert sorted(p.name for p in (tmp_path / "deltas" / "toy").iterdir()) == ["job-2", "job-3"]


# --- progress at the end, the loss curve, and how soon a cancel is seen (issue 25) ----------------------


class CancelOnRequest(RecordingLease):
    """A lease whose heartbeats report a cancel request once `requested` is set (as the registry would)."""

    def __init__(self, job_id: int) -> None:
        super().__init__(job_id)
        self.requested = threading.Event()

    def heartbeat(self, progress: dict[str, Any] | None = None) -> bool:
        super().heartbeat(progress)
        return self.requested.is_set()


def test_a_job_shorter_than_a_heartbeat_reports_step_n_of_n_its_last_loss_and_its_curve_before_its_result(
    tiny_backbone, toy_data, tmp_path
):
    worker = PeltWorker(
        "w1", WorkerConfig(threads=None, heartbeat_seconds=600, lease_seconds=900), backbones=LocalBackbones()
    )
    lease = RecordingLease(1)
    outcome = worker.run(job_spec(tiny_backbone, toy_data, steps=30), lease, LocalDeltaSink(tmp_path))

    assert outcome.status == "succeeded" and lease.ends() == ["complete"]
    names = [name for name, _ in lease.calls]
    final = lease.calls[names.index("complete") - 1]
    assert final[0] == "heartbeat" and final[1] is not None, "no progress went out before the result"
    report = final[1]
    assert (report["step"], report["total"]) == (30, 30)
    curve = [point for beat in lease.reports for point in beat.get("losses", [])]
    assert [step for step, _ in curve] == list(range(1, 31))  # every step of a short job: >= 20 points
    assert report["loss"] is not None and curve[-1][1] == pytest.approx(report["loss"])


def test_the_loss_curve_keeps_at_most_256_even_points_each_the_mean_of_its_steps() -> None:
    from workers.loss_curve import LossCurve

    long, short = LossCurve(), LossCurve()
    for step in range(1, 1001):
        long.add(step, 1000, float(step))
    for step in range(1, 21):
        short.add(step, 57, 1.0)
    short.add(21, 57, float("nan"))  # a non-finite loss is left out

    points = long.take()
    assert [step for step, _ in points] == list(range(4, 1001, 4))  # 250 points, stride ceil(1000 / 256)
    assert points[0][1] == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert short.flush() == [[step, 1.0] for step in range(1, 21)]


def test_a_cancel_requested_while_a_job_trains_is_seen_within_a_progress_interval_not_a_heartbeat_interval(
    tiny_backbone, toy_data, tmp_path
):
    worker = PeltWorker(
        "w1",
        WorkerConfig(threads=None, heartbeat_seconds=600, lease_seconds=900, progress_seconds=0.05),
        backbones=LocalBackbones(),
    )
    lease = CancelOnRequest(1)
    outcome: list[Any] = []
    thread = threading.Thread(
        target=lambda: outcome.append(
            worker.run(job_spec(tiny_backbone, toy_data, steps=UNENDING), lease, LocalDeltaSink(tmp_path))
        )
    )
    thread.start()
    try:
        wait_for(lambda: lease.reports, 60, "training to report its steps (a heartbeat is 600 s away)")
        lease.requested.set()
        thread.join(60)  # far below the 600 s heartbeat: only a beat while training can see it in time
        assert not thread.is_alive(), "the cancel was not seen while the job trained"
    finally:
        worker.stop(1, "cancel")
        thread.join()
    assert outcome[0].status == "cancelled" and lease.ends() == ["cancelled"]


class RefusesLossPoints(RecordingLease):
    """A lease whose registry refuses every report that carries loss points (a ValueError, as the
    registry's validation error is), and renews the lease for any other."""

    refused_before: list[int]  # for each refused report, the number of calls recorded then

    def heartbeat(self, progress: dict[str, Any] | None = None) -> bool:
        if progress and progress.get("losses"):
            self.refused_before = [*getattr(self, "refused_before", []), len(self.calls)]
            raise ValueError("progress.losses[].step: must be at most the report's step")
        return super().heartbeat(progress)


def test_a_report_the_registry_refuses_drops_its_loss_points_and_the_lease_is_renewed_without_them(
    tiny_backbone, toy_data, tmp_path
):
    """Not an outage: the job is not ended as lease_lost after resending the same points for a lease."""
    worker = PeltWorker(
        "w1",
        WorkerConfig(threads=None, heartbeat_seconds=600, lease_seconds=900, progress_seconds=0.05),
        backbones=LocalBackbones(),
    )
    lease = RefusesLossPoints(1)
    outcome = worker.run(job_spec(tiny_backbone, toy_data, steps=30), lease, LocalDeltaSink(tmp_path))

    assert outcome.status == "succeeded" and lease.ends() == ["complete"]
    assert lease.refused_before
    for index in lease.refused_before:
        name, report = lease.calls[index]  # the call right after the refusal
        assert name == "heartbeat" and not (report or {}).get("losses")  # renewed at once, without them


@pytest.mark.parametrize("field", ["heartbeat_seconds", "progress_seconds", "lease_seconds"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_a_worker_config_with_a_time_that_is_not_positive_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a positive number of seconds"):
        WorkerConfig(**{field: value})


def test_a_fusion_job_fetches_its_recorded_sources_from_the_sink_and_a_source_changed_since_fails_it_for_good(
    worker, tiny_backbone, toy_data, tmp_path
):
    from pelt_core import get_method
    from pelt_core.methods.fusion import Source, fusion_method

    sink = LocalDeltaSink(tmp_path / "deltas")
    pfeiffer = get_method("pfeiffer").to_dict()
    stored = {}
    for job_id, task in ((1, "src-a"), (2, "src-b")):
        spec = job_spec(tiny_backbone, toy_data, job_id, steps=4, method="pfeiffer", method_spec=pfeiffer)
        spec = replace(spec, task=replace(spec.task, name=task))
        outcome = worker.run(spec, RecordingLease(job_id), sink)
        assert outcome.status == "succeeded", outcome.error
        stored[task] = outcome.delta_sha256
    fusion = fusion_method([Source(task, sha, get_method("pfeiffer"), 1) for task, sha in stored.items()])
    fused = job_spec(tiny_backbone, toy_data, 3, steps=4, method="fusion", method_spec=fusion.to_dict())
    lease = RecordingLease(3)
    outcome = worker.run(fused, lease, sink)
    assert outcome.status == "succeeded", outcome.error
    manifest = read_manifest(tmp_path / "deltas" / "toy" / "job-3")
    assert [s["sha256"] for s in manifest["method"]["fusion"]["sources"]] == list(stored.values())

    stored_file = tmp_path / "deltas" / "src-a" / "job-1" / "delta.safetensors"
    stored_file.write_bytes(stored_file.read_bytes()[:-8] + b"changed!")  # src-a's delta changed since
    lease = RecordingLease(4)
    outcome = worker.run(
        job_spec(tiny_backbone, toy_data, 4, method="fusion", method_spec=fusion.to_dict()), lease, sink
    )
    assert (outcome.status, outcome.retryable) == ("failed", False)
    assert f"no stored delta of task 'src-a' has sha256 {stored['src-a'][:12]}" in outcome.error
