"""Training hyperparameters of one job, validated against the table of limits (pelt_core/limits.py) with
errors that name the field; and the reading of command-line `--set key=value` text through that table."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from pelt_core.limits import SPEC_RANGES, TRAIN_RANGES, LimitError
from pelt_core.spec import (
    NULLS,
    SIZE_ALIASES,
    ModuleSpec,
    SpecError,
    as_bool,
    override_field,
    read_override,
)


class ConfigError(ValueError):
    """A training hyperparameter has the wrong type or is out of range."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides one training run besides data, backbone and method."""

    learning_rate: float | None = None  # None: the method's default (see its preset), else 1e-3
    epochs: float = 3.0
    batch_size: int = 16
    eval_batch_size: int = 64
    seed: int = 0
    k_shot: int | None = None  # UniPELT's low-resource setting: K training examples sampled by seed
    warmup_ratio: float = 0.06
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_length: int = 128
    max_steps: int | None = None
    bf16: str = "auto"  # "auto": bf16 autocast where the CPU/GPU supports it; "true"/"false" force it
    backbone_dtype: str = "float32"  # "bfloat16" holds the frozen backbone in bf16 (PELT params stay fp32)
    pooling: str = "auto"  # "auto": mean for encoders, last token for decoders; or "cls", "mean", "last"
    head_dropout: float = 0.1
    eval_every_epoch: bool = True
    # UniPELT's low-resource protocol (None: off, the plain job above): `dev_rows` training rows, drawn
    # by seed after the K training rows, are a dev split evaluated every epoch; the best checkpoint by the
    # task's metric is kept, and the job's evaluation data becomes its test set, evaluated once at the end
    dev_rows: int | None = None
    patience: int | None = None  # early stopping: dev evaluations without improvement before it stops
    # under the protocol, whether the test set is evaluated at the end: a search's early rungs turn it off
    # (they are ranked on the dev split); such a job's result has dev metrics and no test metrics
    evaluate_test: bool = True

    def resolved_learning_rate(self, method_defaults: dict[str, Any]) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return float(method_defaults.get("learning_rate", 1e-3))

    def validate(self) -> None:
        """Every number within its range of `limits.TRAIN_RANGES` (finite, of its kind); the choices known."""

        def bad(name: str, message: str) -> ConfigError:
            return ConfigError(f"{name}: {message}")

        for name, bound in TRAIN_RANGES.items():
            value = getattr(self, name)
            if value is None and name in OPTIONAL_FIELDS:
                continue
            try:
                bound.check(value, name)
            except LimitError as exc:
                raise ConfigError(str(exc)) from None
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.bf16 not in ("auto", "true", "false"):
            raise bad("bf16", f"must be auto, true or false, got {self.bf16!r}")
        if self.backbone_dtype not in ("float32", "bfloat16"):
            raise bad("backbone_dtype", f"must be float32 or bfloat16, got {self.backbone_dtype!r}")
        if self.pooling not in ("auto", "cls", "mean", "last"):
            raise bad("pooling", f"must be auto, cls, mean or last, got {self.pooling!r}")
        if self.patience is not None and self.dev_rows is None:
            raise bad("patience", "early stopping needs a dev split: set dev_rows too")
        if self.dev_rows is not None and not self.eval_every_epoch:
            raise bad("eval_every_epoch", "the study protocol (dev_rows) evaluates its dev split every epoch")
        if not self.evaluate_test and self.dev_rows is None:
            raise bad(
                "evaluate_test", "only the study protocol has a test set to leave out: set dev_rows too"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build and validate from JSON-ish values; strings (from `--set key=value`) are read through the
        table of limits (no "inf", "nan" or "1e400"). The service refuses strings for numbers before this."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ConfigError(
                f"{', '.join(unknown)}: unknown training hyperparameter(s); known: {', '.join(fields)}"
            )
        converted = {name: _convert(name, fields[name].type, value) for name, value in values.items()}
        config = cls(**converted)
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))
BOOL_FIELDS = frozenset({"eval_every_epoch", "evaluate_test"})
OPTIONAL_FIELDS = frozenset(
    {"learning_rate", "k_shot", "max_steps", "dev_rows", "patience"}
)  # None: the method's default / all / epochs / no dev split / no early stopping
ALIASES = {
    "lr": "learning_rate",
    "k": "k_shot",
    "K": "k_shot",
    "bs": "batch_size",
}  # the method spec's: spec.py


def setting_names() -> list[str]:
    """Every bare key a setting may have: training hyperparameters and their aliases, module fields and
    their size aliases, `bias`, `layer_norm` (a method-spec key may also be `role.field`)."""
    module_fields = {f.name for f in dataclasses.fields(ModuleSpec)}
    return sorted({*TRAIN_FIELDS, *ALIASES, *module_fields, *SIZE_ALIASES, "bias", "layer_norm"})


def check_setting_name(key: str) -> None:
    """A SpecError for a bare key no setting has, suggesting the nearest known names (`epoch`: epochs)."""
    if "." in key:  # role.field: the method knows its roles (MethodSpec.with_overrides)
        return
    names = setting_names()
    if key in names:
        return
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise SpecError(
        f"{key}: not a training hyperparameter and not a field of any module; {hint}"
        f"training hyperparameters: {', '.join(sorted(TRAIN_FIELDS))}; "
        f"method-spec fields: {', '.join(sorted(set(names) - TRAIN_FIELDS - set(ALIASES)))} or role.field"
    )


def split_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `key=value` settings into (training hyperparameters, method-spec overrides); a SpecError
    names a key that is neither, with the nearest known names (`check_setting_name`)."""
    train: dict[str, Any] = {}
    spec: dict[str, Any] = {}
    for key, value in overrides.items():
        name = ALIASES.get(key, key)
        if name in TRAIN_FIELDS:
            train[name] = value
        else:
            check_setting_name(key)
            spec[key] = value
    return train, spec


def parse_assignments(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Parse `key=value` strings (the CLI's --set) into a dict, with a clear error for a malformed one."""
    result: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise SpecError(f"--set {item!r}: expected key=value")
        key, value = item.split("=", 1)
        if not key.strip():
            raise SpecError(f"--set {item!r}: empty key")
        result[key.strip()] = value.strip()
    return result


def parse_settings(pairs: dict[str, str]) -> dict[str, Any]:
    """Command-line `--set` text as values, keys unchanged: numbers of training hyperparameters and of
    method-spec fields (`lr`, `epochs`, `r`, `q.size`, `layers=0,1`, ...) through the table of limits
    (a ConfigError naming the key for "inf", "nan", "1e400" or a value out of range), `none`/`null` for
    optional ones, booleans (`true`/`false`); anything else stays text (checked where it is used).
    Spec fields are read as `MethodSpec.with_overrides` reads them (`spec.read_override`), then bounded."""
    values: dict[str, Any] = {}
    for key, text in pairs.items():
        train_name = ALIASES.get(key, key)
        stripped = text.strip()
        try:
            if train_name in TRAIN_RANGES:
                optional = train_name in OPTIONAL_FIELDS and stripped.lower() in NULLS
                values[key] = None if optional else TRAIN_RANGES[train_name].parse(stripped, key)
            elif train_name in BOOL_FIELDS:
                values[key] = as_bool(stripped, key)
            else:
                spec_name = override_field(key)
                value = read_override(spec_name, text, key)
                if spec_name in SPEC_RANGES and value is not None:
                    for item in value if isinstance(value, list) else [value]:
                        SPEC_RANGES[spec_name].check(item, key)
                values[key] = value
        except (LimitError, SpecError) as exc:
            raise ConfigError(str(exc) if str(exc).startswith(f"{key}:") else f"{key}: {exc}") from None
    return values


def _convert(name: str, annotation: Any, value: Any) -> Any:
    if not isinstance(value, str):
        if "float" in str(annotation) and isinstance(value, int) and not isinstance(value, bool):
            return (
                float(value) if abs(value) < 2**1000 else value
            )  # too large for a float: the range refuses it
        return value
    text = value.strip()
    kind = str(annotation)
    if "None" in kind and text.lower() in ("none", "null", ""):
        return None
    if name in TRAIN_RANGES:
        try:
            return TRAIN_RANGES[name].parse(text, name)
        except LimitError as exc:
            raise ConfigError(str(exc)) from None
    try:
        if kind.startswith("bool"):
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError(text)
    except ValueError as exc:
        raise ConfigError(f"{name}: cannot read {value!r} as {kind.split(' ')[0]}") from exc
    if name == "bf16":
        return text.lower()
    return text
