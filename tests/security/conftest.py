"""Fixtures of the security tests: those of the API tests (a real app over a real service, in-process),
and stored deltas to compose."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.conftest import *  # noqa: F403
from tests.api.conftest import Api


@pytest.fixture
def loras(api: Api, tiny_bert_dir: Path, tmp_path: Path) -> list[str]:
    """Two rank-2 LoRA deltas on the tiny backbone (hidden 32), stored as versions 1 and 2 of task `toy`."""
    import torch

    from pelt_core.backbones import Backbone
    from pelt_core.delta import save_delta
    from pelt_core.methods import get_method
    from pelt_core.model import JobDelta

    backbone = Backbone.load(str(tiny_bert_dir))
    refs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        delta = JobDelta(get_method("lora", {"r": 2}), backbone, num_labels=2, label_names=["0", "1"])
        with torch.no_grad():
            for parameter in delta.parameters():
                parameter.normal_(std=0.1)
        folder = save_delta(delta, backbone, tmp_path / f"lora-{seed}").path
        refs.append(f"toy/{api.store.register('toy', folder).model_version}")
    return refs


def versions(api: Api, task: str) -> list[str]:
    """The version numbers of a task in the delta store (none for a task it does not hold)."""
    return [v.version for v in api.store.list_versions(task)] if task in api.store.list_tasks() else []
