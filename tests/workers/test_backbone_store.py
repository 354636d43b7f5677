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


def test_a_backbone_whose_loading_worker_dies_is_loaded_by_the_next_worker_that_asks(
    local_ray, tiny_backbone
):
    """The host publishes nothing when the worker loading for it dies: the next request loads again."""
    ray = local_ray
    from workers.backbone_host import node_host
    from workers.worker import WorkerConfig, worker_actor_class

    namespace = "dying-loader-test"
    config = WorkerConfig(namespace=namespace)
    doomed = (
        worker_actor_class()
        .options(name="doomed", namespace=namespace, max_concurrency=4)
        .remote("doomed", config)
    )
    survivor = (
        worker_actor_class()
        .options(name="survivor", namespace=namespace, max_concurrency=4)
        .remote("survivor", config)
    )
    host = node_host(namespace)
    try:
        ray.get([doomed.ping.remote(), survivor.ping.remote()])
        ray.kill(doomed)  # it dies before its load is stored: the host's request to it fails
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(host.handle.remote(tiny_backbone[0], loader=doomed))
        assert ray.get(host.published.remote()) == []
        warmed = ray.get(survivor.warm.remote(tiny_backbone[0]))
        (entry,) = ray.get(host.published.remote())
    finally:
        ray.kill(survivor)
        ray.kill(host)
    assert entry["content_hash"] == tiny_backbone[1] and warmed["shared_bytes"] == entry["num_bytes"]


@pytest.fixture(scope="module")
def local_ray():
    from services.dispatcher import connect_ray
    from services.settings import Settings

    # as the service starts it: loopback only, no dashboard, token auth on
    connect_ray(Settings(ray_address=None), namespace="pelt-store-tests", num_cpus=4, log_to_driver=False)
    yield ray
    ray.shutdown()
