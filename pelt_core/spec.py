"""One modification spec for every PELT method.

He et al. ("Towards a Unified View of Parameter-Efficient Transfer Learning", ICLR 2022) describe
every method as a learned modification Δh of some hidden representation h, along four design
dimensions. A `ModuleSpec` is one such modification; a `MethodSpec` is a named set of them plus the
two extras the dimensions do not cover (BitFit's bias deltas and trainable LayerNorms).

    functional form     `form` + `nonlinearity` + `size` (+ `proj_bias`):
                          "bottleneck":  Δh = f(x W_down) W_up        (adapters, LoRA: f = identity)
                          "prefix":      Δh = softmax(x W_q P_kᵀ) P_v  (prefix tuning, l = size)
                          "dense":       Δh = x ΔW, ΔW the weight's full shape (full fine-tuning of
                                         that weight as the job's own tensor; `size` unused)
    modified repr.      `representation`: a sub-layer output ("attn", "ffn"), a weight matrix's output
                          ("attn.q", "attn.k", "attn.v", "attn.o", "ffn.in", "ffn.out") or the
                          attention heads' keys/values ("attn.heads", prefix only)
    insertion form      `insertion`: "sequential" (Δh computed from h itself) or "parallel"
                          (computed from the input x of the modified sub-layer or matrix)
    composition         `composition`: "add" (h + Δh), "scaled" (h + s·Δh, s fixed or learned),
                          "gated" ((1-λ)h + λΔh: prefix tuning's attention-weighted mixture)

`fusion` (a `FusionSpec`) adds AdapterFusion's learned composition across modules: at each sub-layer where the
method's adapters sit, an attention over their outputs replaces their sum (`pelt_core.methods.fusion`); the
modules that came from other tasks' stored deltas are frozen and the spec names their sources.

`gate=True` adds UniPELT's learned gate G = σ(W_g x + b_g) on top of a module's own composition.
`lr_multiplier` trains a module at that multiple of the job's learning rate (its own AdamW parameter group,
on the job's schedule): a mixture's modules can learn at their own presets' rates, and a sweep of the job's
rate moves them together. BitFit's bias deltas, LayerNorms and the task head learn at the job's rate.

A user-defined method is just `MethodSpec.from_dict(json)`; nothing else needs to change.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pelt_core.limits import MAX_MODULES, SPEC_RANGES, LimitError

FORMS = ("bottleneck", "prefix", "dense")
SUBLAYER_REPRESENTATIONS = ("attn", "ffn")
WEIGHT_REPRESENTATIONS = ("attn.q", "attn.k", "attn.v", "attn.o", "ffn.in", "ffn.out")
REPRESENTATIONS = (*SUBLAYER_REPRESENTATIONS, *WEIGHT_REPRESENTATIONS, "attn.heads")
INSERTIONS = ("sequential", "parallel")
COMPOSITIONS = ("add", "scaled", "gated")
NONLINEARITIES = ("relu", "gelu", "tanh", "silu", "identity")
INITS = ("near_identity", "lora", "zero_up")


class SpecError(ValueError):
    """A method spec or an override names something that does not exist or is out of range."""


@dataclass(frozen=True)
class ModuleSpec:
    """One learned modification Δh (see the module docstring for the four dimensions)."""

    form: str
    representation: str
    insertion: str = "sequential"
    composition: str = "add"
    size: int = 64
    nonlinearity: str = "relu"
    proj_bias: bool = True
    scale: float = 1.0
    alpha: float | None = None
    learned_scale: bool = False
    gate: bool = False
    init: str = "near_identity"
    init_std: float = 1e-2
    dropout: float = 0.0
    layers: tuple[int, ...] | None = None
    reparam_hidden: int | None = None
    lr_multiplier: float = 1.0

    @property
    def effective_scale(self) -> float:
        """s in h + s·Δh: α/r when `alpha` is given (LoRA's convention), else `scale`."""
        return self.alpha / self.size if self.alpha is not None else self.scale

    def validate(self, where: str = "module") -> None:
        def bad(name: str, message: str) -> SpecError:
            return SpecError(f"{where}.{name}: {message}")

        if self.form not in FORMS:
            raise bad("form", f"{self.form!r} is not one of {', '.join(FORMS)}")
        if self.representation not in REPRESENTATIONS:
            raise bad("representation", f"{self.representation!r} is not one of {', '.join(REPRESENTATIONS)}")
        if self.insertion not in INSERTIONS:
            raise bad("insertion", f"{self.insertion!r} is not one of {', '.join(INSERTIONS)}")
        if self.composition not in COMPOSITIONS:
            raise bad("composition", f"{self.composition!r} is not one of {', '.join(COMPOSITIONS)}")
        if self.nonlinearity not in NONLINEARITIES:
            raise bad("nonlinearity", f"{self.nonlinearity!r} is not one of {', '.join(NONLINEARITIES)}")
        if self.init not in INITS:
            raise bad("init", f"{self.init!r} is not one of {', '.join(INITS)}")
        for name in ("size", "scale", "alpha", "init_std", "dropout", "reparam_hidden", "lr_multiplier"):
            value = getattr(self, name)
            if value is None and name in ("alpha", "reparam_hidden"):
                continue
            _check_range(name, value, where)
        if self.layers is not None:
            if not isinstance(self.layers, tuple | list) or len(self.layers) > SPEC_RANGES["layers"].high + 1:
                raise bad("layers", f"must be a list of layer indices or null, got {self.layers!r}")
            for index in self.layers:
                _check_range("layers", index, where)
        if self.form == "dense":
            if self.representation not in WEIGHT_REPRESENTATIONS:
                raise bad(
                    "representation",
                    f"a dense delta modifies a weight matrix: use one of {', '.join(WEIGHT_REPRESENTATIONS)}",
                )
            if self.insertion != "parallel":
                raise bad("insertion", "a dense delta works beside its weight (Δh = x ΔW): use 'parallel'")
        if self.form == "prefix":
            if self.representation != "attn.heads":
                raise bad("representation", "a prefix modifies the attention heads: use 'attn.heads'")
            if self.composition != "gated":
                raise bad("composition", "prefix tuning composes by attention gating: use 'gated'")
            if self.insertion != "parallel":
                raise bad("insertion", "prefix tuning is a parallel modification: use 'parallel'")
        else:
            if self.representation == "attn.heads":
                raise bad("representation", "'attn.heads' is only for form 'prefix'")
            if self.composition == "gated":
                raise bad(
                    "composition",
                    "'gated' is prefix tuning's attention gating; use 'add' or 'scaled' (and gate=true for UniPELT's gate)",
                )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["layers"] = list(self.layers) if self.layers is not None else None
        # the default is left out, so a spec written before the field existed reads and writes the same
        if self.lr_multiplier == 1.0:
            del data["lr_multiplier"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "module") -> ModuleSpec:
        if not isinstance(data, dict):
            raise SpecError(f"{where}: expected an object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(
                f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        for required in ("form", "representation"):
            if required not in data:
                raise SpecError(f"{where}.{required}: missing")
        values = dict(data)
        if values.get("layers") is not None:
            values["layers"] = tuple(values["layers"])
        for name in ("scale", "init_std", "dropout", "lr_multiplier"):
            if name in values and isinstance(values[name], int) and not isinstance(values[name], bool):
                values[name] = float(values[name])
        spec = cls(**values)
        spec.validate(where)
        return spec


@dataclass(frozen=True)
class FusionSource:
    """One stored delta whose adapters a fusion holds, frozen: its task, version, sha256 and method, and
    which of the fusion's module roles came from which of its own roles."""

    task: str
    sha256: str
    method: str
    roles: dict[str, str]  # the fusion's role -> the source delta's role
    version: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "version": self.version,
            "sha256": self.sha256,
            "method": self.method,
            "roles": dict(self.roles),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> FusionSource:
        if not isinstance(data, dict):
            raise SpecError(f"{where}: expected an object, got {type(data).__name__}")
        known = {"task", "version", "sha256", "method", "roles"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(
                f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        for name in ("task", "sha256", "method"):
            if not isinstance(data.get(name), str) or not data[name]:
                raise SpecError(f"{where}.{name}: a non-empty string is required")
        version = data.get("version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise SpecError(f"{where}.version: an integer or null, got {version!r}")
        roles = data.get("roles")
        if (
            not isinstance(roles, dict)
            or not roles
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in roles.items())
        ):
            raise SpecError(f"{where}.roles: an object of fusion role -> source role is required")
        return cls(data["task"], data["sha256"], data["method"], dict(roles), version)


@dataclass(frozen=True)
class FusionSpec:
    """AdapterFusion (Pfeiffer et al., EACL 2021) over a method's modules: per sub-layer, an attention with
    query from the sub-layer's output and keys and values from each adapter's output replaces their sum;
    `regularization` is λ of the paper's penalty λ‖I − V‖² that keeps the value matrices near identity."""

    sources: tuple[FusionSource, ...] = ()
    regularization: float = 0.01

    @property
    def frozen_roles(self) -> frozenset[str]:
        """The roles loaded from sources (not trained by the fusion job)."""
        return frozenset(role for source in self.sources for role in source.roles)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sources": [source.to_dict() for source in self.sources],
            "regularization": self.regularization,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> FusionSpec:
        if not isinstance(data, dict):
            raise SpecError(f"{where}: expected an object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"sources", "regularization"})
        if unknown:
            raise SpecError(f"{where}: unknown field(s) {', '.join(unknown)}; known: regularization, sources")
        sources = data.get("sources", [])
        if not isinstance(sources, list):
            raise SpecError(f"{where}.sources: expected a list")
        regularization = data.get("regularization", 0.01)
        if isinstance(regularization, bool) or not isinstance(regularization, int | float):
            raise SpecError(f"{where}.regularization: expected a number, got {regularization!r}")
        return cls(
            tuple(FusionSource.from_dict(s, f"{where}.sources[{i}]") for i, s in enumerate(sources)),
            float(regularization),
        )


def fusion_refusal(module: ModuleSpec) -> str | None:
    """Why AdapterFusion cannot attend over this module's output (None: it can). Fusion needs one output per
    module at one sub-layer: a bottleneck adapter on a sub-layer's output, sequential or parallel, ungated."""
    if module.form == "prefix":
        return (
            "a prefix changes the attention's keys and values inside every head, so it has no output of its "
            "own at a sub-layer to attend over"
        )
    if module.representation in WEIGHT_REPRESENTATIONS:
        return (
            f"it modifies the weight matrix {module.representation} inside a sub-layer (LoRA-style), so it has "
            "no output of its own at a sub-layer to attend over"
        )
    if module.form != "bottleneck":
        return f"form {module.form!r} is not a bottleneck adapter"
    if module.gate:
        return "a gated module's output already mixes with the others by its own gate (UniPELT)"
    return None


@dataclass(frozen=True)
class MethodSpec:
    """A named PELT method: modification modules plus BitFit bias deltas and trainable LayerNorms."""

    name: str
    modules: dict[str, ModuleSpec] = field(default_factory=dict)
    bias: bool = False
    layer_norm: bool = False
    description: str = ""
    reference: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    fusion: FusionSpec | None = None

    def validate(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise SpecError("name: a method needs a non-empty name")
        if not self.modules and not self.bias and not self.layer_norm:
            raise SpecError(f"{self.name}: a method must train something (modules, bias or layer_norm)")
        if len(self.modules) > MAX_MODULES:
            raise SpecError(f"{self.name}.modules: at most {MAX_MODULES} modules, got {len(self.modules)}")
        for role, module in self.modules.items():
            if not role.isidentifier():
                raise SpecError(
                    f"{self.name}.modules: role {role!r} must be an identifier (letters, digits, _)"
                )
            module.validate(f"{self.name}.modules.{role}")
        prefixes = [r for r, m in self.modules.items() if m.form == "prefix"]
        if len(prefixes) > 1:
            raise SpecError(f"{self.name}.modules: at most one prefix module, got {', '.join(prefixes)}")
        if self.fusion is not None:
            self._validate_fusion(self.fusion)

    def _validate_fusion(self, fusion: FusionSpec) -> None:
        where = f"{self.name}.fusion"
        if self.bias or self.layer_norm:
            raise SpecError(
                f"{where}: a fusion trains no bias or LayerNorm deltas (they would change the shared norms for "
                "every adapter it attends over); set bias and layer_norm to false"
            )
        if len(self.modules) < 2:
            raise SpecError(
                f"{where}: AdapterFusion attends over two or more adapters, got {len(self.modules)}"
            )
        for role, module in self.modules.items():
            reason = fusion_refusal(module)
            if reason is not None:
                raise SpecError(f"{self.name}.modules.{role}: AdapterFusion cannot use this module: {reason}")
        seen: set[str] = set()
        for index, source in enumerate(fusion.sources):
            for role in source.roles:
                if role not in self.modules:
                    raise SpecError(
                        f"{where}.sources[{index}].roles: {role!r} is not a module of {self.name!r}"
                    )
                if role in seen:
                    raise SpecError(f"{where}.sources[{index}].roles: {role!r} comes from two sources")
                seen.add(role)
        if not 0.0 <= fusion.regularization <= 10.0 or fusion.regularization != fusion.regularization:
            raise SpecError(f"{where}.regularization: must be within [0, 10], got {fusion.regularization}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "modules": {role: m.to_dict() for role, m in self.modules.items()},
            "bias": self.bias,
            "layer_norm": self.layer_norm,
            "description": self.description,
            "reference": self.reference,
            "defaults": dict(self.defaults),
            # absent unless set, so every spec written before fusion existed reads and writes the same
            **({"fusion": self.fusion.to_dict()} if self.fusion is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MethodSpec:
        if not isinstance(data, dict):
            raise SpecError(f"method: expected an object, got {type(data).__name__}")
        known = {"name", "modules", "bias", "layer_norm", "description", "reference", "defaults", "fusion"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(
                f"method: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        name = data.get("name", "")
        modules_data = data.get("modules", {})
        if not isinstance(modules_data, dict):
            raise SpecError(f"{name}.modules: expected an object of role -> module spec")
        spec = cls(
            name=name,
            modules={
                role: ModuleSpec.from_dict(m, f"{name}.modules.{role}") for role, m in modules_data.items()
            },
            bias=bool(data.get("bias", False)),
            layer_norm=bool(data.get("layer_norm", False)),
            description=data.get("description", ""),
            reference=data.get("reference", ""),
            defaults=dict(data.get("defaults", {})),
            fusion=(
                FusionSpec.from_dict(data["fusion"], f"{name}.fusion")
                if data.get("fusion") is not None
                else None
            ),
        )
        spec.validate()
        return spec

    def with_overrides(self, overrides: dict[str, Any]) -> MethodSpec:
        """Return a copy with spec fields changed.

        Keys are `role.field` (one module), a bare module `field` (every module that has it, e.g. `size`),
        `bias` or `layer_norm`. Handy aliases: `r`/`rank` and `bottleneck`/`prefix_length` mean `size`
        of the LoRA-like, adapter-like or prefix modules respectively.
        """
        modules = dict(self.modules)
        bias, layer_norm = self.bias, self.layer_norm
        module_fields = {f.name for f in dataclasses.fields(ModuleSpec)}
        for key, value in overrides.items():
            if key == "bias":
                bias = _as_bool(value, key)
                continue
            if key == "layer_norm":
                layer_norm = _as_bool(value, key)
                continue
            if "." in key:
                role, field_name = key.split(".", 1)
                if role not in modules:
                    raise SpecError(
                        f"{key}: method {self.name!r} has no module {role!r} (has: {', '.join(modules) or 'none'})"
                    )
                targets = [role]
            else:
                field_name, targets = _alias_targets(key, modules)
                if not targets:
                    raise SpecError(
                        f"{key}: not a field of any module of {self.name!r}; use role.field with roles "
                        f"{', '.join(modules) or 'none'} and fields {', '.join(sorted(module_fields))}"
                    )
            if field_name not in module_fields:
                raise SpecError(
                    f"{key}: unknown module field {field_name!r}; known: {', '.join(sorted(module_fields))}"
                )
            for role in targets:
                current = modules[role].to_dict()
                current[field_name] = (
                    read_override(field_name, value, key) if isinstance(value, str) else value
                )
                modules[role] = ModuleSpec.from_dict(current, f"{self.name}.modules.{role}")
        spec = dataclasses.replace(self, modules=modules, bias=bias, layer_norm=layer_norm)
        spec.validate()
        return spec


# --- override keys: the one alias table, read by `with_overrides`, the command line's `--set`
# (pelt_core.config.parse_settings) and the service's check of JSON numbers --------------------------------

# short names of a module's `size`, each for the modules of one kind (`r=16`: the rank of the LoRA-like ones)
SIZE_ALIASES: dict[str, str] = {
    "r": "lora",
    "rank": "lora",
    "bottleneck": "adapter",
    "prefix_length": "prefix",
    "l": "prefix",
}
NULLS = ("none", "null")
OPTIONAL_MODULE_FIELDS = frozenset({"alpha", "reparam_hidden"})  # none/null: the default
BOOLEAN_FIELDS = frozenset({"proj_bias", "learned_scale", "gate", "bias", "layer_norm"})


def override_field(key: str) -> str:
    """The field an override key sets: `q.size` and `r` set `size`, `dropout` sets `dropout`."""
    if "." in key:
        return key.split(".", 1)[1]
    return "size" if key in SIZE_ALIASES else key


def read_override(field_name: str, text: str, key: str) -> Any:
    """Command-line text of an override of `field_name` as its value: numbers read through the table of
    limits (no "inf", "nan", "1e400"; bounded later, by `validate` or the caller), `layers` as a list
    (`0,1`; `all`/`none`: every layer), none/null for optional fields, true/false for booleans; other
    fields keep their text. A SpecError names `key`."""
    stripped = text.strip()
    lowered = stripped.lower()
    try:
        if field_name == "layers":
            return (
                None
                if lowered in ("", "all", *NULLS)
                else [SPEC_RANGES["layers"].read(part, key) for part in stripped.split(",")]
            )
        if field_name in OPTIONAL_MODULE_FIELDS and lowered in NULLS:
            return None
        if field_name in SPEC_RANGES:
            return SPEC_RANGES[field_name].read(stripped, key)
    except LimitError as exc:
        raise SpecError(str(exc)) from None
    if field_name in BOOLEAN_FIELDS:
        return _as_bool(stripped, key)
    return text


def module_kind(module: ModuleSpec | Mapping[str, Any]) -> str:
    """What SIZE_ALIASES call a module (a ModuleSpec or its dict): "prefix", "dense", "lora" (a linear
    bottleneck) or "adapter"."""
    if isinstance(module, Mapping):
        form, nonlinearity = module.get("form"), module.get("nonlinearity", ModuleSpec.nonlinearity)
    else:
        form, nonlinearity = module.form, module.nonlinearity
    if form in ("prefix", "dense"):
        return str(form)
    return "lora" if nonlinearity == "identity" else "adapter"


def _alias_targets(key: str, modules: dict[str, ModuleSpec]) -> tuple[str, list[str]]:
    """(the field a bare key sets, the roles of the modules it sets it on)."""
    if key in SIZE_ALIASES:
        return "size", [role for role, module in modules.items() if module_kind(module) == SIZE_ALIASES[key]]
    names = {f.name for f in dataclasses.fields(ModuleSpec)}
    if key in names:
        return key, list(modules)
    return key, []


def _check_range(name: str, value: Any, where: str) -> None:
    """A module field within its range of `limits.SPEC_RANGES`, else a SpecError naming `where.name`."""
    try:
        SPEC_RANGES[name].check(value, f"{where}.{name}")
    except LimitError as exc:
        raise SpecError(str(exc)) from None


def as_bool(value: Any, key: str) -> bool:
    """A boolean, or its command-line text (true/false, 1/0, yes/no, on/off); else a SpecError naming `key`."""
    return _as_bool(value, key)


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
        return False
    raise SpecError(f"{key}: expected true or false, got {value!r}")
