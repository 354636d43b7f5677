"""Scaling from the queue (services/dispatcher/scaling.py) as a specification: the dispatcher asks Ray's
autoscaler for one worker's shape per worker it keeps and per worker its waiting jobs need, sends a request
only when it changes, and stops workers idle past --idle-worker-seconds when nothing of their kind waits."""

from __future__ import annotations

from services.dispatcher.config import DispatcherConfig
from services.dispatcher.scaling import NodeRequests
from services.dispatcher.slots import SlotJob, WorkerSlots

GPU = {"GPU": 1.0, "CPU": 2.0}
CPU = {"CPU": 1.0}


def requests(config: DispatcherConfig) -> tuple[NodeRequests, list[list[dict[str, float]]]]:
    sent: list[list[dict[str, float]]] = []
    return NodeRequests(config, request=sent.append), sent


def worker(name: str, device: str = "cpu", busy: bool = False, slots: int = 1) -> WorkerSlots:
    jobs = {0: SlotJob(1, name)} if busy else {}
    return WorkerSlots(name, "node", actor=None, slots=slots, ready=True, jobs=jobs, device=device)


def test_a_gpu_job_with_no_gpu_anywhere_asks_for_one_gpu_worker_and_the_same_again_sends_nothing():
    scaling, sent = requests(DispatcherConfig(cpus_per_gpu_worker=2, gpu_pack_size=4))
    scaling.update({"gpu": 1}, [], has_gpus=False, now=0)
    assert sent == [[GPU]]
    scaling.update({"gpu": 3}, [], has_gpus=False, now=10)  # a pack of 4 takes 3
    assert sent == [[GPU]]
    scaling.update({"gpu": 5}, [], has_gpus=False, now=20)
    assert sent[-1] == [GPU, GPU]


def test_any_jobs_ask_for_cpu_workers_unless_a_node_has_a_gpu():
    scaling, sent = requests(DispatcherConfig())
    scaling.update({"any": 2}, [], has_gpus=False, now=0)
    assert sent == [[CPU, CPU]]
    gpu_worker = worker("g", "gpu", busy=True)
    scaling.update({"any": 2}, [gpu_worker], has_gpus=True, now=10)
    assert sent[-1] == [{"GPU": 1.0, "CPU": 1.0}] * 2  # the busy GPU worker and one more for the pack of 2


def test_free_places_are_counted_before_asking_for_more_and_the_request_keeps_the_workers_it_has():
    scaling, sent = requests(DispatcherConfig())
    workers = [worker("a", busy=True), worker("b")]
    scaling.update({"cpu": 1}, workers, has_gpus=False, now=0)
    assert sent == [[CPU, CPU]]  # the two it has: b's free place takes the queued job
    scaling.update({"cpu": 4}, workers, has_gpus=False, now=10)
    assert sent[-1] == [CPU] * 5  # b's place takes one, three more workers for the rest
    scaling.update({}, workers, has_gpus=False, now=20)
    assert sent[-1] == [CPU, CPU]  # a node's room is not asked for until a worker stands on it


def pack(name: str, backbone: str | None = None, running: int = 0, places: int = 4) -> WorkerSlots:
    """A pack worker with `running` jobs of `backbone` in its places."""
    jobs = {slot: SlotJob(slot + 1, f"{name}#{slot}", backbone=backbone) for slot in range(running)}
    return WorkerSlots(name, "node", actor=None, slots=places, ready=True, jobs=jobs, packed=True)


def test_a_pack_training_one_backbone_has_no_room_for_another_backbones_jobs():
    scaling, sent = requests(DispatcherConfig(pack_size=4))
    busy_on_minilm = pack("p", backbone="minilm", running=1)  # 3 free places, for MiniLM jobs only
    scaling.update({"cpu": 2}, [busy_on_minilm], False, {("cpu", "smollm2"): 2}, now=0)
    assert sent == [[CPU, CPU]]  # the pack it keeps, and one more for the SmolLM2 jobs
    scaling.update({"cpu": 3}, [busy_on_minilm], False, {("cpu", "minilm"): 3}, now=10)
    assert sent[-1] == [CPU]  # the pack's free places take them
    both = {("cpu", "minilm"): 3, ("cpu", "smollm2"): 5}
    scaling.update({"cpu": 8}, [busy_on_minilm], False, both, now=20)
    assert sent[-1] == [CPU] * 3  # MiniLM's 3 fit; SmolLM2's 5 need two packs of 4
    scaling.update({"cpu": 5}, [busy_on_minilm], False, None, now=30)
    assert sent[-1] == [CPU, CPU]  # not told the backbones: every free place counts (2 left: one pack more)


def test_an_idle_pack_takes_one_backbone_and_job_slots_take_any():
    scaling, sent = requests(DispatcherConfig(pack_size=4))
    two_backbones = {("cpu", "minilm"): 2, ("any", "smollm2"): 2}
    scaling.update({"cpu": 2, "any": 2}, [pack("idle")], False, two_backbones, now=0)
    assert sent == [[CPU, CPU]]  # the idle pack takes one backbone's jobs; the other needs a pack
    scaling.update({"gpu": 2}, [pack("idle")], False, {("gpu", "minilm"): 2}, now=10)
    assert sent[-1] == [{"GPU": 1, "CPU": 1}, CPU]  # GPU jobs never count on a CPU worker's places
    slots, sent = requests(DispatcherConfig(jobs_per_worker=2))  # no packs: two job slots per worker
    one_busy = worker("w", busy=True, slots=2)
    three_backbones = {("cpu", "a"): 1, ("cpu", "b"): 1, ("cpu", "c"): 1}
    slots.update({"cpu": 3}, [one_busy], False, three_backbones, now=0)
    assert sent == [[{"CPU": 2}, {"CPU": 2}]]  # its free slot takes one; a new worker's two slots the others


def test_the_request_is_capped_and_no_gpu_is_asked_for_without_gpu_workers():
    scaling, sent = requests(DispatcherConfig(max_requested_workers=3))
    scaling.update({"cpu": 50}, [], has_gpus=False, now=0)
    assert sent == [[CPU] * 3]
    scaling, sent = requests(DispatcherConfig(gpus_per_worker=0))
    scaling.update({"gpu": 2}, [], has_gpus=False, now=0)
    assert sent == [[]]


def test_idle_workers_go_after_the_idle_time_only_when_nothing_of_their_kind_waits():
    scaling, _ = requests(DispatcherConfig(idle_worker_seconds=60))
    idle, busy = worker("idle"), worker("busy", busy=True)
    assert scaling.update({}, [idle, busy], has_gpus=False, now=0) == []
    assert scaling.update({"cpu": 1}, [idle, busy], has_gpus=False, now=61) == []  # a job waits
    assert scaling.update({}, [idle, busy], has_gpus=False, now=62) == [idle]
    busy.jobs.clear()
    assert scaling.update({}, [busy], has_gpus=False, now=100) == []  # idle since 100, not since 0
    assert scaling.update({}, [busy], has_gpus=False, now=160) == [busy]
    keep_warm, _ = requests(DispatcherConfig())
    assert keep_warm.update({}, [idle], has_gpus=False, now=10**6) == []


def test_it_is_due_every_scaling_seconds_and_never_at_0():
    scaling, _ = requests(DispatcherConfig(scaling_seconds=5))
    assert scaling.due(now=0)
    scaling.update({}, [], has_gpus=False, now=0)
    assert not scaling.due(now=4) and scaling.due(now=5)
    off, _ = requests(DispatcherConfig(scaling_seconds=0))
    assert not off.due(now=0)


def test_a_cluster_that_refuses_the_request_keeps_its_size_and_is_asked_again_next_time():
    calls = []

    def refuse(bundles):
        calls.append(bundles)
        raise RuntimeError("no autoscaler")

    scaling = NodeRequests(DispatcherConfig(), request=refuse)
    scaling.update({"cpu": 1}, [], has_gpus=False, now=0)
    scaling.update({"cpu": 1}, [], has_gpus=False, now=10)
    assert calls == [[CPU], [CPU]] and scaling.sent is None


def test_the_idle_time_comes_from_pelt_idle_worker_seconds_unless_the_dispatcher_is_given_one(
    registry_url, tmp_path
):
    from services.dispatcher import Dispatcher
    from services.registry import Registry
    from services.settings import Settings

    settings = Settings(data_dir=tmp_path / "data", idle_worker_seconds=600)
    with Registry(registry_url) as registry:
        assert Dispatcher(registry, settings=settings).config.idle_worker_seconds == 600
        given = DispatcherConfig(idle_worker_seconds=30)
        assert Dispatcher(registry, config=given, settings=settings).config.idle_worker_seconds == 30
        unset = Settings(data_dir=tmp_path / "data")
        assert Dispatcher(registry, settings=unset).config.idle_worker_seconds is None


def test_the_leader_reports_its_largest_started_worker_of_each_kind():
    from services.dispatcher.slots import largest_worker_memory

    workers = [worker("a"), worker("b"), worker("g", "gpu")]
    workers[0].memory_bytes, workers[1].memory_bytes, workers[2].memory_bytes = 3 << 30, 5 << 30, 70 << 30
    starting = worker("c")
    starting.ready, starting.memory_bytes = False, 100 << 30  # not started yet: not counted
    assert largest_worker_memory([*workers, starting]) == {"cpu": 5 << 30, "gpu": 70 << 30}


def test_each_renewal_of_the_leadership_carries_the_workers_budgets():
    from services.dispatcher.leadership import LeaderLock

    class Registry:
        def __init__(self):
            self.renewals = []

        def renew_leadership(self, namespace, holder, ttl_seconds, worker_memory=None):
            self.renewals.append(worker_memory)
            return True

    registry = Registry()
    lock = LeaderLock(registry, "pelt", leader_seconds=15)
    lock.leading = True
    assert lock.still_leading(force=True)  # nothing to report yet: nothing sent
    lock.worker_memory = lambda: {"cpu": 3 << 30}
    assert lock.still_leading(force=True)
    assert registry.renewals == [None, {"cpu": 3 << 30}]


def test_a_dispatcher_stopping_its_workers_withdraws_its_request_and_shapes_are_whole_numbers():
    scaling, sent = requests(DispatcherConfig(cpus_per_worker=2))
    scaling.withdraw()
    assert sent == []  # nothing asked yet: nothing to withdraw
    scaling.update({"cpu": 1}, [], has_gpus=False, now=0)
    assert sent == [[{"CPU": 2}]] and isinstance(sent[0][0]["CPU"], int)  # Ray before 2.60 took ints only
    scaling.withdraw()
    assert sent[-1] == []
