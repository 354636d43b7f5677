"""A method search's arithmetic (no SQL here): the search space of a method, the configurations drawn from
it, and the successive-halving schedule a budget buys.

Successive halving (Jamieson & Talwalkar 2016; the synchronous form of ASHA, Li et al. 2020): many
configurations train briefly, the best third (η = 3) by the dev metric trains three times as long, and so
on; the last rung trains its survivors at the full epochs with several seeds, so the chosen
configuration carries its own interval. The budget counts full-job equivalents: one job at the search's
full epochs costs 1, a job at a third of them 1/3.

The space of a method, around its preset (what the search varies; the rest of the spec stays as is):
- `learning_rate`: log-uniform over [preset / 3, preset × 3] (the presets' rates are the papers' for
  BERT-base; a smaller backbone or K moves the optimum by about that much);
- a size per kind of module the method has: `r` (LoRA rank), `bottleneck` (adapter width),
  `prefix_length`, each one of {preset / 2, preset, preset × 2};
- a mixture's per-module rates: `<role>.lr_multiplier` of every module that trains at its own multiple
  of the job's rate (UniPELT's), log-uniform over [multiplier / 2, multiplier × 2]; modules of one kind
  at one multiplier (UniPELT's LoRA on W_q and on W_v) are one module to the search and share the draw.
A hyperparameter the user fixes is left out of the space (a fixed size or `lr_multiplier`, however it is
spelled, fixes every dimension of that field). A method whose space is finite (only sizes, or nothing left)
gets at most as many configurations as it has distinct points; the draws never repeat a configuration.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pelt_core.spec import module_kind

ETA = 3  # each rung keeps the best 1/ETA of its configurations and trains them ETA times as long
FINAL_SEEDS = 3
MAX_RUNGS = 3
MAX_CONFIGURATIONS = 243  # configurations a search draws at most (3^5), whatever its budget
MIN_FIRST_RUNG_STEPS = 8  # three rungs only where the first (1/9 of the epochs) trains this many steps
LEARNING_RATE_SPAN = 3.0  # the learning rate varies over [preset / span, preset × span]
MULTIPLIER_SPAN = 2.0
SIZE_FACTORS = (0.5, 1.0, 2.0)
SIZE_KEYS = {"lora": "r", "adapter": "bottleneck", "prefix": "prefix_length"}


class SearchPlanError(ValueError):
    """A search that cannot be planned: `field` names what to change."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class LogUniform:
    low: float
    high: float

    def draw(self, rng: random.Random) -> float:
        value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return float(f"{value:.3g}")  # three digits: readable in a table, and far finer than the noise

    def describe(self) -> str:
        return f"log-uniform {self.low:g} to {self.high:g}"


@dataclass(frozen=True)
class Choice:
    values: tuple[Any, ...]

    def draw(self, rng: random.Random) -> Any:
        return rng.choice(self.values)

    def describe(self) -> str:
        return "one of " + ", ".join(str(value) for value in self.values)


@dataclass(frozen=True)
class SameAs:
    """A dimension tied to another of the same method: it takes the value drawn for `key`."""

    key: str

    def describe(self) -> str:
        return f"the same as {self.key}"


Dimension = LogUniform | Choice | SameAs


def method_space(spec: Mapping[str, Any], fixed: Mapping[str, Any] = ()) -> dict[str, Dimension]:
    """The hyperparameters a search varies for a method (its resolved spec dict), less those in `fixed`."""
    space: dict[str, Dimension] = {}
    rate = float((spec.get("defaults") or {}).get("learning_rate", 1e-3))
    space["learning_rate"] = LogUniform(rate / LEARNING_RATE_SPAN, rate * LEARNING_RATE_SPAN)
    sizes: dict[str, int] = {}
    for module in (spec.get("modules") or {}).values():
        key = SIZE_KEYS.get(module_kind(module))
        if key is not None:
            sizes.setdefault(key, int(module["size"]))
    for key, size in sizes.items():
        space[key] = Choice(tuple(sorted({max(1, round(size * factor)) for factor in SIZE_FACTORS})))
    leads: dict[tuple[str, float], str] = {}  # (kind, multiplier) -> the key drawn for those modules
    for role, module in (spec.get("modules") or {}).items():
        multiplier = float(module.get("lr_multiplier", 1.0))
        if multiplier != 1.0:
            key, lead = f"{role}.lr_multiplier", leads.get((module_kind(module), multiplier))
            if lead is None:
                leads[(module_kind(module), multiplier)] = key
                space[key] = LogUniform(multiplier / MULTIPLIER_SPAN, multiplier * MULTIPLIER_SPAN)
            else:
                space[key] = SameAs(lead)
    aliases = {"lr": "learning_rate", "rank": "r", "l": "prefix_length"}
    left_out = {aliases.get(key, key) for key in fixed}
    fields = {key.rsplit(".", 1)[-1] for key in fixed}  # `size`, `q.size`, `r`, `lr_multiplier`, ...
    if fields & {"size", *SIZE_KEYS.values(), "rank", "l"}:
        left_out.update(SIZE_KEYS.values())  # any size fixed: the sizes are the user's
    if "lr_multiplier" in fields:
        left_out.update(key for key in space if key.endswith(".lr_multiplier"))
    return {
        key: dimension
        for key, dimension in space.items()
        if key not in left_out and not (isinstance(dimension, SameAs) and dimension.key in left_out)
    }


def distinct_points(space: Mapping[str, Dimension]) -> float:
    """How many distinct configurations a space holds: the product of its choices; infinite with a
    continuous dimension; 1 when nothing is left to vary."""
    count = 1.0
    for dimension in space.values():
        if isinstance(dimension, LogUniform):
            return math.inf
        if isinstance(dimension, Choice):
            count *= len(dimension.values)
    return count


@dataclass(frozen=True)
class Configuration:
    """One point of the search: a method and the hyperparameters drawn for it (job overrides)."""

    index: int
    method: str
    hyperparameters: dict[str, Any]


def draw_configurations(
    spaces: Mapping[str, Mapping[str, Dimension]], count: int, seed: int
) -> list[Configuration]:
    """`count` configurations, the methods taking turns (a method whose space has fewer distinct points
    than its share leaves its turns to the others), each hyperparameter drawn from its dimension, none
    drawn twice; the same seed draws the same. ValueError when the spaces hold fewer than `count`."""
    if count > sum(min(distinct_points(space), count) for space in spaces.values()):
        raise ValueError(f"the spaces hold fewer than {count} distinct configurations")
    rng = random.Random(seed)
    methods = list(spaces)
    seen: dict[str, set[str]] = {method: set() for method in methods}
    drawn: list[Configuration] = []
    turn = 0
    while len(drawn) < count:
        method = methods[turn % len(methods)]
        turn += 1
        if len(seen[method]) >= distinct_points(spaces[method]):
            continue  # every point of this method is drawn
        while True:
            space = spaces[method]
            values = {key: d.draw(rng) for key, d in space.items() if not isinstance(d, SameAs)}
            values |= {key: values[d.key] for key, d in space.items() if isinstance(d, SameAs)}
            identity = repr(sorted(values.items()))
            if identity not in seen[method]:
                break
        seen[method].add(identity)
        drawn.append(Configuration(len(drawn), method, values))
    return drawn


def space_size(spaces: Mapping[str, Mapping[str, Dimension]]) -> float:
    """Distinct configurations over every method (infinite with any continuous dimension)."""
    return sum(distinct_points(space) for space in spaces.values())


@dataclass(frozen=True)
class Rung:
    index: int
    configurations: int
    seeds: int  # jobs per configuration (the last rung: its seeds)
    epochs: float

    def cost(self, full_epochs: float) -> float:
        return self.configurations * self.seeds * self.epochs / full_epochs


@dataclass(frozen=True)
class Schedule:
    rungs: tuple[Rung, ...]
    full_epochs: float

    @property
    def cost(self) -> float:
        """Full-job equivalents the whole schedule spends when every job runs to its end."""
        return sum(rung.cost(self.full_epochs) for rung in self.rungs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "full_epochs": self.full_epochs,
            "rungs": [
                {"index": r.index, "configurations": r.configurations, "seeds": r.seeds, "epochs": r.epochs}
                for r in self.rungs
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        return cls(
            tuple(
                Rung(int(r["index"]), int(r["configurations"]), int(r["seeds"]), float(r["epochs"]))
                for r in data["rungs"]
            ),
            float(data["full_epochs"]),
        )


def _schedule(first: int, rungs: int, full_epochs: float, final_seeds: int, eta: int) -> Schedule:
    return Schedule(
        tuple(
            Rung(
                index,
                first // eta**index,
                final_seeds if index == rungs - 1 else 1,
                full_epochs / eta ** (rungs - 1 - index),
            )
            for index in range(rungs)
        ),
        full_epochs,
    )


def plan_schedule(
    budget: float,
    full_epochs: float,
    *,
    final_seeds: int = FINAL_SEEDS,
    eta: int = ETA,
    max_configurations: float = MAX_CONFIGURATIONS,
    steps_per_epoch: int | None = None,
) -> Schedule:
    """The schedule that draws the most configurations (at most `max_configurations`) within `budget`
    (full-job equivalents): three rungs (1/9, 1/3 and all of the full epochs) where the budget allows and
    the first rung trains at least MIN_FIRST_RUNG_STEPS steps (given `steps_per_epoch`), else two; a
    SearchPlanError naming `budget` when not even the smallest (`eta` configurations at 1/eta of the
    epochs, the best one at full epochs with its seeds) fits."""
    if not (isinstance(budget, int | float) and math.isfinite(budget) and budget > 0):
        raise SearchPlanError("budget", f"must be a positive number of full-job equivalents, got {budget!r}")
    if final_seeds < 2:
        raise SearchPlanError(
            "seeds", f"the last rung needs at least 2 seeds for an interval, got {final_seeds}"
        )
    most = int(min(max_configurations, MAX_CONFIGURATIONS))
    for rungs in range(MAX_RUNGS, 1, -1):
        smallest = eta ** (rungs - 1)
        shortest = full_epochs / smallest
        if rungs > 2 and steps_per_epoch is not None and shortest * steps_per_epoch < MIN_FIRST_RUNG_STEPS:
            continue  # its first rung would train a few steps: promotions on noise
        first = None
        for candidate in range(smallest, most + 1):
            if _schedule(candidate, rungs, full_epochs, final_seeds, eta).cost <= budget + 1e-9:
                first = candidate
            else:
                break
        if first is not None:
            return _schedule(first, rungs, full_epochs, final_seeds, eta)
    least = _schedule(eta, 2, full_epochs, final_seeds, eta).cost
    raise SearchPlanError(
        "budget",
        f"{budget:g} full-job equivalents is too small for one rung: the smallest search ({eta} "
        f"configurations at 1/{eta} of the epochs, the best one at full epochs with {final_seeds} seeds) "
        f"costs {least:g}",
    )


def survivors(values: Sequence[tuple[int, float | None]], keep: int, direction: str) -> list[int]:
    """The `keep` best configuration indices by their value in the metric's direction ("max"/"min"); a
    configuration without a value (its job failed) ranks last; ties go to the earlier index."""
    sign = -1.0 if direction == "max" else 1.0
    ranked = sorted(values, key=lambda item: (item[1] is None, sign * (item[1] or 0.0), item[0]))
    return [index for index, _ in ranked[:keep]]


__all__ = [
    "ETA",
    "FINAL_SEEDS",
    "Choice",
    "Configuration",
    "LogUniform",
    "Rung",
    "SameAs",
    "Schedule",
    "SearchPlanError",
    "distinct_points",
    "draw_configurations",
    "method_space",
    "plan_schedule",
    "space_size",
    "survivors",
]
