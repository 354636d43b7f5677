"""Training hyperparameters of one job, validated with errors that name the field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pelt_core.spec import SpecError


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

    def resolved_learning_rate(self, method_defaults: dict[str, Any]) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return float(method_defaults.get("learning_rate", 1e-3))

    def validate(self) -> None:
        def bad(name: str, message: str) -> ConfigError:
            return ConfigError(f"{name}: {message}")

        if self.learning_rate is not None and not self.learning_rate > 0:
            raise bad("learning_rate", f"must be > 0, got {self.learning_rate!r}")
        if not self.epochs > 0:
            raise bad("epochs", f"must be > 0, got {self.epochs!r}")
        for name in ("batch_size", "eval_batch_size", "max_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, f"must be a whole number >= 1, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise bad("seed", f"must be a whole number >= 0, got {self.seed!r}")
        if self.k_shot is not None and (not isinstance(self.k_shot, int) or self.k_shot < 1):
            raise bad("k_shot", f"must be a whole number >= 1 or null, got {self.k_shot!r}")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise bad("max_steps", f"must be a whole number >= 1 or null, got {self.max_steps!r}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise bad("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio!r}")
        if self.weight_decay < 0:
            raise bad("weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        if not self.max_grad_norm > 0:
            raise bad("max_grad_norm", f"must be > 0, got {self.max_grad_norm!r}")
        if not 0.0 <= self.head_dropout < 1.0:
            raise bad("head_dropout", f"must be in [0, 1), got {self.head_dropout!r}")
        if self.bf16 not in ("auto", "true", "false"):
            raise bad("bf16", f"must be auto, true or false, got {self.bf16!r}")
        if self.backbone_dtype not in ("float32", "bfloat16"):
            raise bad("backbone_dtype", f"must be float32 or bfloat16, got {self.backbone_dtype!r}")
        if self.pooling not in ("auto", "cls", "mean", "last"):
            raise bad("pooling", f"must be auto, cls, mean or last, got {self.pooling!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build and validate from JSON-ish values; strings (from `--set key=value`) are converted."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ConfigError(f"{', '.join(unknown)}: unknown training hyperparameter(s); known: {', '.join(fields)}")
        converted = {name: _convert(name, fields[name].type, value) for name, value in values.items()}
        config = cls(**converted)
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))
ALIASES = {"lr": "learning_rate", "k": "k_shot", "K": "k_shot", "bs": "batch_size"}


def split_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `key=value` settings into (training hyperparameters, method-spec overrides)."""
    train: dict[str, Any] = {}
    spec: dict[str, Any] = {}
    for key, value in overrides.items():
        name = ALIASES.get(key, key)
        if name in TRAIN_FIELDS:
            train[name] = value
        else:
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


def _convert(name: str, annotation: Any, value: Any) -> Any:
    if not isinstance(value, str):
        if "float" in str(annotation) and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value
    text = value.strip()
    kind = str(annotation)
    if "None" in kind and text.lower() in ("none", "null", ""):
        return None
    try:
        if kind.startswith("float"):
            return float(text)
        if kind.startswith("int"):
            return int(text)
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
