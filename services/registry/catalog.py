"""The Registry's catalog: tasks, method presets and backbones (registered once, looked up by name)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import select

from services.registry import dataset_probe, presets
from services.registry.core import RegistryCore
from services.registry.errors import AlreadyExistsError, RegistryValidationError
from services.registry.models import Backbone, Method, Task
from services.registry.records import BackboneRecord, MethodRecord, TaskRecord
from services.registry.rows import (
    audit,
    find_backbone,
    find_task,
    get_or_create,
    jsonable,
    retry_once_on_conflict,
)
from services.registry.task_data import check_task_against_data, detect_problem_type, detect_text_fields
from services.registry.validation import check_method_spec, check_name, check_task_definition


class Catalog(RegistryCore):
    """Tasks, methods and backbones: one part of `Registry`."""

    # --- tasks -----------------------------------------------------------------------------------

    def register_task(
        self,
        name: str,
        source: str | Path | Mapping[str, str | Path],
        *,
        text_fields: Sequence[str] | str | None = None,
        label_field: str = "label",
        problem_type: str | None = None,
        metric: str | None = None,
        metric_direction: str | None = None,
        label_names: Sequence[str] | None = None,
        max_length: int = 128,
        description: str = "",
        prober: Callable[..., dataset_probe.DatasetProbe] | None = None,
    ) -> TaskRecord:
        """Register a task after checking its fields against the data (train rows are counted, label
        names inferred for classification when not given; no `text_fields`: the GLUE-style columns
        `pelt train` takes; no `problem_type`: told by the labels, `pelt_core.labels`' one rule; no
        `metric`: the problem type's default,
        `pelt_core.vocabulary.DEFAULT_METRIC`). Re-registering the same definition returns
        the existing task; a different one under the same name is an AlreadyExistsError. `prober`
        (source, label_field, limits) -> DatasetProbe reads the data (default: `dataset_probe.probe_dataset`
        in this process; uploads use `probe_dataset_in_child`)."""
        check_name(name)
        definition = check_task_definition(
            text_fields=text_fields,
            label_field=label_field,
            problem_type=problem_type,
            metric=metric,
            metric_direction=metric_direction,
            label_names=label_names,
            max_length=max_length,
        )
        if not isinstance(description, str):
            raise RegistryValidationError("description", "must be a string")
        resolved = dataset_probe.resolve_source(source)
        probe = (prober or dataset_probe.probe_dataset)(resolved, definition.label_field, self.dataset_limits)
        if not definition.text_fields or definition.problem_type is None:  # told by the data
            definition = check_task_definition(
                text_fields=detect_text_fields(definition, probe, "the train split"),
                label_field=label_field,
                problem_type=detect_problem_type(definition, probe),
                metric=metric,
                metric_direction=metric_direction,
                label_names=label_names,
                max_length=max_length,
            )
        names = check_task_against_data(definition, probe, "the train split")
        values: dict[str, Any] = {
            "name": name,
            "source_kind": resolved.kind,
            "source": dict(resolved.paths),
            "split_sizes": dict(probe.split_sizes),
            "train_size": probe.train_rows,
            "text_fields": definition.text_fields,
            "label_field": definition.label_field,
            "problem_type": definition.problem_type,
            "metric": definition.metric,
            "metric_direction": definition.metric_direction,
            "label_names": names,
            "max_length": definition.max_length,
            "description": description,
        }

        def write() -> TaskRecord:
            with self._writing() as session:
                row, created = get_or_create(
                    session, Task, name, lambda: Task(**values, created_at=self._now())
                )
                if created:
                    audit(session, row.created_at, "task.register", name, {"source_kind": resolved.kind})
                    return TaskRecord.of(row)
                differences = [
                    key for key, value in values.items() if jsonable(getattr(row, key)) != jsonable(value)
                ]
                if differences:
                    raise AlreadyExistsError(
                        "name", f"task {name!r} already exists with a different {', '.join(differences)}"
                    )
                return TaskRecord.of(row)

        return retry_once_on_conflict(write)

    def get_task(self, name: str) -> TaskRecord:
        """The task of that name (UnknownTaskError lists the known ones)."""
        with self._reading() as session:
            return TaskRecord.of(find_task(session, name))

    def list_tasks(self) -> list[TaskRecord]:
        """Every task, by name."""
        with self._reading() as session:
            return [TaskRecord.of(row) for row in session.scalars(select(Task).order_by(Task.name))]

    # --- methods ---------------------------------------------------------------------------------

    def register_method(self, spec: Mapping[str, Any], *, replace: bool = False) -> MethodRecord:
        """Store a user-defined preset (validated by pelt_core.get_method). The same spec again returns
        the existing row; a different spec needs `replace=True` (queued jobs keep their own copy).
        A built-in's name is refused (its own spec, unchanged, returns the built-in)."""
        normalized = check_method_spec(spec)
        name = normalized["name"]
        if name == presets.FUSION or normalized.get("fusion") is not None:
            raise RegistryValidationError(
                "name" if name == presets.FUSION else "fusion",
                f"a preset cannot be a fusion: {presets.FUSION_HOW}",
            )
        builtin = presets.builtin_spec(name)

        def write() -> MethodRecord:
            with self._writing() as session:
                existing = session.scalar(select(Method).where(Method.name == name))
                if existing is None and builtin is None:
                    row = Method(
                        name=name,
                        spec=normalized,
                        builtin=False,
                        description=normalized.get("description", ""),
                        created_at=self._now(),
                    )
                    session.add(row)
                    session.flush()
                    audit(session, row.created_at, "method.register", name)
                    return MethodRecord.of(row)
                if existing is None or existing.builtin:
                    if builtin is None or jsonable(builtin) != jsonable(normalized):
                        what = "a built-in method" if builtin else "the name of a former built-in method"
                        raise AlreadyExistsError("name", f"{name!r} is {what}; give your preset another name")
                    return MethodRecord.of(presets.job_method(session, name, self._now()).row, builtin)
                if jsonable(existing.spec) == jsonable(normalized):
                    return MethodRecord.of(existing)
                if not replace:
                    raise AlreadyExistsError(
                        "name",
                        f"method {name!r} already exists with a different spec; to change it, register it "
                        "with replace (`pelt method register --replace`, `replace=True` in Python, "
                        '"replace": true in POST /v1/methods)',
                    )
                existing.spec = normalized
                existing.description = normalized.get("description", "")
                audit(session, self._now(), "method.register", name, {"replaced": True})
                return MethodRecord.of(existing)

        return retry_once_on_conflict(write)

    def get_method(self, name: str) -> MethodRecord:
        """The method preset of that name (UnknownMethodError lists the known ones)."""
        if presets.builtin_spec(name) is not None:
            found = self._builtin_records([name])
            if found:
                return found[0]
        with self._reading() as session:
            return MethodRecord.of(presets.user_method_row(session, name))

    def check_method_known(self, name: str) -> None:
        """UnknownMethodError (listing the known methods) unless some job could name this method: a
        built-in, a user preset or a former built-in that older jobs ran."""
        with self._reading() as session:
            presets.check_known(session, name)

    def list_methods(self, *, builtin: bool | None = None) -> list[MethodRecord]:
        """Method presets: built-ins in pelt_core's order, then user-defined ones in registration order."""
        records = [] if builtin is False else self._builtin_records(presets.builtin_names())
        if builtin is not True:
            query = select(Method).where(Method.builtin.is_(False)).order_by(Method.id)
            with self._reading() as session:
                records += [MethodRecord.of(row) for row in session.scalars(query)]
        return records

    def _builtin_records(self, names: list[str]) -> list[MethodRecord]:
        """The records of these built-in presets, specs from pelt_core (a name a user preset holds is
        left out). Their rows are made on first use: one write, once per new preset."""
        with self._reading() as session:
            rows = presets.rows_named(session, names)
        if not rows.keys() >= set(names):
            rows = retry_once_on_conflict(lambda: self._add_builtin_rows(names))
        specs = {name: presets.builtin_spec(name) for name in names}
        return [
            MethodRecord.of(rows[name], spec)
            for name, spec in specs.items()
            if spec is not None and rows[name].builtin
        ]

    def _add_builtin_rows(self, names: list[str]) -> dict[str, Method]:
        with self._writing() as session:
            now = self._now()
            return {
                name: get_or_create(session, Method, name, lambda name=name: presets.builtin_row(name, now))[
                    0
                ]
                for name in names
            }

    # --- backbones -------------------------------------------------------------------------------

    def register_backbone(
        self, name: str, source: str, content_hash: str, facts: Mapping[str, Any] | None = None
    ) -> BackboneRecord:
        """Record a backbone. The same name, source and hash again returns it; another source or hash
        under the same name is an AlreadyExistsError (a changed model needs a new name). `facts`: the
        backbone's shape ({hidden_size: 384, ...}, numbers and short strings), kept as given."""
        check_name(name)
        for field, value in (("source", source), ("content_hash", content_hash)):
            if not isinstance(value, str) or not value.strip():
                raise RegistryValidationError(field, f"must be a non-empty string, got {value!r}")
        if len(content_hash) > 200:
            raise RegistryValidationError("content_hash", "at most 200 characters")
        facts = _backbone_facts(facts)

        def make() -> Backbone:
            return Backbone(
                name=name, source=source, content_hash=content_hash, facts=facts, created_at=self._now()
            )

        def write() -> BackboneRecord:
            with self._writing() as session:
                row, created = get_or_create(session, Backbone, name, make)
                if created:
                    audit(session, row.created_at, "backbone.register", name)
                elif row.source != source:  # the message names no source: it may be a server path
                    raise AlreadyExistsError(
                        "source",
                        f"backbone {name!r} is registered from another source; register this one under "
                        "a new name",
                    )
                elif row.content_hash != content_hash:
                    raise AlreadyExistsError(
                        "content_hash",
                        f"backbone {name!r} is registered with content_hash {row.content_hash!r}, "
                        f"not {content_hash!r}",
                    )
                return BackboneRecord.of(row)

        return retry_once_on_conflict(write)

    def set_backbone_facts(self, name: str, facts: Mapping[str, Any]) -> BackboneRecord:
        """Record the facts of a backbone registered without them (before migration 0006). Facts once
        recorded stay: a backbone's shape never changes under its name."""
        checked = _backbone_facts(facts)
        if checked is None:
            raise RegistryValidationError(
                "facts", "must be a mapping of names to numbers or strings, got None"
            )
        with self._writing() as session:
            row = find_backbone(session, name)
            if row.facts is None:
                row.facts = checked
            return BackboneRecord.of(row)

    def get_backbone(self, name: str) -> BackboneRecord:
        """The backbone of that name (UnknownBackboneError lists the known ones)."""
        with self._reading() as session:
            return BackboneRecord.of(find_backbone(session, name))

    def list_backbones(self) -> list[BackboneRecord]:
        """Every backbone, by name."""
        with self._reading() as session:
            return [
                BackboneRecord.of(row) for row in session.scalars(select(Backbone).order_by(Backbone.name))
            ]


def _backbone_facts(facts: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A backbone's facts as stored: a flat mapping of short names to numbers or short strings."""
    if facts is None:
        return None
    if not isinstance(facts, Mapping) or len(facts) > 50:
        raise RegistryValidationError("facts", "must be a mapping of at most 50 names to numbers or strings")
    for key, value in facts.items():
        if not isinstance(key, str) or not 0 < len(key) <= 100:
            raise RegistryValidationError("facts", f"names are strings of 1 to 100 characters, got {key!r}")
        if not (
            value is None or isinstance(value, int | float) or (isinstance(value, str) and len(value) <= 200)
        ):
            raise RegistryValidationError(
                f"facts.{key}", f"must be a number or a short string, got {value!r}"
            )
    return dict(facts)


__all__ = ["Catalog"]
