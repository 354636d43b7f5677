"""One frozen backbone per node: workers build their models around the node's shared arrays, zero-copy."""

from __future__ import annotations

import pytest
import ray
import torch

from pelt_core.testing import tiny_bert, tiny_llama
from workers.backbone_store import assemble, backbone_tensors, from_shareable, to_shareable


@pytest.mark.parametrize("make", [tiny_bert, tiny_llama])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_assembled_around_shared_arrays_computes_the_same_and_copies_nothing(make, dtype):
    original = make(None)
    original.model.to(dtype)
    tensors = backbone_tensors(original.model)
    arrays = to_shareable(tensors)
    for array in arrays.values():
        array.flags.writeable = False  # as Ray's object store hands them out
    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()}
    shared = from_shareable(arrays, dtypes)
    model = assemble(original.config.to_dict(), shared, "sdpa")

    for name, tensor in backbone_tensors(model).items():
        assert tensor.data_ptr() == arrays[name].ctypes.data, f"{name} was copied"
        assert tensor.dtype == dtype or not tensor.is_floating_point()
    ids = torch.tensor([[2, 100, 104, 3, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    expected = original.model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).last_hidden_state, expected)


@pytest.mark.slow
def test_worker_actors_on_one_node_map_one_published_copy(local_ray, tiny_backbone):
    """Real worker actors (as the dispatcher starts them): the node's host publishes each backbone
    once, loaded by one of the workers that asked for it, and no worker's own memory (its heap, not the
    node's shared memory) grows by more than a small fraction of the weights it maps, the loader's included."""
    ray = local_ray
    from workers.backbone_host import node_host
    from workers.worker import WorkerConfig, worker_actor_class

    namespace = "shared-backbone-test"
    workers = [
        worker_actor_class()
        .options(name=f"w{i}", namespace=namespace, num_cpus=1, max_concurrency=4)
        .remote(f"w{i}", WorkerConfig(namespace=namespace))
        for i in range(4)
    ]
    try:
        ray.get([w.warm.remote(tiny_backbone[0]) for w in workers])  # imports and code paths, a tiny model
        before = ray.get([w.memory.remote() for w in workers])
        warmed = ray.get([w.warm.remote("all-minilm-l6-v2") for w in workers])
        after = ray.get([w.memory.remote() for w in workers])
        published = ray.get(node_host(namespace).published.remote())
    finally:
        for worker in workers:
            ray.kill(worker)
        ray.kill(node_host(namespace))

    shared = warmed[0]["shared_bytes"]
    assert shared > 80e6 and all(w["shared_bytes"] == shared for w in warmed)
    assert sorted(p["name"] for p in published) == sorted(["all-minilm-l6-v2", tiny_backbone[0]])  # once each
    growth = [a["anonymous"] - b["anonymous"] for a, b in zip(after, before, strict=True)]
    print(
        f"heap growth per worker for {shared / 1e6:.0f} MB of shared weights: "
        f"{[round(g / 1e6, 1) for g in growth]} MB"
    )
    assert all(extra < 0.25 * shared for extra in growth), (growth, shared)


def test_a_published_backbone_outlives_the_worker_that_loaded_it_and_a_dead_loader_publishes_nothing(
    local_ray, tiny_backbone
):
    """The host owns what a worker loads for it: the copy stays when that worker dies. A loader that is dead
    when the host asks it publishes nothing, and the next request loads again; without a loader, a one-off
    task loads."""
    ray = local_ray
    from workers.backbone_host import node_host
    from workers.worker import WorkerConfig, worker_actor_class

    namespace = "loader-lifetime-test"
    config = WorkerConfig(namespace=namespace)
    doomed, loader, reader = (
        worker_actor_class().options(name=name, namespace=namespace, max_concurrency=4).remote(name, config)
        for name in ("doomed", "loader", "reader")
    )
    host = node_host(namespace)
    try:
        ray.get([worker.ping.remote() for worker in (doomed, loader, reader)])
        ray.kill(doomed)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(host.handle.remote(tiny_backbone[0], loader=doomed))
        assert ray.get(host.published.remote()) == []
        loaded = ray.get(loader.warm.remote(tiny_backbone[0]))  # the first to ask loads it for the host
        ray.kill(loader)
        mapped = ray.get(reader.warm.remote(tiny_backbone[0]))  # the copy the dead loader wrote
        by_task = ray.get(host.handle.remote(tiny_backbone[0], "bfloat16"))  # no loader: a one-off task
        published = ray.get(host.published.remote())
    finally:
        for worker in (loader, reader):
            ray.kill(worker)
        ray.kill(host)
    assert mapped == loaded and mapped["shared_bytes"] > 0
    assert by_task.dtype == "bfloat16" and by_task.content_hash == tiny_backbone[1]
    assert sorted(p["dtype"] for p in published) == ["bfloat16", "float32"]


@pytest.fixture(scope="module")
def local_ray():
    from services.dispatcher import connect_ray
    from services.settings import Settings

    # as the service starts it: loopback only, no dashboard, token auth on
    connect_ray(Settings(ray_address=None), namespace="pelt-store-tests", num_cpus=4, log_to_driver=False)
    yield ray
    ray.shutdown()
