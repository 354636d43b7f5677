"""Input checks of the registry. Each raises RegistryValidationError naming the offending field.

Nothing here touches the database: the service runs these checks before it writes anything.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pelt_core import limits
from pelt_core.config import ALIASES, ConfigError, TrainConfig, split_overrides
from pelt_core.limits import LimitError, Range
from pelt_core.methods import get_method
from pelt_core.spec import SpecError, override_field
from pelt_core.vocabulary import (
    DEFAULT_METRIC,
    DIRECTIONS,
    METRIC_DIRECTIONS,
    MULTI_LABEL,
    PROBLEM_TYPES,
    REGRESSION,
    SINGLE_LABEL,
    canonical_problem_type,
    check_task_metric,
)
from services.registry.errors import RegistryValidationError
from services.registry.models import JOB_DEVICES

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")
MAX_KEY_LENGTH = 200
MAX_RESULT_DEVICE_LENGTH = 200
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")


def check_name(value: object, field: str = "name") -> str:
    """Names of tasks, methods and backbones: letters, digits, `_`, `.`, `-`; at most 100 characters."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):  # (match's $ passes "name\n")
        raise RegistryValidationError(
            field, f"{value!r} is not a valid name (letters, digits, '_', '.', '-'; at most 100 characters)"
        )
    return value


def check_int(value: object, field: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """A whole number (booleans refused) within bounds."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise RegistryValidationError(field, f"must be a whole number, got {value!r}")
    if minimum is not None and value < minimum:
        raise RegistryValidationError(field, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise RegistryValidationError(field, f"must be <= {maximum}, got {value}")
    return value


def check_range(bound: Range, value: object, field: str) -> int | float:
    """A number within a range of the table of limits (pelt_core/limits.py), else a RegistryValidationError."""
    try:
        return bound.check(value, field)
    except LimitError as exc:
        raise RegistryValidationError(field, str(exc)) from None


def check_key(value: object, field: str = "idempotency_key") -> str | None:
    """An optional idempotency key: a non-empty string of at most 200 characters."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_LENGTH:
        raise RegistryValidationError(
            field, f"must be a non-empty string of at most {MAX_KEY_LENGTH} characters"
        )
    return value


def check_device(value: object, field: str = "device") -> str:
    """A job's device: `any` (either), `cpu` or `gpu` (models.JOB_DEVICES)."""
    if not isinstance(value, str) or value not in JOB_DEVICES:
        raise RegistryValidationError(field, f"must be one of {', '.join(JOB_DEVICES)}, got {value!r}")
    return value


def check_devices(values: Iterable[str] | None, field: str = "devices") -> list[str] | None:
    """The devices a worker can run jobs for (None: every job), each one of models.JOB_DEVICES."""
    if values is None:
        return None
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise RegistryValidationError(field, f"expected a list of {', '.join(JOB_DEVICES)}, got {values!r}")
    return sorted({check_device(value, f"{field}[]") for value in values})


# --- tasks ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskDefinition:
    """A task's fields after validation (what register_task stores)."""

    text_fields: list[str]
    label_field: str
    problem_type: str
    metric: str
    metric_direction: str
    label_names: list[str] | None
    max_length: int


def check_task_definition(
    *,
    text_fields: Sequence[str] | str | None,
    label_field: str,
    problem_type: str | None,
    metric: str | None,
    metric_direction: str | None,
    label_names: Sequence[str] | None,
    max_length: int,
) -> TaskDefinition:
    """The checks that need no data: field names, problem type, metric and its direction, lengths.
    No metric (None) means the problem type's default (`pelt_core.vocabulary.DEFAULT_METRIC`).
    No text fields or no problem type (None): detected from the data later (`task_data.detect_definition`),
    so the definition has no text fields or problem type yet and its metric is checked then."""
    fields = (
        [text_fields]
        if isinstance(text_fields, str)
        else list(text_fields)
        if text_fields is not None
        else []
    )
    if text_fields is not None and (
        not 1 <= len(fields) <= 2 or not all(isinstance(f, str) and f for f in fields)
    ):
        raise RegistryValidationError("text_fields", f"give one or two column names, got {text_fields!r}")
    if len(set(fields)) != len(fields):
        raise RegistryValidationError("text_fields", f"the same column twice: {fields!r}")
    if not isinstance(label_field, str) or not label_field:
        raise RegistryValidationError("label_field", f"must be a column name, got {label_field!r}")
    if label_field in fields:
        raise RegistryValidationError("label_field", f"{label_field!r} is also a text field")
    try:
        problem = None if problem_type is None else canonical_problem_type(problem_type)
    except ValueError as exc:
        raise RegistryValidationError("problem_type", str(exc)) from None
    names = _check_label_names(label_names, problem)
    if problem is None:  # checked again once the data have told the problem type
        if metric is not None:  # already now: a metric that no type the task can still be reports
            _check_metric_for_any(metric, metric_direction, names)
        canonical, direction = metric or "", metric_direction or ""
    else:
        canonical, direction = _check_metric(
            DEFAULT_METRIC[problem] if metric is None else metric,
            metric_direction,
            problem,
            None if names is None else len(names),
        )
    check_range(limits.TRAIN_RANGES["max_length"], max_length, "max_length")
    return TaskDefinition(
        text_fields=fields,
        label_field=label_field,
        problem_type=problem,  # type: ignore[arg-type]  # None: detected from the data
        metric=canonical,
        metric_direction=direction,
        label_names=names,
        max_length=max_length,
    )


def _check_metric_for_any(metric: str, direction: str | None, names: list[str] | None) -> None:
    """Refuse (with the first candidate's reason) a metric that no problem type the data could still tell
    would report: declared class names leave the two classification types, else all three."""
    candidates = [SINGLE_LABEL, MULTI_LABEL] if names is not None else list(PROBLEM_TYPES)
    refusals = []
    for candidate in candidates:
        try:
            _check_metric(metric, direction, candidate, None if names is None else len(names))
            return
        except RegistryValidationError as exc:
            refusals.append(exc)
    raise refusals[0]


def _check_label_names(label_names: Sequence[str] | None, problem: str | None) -> list[str] | None:
    """Declared class names: distinct non-empty strings, none for a regression task."""
    if label_names is None:
        return None
    if problem == REGRESSION:
        raise RegistryValidationError("label_names", "a regression task has no label names")
    names = list(label_names)
    if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise RegistryValidationError(
            "label_names", f"must be distinct non-empty strings, got {label_names!r}"
        )
    return names


def _check_metric(
    metric: object, metric_direction: str | None, problem: str, num_labels: int | None
) -> tuple[str, str]:
    """(canonical metric name, its direction): a metric pelt_core reports for this problem type (and
    number of classes, when known), by its name or an alias (pelt_core.vocabulary's table). A custom
    metric is refused: no worker could report it, so every job of the task would fail at completion."""
    if not isinstance(metric, str) or not metric:
        raise RegistryValidationError("metric", f"must be a metric name, got {metric!r}")
    if metric_direction is not None and metric_direction not in DIRECTIONS:
        raise RegistryValidationError("metric_direction", f"must be 'max' or 'min', got {metric_direction!r}")
    try:
        canonical = check_task_metric(metric, problem, num_labels)
    except ValueError as exc:
        raise RegistryValidationError("metric", str(exc)) from None
    direction = METRIC_DIRECTIONS[canonical]
    if metric_direction is not None and metric_direction != direction:
        raise RegistryValidationError(
            "metric_direction", f"{canonical} is a {direction}imized metric, not {metric_direction}"
        )
    return canonical, direction


def check_metric_for_labels(definition: TaskDefinition, label_names: Sequence[str] | None) -> None:
    """Once the data have given the task's classes: its metric is reported for that many (pelt_core
    reports `f1` for two classes only)."""
    if label_names is not None:
        _check_metric(definition.metric, None, definition.problem_type, len(label_names))


# --- jobs ----------------------------------------------------------------------------------------

_TRAIN_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(TrainConfig)}
_RESERVED = frozenset({"seed", "k_shot"})


def split_hyperparameters(
    hyperparameters: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """(training values by canonical name, method-spec overrides, canonical name → key as given).

    Seeds and K are arguments of their own (a sweep takes lists of them), not hyperparameters.
    """
    if hyperparameters is None:
        return {}, {}, {}
    if not isinstance(hyperparameters, Mapping):
        raise RegistryValidationError(
            "hyperparameters", f"expected a mapping, got {type(hyperparameters).__name__}"
        )
    given: dict[str, str] = {}
    for key in hyperparameters:
        if not isinstance(key, str) or not key:
            raise RegistryValidationError("hyperparameters", f"keys must be non-empty strings, got {key!r}")
        canonical = ALIASES.get(key, key)
        if canonical in _RESERVED:
            raise RegistryValidationError(
                key,
                f"pass {canonical} as its own argument (a sweep takes a list of them), not as a hyperparameter",
            )
        if canonical in _TRAIN_FIELDS and canonical in given:
            raise RegistryValidationError(key, f"given twice (as {given[canonical]!r} and {key!r})")
        given[canonical] = key
    try:
        train, spec = split_overrides(dict(hyperparameters))
    except SpecError as exc:  # a key no setting has: the message names it and the nearest known names
        key, _, message = str(exc).partition(": ")
        raise RegistryValidationError(key, message) from None
    for name, value in train.items():
        _check_train_type(name, value, given.get(name, name))
    return train, spec, given


def check_json_numbers(hyperparameters: Mapping[str, Any] | None) -> None:
    """Over JSON (the HTTP API) a number is a JSON number: text such as "1e-3" or "inf" for a numeric
    training hyperparameter or method-spec field is refused, naming the key, not parsed. (Python callers
    of the registry and the CLIs' `--set` text are read through the table of limits, which refuses
    "inf" and "nan".)"""
    if not isinstance(hyperparameters, Mapping):
        return
    for key, value in hyperparameters.items():
        if not isinstance(key, str):
            continue
        bound = limits.TRAIN_RANGES.get(ALIASES.get(key, key)) or limits.SPEC_RANGES.get(override_field(key))
        items = value if isinstance(value, list) else [value]
        if bound is not None and any(isinstance(item, str) for item in items):
            raise RegistryValidationError(
                key, f"expected a JSON number in {bound.describe()}, got the text {str(value)[:40]!r}"
            )


def _check_train_type(name: str, value: Any, key: str) -> None:
    """Refuse values of the wrong JSON type before pelt_core compares them (text is read there, through
    the table of limits)."""
    annotation = _TRAIN_FIELDS[name]
    if value is None:
        if "None" not in annotation:
            raise RegistryValidationError(key, f"must not be null ({name})")
        return
    if isinstance(value, str):
        return
    base = annotation.split("|")[0].strip()
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = {
        "float": is_number,
        "int": isinstance(value, int) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": False,
    }.get(base, True)
    if not ok:
        raise RegistryValidationError(
            key, f"expected {base} for {name}, got {type(value).__name__} {value!r}"
        )
    if base == "float" and isinstance(value, float) and not math.isfinite(value):
        raise RegistryValidationError(key, f"must be a finite number, got {value!r}")


def resolve_train_config(
    train: Mapping[str, Any],
    given: Mapping[str, str],
    *,
    seed: int,
    k_shot: int | None,
    task_max_length: int,
    task_train_size: int,
    held_out: int = 0,
) -> dict[str, Any]:
    """Validate the training hyperparameters with pelt_core's TrainConfig; returns its dict.
    `held_out`: training rows each job holds out as its dev split (a task without a validation split).

    The task's max sequence length is the default `max_length`; K may not exceed the training set; the
    job's steps (epochs x batches) are bounded by limits.MAX_TRAIN_STEPS.
    """
    values = {"max_length": task_max_length, **train, "seed": seed, "k_shot": k_shot}
    try:
        config = TrainConfig.from_dict(values)
        limits.check_train_steps(config.to_dict(), task_train_size - held_out)
    except (ConfigError, LimitError) as exc:
        name = getattr(exc, "field", None) or _field_of(exc) or "hyperparameters"
        raise RegistryValidationError(given.get(name, name), str(exc)) from exc
    except TypeError as exc:  # pragma: no cover - _check_train_type refuses wrong types first
        raise RegistryValidationError("hyperparameters", str(exc)) from exc
    if k_shot is not None and k_shot > task_train_size - held_out:
        after = (
            (
                f" left after the dev split of {held_out} rows that each job holds out (the task has no "
                "validation split)"
            )
            if held_out
            else ""
        )
        raise RegistryValidationError(
            "k_shot",
            f"{k_shot} is more than the task's {task_train_size - held_out} training examples{after}",
        )
    available = task_train_size - held_out
    if config.dev_rows is not None and (k_shot or 1) + config.dev_rows > available:
        raise RegistryValidationError(
            given.get("dev_rows", "dev_rows"),
            f"{config.dev_rows} dev rows and {f'K={k_shot}' if k_shot else 'at least one'} training row(s) "
            f"need more than the task's {available} training examples",
        )
    return config.to_dict()


def check_against_backbone(
    method_name: str,
    method_spec: Mapping[str, Any],
    overrides: Mapping[str, Any],
    resolved_spec: Mapping[str, Any],
    train_config: Mapping[str, Any],
    given: Mapping[str, str],
    facts: Mapping[str, Any] | None,
    *,
    memory_budget: int,
    budget_source: str = "PELT_WORKER_MEMORY_BYTES",
) -> None:
    """The ranges that depend on the backbone (limits.check_against_backbone: ranks, prefix lengths, layer
    indices, max_length, the job's memory under `memory_budget`, which `budget_source` names), naming the
    key the caller wrote (`r` rather than `lora.modules.q.size`). Skipped for a backbone registered without
    facts."""
    if facts is None:
        return
    try:
        limits.check_against_backbone(train_config, resolved_spec, facts, memory_budget=memory_budget)
    except LimitError as exc:
        field = given.get(exc.field, exc.field)
        if ".modules." in exc.field:
            field = _backbone_culprit(method_spec, overrides, train_config, facts, exc.field) or field
        where = f" ({budget_source})" if isinstance(exc, limits.MemoryBudgetError) else ""
        raise RegistryValidationError(field, f"{exc} (method {method_name!r}){where}") from None


def _backbone_culprit(
    method_spec: Mapping[str, Any],
    overrides: Mapping[str, Any],
    train_config: Mapping[str, Any],
    facts: Mapping[str, Any],
    field: str,
) -> str | None:
    """The override that alone takes a module out of the backbone's range (None: the preset itself does)."""
    for key, value in overrides.items():
        spec = get_method(dict(method_spec), {key: value}).to_dict()
        try:
            limits.check_against_backbone(train_config, spec, facts)
        except LimitError as exc:
            if exc.field == field:
                return key
    return None


def resolve_method_spec(
    method_name: str, method_spec: Mapping[str, Any], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """Apply method-spec overrides (e.g. `r`, `bottleneck`, `q.size`) with pelt_core; returns the spec dict."""
    return _resolve_spec(method_name, method_spec, dict(overrides))


def canonical_hyperparameters(
    train: Mapping[str, Any], train_config: Mapping[str, Any], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """The hyperparameters as stored on a job: training names canonical and parsed, spec overrides as given."""
    values = {name: train_config[name] for name in train}
    values.update(overrides)
    return values


def _resolve_spec(
    method_name: str, method_spec: Mapping[str, Any], overrides: dict[str, Any]
) -> dict[str, Any]:
    try:
        return get_method(dict(method_spec), overrides or None).to_dict()
    except (SpecError, TypeError) as exc:
        culprit = _culprit(method_spec, overrides)
        if culprit is not None:
            raise RegistryValidationError(culprit, f"{exc} (method {method_name!r})") from exc
        raise RegistryValidationError(_field_of(exc) or "method", f"{exc} (method {method_name!r})") from exc


def _culprit(method_spec: Mapping[str, Any], overrides: dict[str, Any]) -> str | None:
    """The first override that fails on its own (to name the key the caller wrote, e.g. `r`)."""
    for key, value in overrides.items():
        try:
            get_method(dict(method_spec), {key: value})
        except (SpecError, TypeError):
            return key
    return None


def check_method_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A user-defined preset, validated by pelt_core; returns its normalized spec dict."""
    if not isinstance(spec, Mapping):
        raise RegistryValidationError("spec", f"expected a method spec object, got {type(spec).__name__}")
    check_name(spec.get("name"), "name")
    try:
        return get_method(dict(spec)).to_dict()
    except (SpecError, TypeError) as exc:
        raise RegistryValidationError(_field_of(exc) or "spec", str(exc)) from exc


def _field_of(exc: Exception) -> str | None:
    """pelt_core's errors start with the field they are about: 'learning_rate: must be > 0'."""
    head, sep, _ = str(exc).partition(": ")
    if sep and head and " " not in head:
        return head
    return None


# --- results -------------------------------------------------------------------------------------

RESULT_FIELDS = (
    "metrics",
    "dev_metrics",
    "primary_metric",
    "trainable_params",
    "total_params",
    "trainable_percent",
    "train_seconds",
    "peak_memory_bytes",
    "job_memory_bytes",
    "device",
    "delta_uri",
    "delta_sha256",
    "mlflow_run_id",
    "mlflow_model_version",
)


def check_result(result: Mapping[str, Any], metric: str, test_left_out: bool = False) -> dict[str, Any]:
    """A worker's result: metrics (with the task's primary metric), sizes, time, memory, the device it
    trained on (text of at most 200 characters, e.g. "cuda:0 (NVIDIA H100 80GB HBM3)"), delta and MLflow
    ids. `test_left_out`: the job left its test set out (`evaluate_test=false`): no test metrics, the dev
    metrics required instead."""
    if not isinstance(result, Mapping):
        raise RegistryValidationError("result", f"expected a mapping, got {type(result).__name__}")
    unknown = sorted(set(result) - set(RESULT_FIELDS))
    if unknown:
        raise RegistryValidationError(
            f"result.{unknown[0]}",
            f"unknown result field(s) {', '.join(unknown)}; known: {', '.join(RESULT_FIELDS)}",
        )
    metrics = result.get("metrics")
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        raise RegistryValidationError("result.metrics", "must be a mapping of metric name to value")
    primary = result.get("primary_metric", metrics.get(metric))
    if test_left_out:
        if metrics or primary is not None:
            raise RegistryValidationError(
                "result.primary_metric" if "primary_metric" in result else "result.metrics",
                "the job left its test set out (evaluate_test=false): it has no test metrics "
                f"(got: {', '.join(metrics) or 'primary_metric'})",
            )
        if result.get("dev_metrics") is None:
            raise RegistryValidationError(
                "result.dev_metrics",
                "the job left its test set out (evaluate_test=false): its dev metrics are required",
            )
    elif primary is None:
        raise RegistryValidationError(
            f"result.metrics.{metric}",
            f"the task's primary metric {metric!r} is missing (have: {', '.join(metrics)})",
        )
    else:
        primary = _number(primary, "result.primary_metric")
    dev_metrics, dev_primary = result.get("dev_metrics"), None
    if dev_metrics is not None:
        if not isinstance(dev_metrics, Mapping) or not all(isinstance(k, str) for k in dev_metrics):
            raise RegistryValidationError("result.dev_metrics", "must be a mapping of metric name to value")
        if dev_metrics.get(metric) is None:
            raise RegistryValidationError(
                f"result.dev_metrics.{metric}",
                f"the task's primary metric {metric!r} is missing (have: {', '.join(dev_metrics)})",
            )
        dev_primary = _number(dev_metrics[metric], f"result.dev_metrics.{metric}")
        dev_metrics = dict(dev_metrics)
    trainable = _count(result.get("trainable_params"), "result.trainable_params", required=True)
    total = _count(result.get("total_params"), "result.total_params")
    percent = result.get("trainable_percent")
    if percent is None:
        if not total:
            raise RegistryValidationError(
                "result.trainable_percent", "give trainable_percent or total_params"
            )
        percent = 100.0 * trainable / total
    percent = _number(percent, "result.trainable_percent")
    if not 0.0 <= percent <= 100.0:
        raise RegistryValidationError("result.trainable_percent", f"must be in [0, 100], got {percent}")
    seconds = _number(result.get("train_seconds"), "result.train_seconds")
    if seconds < 0:
        raise RegistryValidationError("result.train_seconds", f"must be >= 0, got {seconds}")
    sha = result.get("delta_sha256")
    if sha is not None and (not isinstance(sha, str) or not SHA256_PATTERN.fullmatch(sha.lower())):
        raise RegistryValidationError("result.delta_sha256", "must be 64 hexadecimal characters")
    version = result.get("mlflow_model_version")
    for name in ("delta_uri", "mlflow_run_id"):
        if result.get(name) is not None and not isinstance(result[name], str):
            raise RegistryValidationError(f"result.{name}", f"must be a string, got {result[name]!r}")
    device = result.get("device")
    if device is not None and (
        not isinstance(device, str) or not device.strip() or len(device) > MAX_RESULT_DEVICE_LENGTH
    ):
        raise RegistryValidationError(
            "result.device",
            f"must be a non-empty string of at most {MAX_RESULT_DEVICE_LENGTH} characters, got {device!r:.80}",
        )
    return {
        "metrics": dict(metrics),
        "primary_metric": primary,
        "dev_metrics": dev_metrics,
        "dev_primary_metric": dev_primary,
        "trainable_params": trainable,
        "total_params": total,
        "trainable_percent": percent,
        "train_seconds": seconds,
        "peak_memory_bytes": _count(result.get("peak_memory_bytes"), "result.peak_memory_bytes"),
        "job_memory_bytes": _count(result.get("job_memory_bytes"), "result.job_memory_bytes"),
        "device": device,
        "delta_uri": result.get("delta_uri"),
        "delta_sha256": sha.lower() if isinstance(sha, str) else None,
        "mlflow_run_id": result.get("mlflow_run_id"),
        "mlflow_model_version": None if version is None else str(version),
    }


# --- progress ------------------------------------------------------------------------------------

PROGRESS_FIELDS = ("step", "total", "loss", "tokens_per_second", "epoch", "learning_rate")
LOSS_POINTS_FIELD = "losses"  # a report's loss-curve points since the last one: [[step, loss], ...]
MAX_LOSS_POINTS_PER_REPORT = 1024


def check_progress(progress: Any) -> tuple[float | None, dict[str, Any] | None]:
    """A heartbeat's progress: a fraction in [0, 1], or a worker's report {step, total, loss,
    tokens_per_second, epoch, learning_rate} (step and total required, the rest optional).
    Returns (fraction done, report or None); a report's fraction is step / total."""
    if progress is None:
        return None, None
    if isinstance(progress, Mapping):
        unknown = sorted(set(progress) - {*PROGRESS_FIELDS, LOSS_POINTS_FIELD})
        if unknown:
            raise RegistryValidationError(
                f"progress.{unknown[0]}",
                f"unknown progress field(s) {', '.join(map(str, unknown))}; known: {', '.join(PROGRESS_FIELDS)}",
            )
        total = check_int(progress.get("total"), "progress.total", minimum=1)
        step = check_int(progress.get("step"), "progress.step", minimum=0, maximum=total)
        detail: dict[str, Any] = {"step": step, "total": total}
        for name in PROGRESS_FIELDS[2:]:
            value = progress.get(name)
            if value is None:
                continue
            number = _number(value, f"progress.{name}")
            if name != "loss" and number < 0:
                raise RegistryValidationError(f"progress.{name}", f"must be >= 0, got {number}")
            detail[name] = number
        return step / total, detail
    if isinstance(progress, bool) or not isinstance(progress, int | float) or not 0 <= progress <= 1:
        raise RegistryValidationError("progress", f"must be a number in [0, 1] or a report, got {progress!r}")
    return float(progress), None


def check_loss_points(progress: Any) -> list[list[float]] | None:
    """A worker report's loss-curve points (`losses`: [[step, loss], ...], steps in [0, the report's step]
    — none ahead of the step it reports — losses finite), or None when the report has none. Call after
    `check_progress` (which checked `step` and `total`)."""
    if not isinstance(progress, Mapping) or progress.get(LOSS_POINTS_FIELD) is None:
        return None
    points = progress[LOSS_POINTS_FIELD]
    if not isinstance(points, list | tuple) or len(points) > MAX_LOSS_POINTS_PER_REPORT:
        raise RegistryValidationError(
            "progress.losses", f"must be a list of at most {MAX_LOSS_POINTS_PER_REPORT} [step, loss] points"
        )
    checked = []
    for point in points:
        if not isinstance(point, list | tuple) or len(point) != 2:
            raise RegistryValidationError("progress.losses[]", f"must be a [step, loss] pair, got {point!r}")
        step = check_int(point[0], "progress.losses[].step", minimum=0, maximum=int(progress["step"]))
        checked.append([step, _number(point[1], "progress.losses[].loss")])
    return checked


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(float(value)):
        raise RegistryValidationError(field, f"must be a finite number, got {value!r}")
    return float(value)


def _count(value: Any, field: str, *, required: bool = False) -> int | None:
    if value is None and not required:
        return None
    return check_int(value, field, minimum=0)


__all__ = [
    "TaskDefinition",
    "canonical_hyperparameters",
    "check_against_backbone",
    "check_device",
    "check_devices",
    "check_int",
    "check_json_numbers",
    "check_key",
    "check_loss_points",
    "check_method_spec",
    "check_metric_for_labels",
    "check_name",
    "check_progress",
    "check_range",
    "check_result",
    "check_task_definition",
    "resolve_method_spec",
    "resolve_train_config",
    "split_hyperparameters",
]
