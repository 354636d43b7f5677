"""pelt_core: PELT methods as data, portable deltas and a one-job trainer (pure torch + transformers)."""

from pelt_core.config import ConfigError, TrainConfig
from pelt_core.methods import BUILTIN_METHODS, builtin_specs, get_method, list_methods
from pelt_core.spec import MethodSpec, ModuleSpec, SpecError

__version__ = "0.1.0"

__all__ = [
    "BUILTIN_METHODS",
    "ConfigError",
    "MethodSpec",
    "ModuleSpec",
    "SpecError",
    "TrainConfig",
    "__version__",
    "builtin_specs",
    "get_method",
    "list_methods",
]
