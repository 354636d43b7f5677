"""A split's label column, summarized batch by batch (kinds, nulls, distinct values) without decoding a
dictionary-encoded one, and the class names `datasets` declares for it."""

from __future__ import annotations

from typing import Any

from pelt_core.labels import ProblemTypeError, problem_type_for
from pelt_core.limits import MAX_LABEL_CHARS
from services.registry.dataset_probe.records import LabelSummary
from services.registry.errors import RegistryValidationError

MAX_DISTINCT_LABELS = 10_000


class LabelColumn:
    """The label column of one split, summarized batch by batch: kinds, nulls, distinct values."""

    def __init__(self, field_name: str | None, split: str, names: list[str] | None) -> None:
        self.field, self.split, self.names = field_name, split, names
        self.kinds: set[str] = set()
        self.nulls = 0
        self.values: set[Any] = set()
        self.too_many = False
        self.non_finite = False
        self.fractional = False  # a float label with a fractional part

    def add(self, column: Any, rows: int) -> None:
        """One batch's column (None: the batch has no such column, so its rows have no label)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if column is None or pa.types.is_null(column.type):
            self.nulls += rows
            return
        if pa.types.is_dictionary(column.type):  # its dictionary's values in use, never decoded per row
            values, nulls = _dictionary_values(column)
            self.nulls += nulls
            kind = self._scalar_kind(values.type) or self._refuse(values.type)
        else:
            self.nulls += column.null_count
            kind, values = self._kind(column)
        if kind is None:
            return
        self.kinds.add(kind)
        if kind in ("string", "list") and self._scalar_kind(values.type) == "string":
            text = (
                values.cast(pa.large_string()) if pa.types.is_string_view(values.type) else values
            )  # no kernel
            longest = pc.max(pc.utf8_length(text)).as_py() if len(values) else None
            if longest is not None and longest > MAX_LABEL_CHARS:
                raise RegistryValidationError(
                    "label_field",
                    f"{self.field!r} holds a label of {longest} characters in the {self.split} "
                    f"split; a class label is at most {MAX_LABEL_CHARS} characters",
                )
        if pa.types.is_floating(values.type):
            present = values.drop_null()
            if pc.any(pc.invert(pc.is_finite(present))).as_py():
                self.non_finite = True
            finite = present.filter(pc.is_finite(present))
            if kind == "float" and pc.any(pc.not_equal(finite, pc.floor(finite))).as_py():
                self.fractional = True  # regression, by pelt_core.labels' rule
        if self.too_many:
            return
        self.values.update(pc.unique(values).drop_null().to_pylist())
        if len(self.values) > MAX_DISTINCT_LABELS:
            self.too_many, self.values = True, set()

    def _kind(self, column: Any) -> tuple[str | None, Any]:
        import pyarrow as pa
        import pyarrow.compute as pc

        values, kind_of = column, column.type
        if (
            pa.types.is_list(kind_of)
            or pa.types.is_large_list(kind_of)
            or pa.types.is_fixed_size_list(kind_of)
        ):
            values = pc.list_flatten(column)
            if pa.types.is_dictionary(values.type):
                values, _ = _dictionary_values(values)
            element = self._scalar_kind(values.type)
            return (
                "list" if element is not None or pa.types.is_null(values.type) else self._refuse(values.type)
            ), values
        if pa.types.is_null(kind_of):
            return None, values
        return (self._scalar_kind(kind_of) or self._refuse(kind_of)), values

    @staticmethod
    def _scalar_kind(kind_of: Any) -> str | None:
        import pyarrow as pa

        if (
            pa.types.is_string(kind_of)
            or pa.types.is_large_string(kind_of)
            or pa.types.is_string_view(kind_of)
        ):
            return "string"
        if pa.types.is_boolean(kind_of):
            return "bool"
        if pa.types.is_integer(kind_of):
            return "integer"
        if pa.types.is_floating(kind_of):
            return "float"
        return None

    def _refuse(self, kind_of: Any) -> str:
        raise RegistryValidationError(
            "label_field",
            f"{self.field!r} holds {kind_of} values in the {self.split} split: a label is a string, a number or "
            "a boolean (a list of them for a multi-label task)",
        )

    def summary(self) -> LabelSummary:
        kinds = set(self.kinds)
        if kinds == {"integer", "float"}:
            kinds = {"float"}
        if self.fractional:  # fractional numbers beside strings or booleans: the user names the problem
            try:
                problem_type_for(kinds, self.fractional, str(self.field))
            except ProblemTypeError as exc:
                raise RegistryValidationError("problem_type", f"in the {self.split} split, {exc}") from None
        if len(kinds) > 1:
            raise RegistryValidationError(
                "label_field",
                f"{self.field!r} holds values of different kinds in the {self.split} split "
                f"({' and '.join(sorted(kinds))}); give every row the same kind of label",
            )
        return LabelSummary(
            kind=next(iter(kinds), "other"),
            nulls=self.nulls,
            values=None if self.too_many else list(self.values),
            names=self.names,
            non_finite=self.non_finite,
            fractional=self.fractional,
        )


def _dictionary_values(array: Any) -> tuple[Any, int]:
    """(the dictionary's values the indices use, rows that are null) of a dictionary-encoded array,
    without decoding it: a million indices into one 100 KB value stay a million indices."""
    import pyarrow as pa
    import pyarrow.compute as pc

    indices, dictionary = array.indices, array.dictionary
    values = dictionary.take(pc.unique(indices.drop_null()))
    nulls = indices.null_count
    if values.null_count:
        null_positions = pc.indices_nonzero(pc.is_null(dictionary)).cast(indices.type)
        nulls += int(pc.sum(pc.is_in(indices, value_set=null_positions)).as_py() or 0)
    if pa.types.is_dictionary(values.type):
        raise ValueError("a dictionary of dictionaries")
    return values, nulls


def class_label_names(feature: Any) -> list[str] | None:
    """The names of a ClassLabel feature (as datasets writes features to JSON), or of a list of them."""
    candidates = [feature]
    if isinstance(feature, dict):
        candidates.append(feature.get("feature"))  # Sequence / List of ClassLabel
    elif isinstance(feature, list) and feature:
        candidates.append(feature[0])
    for candidate in candidates:
        if (
            isinstance(candidate, dict)
            and candidate.get("_type") == "ClassLabel"
            and isinstance(candidate.get("names"), list)
        ):
            return [str(name) for name in candidate["names"]] or None
    return None


__all__ = ["MAX_DISTINCT_LABELS", "LabelColumn", "class_label_names"]
