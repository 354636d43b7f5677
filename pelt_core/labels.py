"""Class labels: which class a label value is, one rule for the registry's checks and the trainer.

The label *values* are the class names. A task's `label_names` list its classes in index order; when
none are declared they are the distinct training values, sorted (numbers numerically, so -3..-1 gives
["-3", "-2", "-1"] and {0, 1, 1e9} gives ["0", "1", "1000000000"]). A value maps to a class by name
first (`True` → "True", 2.0 → "2", "pos" → "pos"). Only when the names were given (a task's declared
`label_names`, a `datasets` ClassLabel) is a whole number that names no class a position (0..N-1) into
them, as with ClassLabel or ["neg", "pos"] over 0/1 data; names inferred from the data are matched by
name only (training labels {1, 2} make the classes ["1", "2"], and a 0 is none of them). Any other
value fits no class.

Pure Python (no numpy, no torch): the service imports it on its request path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from numbers import Integral, Real
from typing import Any


def label_key(value: Any) -> str | None:
    """The class name a label value stands for, or None for a value that cannot name a class (a float
    with a fraction, an object, a list, None)."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        return value
    if isinstance(value, Integral):
        return str(int(value))
    if isinstance(value, Real) and math.isfinite(float(value)) and float(value).is_integer():
        return str(int(value))
    return None


def label_index(
    value: Any, names: Sequence[str], lookup: dict[str, int] | None = None, *, positions: bool = True
) -> int | None:
    """The class index of `value` among `names` (see the module's rule), or None when it fits none.
    `lookup` ({name: index}) saves rebuilding it per value; `positions`: the names were given (declared
    or a ClassLabel), so a whole number that names no class is a position; False for inferred names."""
    key = label_key(value)
    if key is None:
        return None
    index = (lookup if lookup is not None else {name: i for i, name in enumerate(names)}).get(key)
    if index is not None:
        return index
    if positions and not isinstance(value, bool | str):
        position = int(key)
        if 0 <= position < len(names):
            return position
    return None


def class_names(values: Iterable[Any]) -> list[str]:
    """The class names of distinct label values: strings sorted, booleans False then True, whole numbers
    sorted numerically. ValueError when the values are none of these (or mix strings and numbers)."""
    distinct = list(values)
    if distinct and all(isinstance(v, bool) for v in distinct):
        return [str(v) for v in sorted(set(distinct))]
    if all(isinstance(v, str) for v in distinct):
        return sorted(set(distinct))
    if all(not isinstance(v, bool | str) and label_key(v) is not None for v in distinct):
        return [str(number) for number in sorted({int(label_key(v)) for v in distinct})]  # type: ignore[arg-type]
    odd = next((v for v in distinct if label_key(v) is None), distinct[0])
    raise ValueError(
        f"class labels must be strings or whole numbers (or booleans), all of one kind; got {odd!r}"
    )


__all__ = ["class_names", "label_index", "label_key"]
