"""The arguments of a composition, checked before any delta is loaded or any tensor allocated.

`check_options` is what the service runs on a request (names, types, `limits.COMPOSE_RANGES`, one weight per
source); the other checks here are shared by the operations in `pelt_core.compose`. Every refusal is a
`CompositionError` naming the argument (`field`). Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pelt_core.limits import COMPOSE_RANGES, LimitError
from pelt_core.vocabulary import COMPOSE_OPTIONS

MERGE_METHODS = ("linear", "ties", "dare")
DARE_COMBINES = ("linear", "ties")
DEFAULT_DENSITY = {"ties": 0.2, "dare": 0.1}  # TIES paper: top 20 %; DARE paper: p = 0.9
OPTIONS = COMPOSE_OPTIONS  # the keyword options each operation takes (pelt_core.vocabulary)


class CompositionError(ValueError):
    """Deltas that cannot be composed together, or a composition argument out of range (`field`: its name)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def check_options(op: str, options: Mapping[str, Any], sources: int) -> None:
    """An operation's options before any delta is loaded: known to `op`, of the right type, within the
    ranges of `limits.COMPOSE_RANGES`, one weight per source. A CompositionError names the option (`field`).
    The bounds that depend on the deltas (a rank at most what their matrices hold) are checked by the
    operations themselves, still before anything is allocated."""
    if op not in OPTIONS:
        raise CompositionError(f"op must be one of {', '.join(OPTIONS)}, got {op!r}", field="op")
    for name, value in options.items():
        if name not in OPTIONS[op]:
            raise CompositionError(
                f"{name}: not an option of {op}; its options: {', '.join(OPTIONS[op]) or '(none)'}",
                field=name,
            )
        if name == "how" and value not in MERGE_METHODS:
            raise CompositionError(
                f"how must be one of {', '.join(MERGE_METHODS)}, got {value!r}", field=name
            )
        if name == "combine" and value not in DARE_COMBINES:
            raise CompositionError(
                f"combine must be one of {', '.join(DARE_COMBINES)}, got {value!r}", field=name
            )
        if name == "weights" and value is not None:
            if isinstance(value, str | bytes) or not isinstance(value, Sequence):
                raise CompositionError(
                    f"weights must be a list of {sources} numbers, got {value!r}", field=name
                )
            if len(value) != sources:
                raise CompositionError(
                    f"{len(value)} weights for {sources} deltas; give one weight per delta", field=name
                )
            for index, weight in enumerate(value):
                check_in_range("weights", weight, f"weights[{index}]")
        elif name in COMPOSE_RANGES and not (value is None and name in ("lora_rank", "density")):
            check_in_range(name, value, name)
    if op == "merge_lora_svd" and options.get("rank") is None:
        raise CompositionError("rank: merge_lora_svd needs the rank of its result", field="rank")


def check_in_range(name: str, value: Any, field: str) -> None:
    """`value` within `limits.COMPOSE_RANGES[name]`, else a CompositionError naming `field`."""
    try:
        COMPOSE_RANGES[name].check(value, field)
    except LimitError as exc:
        raise CompositionError(str(exc), field=field) from None


def check_weights(weights: Sequence[float] | None, n: int, default: float, positive: bool) -> list[float]:
    """One finite weight per delta (`default` for each when none are given); > 0 where `positive`."""
    if weights is None:
        return [default] * n
    if isinstance(weights, str | bytes) or not isinstance(weights, Sequence):
        raise CompositionError(f"weights must be a list of {n} numbers, got {weights!r}")
    if len(weights) != n:
        raise CompositionError(f"{len(weights)} weights for {n} deltas; give one weight per delta")
    values = [finite_number(w, f"weights[{i}]") for i, w in enumerate(weights)]
    if positive and any(v <= 0 for v in values):
        raise CompositionError(f"TIES weights must be > 0 (sign election), got {values}")
    return values


def finite_number(value: Any, name: str) -> float:
    """`value` as a float when it is a finite int or float (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CompositionError(f"{name} must be a finite number, got {value!r}", field=name)
    return float(value)


def check_density(density: Any) -> None:
    """A kept fraction in (0, 1]."""
    if isinstance(density, bool) or not isinstance(density, int | float) or not 0.0 < density <= 1.0:
        raise CompositionError(f"density must be in (0, 1], got {density!r}", field="density")


def check_rank(rank: Any, name: str) -> None:
    """A whole rank >= 1 within `limits.COMPOSE_RANGES[name]` (the deltas' own bound: `check_rank_fits`)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise CompositionError(f"{name} must be a whole number >= 1, got {rank!r}", field=name)
    check_in_range(name, rank, name)


def check_seed(seed: Any) -> None:
    """DARE's seed: a whole number >= 0."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise CompositionError(f"seed must be a whole number >= 0, got {seed!r}", field="seed")
