from __future__ import annotations

import pytest
import torch

from pelt_core.testing import tiny_bert, tiny_llama

TINY = {"bert": tiny_bert, "llama": tiny_llama}


@pytest.fixture(params=["bert", "llama"])
def family(request) -> str:
    return request.param


@pytest.fixture
def make_backbone(tmp_path):
    """make_backbone("bert" | "llama", seed=0, attn_implementation="sdpa", **config) -> a fresh tiny Backbone."""

    def make(family: str = "bert", seed: int = 0, attn_implementation: str = "sdpa", **config_overrides):
        return TINY[family](
            str(tmp_path), seed=seed, attn_implementation=attn_implementation, **config_overrides
        )

    return make


@pytest.fixture
def sentences():
    return ["the movie was good", "bad film", "a very boring film , not fun", "great"]


def encode(backbone, texts):
    batch = backbone.tokenizer(texts, padding=True, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


def trained_like(delta, seed: int, std: float = 0.1):
    """Give every tensor of a JobDelta (zero-initialised ones and the head included) random N(0, std²)
    additions, as training would; returns the delta."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in delta.parameters():
            parameter.add_(torch.randn_like(parameter) * std)
    return delta
