"""One table of limits: the range of every number a user can give pelt.

The CLI, the HTTP API, the registry and the trainer all check numbers against the `Range`s here, so a
value the service accepts is one the trainer can run, and the error names the field and its range.
Some ranges also depend on the backbone (a LoRA rank at most the hidden size, `max_length` at most
its positions): `check_against_backbone` applies those once the backbone is known.

Pure Python (no torch): the service imports it on its request path.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class LimitError(ValueError):
    """A number is of the wrong kind or outside its range; the message starts with the field's name."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class MemoryBudgetError(LimitError):
    """A job's memory estimate is above the worker's budget (`check_against_backbone`'s `memory_budget`):
    `field` names what to lower."""


@dataclass(frozen=True)
class Range:
    """The allowed values of one numeric field.

    kind: "int" (whole numbers only) or "float" (any finite number; ints are accepted). Booleans and
    strings are never numbers here: `parse` turns command-line text into a number first, and refuses
    "inf"/"nan". low/high: bounds, inclusive unless `low_open`/`high_open`. `doc`: what it is.
    """

    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    doc: str = ""

    def describe(self) -> str:
        """The range as a reader writes it: `[1, 4096]`, `(0, 1]`, `>= 0`."""
        if self.low is not None and self.high is not None:
            return (
                f"{'(' if self.low_open else '['}{_show(self.low)}, {_show(self.high)}"
                f"{')' if self.high_open else ']'}"
            )
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_show(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_show(self.high)}"
        return "any finite number"

    def check(self, value: Any, field: str) -> int | float:
        """The value if it is a number of this kind within range; else a LimitError naming `field`."""
        noun = "a whole number" if self.kind == "int" else "a number"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise LimitError(
                field, f"must be {noun} in {self.describe()}, got {type(value).__name__} {value!r}"
            )
        if self.kind == "int" and not isinstance(value, int):
            raise LimitError(field, f"must be {noun} in {self.describe()}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise LimitError(field, f"must be a finite number in {self.describe()}, got {value!r}")
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if too_low or too_high:
            raise LimitError(field, f"must be in {self.describe()}, got {value!r}")
        return value if self.kind == "int" else float(value)

    def parse(self, text: str, field: str) -> int | float:
        """A command-line string as a number of this kind, then checked (no "inf", "nan", "1e400")."""
        return self.check(self.read(text, field), field)

    def read(self, text: str, field: str) -> int | float:
        """A command-line string as a finite number of this kind, not yet checked against the bounds."""
        stripped = text.strip()
        noun = "a whole number" if self.kind == "int" else "a number"
        try:
            value: int | float = int(stripped) if self.kind == "int" else float(stripped)
        except ValueError:
            raise LimitError(field, f"expected {noun} in {self.describe()}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise LimitError(field, f"must be a finite number in {self.describe()}, got {text!r}")
        return value


def _show(number: float) -> str:
    """1e-08, 0.5, 4096, 2**31 - 1: short and exact."""
    if float(number).is_integer():
        whole = int(number)
        for offset, suffix in ((0, ""), (1, " - 1")):
            exponent = math.log2(whole + offset) if whole + offset > 0 else 0.5
            if whole >= 2**20 and exponent.is_integer():
                return f"2**{int(exponent)}{suffix}"
        return str(whole)
    return f"{number:g}"


INT32_MAX = 2**31 - 1  # ids and seeds fit PostgreSQL's integer


# --- backbones: a model config is checked against these before anything is built ------------------------

BACKBONE_CONFIG: dict[str, Range] = {
    "hidden_size": Range("int", 1, 16_384, doc="width of the hidden states"),
    "num_hidden_layers": Range("int", 1, 256, doc="transformer layers"),
    "num_attention_heads": Range("int", 1, 512, doc="attention heads"),
    "num_key_value_heads": Range("int", 1, 512, doc="key/value heads (grouped-query attention)"),
    "intermediate_size": Range("int", 1, 131_072, doc="width of the feed-forward layer"),
    "vocab_size": Range("int", 1, 1_048_576, doc="tokenizer vocabulary"),
    "max_position_embeddings": Range("int", 1, 1_048_576, doc="longest sequence the model takes"),
    "head_dim": Range("int", 1, 4_096, doc="width of one attention head, where the config sets it"),
    "type_vocab_size": Range("int", 1, 1_024, doc="token types (BERT's segment embeddings)"),
}
# fields every supported config has; the others are checked where present
REQUIRED_BACKBONE_CONFIG = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
MAX_BACKBONE_PARAMETERS = 20_000_000_000  # estimated from the config; PELT_MAX_BACKBONE_PARAMETERS lowers it
MAX_BACKBONE_CONFIG_BYTES = 1 << 20  # a model's config.json (real ones are a few KB)
# weight files may hold this many bytes per estimated parameter (fp32 is 4; a folder with both a
# .safetensors and a .bin copy 8), plus a fixed allowance for small extras
MAX_BACKBONE_WEIGHT_BYTES_PER_PARAMETER = 12
BACKBONE_WEIGHT_BYTES_ALLOWANCE = 64 << 20


# --- training hyperparameters (TrainConfig: `pelt train --set`, POST /v1/jobs and /v1/sweeps, workers) ----

MAX_TRAIN_STEPS = 10_000_000  # optimisation steps of one job: max_steps, or epochs x batches per epoch
SEED = Range("int", 0, INT32_MAX, doc="a job's random seed (a sweep: each of its seeds)")

TRAIN_RANGES: dict[str, Range] = {
    "learning_rate": Range("float", 0, 10, low_open=True, doc="peak learning rate of AdamW (`lr`)"),
    "epochs": Range("float", 0, 1_000, low_open=True, doc="passes over the training set (fractions allowed)"),
    "batch_size": Range("int", 1, 4_096, doc="training examples per step (`bs`)"),
    "eval_batch_size": Range("int", 1, 4_096, doc="examples per evaluation batch"),
    "seed": SEED,
    "k_shot": Range(
        "int", 1, INT32_MAX, doc="K training examples sampled by seed (`k`); at most the task's rows"
    ),
    "warmup_ratio": Range(
        "float", 0, 1, high_open=True, doc="share of the steps with a rising learning rate"
    ),
    "weight_decay": Range("float", 0, 10, doc="AdamW's decoupled weight decay"),
    "max_grad_norm": Range("float", 0, 1e6, low_open=True, doc="gradient clipping norm"),
    "max_length": Range("int", 1, 131_072, doc="tokens kept per example; at most the backbone's positions"),
    "max_steps": Range("int", 1, MAX_TRAIN_STEPS, doc="optimisation steps (instead of epochs)"),
    "head_dropout": Range("float", 0, 1, high_open=True, doc="dropout before the task head"),
    "dev_rows": Range(
        "int",
        1,
        INT32_MAX,
        doc="the study protocol's dev split: training rows held out by seed after the K rows; "
        "K + dev_rows at most the task's rows",
    ),
    "patience": Range(
        "int", 1, 10_000, doc="early stopping: dev evaluations without improvement (needs dev_rows)"
    ),
}


def check_train_steps(train_config: Mapping[str, Any], train_rows: int) -> int:
    """The job's optimisation steps (max_steps, else epochs x batches of its K or all training rows);
    a LimitError naming `epochs` when they exceed MAX_TRAIN_STEPS."""
    max_steps = train_config.get("max_steps")
    if max_steps is not None:
        return int(max_steps)
    rows = train_config.get("k_shot") or train_rows
    steps = math.ceil(
        float(train_config["epochs"]) * math.ceil(max(rows, 1) / int(train_config["batch_size"]))
    )
    if steps > MAX_TRAIN_STEPS:
        raise LimitError(
            "epochs",
            f"{train_config['epochs']!r} epochs of {rows} examples at batch_size "
            f"{train_config['batch_size']} make {steps:,} steps; at most {MAX_TRAIN_STEPS:,}",
        )
    return max(1, steps)


# --- method spec: every module of a method (POST /v1/methods, overrides such as r, bottleneck, q.size) -----

MAX_MODULES = 32  # modules of one method spec
SPEC_RANGES: dict[str, Range] = {
    "size": Range(
        "int",
        1,
        16_384,
        doc="LoRA rank (`r`), adapter width (`bottleneck`) or prefix length "
        "(`prefix_length`); the backbone bounds it further",
    ),
    "scale": Range("float", -10_000, 10_000, doc="s in h + s·Δh (composition `scaled`)"),
    "alpha": Range("float", 0, 1e6, low_open=True, doc="LoRA's α (s = α / r)"),
    "init_std": Range("float", 0, 100, low_open=True, doc="standard deviation of the initial weights"),
    "dropout": Range("float", 0, 1, high_open=True, doc="dropout on the module's input"),
    "layers": Range("int", 0, 1_023, doc="indices of the layers modified; below the backbone's layer count"),
    "reparam_hidden": Range("int", 1, 16_384, doc="width of prefix tuning's reparameterisation MLP"),
    "lr_multiplier": Range(
        "float", 0, 1_000, low_open=True, doc="the module's learning rate as a multiple of the job's"
    ),
}


# --- compose: options of POST /v1/compose (pelt_core.compose: merge, average, merge_lora_svd) -------------

MAX_COMPOSE_SOURCES = 32  # deltas one composition pulls
MAX_COMPOSE_ALIASES = 20  # aliases set on the composed version
COMPOSE_RANGES: dict[str, Range] = {
    "weights": Range("float", -100, 100, doc="one weight per source (merge, merge_lora_svd)"),
    "density": Range("float", 0, 1, low_open=True, doc="kept fraction: TIES trim, DARE keep probability"),
    "seed": Range("int", 0, INT32_MAX, doc="seed of DARE's drop masks"),
    "scale": Range("float", -100, 100, doc="λ, the merge's overall scale"),
    "lora_rank": Range(
        "int",
        1,
        16_384,
        doc="rank of composed LoRA modules (merge, average); at most the "
        "larger of min(d_in, d_out) of their matrices and the sources' summed rank",
    ),
    "rank": Range("int", 1, 16_384, doc="merge_lora_svd's rank; bounded like lora_rank"),
}


# --- sweeps ------------------------------------------------------------------------------------------------

SWEEP_LIST_LENGTH = 1_000  # entries of a sweep's methods, seeds or k_values lists
DEFAULT_MAX_SWEEP_JOBS = 2_000  # jobs of one sweep; PELT_MAX_SWEEP_JOBS changes it


# --- list answers ------------------------------------------------------------------------------------------

DEFAULT_COMPOSE_MEMORY_BYTES = (
    4 << 30
)  # PELT_COMPOSE_MEMORY_BYTES: one composition's estimated memory for its deltas
MAX_PAGE_LIMIT = 1_000  # rows of one list answer (GET /v1/jobs, /v1/audit: `limit`); clients page beyond it
MAX_PREDICT_ROWS = 256  # texts (or text pairs) of one prediction request; clients split larger inputs
MAX_PREDICT_TEXT_CHARS = 10_000  # characters of one text of a prediction request (a pair: each side)


# --- the backbone: ranges that depend on it, and a job's memory --------------------------------------------

UNKNOWN_MACHINE_MEMORY_BYTES = 8 << 30  # the budget where a machine's memory cannot be read at all
CGROUP_ROOT = Path("/sys/fs/cgroup")  # where cgroup v2 (and v1's memory/ controller) is mounted
_PROC_SELF_CGROUP = Path("/proc/self/cgroup")
_NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as a number near 2**63
_FLOAT = (
    4  # bytes: PELT parameters, their gradients, AdamW's moments and activations are fp32 (an upper bound)
)
_SQUARE_REPRESENTATIONS = ("attn", "ffn", "attn.q", "attn.k", "attn.v", "attn.o")


def _positive(facts: Mapping[str, Any], key: str) -> int | None:
    """A fact that is a whole number above 0 (None: unknown; facts may lack keys or hold None)."""
    value = facts.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def fitted_max_length(max_length: int, facts: Mapping[str, Any] | None) -> int:
    """Tokens kept per example: `max_length`, cut to the backbone's positions when its facts know them.
    The trainer and the registry (a task's default max_length) apply this one rule; a max_length the
    caller gives explicitly is refused above the positions instead (`check_against_backbone`)."""
    positions = _positive(facts or {}, "max_positions")
    return min(max_length, positions) if positions is not None else max_length


@dataclass(frozen=True)
class MemoryEstimate:
    """An upper bound on one job's memory, in bytes (fp32 throughout; bf16 autocast needs less)."""

    backbone: int  # the frozen weights (shared by a worker's jobs, counted once per job here)
    parameters: int  # the job's own parameters with their gradients and AdamW's two moments
    activations: int  # what a training step keeps for backward (or an evaluation batch, if larger)
    largest_module: str | None  # the role of the module with the most parameters

    @property
    def total(self) -> int:
        return self.backbone + self.parameters + self.activations


def estimate_job_memory(
    train_config: Mapping[str, Any], method_spec: Mapping[str, Any], facts: Mapping[str, int]
) -> MemoryEstimate:
    """One job's memory on a backbone (facts: hidden_size, num_layers, num_heads, intermediate_size,
    num_parameters), from its batch size, max_length and modules.

    Activations follow Korthikanti et al. (2022): per token and layer a transformer keeps about
    18·h + 4·f values plus 5·heads·(tokens + prefix) for attention, here in fp32; each bottleneck adds its
    width and output. An evaluation batch keeps one layer's working set. Parameters count 16 bytes each
    (weight, gradient, two AdamW moments)."""
    h, layers, heads = int(facts["hidden_size"]), int(facts["num_layers"]), int(facts["num_heads"])
    ffn = int(facts.get("intermediate_size") or 4 * h)
    tokens, batch = int(train_config["max_length"]), int(train_config["batch_size"])
    eval_batch = int(train_config.get("eval_batch_size") or batch)
    modules: Mapping[str, Mapping[str, Any]] = method_spec.get("modules") or {}
    kv = _kv_width(facts, h)
    per_module = {role: _module_parameters(module, h, ffn, kv, layers) for role, module in modules.items()}
    extras = h * h + 3 * h  # the task head
    extras += layers * (6 * h + ffn) if method_spec.get("bias") else 0
    extras += layers * 4 * h if method_spec.get("layer_norm") else 0
    fused_sites = _fused_sites(method_spec, layers)
    extras += fused_sites * (3 * h * h + 2 * h)  # AdapterFusion: query, key (with biases) and value per site
    prefix = max((int(m["size"]) for m in modules.values() if m.get("form") == "prefix"), default=0)
    per_token = layers * (18 * h + 4 * ffn + 5 * heads * (tokens + prefix))
    for module in modules.values():
        if module.get("form") != "prefix":
            d_out = _dims(str(module.get("representation")), h, ffn, kv)[1]
            width = 0 if module.get("form") == "dense" else 2 * int(module["size"])
            per_token += _sites(module, layers) * (width + d_out)
    per_token += fused_sites * (2 * len(modules) + 1) * h  # the members' keys and values, the query
    training = batch * tokens * per_token * _FLOAT
    evaluation = eval_batch * tokens * (4 * h + ffn + 2 * heads * (tokens + prefix)) * _FLOAT
    weight_bytes = 2 if train_config.get("backbone_dtype") == "bfloat16" else _FLOAT
    return MemoryEstimate(
        backbone=int(facts.get("num_parameters") or 0) * weight_bytes,
        parameters=4 * _FLOAT * (sum(per_module.values()) + extras),
        activations=max(training, evaluation),
        largest_module=max(per_module, key=per_module.__getitem__) if per_module else None,
    )


def check_against_backbone(
    train_config: Mapping[str, Any],
    method_spec: Mapping[str, Any],
    facts: Mapping[str, Any],
    *,
    memory_budget: int | None = None,
) -> None:
    """The ranges that depend on the backbone; a LimitError naming the field (`max_length`,
    `<method>.modules.<role>.size`, `...layers`, `batch_size`) when one is out of range.

    - max_length <= the backbone's positions;
    - a LoRA-like module (a linear bottleneck) has rank <= min(d_in, d_out) of the matrix it modifies
      (a larger rank adds nothing); a prefix <= the backbone's positions; layer indices < its layer count
      (an adapter's width is bounded by the table and the memory estimate only: the built-in parallel
      adapters are wider than small backbones);
    - with `memory_budget` (bytes): `estimate_job_memory` within it (else a MemoryBudgetError).
    `facts`: `pelt_core.backbones.backbone_facts` (hidden_size, num_layers, num_heads, num_kv_heads,
    head_dim, intermediate_size, max_positions, vocab_size, num_parameters); a fact that is missing or
    not a positive whole number skips the checks that need it.
    `train_config` and `method_spec` are TrainConfig.to_dict() and MethodSpec.to_dict() shaped mappings.
    """
    known = {key: value for key in facts if (value := _positive(facts, key)) is not None}
    positions, layers = known.get("max_positions"), known.get("num_layers")
    h, ffn = known.get("hidden_size"), known.get("intermediate_size")
    max_length = train_config.get("max_length")
    if positions is not None and isinstance(max_length, int) and max_length > positions:
        raise LimitError(
            "max_length", f"must be at most {positions}, the backbone's positions, got {max_length}"
        )
    name = method_spec.get("name") or "method"
    for role, module in (method_spec.get("modules") or {}).items():
        where = f"{name}.modules.{role}"
        size = int(module["size"])
        if module.get("form") == "dense":  # `size` is unused
            bound, what = None, ""
        elif module.get("form") == "prefix":
            bound, what = positions, "the backbone's positions"
        elif h is not None and module.get("nonlinearity") == "identity":
            d_in, d_out = _dims(str(module.get("representation")), h, ffn or 4 * h, _kv_width(known, h))
            bound, what = (
                min(d_in, d_out),
                f"min(d_in, d_out) = min({d_in}, {d_out}) of the matrix it modifies",
            )
        else:  # adapters may be wider than the backbone (He et al.'s 512 on MiniLM's 384): memory bounds them
            bound, what = None, ""
        if bound is not None and size > bound:
            raise LimitError(f"{where}.size", f"must be at most {bound}, {what}, got {size}")
        if layers is not None:
            beyond = [i for i in module.get("layers") or () if i >= layers]
            if beyond:
                raise LimitError(
                    f"{where}.layers",
                    f"layer {beyond[0]} does not exist: the backbone has {layers} layers (0 to {layers - 1})",
                )
    if memory_budget is not None:
        check_job_memory(train_config, method_spec, known, memory_budget)


def check_job_memory(
    train_config: Mapping[str, Any],
    method_spec: Mapping[str, Any],
    facts: Mapping[str, Any],
    memory_budget: int,
) -> MemoryEstimate | None:
    """`estimate_job_memory` within `memory_budget` bytes, else a MemoryBudgetError whose field names what
    to lower. The registry checks it at submission (`check_against_backbone`), and the worker that takes
    the job checks it again against its own machine's budget. Returns the estimate; None (nothing checked)
    when the facts lack hidden_size, num_layers or num_heads, or the config its max_length."""
    known = {key: value for key in facts if (value := _positive(facts, key)) is not None}
    needed = ("hidden_size", "num_layers", "num_heads")
    if not all(key in known for key in needed) or train_config.get("max_length") is None:
        return None
    estimate = estimate_job_memory(train_config, method_spec, known)
    if estimate.total <= memory_budget:
        return estimate
    name = method_spec.get("name") or "method"
    if estimate.backbone >= memory_budget:
        field = "backbone"
        halved = (
            ""
            if train_config.get("backbone_dtype") == "bfloat16"
            else "backbone_dtype=bfloat16 halves them; "
        )
        advice = (
            f"the backbone's weights alone need {_gib(estimate.backbone)}: {halved}a smaller backbone or a "
            "worker with more memory (PELT_WORKER_MEMORY_BYTES) would fit"
        )
    elif estimate.activations >= estimate.parameters or estimate.largest_module is None:
        field, advice = "batch_size", "lower batch_size, eval_batch_size or max_length"
    elif (method_spec.get("modules") or {})[estimate.largest_module].get("form") == "dense":
        field = "method"
        advice = (
            f"{name} trains dense deltas as large as the backbone's layers (each held four times: delta, "
            "gradient, two AdamW moments); a worker with more memory (PELT_WORKER_MEMORY_BYTES) or a "
            "parameter-efficient method would fit"
        )
    else:
        field, advice = f"{name}.modules.{estimate.largest_module}.size", "make the largest module smaller"
    raise MemoryBudgetError(
        field,
        f"the job would need about {_gib(estimate.total)} (backbone {_gib(estimate.backbone)}, "
        f"its parameters with optimizer state {_gib(estimate.parameters)}, activations "
        f"{_gib(estimate.activations)}), more than a worker's {_gib(memory_budget)}: {advice}",
    )


def _dims(representation: str, hidden: int, ffn: int, kv: int) -> tuple[int, int]:
    """(d_in, d_out) of what a module modifies; kv: the width of the key/value projections."""
    if representation == "ffn.in":
        return hidden, ffn
    if representation == "ffn.out":
        return ffn, hidden
    if representation in ("attn.k", "attn.v"):
        return hidden, kv
    return hidden, hidden


def _kv_width(facts: Mapping[str, int], hidden: int) -> int:
    """num_kv_heads x head_dim where the facts have them (grouped-query attention), else the hidden size."""
    kv_heads, head_dim = facts.get("num_kv_heads"), facts.get("head_dim")
    return int(kv_heads) * int(head_dim) if kv_heads and head_dim else hidden


def _fused_sites(method_spec: Mapping[str, Any], num_layers: int) -> int:
    """The sub-layers an AdapterFusion attends at (one per representation and layer its modules use); 0
    for any other method."""
    if not method_spec.get("fusion"):
        return 0
    sites = set()
    for module in (method_spec.get("modules") or {}).values():
        chosen = module.get("layers")
        for layer in set(chosen) if chosen else range(num_layers):
            sites.add((module.get("representation"), layer))
    return len(sites)


def _sites(module: Mapping[str, Any], num_layers: int) -> int:
    chosen = module.get("layers")
    return len(set(chosen)) if chosen else num_layers


def _module_parameters(module: Mapping[str, Any], hidden: int, ffn: int, kv: int, num_layers: int) -> int:
    size, sites = int(module["size"]), _sites(module, num_layers)
    gate = hidden + 1 if module.get("gate") else 0
    if module.get("form") == "prefix":
        count = sites * (2 * size * kv + gate)
        reparam = module.get("reparam_hidden")
        if reparam:
            count += size * hidden + (hidden + 1) * reparam + (reparam + 1) * sites * 2 * kv
        return count
    d_in, d_out = _dims(str(module.get("representation")), hidden, ffn, kv)
    if module.get("form") == "dense":  # the weight's whole shape
        return sites * (d_in * d_out + gate + 1)
    biases = size + d_out if module.get("proj_bias", True) else 0
    return sites * (d_in * size + size * d_out + biases + gate + 1)


def _gib(count: int) -> str:
    return f"{count / (1 << 30):.1f} GiB"


def machine_memory_bytes() -> int:
    """The memory this process may use, in bytes: the least of the machine's physical memory, its cgroup's
    memory limit (`cgroup_memory_limit`) and its address-space limit (RLIMIT_AS) where one is set.
    PELT_WORKER_MEMORY_BYTES's default on the API host, and a worker's budget on its own host (a few small
    reads; UNKNOWN_MACHINE_MEMORY_BYTES where none of them can be read)."""
    bounds = [
        bound
        for bound in (physical_memory_bytes(), cgroup_memory_limit(), address_space_limit())
        if bound is not None
    ]
    return min(bounds, default=UNKNOWN_MACHINE_MEMORY_BYTES)


def physical_memory_bytes() -> int | None:
    """The machine's physical memory (SC_PHYS_PAGES x SC_PAGE_SIZE); None where the system does not say."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def address_space_limit() -> int | None:
    """This process's RLIMIT_AS (the soft limit) in bytes; None when it has none."""
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else soft


def cgroup_memory_limit(root: Path = CGROUP_ROOT, membership: Path = _PROC_SELF_CGROUP) -> int | None:
    """The lowest memory limit of this process's cgroup and the cgroups above it, in bytes: cgroup v2's
    memory.max under `root`, or v1's memory.limit_in_bytes under `root`/memory; None when there is none
    (no cgroup file, "max", or v1's no-limit value). `membership`: /proc/self/cgroup."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    places: list[tuple[Path, str]] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            places.append((root / path.lstrip("/"), "memory.max"))
        elif "memory" in controllers.split(","):
            places.append((root / "memory" / path.lstrip("/"), "memory.limit_in_bytes"))
    places += [(root, "memory.max"), (root / "memory", "memory.limit_in_bytes")]
    limits = []
    for folder, name in places:
        for level in (folder, *folder.parents):
            limit = _read_limit(level / name)
            if limit is not None:
                limits.append(limit)
            if level == root:
                break
    return min(limits, default=None)


def _read_limit(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not text.isdigit():  # "max": no limit
        return None
    value = int(text)
    return value if 0 < value < _NO_LIMIT else None


# --- uploaded datasets: rows, decoded bytes, archives, JSON nesting, the held-out dev split ----------------

MAX_DATASET_ROWS = 5_000_000  # rows of one split (GLUE's largest are ~400k); PELT_MAX_DATASET_ROWS changes it
MAX_DATASET_BYTES = (
    4 << 30
)  # decoded bytes of a task's data (unpacked archive, decoded Parquet); PELT_MAX_DATASET_BYTES
MAX_ARCHIVE_ENTRIES = 1_000  # files and folders of one dataset archive; PELT_MAX_ARCHIVE_ENTRIES changes it
MAX_ARCHIVE_EXPANSION = (
    50  # unpacked bytes per archive byte (save_to_disk folders zip 2-5x); PELT_MAX_ARCHIVE_EXPANSION
)
ARCHIVE_EXPANSION_FLOOR_BYTES = (
    16 << 20
)  # a small archive may always unpack to this much (tar headers, padding)
MAX_JSON_DEPTH = 32  # nesting of a JSON request body or form field (real ones nest 3-4 deep)
MAX_JSON_ROW_DEPTH = 64  # nesting of one JSON Lines row of task data (pyarrow's reader crashes near 20,000)
MAX_LABEL_CHARS = 1_000  # characters of one class label (a class name)
DEV_SPLIT_FRACTION = (
    0.1  # a task without a validation split: each job holds out this share of its training rows
)
DEV_SPLIT_MAX_ROWS = 1_000  # ... at most this many (and at least one)


def dev_split_rows(train_rows: int) -> int:
    """Rows a job of a task without a validation split holds out from its `train_rows` training rows as
    its dev split: 10% (rounded down) capped at 1,000, at least 1. Needs `train_rows` >= 2."""
    return max(1, min(DEV_SPLIT_MAX_ROWS, int(train_rows * DEV_SPLIT_FRACTION)))


# --- reading uploads: tar headers, the probe's memory and concurrency ---------------------------------------

# bytes of tar headers that are not one plain 512-byte header per entry (pax records, GNU long names):
# tarfile reads such a record whole into memory, so it is refused past this while it is read
MAX_TAR_HEADER_BYTES = 1 << 20
# the probe memory-maps a split whole: its child's default address space is PELT_MAX_DATASET_BYTES plus this
DATASET_PROBE_MEMORY_HEADROOM_BYTES = 2 << 30
DEFAULT_DATASET_PROBE_CONCURRENCY = (
    2  # uploads whose data are checked at once; PELT_DATASET_PROBE_CONCURRENCY
)


__all__ = [
    "ARCHIVE_EXPANSION_FLOOR_BYTES",
    "BACKBONE_CONFIG",
    "BACKBONE_WEIGHT_BYTES_ALLOWANCE",
    "CGROUP_ROOT",
    "COMPOSE_RANGES",
    "DATASET_PROBE_MEMORY_HEADROOM_BYTES",
    "DEFAULT_COMPOSE_MEMORY_BYTES",
    "DEFAULT_DATASET_PROBE_CONCURRENCY",
    "DEFAULT_MAX_SWEEP_JOBS",
    "DEV_SPLIT_FRACTION",
    "DEV_SPLIT_MAX_ROWS",
    "INT32_MAX",
    "MAX_ARCHIVE_ENTRIES",
    "MAX_ARCHIVE_EXPANSION",
    "MAX_BACKBONE_CONFIG_BYTES",
    "MAX_BACKBONE_PARAMETERS",
    "MAX_BACKBONE_WEIGHT_BYTES_PER_PARAMETER",
    "MAX_COMPOSE_ALIASES",
    "MAX_COMPOSE_SOURCES",
    "MAX_DATASET_BYTES",
    "MAX_DATASET_ROWS",
    "MAX_JSON_DEPTH",
    "MAX_MODULES",
    "MAX_PAGE_LIMIT",
    "MAX_PREDICT_ROWS",
    "MAX_PREDICT_TEXT_CHARS",
    "MAX_TAR_HEADER_BYTES",
    "MAX_TRAIN_STEPS",
    "REQUIRED_BACKBONE_CONFIG",
    "SEED",
    "SPEC_RANGES",
    "SWEEP_LIST_LENGTH",
    "TRAIN_RANGES",
    "UNKNOWN_MACHINE_MEMORY_BYTES",
    "LimitError",
    "MemoryBudgetError",
    "MemoryEstimate",
    "Range",
    "address_space_limit",
    "cgroup_memory_limit",
    "check_against_backbone",
    "check_job_memory",
    "check_train_steps",
    "dev_split_rows",
    "estimate_job_memory",
    "fitted_max_length",
    "machine_memory_bytes",
    "physical_memory_bytes",
]
