"""The fixtures the GPU tests share with the CPU tests of the same paths."""

from tests.core.conftest import family, make_backbone  # noqa: F401
from tests.workers.conftest import tiny_backbone, toy_data  # noqa: F401
