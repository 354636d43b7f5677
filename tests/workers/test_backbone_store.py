"""One frozen backbone per node: workers build their models around the node's shared arrays, zero-copy."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pelt_core import get_method
from pelt_core.model import JobDelta, PeltModel
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


def uss_bytes() -> int:
    import psutil

    return psutil.Process().memory_full_info().uss


@pytest.mark.slow
def test_workers_on_one_node_share_the_backbone_memory(local_ray):
    ray = local_ray
    from workers.backbone_store import materialize, publish_backbone

    @ray.remote(num_cpus=0)
    class Probe:
        def warm(self) -> int:
            """Everything a warm worker has besides the weights: imports, tokenizer, kernels run once."""
            from workers.backbone_store import load_tokenizer

            self.tokenizer = load_tokenizer("all-minilm-l6-v2")
            tiny = tiny_bert(None)
            model = PeltModel(tiny, JobDelta(get_method("lora"), tiny, 2)).eval()
            with torch.no_grad():
                model(torch.tensor([[2, 100, 3]]), torch.tensor([[1, 1, 1]]))
            return uss_bytes()

        def build(self, handle) -> tuple[int, list[float]]:
            self.backbone = materialize(handle)
            self.model = PeltModel(self.backbone, JobDelta(get_method("lora"), self.backbone, 2)).eval()
            batch = self.backbone.tokenizer(["a shared backbone"], return_tensors="pt")
            with torch.no_grad():
                logits = self.model(batch["input_ids"], batch["attention_mask"])
            return uss_bytes(), logits.tolist()

    handle = ray.get(ray.remote(num_cpus=0)(publish_backbone).remote("all-minilm-l6-v2"))
    probes = [Probe.remote() for _ in range(4)]
    before = ray.get([p.warm.remote() for p in probes])
    after = ray.get([p.build.remote(handle) for p in probes])
    growth = [a[0] - b for a, b in zip(after, before, strict=True)]
    # each worker's own memory grows by a small fraction of the 90 MB of weights it uses
    for extra in growth[1:]:
        assert extra < 0.25 * handle.num_bytes, (growth, handle.num_bytes)
    assert np.std([a[1][0][0] for a in after]) < 1.0  # all run a real forward
    for probe in probes:
        ray.kill(probe)


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # bind the local cluster to 127.0.0.1
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()
