"""The errors of pelt_core's heavy modules, importable without torch: a service that only answers them
(the API's error handlers) need not load torch to recognise them. `pelt_core.backbones` and
`pelt_core.data` raise and re-export them."""

from __future__ import annotations


class BackboneError(ValueError):
    """A backbone cannot be found, or its architecture is not supported."""


class DataError(ValueError):
    """A dataset file cannot be read or lacks a field the task needs; the message names it."""


__all__ = ["BackboneError", "DataError"]
