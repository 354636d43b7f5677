"""The built-in PELT methods: each is a preset of the shared modification spec (see pelt_core.spec)."""

from __future__ import annotations

from typing import Any

from pelt_core.methods import bitfit, full, houlsby, lora, mam, parallel_adapter, pfeiffer, prefix, unipelt
from pelt_core.spec import MethodSpec, SpecError

BUILTIN_METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for module in (bitfit, houlsby, pfeiffer, prefix, lora, parallel_adapter, mam, unipelt, full)
    for spec in module.PRESETS
}

for _spec in BUILTIN_METHODS.values():
    _spec.validate()


def list_methods() -> list[str]:
    """Names of the built-in presets, in a stable order."""
    return list(BUILTIN_METHODS)


def builtin_specs() -> dict[str, dict[str, Any]]:
    """Every built-in preset as its JSON-ready spec dict (what the registry stores)."""
    return {name: spec.to_dict() for name, spec in BUILTIN_METHODS.items()}


def get_method(
    method: str | dict[str, Any] | MethodSpec, overrides: dict[str, Any] | None = None
) -> MethodSpec:
    """Resolve a preset name, a spec dict or a MethodSpec, then apply overrides (see MethodSpec.with_overrides)."""
    if isinstance(method, MethodSpec):
        spec = method
    elif isinstance(method, dict):
        spec = MethodSpec.from_dict(method)
    elif method in BUILTIN_METHODS:
        spec = BUILTIN_METHODS[method]
    else:
        raise SpecError(f"unknown method {method!r}; built-in methods: {', '.join(BUILTIN_METHODS)}")
    return spec.with_overrides(overrides) if overrides else spec


__all__ = ["BUILTIN_METHODS", "builtin_specs", "get_method", "list_methods"]
