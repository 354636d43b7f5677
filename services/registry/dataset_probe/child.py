"""The probe in a child process (`services.sandbox`), under a memory and a time limit: the parent's call
and the child's side."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from services.registry.dataset_probe.probe import probe_dataset
from services.registry.dataset_probe.records import (
    DatasetLimits,
    DatasetProbe,
    Report,
    probe_from_json,
    too_large,
)
from services.registry.dataset_probe.source import DatasetSource
from services.registry.errors import RegistryValidationError


def probe_dataset_in_child(
    source: DatasetSource,
    label_field: str | None,
    limits: DatasetLimits,
    *,
    memory_bytes: int,
    timeout_seconds: float,
    warm_seconds: float | None = None,
) -> DatasetProbe:
    """`probe_dataset` in a child process (`services.sandbox`) under `memory_bytes` of address space
    (PELT_DATASET_PROBE_MEMORY_BYTES) and `timeout_seconds` (PELT_DATASET_PROBE_TIMEOUT_SECONDS), forked
    from a warm interpreter kept `warm_seconds` (PELT_SANDBOX_WARM_SECONDS; None: the setting's). Its
    refusals come back as they are; a child that runs out of either, or crashes, is a 422 naming the
    split it was reading (`source.<split>`; `source` for a `datasets` folder or before any split)."""
    from services.sandbox import run_in_child

    request = {"source": asdict(source), "label_field": label_field, "limits": asdict(limits)}
    outcome = run_in_child(
        "dataset_probe",
        request,
        memory_bytes=memory_bytes,
        timeout_seconds=timeout_seconds,
        warm_seconds=warm_seconds,
    )
    answer = outcome.answer or {}
    if "probe" in answer:
        return probe_from_json(answer["probe"])
    if "refused" in answer:
        refusal = answer["refused"]
        error = too_large if refusal["kind"] == "too_large" else RegistryValidationError
        raise error(str(refusal["field"]), str(refusal["message"]))
    split = outcome.last_progress.get("split")
    field_name = f"source.{split}" if split is not None and source.kind == "files" else "source"
    what = f"the {split} split" if split is not None else "the data"
    if outcome.timed_out:
        raise RegistryValidationError(
            field_name,
            f"{what} could not be read within PELT_DATASET_PROBE_TIMEOUT_SECONDS ({timeout_seconds:g} s)",
        )
    if answer.get("memory") or outcome.out_of_memory or outcome.answer is None:
        how = (
            "it ran out of"
            if answer.get("memory") or outcome.out_of_memory
            else f"the reader ended ({outcome.how_it_ended()}); it may have run past"
        )
        raise RegistryValidationError(
            field_name,
            f"{what} could not be read: {how} its memory limit, "
            f"PELT_DATASET_PROBE_MEMORY_BYTES ({memory_bytes:,} bytes)",
        )
    error_type = str(answer.get("error_type") or "error")[:100]  # its text may name files of this machine
    raise RegistryValidationError(field_name, f"{what} could not be read: the reader failed ({error_type})")


def probe_in_child(request: dict[str, Any], report: Report) -> dict[str, Any]:
    """The child's side of `probe_dataset_in_child` (run by services.sandbox): the probe as JSON, or
    the refusal ({"refused": {kind, field, message}})."""
    from services.errors import TooLargeError

    source = DatasetSource(**request["source"])
    try:
        probe = probe_dataset(source, request["label_field"], DatasetLimits(**request["limits"]), report)
    except RegistryValidationError as exc:
        kind = "too_large" if isinstance(exc, TooLargeError) else "validation"
        return {
            "refused": {"kind": kind, "field": exc.field, "message": str(exc).removeprefix(f"{exc.field}: ")}
        }
    return {"probe": asdict(probe)}


__all__ = ["probe_dataset_in_child", "probe_in_child"]
