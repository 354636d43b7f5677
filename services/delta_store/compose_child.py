"""Compositions the service computes: refused from an estimate before anything is downloaded, then computed
in a child process under an address-space limit, so the API's own memory never holds a source's tensors.

A TIES merge of n full deltas holds every source as float32, its float64 view and the working copies at
once, and Python's allocator keeps what it had: in the API's process, memory it never gives back. So the
service (`PeltOperations.compose`) passes `ComposeLimits` to `MlflowDeltaStore.compose`, which then:

1. estimates the composition's memory from the sources' stored sizes (MLflow's artifact listing: the bytes
   of their `.safetensors` files, no download) times the operation's working factor
   (`estimate_compose_bytes`) and refuses one above PELT_COMPOSE_MEMORY_BYTES (`ComposeMemoryError`, a 413
   naming the estimate and the setting) before anything is downloaded or loaded;
2. downloads the sources (sha256-checked) into a private temporary folder and estimates again from the
   files: their sizes (a tracking server's listing may lack them) and, for TIES and DARE, which take every
   LoRA module as its dense ΔW, the ΔW's size from the shapes in each file's header and its manifest's
   method (`dense_lora_bytes`: no tensor is read); the manifests also name the backbone;
3. runs `compose_in_child` in a child process (`services.sandbox`: forked from its warm interpreter, or a
   fresh one; never forked from the threaded server) under RLIMIT_AS = PELT_COMPOSE_MEMORY_BYTES + RUNTIME_HEADROOM_BYTES (the interpreter
   and torch), and PELT_COMPOSE_TIMEOUT_SECONDS. It loads the sources onto the backbone's shapes alone
   (`pelt_core.backbones.ShapeBackbone`: its config, read without transformers where config.json says it
   all; no weights, tokenizer or model: composing takes only the deltas' tensors and the backbone's sizes,
   name and recorded hash), composes them with `pelt_core.compose` and writes the result into the temporary
   folder; its answer is JSON (sha256, method, provenance). A fresh interpreter starts in about a second (torch's
   import); a forked one in milliseconds;
4. stores that folder and records the audit event in the parent, all or nothing as before.

A child that runs out of memory is a `ComposeMemoryError` (413); one that runs out of time, crashes, or
refuses a source or an option is a DeltaStoreError (422, naming the option when one is at fault). Either
way nothing is written, and the temporary folder (sources and result) is removed.

The estimate counts the sources' own tensors (float32 as stored, their float64 views, the merged result and
the copies saving makes) and TIES' and DARE's dense ΔW; an SVD re-factoring (`lora_rank`, merge_lora_svd)
expands one module at a time, which the factors' margin covers; the child's limit bounds whatever it misses.
"""

from __future__ import annotations

import json
import logging
import resource
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.delta_store.errors import ComposeMemoryError, DeltaStoreError

log = logging.getLogger("pelt.delta_store")

RUNTIME_HEADROOM_BYTES = 3 << 30  # the child's interpreter and torch (about 1 GiB mapped)
# peak bytes per stored byte of all sources: float32 as loaded + float64 views + the op's own copies (TIES'
# stacked trims, DARE's dropped copies); a multi-task bundle only loads and saves its parts. Measured on
# MiniLM's full fine-tuning deltas, 1 to 8 of them: 3.3 (linear), 3.2 (ties), 5.05 (dare), 1.0 (multi_task)
WORKING_FACTORS = {"linear": 4, "ties": 4, "dare": 6, "merge_lora_svd": 4, "average": 4, "multi_task": 2}
LARGEST_SOURCE_FACTOR = 6  # plus, of the largest source: loading it, the result in float64 and saving it
CHILD_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "TOKENIZERS_PARALLELISM": "false",
}
MAX_CHILD_MESSAGE_CHARS = 500  # of a child's error, in the message the caller sees
MAX_HEADER_BYTES = 16 << 20  # of a source's .safetensors header, read for its shapes (a delta's: KBs)


@dataclass(frozen=True)
class ComposeLimits:
    """The bounds of a composition computed in a child process (the service's settings):
    `memory_bytes` (PELT_COMPOSE_MEMORY_BYTES) for the sources' tensors and the working copies, checked
    against `estimate_compose_bytes` before anything is downloaded; `timeout_seconds`
    (PELT_COMPOSE_TIMEOUT_SECONDS) for the child; `warm_seconds` (PELT_SANDBOX_WARM_SECONDS) for its warm
    interpreter (None: the setting's)."""

    memory_bytes: int
    timeout_seconds: float
    warm_seconds: float | None = None

    def child_memory_bytes(self) -> int:
        """The child's address-space limit: the budget and the runtime (it loads no backbone weights)."""
        return self.memory_bytes + RUNTIME_HEADROOM_BYTES


def working_factor(op: str, options: Mapping[str, Any]) -> int:
    """Peak bytes per stored byte of the sources for `op` (merge: by its `how`)."""
    key = str(options.get("how", "linear")) if op == "merge" else op
    return WORKING_FACTORS.get(key, max(WORKING_FACTORS.values()))


def dense_factor(op: str, options: Mapping[str, Any]) -> int:
    """Copies of every source's dense LoRA ΔW that `op` holds at once: TIES and DARE take each LoRA module
    as its dense ΔW (float64) for all sources together (DARE: twice, while it drops); others one at a time."""
    how = str(options.get("how", "linear")) if op == "merge" else ""
    return {"ties": 2, "dare": 3}.get(how, 0)


def estimate_compose_bytes(
    op: str, options: Mapping[str, Any], stored_bytes: Sequence[int], dense_bytes: Sequence[int] = ()
) -> int:
    """The memory a composition needs, from the stored sizes of its sources' tensor files: the op's
    working factor times their sum, plus LARGEST_SOURCE_FACTOR times the largest; plus, for TIES and
    DARE, `dense_factor` times the sources' dense LoRA ΔW (`dense_lora_bytes`) and the merged one."""
    if not stored_bytes:
        return 0
    estimate = working_factor(op, options) * sum(stored_bytes) + LARGEST_SOURCE_FACTOR * max(stored_bytes)
    if dense_bytes and dense_factor(op, options):
        estimate += dense_factor(op, options) * sum(dense_bytes) + max(dense_bytes)
    return estimate


def check_compose_budget(
    op: str,
    options: Mapping[str, Any],
    stored_bytes: Mapping[str, int],
    limits: ComposeLimits,
    dense_bytes: Mapping[str, int] | None = None,
) -> int:
    """The estimate (`estimate_compose_bytes`); ComposeMemoryError naming it, the sources' stored sizes
    and PELT_COMPOSE_MEMORY_BYTES when it is above the budget."""
    dense = list((dense_bytes or {}).values())
    estimate = estimate_compose_bytes(op, options, list(stored_bytes.values()), dense)
    if estimate > limits.memory_bytes:
        factor = working_factor(op, options)
        expanded = (
            f" + {dense_factor(op, options)} x their LoRA modules' dense ΔW, {sum(dense):,} bytes"
            if dense and dense_factor(op, options)
            else ""
        )
        raise ComposeMemoryError(
            f"this {op} needs about {estimate:,} bytes of memory ({factor} x the sources' "
            f"{sum(stored_bytes.values()):,} stored bytes + {LARGEST_SOURCE_FACTOR} x the largest, "
            f"{max(stored_bytes.values()):,}{expanded}), above PELT_COMPOSE_MEMORY_BYTES "
            f"({limits.memory_bytes:,}); compose fewer or smaller deltas",
            field="sources",
        )
    return estimate


def dense_lora_bytes(folder: Path, manifest: Mapping[str, Any]) -> int:
    """The bytes of a delta's LoRA modules as dense float64 ΔW (d_out x d_in each), from the shapes in its
    tensor file's header and the method in its manifest: no tensor is read."""
    from pelt_core.compose_tensors import low_rank_roles
    from pelt_core.spec import MethodSpec

    roles = set(low_rank_roles(MethodSpec.from_dict(manifest["method"])))
    if not roles:
        return 0
    shapes = safetensors_shapes(folder / "delta.safetensors")
    total = 0
    for key, down in shapes.items():
        path = key.removesuffix(".down.weight")
        up = shapes.get(f"{path}.up.weight")
        if path != key and path.rsplit(".", 1)[-1] in roles and len(down) == 2 and up and len(up) == 2:
            total += 8 * up[0] * down[1]
    return total


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape, from a .safetensors file's JSON header alone (at most MAX_HEADER_BYTES);
    DeltaStoreError (field "sources") naming the file when that header is not a safetensors header."""
    with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        if size > MAX_HEADER_BYTES:
            raise DeltaStoreError(
                f"{path.name}: a header of {size:,} bytes is not a delta's", field="sources"
            )
        raw = file.read(size)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
        return {
            name: [_dimension(n) for n in entry.get("shape", [])]
            for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict)
        }
    except (ValueError, TypeError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise DeltaStoreError(
            f"{path.name} is not a safetensors file: {_short(str(exc))}", field="sources"
        ) from None


def _dimension(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a tensor's shape holds {value!r}, not a size")
    return value


def run_compose_child(request: Mapping[str, Any], limits: ComposeLimits) -> dict:
    """`compose_in_child(request)` in a child process under `limits`; its answer, or the error it ended
    with: ComposeMemoryError when it ran out of memory, DeltaStoreError for anything else."""
    from services.sandbox import run_in_child

    memory = limits.child_memory_bytes()
    outcome = run_in_child(
        "compose",
        request,
        memory_bytes=memory,
        timeout_seconds=limits.timeout_seconds,
        environment=CHILD_ENVIRONMENT,
        write_files=True,  # the composed delta
        warm_seconds=limits.warm_seconds,
    )
    answer = outcome.answer or {}
    if "sha256" in answer:
        log.info(
            "composition computed in a child process: peak memory %s bytes, peak address space %s bytes",
            answer.get("peak_bytes"),
            answer.get("peak_address_space_bytes"),
        )
        return answer
    step = str(outcome.last_progress.get("step", "starting"))
    if answer.get("memory") or outcome.out_of_memory:
        log.warning("a composition ran out of memory (%s): %s", step, outcome.stderr_tail[-2000:])
        raise ComposeMemoryError(
            f"this composition ran out of memory while {step} (its process may use "
            f"PELT_COMPOSE_MEMORY_BYTES, {limits.memory_bytes:,} bytes, plus its runtime's); "
            "compose fewer or smaller deltas",
            field="sources",
        )
    if "refused" in answer:
        raise _refusal(answer["refused"])
    if outcome.timed_out:
        raise DeltaStoreError(
            f"this composition ran past PELT_COMPOSE_TIMEOUT_SECONDS ({limits.timeout_seconds:g} s) while "
            f"{step}; nothing was written",
            field="sources",
        )
    log.warning("a composition's process failed (%s): %s", step, outcome.stderr_tail[-2000:])
    how = answer.get("error") or outcome.how_it_ended()
    raise DeltaStoreError(
        f"composing failed while {step} ({_short(str(how))}); nothing was written", field="sources"
    )


def _refusal(refusal: Mapping[str, Any]) -> Exception:
    """The child's refusal of a source or an option as the error of its kind (all of them 422s)."""
    from pelt_core.compose_options import CompositionError
    from pelt_core.delta_format import DeltaError

    message, field = _short(str(refusal.get("message"))), refusal.get("field")
    kind = refusal.get("type")
    if kind == "CompositionError":
        return CompositionError(message, field=field)
    if kind == "DeltaError":
        return DeltaError(message)
    return DeltaStoreError(message, field=field)


def _short(text: str) -> str:
    return text if len(text) <= MAX_CHILD_MESSAGE_CHARS else text[: MAX_CHILD_MESSAGE_CHARS - 1] + "…"


# --- the child process (services.sandbox runs it under the memory limit) ------------------------------


@dataclass(frozen=True)
class _Source:
    """What the child knows of a source version (`pelt_core.pulled.PulledVersion`)."""

    task: str
    version: str
    kind: str
    sha256: str | None

    @property
    def uri(self) -> str:
        return f"{self.task}/{self.version}"


def compose_in_child(request: dict[str, Any], report: Any) -> dict[str, Any]:
    """The child's side: load the downloaded sources onto the shapes of the backbone their manifests
    record (`request["backbone"]`: a `ShapeBackbone`, no weights), compose them (`compose_pulled`) into
    `request["out"]`; {"sha256", "method", "provenance", "peak_bytes"} or {"refused": {message, field}}
    for a source or option at fault. Running out of memory is the sandbox's to report."""
    from pelt_core.backbones import BackboneError, ShapeBackbone
    from pelt_core.compose import CompositionError
    from pelt_core.delta_format import DeltaError
    from pelt_core.pulled import load_pulled
    from services.delta_store.composing import compose_pulled

    try:
        report({"step": "reading the backbone's config"})
        backbone = ShapeBackbone.from_manifest(request["backbone"])
        pulled = {}
        for source in request["sources"]:
            report({"step": f"loading source {source['name']}"})
            version = _Source(source["task"], source["version"], source["kind"], source["sha256"])
            pulled[source["name"]] = load_pulled(
                version, Path(source["folder"]), lambda _: backbone, serving=False
            )
        report({"step": "composing"})
        saved, method, provenance, _ = compose_pulled(
            request["op"], pulled, dict(request["options"]), Path(request["out"])
        )
    except (CompositionError, DeltaStoreError, DeltaError, BackboneError) as exc:
        refusal = {"message": str(exc), "field": getattr(exc, "field", None), "type": type(exc).__name__}
        return {"refused": refusal}
    return {
        "sha256": saved.sha256,
        "method": method,
        "provenance": json.loads(json.dumps(provenance, default=str)),
        "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_address_space_bytes": _peak_address_space(),
    }


def _peak_address_space() -> int | None:
    """This process's peak address space (VmPeak: what RLIMIT_AS bounds), for the operator's log."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmPeak:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


__all__ = [
    "RUNTIME_HEADROOM_BYTES",
    "ComposeLimits",
    "check_compose_budget",
    "compose_in_child",
    "dense_lora_bytes",
    "estimate_compose_bytes",
    "run_compose_child",
]
