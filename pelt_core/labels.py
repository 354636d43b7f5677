"""Class labels: which class a label value is, one rule for the registry's checks and the trainer.

The label *values* are the class names. A task's `label_names` list its classes in index order; when
none are declared they are the distinct training values, sorted (numbers numerically, so -3..-1 gives
["-3", "-2", "-1"] and {0, 1, 1e9} gives ["0", "1", "1000000000"]). A value maps to a class by name
first (`True` → "True", 2.0 → "2", "pos" → "pos"). Only when the names were given (a task's declared
`label_names`, a `datasets` ClassLabel) is a whole number that names no class a position (0..N-1) into
them, as with ClassLabel or ["neg", "pos"] over 0/1 data; names inferred from the data are matched by
name only (training labels {1, 2} make the classes ["1", "2"], and a 0 is none of them). Any other
value fits no class.

Which problem a label column poses, when none is named (`infer_problem_type`, the one rule of `pelt
train`, the registry's task checks and every upload format): lists of labels are multi-label
classification; numbers with any fractional value (5.0, 3.8, 0.5) are regression; anything else is
single-label classification (strings, booleans, whole numbers, floats that are all whole). A column that
mixes fractional numbers with strings or booleans is refused: name the problem type.

Pure Python (no numpy, no torch): the service imports it on its request path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from numbers import Integral, Real
from typing import Any

from pelt_core.vocabulary import MULTI_LABEL, REGRESSION, SINGLE_LABEL


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


class ProblemTypeError(ValueError):
    """The labels do not tell which problem they pose; the message says to name it."""


def is_fractional(value: Any) -> bool:
    """A finite real number (not a boolean) with a fractional part: 0.5, 3.8 (not 5.0, not NaN)."""
    return (
        isinstance(value, Real)
        and not isinstance(value, bool | Integral)
        and math.isfinite(float(value))
        and not float(value).is_integer()
    )


def label_kind(value: Any) -> str:
    """ "list", "bool", "string", "integer", "float" or "other": a label value's kind, as the registry's
    dataset probe names a column's (an integer-valued float is a "float")."""
    if isinstance(value, list | tuple):
        return "list"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Integral):
        return "integer"
    if isinstance(value, Real):
        return "float"
    return "other"


def problem_type_for(kinds: Iterable[str], fractional: bool, field: str = "label") -> str:
    """The problem type of a label column from the kinds of its values (`label_kind`) and whether any
    number has a fractional part (the module's rule). ProblemTypeError for fractional numbers mixed with
    strings or booleans: the caller cannot tell, the user names it."""
    kinds = set(kinds)
    if "list" in kinds:
        return MULTI_LABEL
    if fractional:
        others = sorted(kinds - {"integer", "float"})
        if others:
            raise ProblemTypeError(
                f"label field {field!r} mixes fractional numbers with {' and '.join(others)} values, so "
                "its problem type cannot be told: give every row a number (regression) or a class name, "
                "or name the problem type with --problem-type (problem_type in the API)"
            )
        return REGRESSION
    return SINGLE_LABEL


def infer_problem_type(values: Iterable[Any], field: str = "label") -> str:
    """The problem type of a column of label values (None skipped), by the module's rule."""
    kinds: set[str] = set()
    fractional = False
    for value in values:
        if value is None:
            continue
        kinds.add(label_kind(value))
        fractional = fractional or is_fractional(value)
    return problem_type_for(kinds, fractional, field)


__all__ = [
    "ProblemTypeError",
    "class_names",
    "infer_problem_type",
    "is_fractional",
    "label_index",
    "label_key",
    "label_kind",
    "problem_type_for",
]
