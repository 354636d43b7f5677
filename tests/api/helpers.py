"""Helpers of the API and security tests: how a refused request is asserted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from services.client import PeltAPIError


def refused(call: Callable[[], Any], status: int, field: str | None = None, words: str = "") -> PeltAPIError:
    """The PeltAPIError `call` raises: its status, its field (when given) and the words in its message."""
    with pytest.raises(PeltAPIError) as caught:
        call()
    error = caught.value
    assert error.status == status, error
    if field is not None:
        assert error.field == field, error
    assert words.lower() in error.message.lower(), error
    return error


__all__ = ["refused"]


def tiny_lora_spec(name: str) -> dict:
    """A user method spec: LoRA of rank 2 on W_q only (cheap to train on the tiny backbones)."""
    module = {
        "form": "bottleneck",
        "representation": "attn.q",
        "insertion": "parallel",
        "composition": "scaled",
        "size": 2,
        "alpha": 4,
        "nonlinearity": "identity",
        "proj_bias": False,
        "init": "lora",
    }
    return {"name": name, "modules": {"q": module}}
