"""What the training loop stands on: its errors, progress reports and result, the loss, the learning-rate
schedule, a job's fresh delta and encoded data, and the accounting of a finished run (pelt_core.pack
runs the loop; pelt_core.train.train is its one-job form)."""

from __future__ import annotations

import contextlib
import resource
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

from pelt_core.backbones import Backbone
from pelt_core.config import ConfigError, TrainConfig
from pelt_core.data import DataError, Encoded, TaskFields, encode
from pelt_core.limits import LimitError, check_train_steps, fitted_max_length
from pelt_core.methods.fusion import fusion_weights, load_sources
from pelt_core.model import JobDelta
from pelt_core.spec import MethodSpec
from pelt_core.vocabulary import canonical_metric, metric_direction

_INIT_LOCK = threading.Lock()  # torch's global generator seeds one job's initialisation at a time


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss became NaN or infinite)."""


class TrainingCancelled(RuntimeError):
    """The stop flag was raised; no delta should be kept."""


@dataclass
class Progress:
    step: int
    total_steps: int
    epoch: float
    loss: float
    tokens_per_second: float
    learning_rate: float


@dataclass
class TrainResult:
    delta: JobDelta
    task: TaskFields
    # the last evaluation (empty without evaluation data); under the study protocol (`dev_rows`) the test
    # set's, evaluated with the best checkpoint (the best dev evaluation's when there is no test set; empty
    # when the job left its test set out: `evaluate_test=false`)
    metrics: dict[str, float]
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per epoch (the dev split's)
    # the protocol's best dev evaluation, with its "epoch" and "step" (empty without the protocol)
    dev_metrics: dict[str, float] = field(default_factory=dict)
    stopped_early: bool = False  # the protocol's patience ran out before the last step
    steps: int = 0
    train_seconds: float = 0.0  # optimisation steps only (evaluation excluded)
    eval_seconds: float = 0.0
    train_tokens: int = 0
    tokens_per_second: float = 0.0
    peak_memory_bytes: int = (
        0  # the process's peak on its device (on a GPU: its pack's, since the pack started)
    )
    job_memory_bytes: int = 0  # this job's own parameters, gradients and optimizer state on the device
    device: str = "cpu"  # where it trained, e.g. "cpu" or "cuda:0 (NVIDIA H100 80GB HBM3)"
    parameter_counts: dict[str, int] = field(default_factory=dict)
    trainable_percent: float = 0.0
    gate_values: dict[str, float] = field(default_factory=dict)
    fusion_weights: dict[str, float] = field(default_factory=dict)  # a fusion's mean attention per adapter
    bf16: bool = False


def bf16_available(device: torch.device) -> bool:
    """Whether bf16 autocast makes training faster here.

    On CPUs only with AMX. With AVX512-BF16 alone, machines of one kind disagreed (an EPYC's bf16 matmul
    peak was about 4x its fp32 one, an earlier Xeon's bf16 was slower) and no whole bf16 training step there
    has been measured (benchmarks/README.md; benchmarks/bench_pelt_core.py prints both peaks), so autocast
    stays off there.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def autocast_context(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def loss_fn(problem_type: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits, labels)
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels.float())
    return F.mse_loss(logits.squeeze(-1), labels.float())


# --------------------------------------------------------------------------------------------------
# Set-up and accounting around the loop
# --------------------------------------------------------------------------------------------------
def new_delta(
    backbone: Backbone,
    method: MethodSpec,
    task: TaskFields,
    config: TrainConfig,
    sources: Mapping[str, JobDelta] | None = None,
) -> JobDelta:
    """The job's freshly initialised modules and head (seeded by `config.seed`), on the CPU; a fusion's
    frozen adapters copied from `sources` (its source deltas by sha256, `pelt_core.methods.fusion`)."""
    pooling = config.pooling if config.pooling != "auto" else ("last" if backbone.arch.is_decoder else "mean")
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):  # jobs set up in several threads: each by its seed
        torch.manual_seed(config.seed)
        delta = JobDelta(
            method,
            backbone,
            task.num_labels,
            task.problem_type,
            pooling,
            config.head_dropout,
            task.label_names,
        )
    delta.text_fields = tuple(task.text_fields)  # kept in its manifest: pairs in, pairs at prediction
    if method.fusion is not None:
        load_sources(delta, sources or {})
    elif sources:
        raise ConfigError(f"method {method.name!r} is not a fusion: it takes no source deltas")
    return delta


def scale_regression_targets(delta: JobDelta, task: TaskFields, train_set: Encoded) -> None:
    """A regression head trains on standardized targets: the training labels' mean and standard deviation
    (1 when they are all equal) go to its head (`pelt_core.model.Head`), so it starts at the mean and learns
    at the labels' scale whatever their units. Classification heads are left as they are. A label that is
    not a finite number is a DataError naming it, before any step."""
    if task.problem_type != "regression" or len(train_set) == 0:
        return
    labels = torch.as_tensor(train_set.labels, dtype=torch.float64).reshape(len(train_set), -1)[:, 0]
    bad = torch.nonzero(~torch.isfinite(labels)).flatten()
    if len(bad):
        first = int(bad[0])
        raise DataError(
            f"label field {task.label_field!r}: regression labels must be finite numbers; {len(bad)} of the "
            f"{len(labels)} training rows are not (the first: row {first} of the training sample, "
            f"{float(labels[first])})"
        )
    mean = float(labels.mean())
    std = float(labels.std(unbiased=False)) if len(labels) > 1 else 0.0
    delta.head.set_target_scaling(mean, std if std > 1e-8 else 1.0)


def encode_split(
    backbone: Backbone, task: TaskFields, config: TrainConfig, data, where: str
) -> Encoded | None:
    """A split tokenised once (padded per batch later), cut to the backbone's positions as the service
    does; None for no data. `where` names the split in errors ("training data")."""
    if data is None:
        return None
    max_length = fitted_max_length(config.max_length, backbone.facts)
    return encode(data, backbone.tokenizer, task, max_length, where=where)


class Selection:
    """The study protocol's model selection: the best checkpoint by `metric` on the dev split, kept as a
    copy of the job's tensors, and early stopping after `patience` evaluations without improvement."""

    def __init__(self, metric: str, patience: int | None):
        self.metric = canonical_metric(metric)
        self.sign = 1.0 if metric_direction(self.metric) == "max" else -1.0
        self.patience = patience
        self.best: dict[str, Any] | None = None  # the best dev evaluation's record
        self.stale = 0  # evaluations since the best
        self.stopped_early = False
        self._state: dict[str, torch.Tensor] | None = None

    def observe(self, record: dict[str, Any], delta: JobDelta) -> bool:
        """Take one dev evaluation; keeps the delta's tensors when it is the best so far (the first of
        equal ones). Returns True when training should stop early."""
        if self.metric not in record:
            raise TrainingError(
                f"the dev evaluation has no {self.metric!r} to select the best checkpoint by "
                f"(it has {', '.join(k for k in record if k not in ('epoch', 'step'))})"
            )
        value = float(record[self.metric])
        if self.best is None or self.sign * value > self.sign * float(self.best[self.metric]):
            self.best, self.stale = record, 0
            # kept in host memory: on a GPU a full fine-tuning job's copy would take device memory
            self._state = {name: t.detach().to("cpu", copy=True) for name, t in delta.state_dict().items()}
            return False
        self.stale += 1
        self.stopped_early = self.patience is not None and self.stale >= self.patience
        return self.stopped_early

    def restore(self, delta: JobDelta) -> None:
        """The best checkpoint's tensors back into the delta (nothing when nothing was evaluated)."""
        if self._state is not None:
            delta.load_state_dict(self._state)


def total_train_steps(config: TrainConfig, train_rows: int) -> int:
    """Optimisation steps over the K-shot sample already drawn, within the limits (a ConfigError if not)."""
    try:
        return check_train_steps({**config.to_dict(), "k_shot": None}, train_rows)
    except LimitError as exc:
        raise ConfigError(str(exc)) from None


def linear_schedule(learning_rate: float, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The learning rate at each step: linear warmup over `warmup_steps`, then linear decay to 0."""

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return learning_rate * (step + 1) / warmup_steps
        return learning_rate * max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return lr_at


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process on `device` (CUDA allocator peak; on the CPU the max RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def job_memory_bytes(delta: JobDelta, optimizer: torch.optim.Optimizer) -> int:
    """A job's own bytes on its device: its delta's tensors, a gradient per trainable one (alive during each
    step) and the optimizer's state (AdamW: two moments per trainable value). The shared backbone and the
    activations are not counted."""
    tensors = [*delta.parameters(), *delta.buffers()]
    tensors += [p for p in delta.parameters() if p.requires_grad]  # their gradients' size
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def device_label(device: torch.device) -> str:
    """ "cpu", or a GPU's index and name: "cuda:0 (NVIDIA H100 80GB HBM3)"."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def finished_result(
    delta: JobDelta,
    task: TaskFields,
    backbone: Backbone,
    history: list[dict[str, Any]],
    steps: int,
    tokens: int,
    train_seconds: float,
    eval_seconds: float,
    bf16: bool,
    optimizer: torch.optim.Optimizer,
    selection: Selection | None = None,
    test_metrics: dict[str, float] | None = None,
    test_left_out: bool = False,
) -> TrainResult:
    """A finished run's result: the last evaluation's metrics (the protocol's: the test set's, else its best
    dev evaluation's; none when `test_left_out`), the delta's sizes and gates, speed, memory."""
    last = selection.best if selection is not None and selection.best is not None else None
    last = last or (history[-1] if history else {})
    if test_left_out:
        metrics = {}
    else:
        metrics = test_metrics or {k: v for k, v in last.items() if k not in ("epoch", "step")}
    dev_metrics = dict(selection.best) if selection is not None and selection.best is not None else {}
    counts = delta.parameter_counts()
    device = next(delta.parameters()).device
    return TrainResult(
        delta=delta,
        task=task,
        metrics=metrics,
        history=history,
        dev_metrics=dev_metrics,
        stopped_early=selection is not None and selection.stopped_early,
        steps=steps,
        train_seconds=train_seconds,
        eval_seconds=eval_seconds,
        train_tokens=tokens,
        tokens_per_second=tokens / max(train_seconds, 1e-9),
        peak_memory_bytes=peak_memory_bytes(device),
        job_memory_bytes=job_memory_bytes(delta, optimizer),
        device=device_label(device),
        parameter_counts=counts,
        trainable_percent=100.0 * counts["trained"] / backbone.num_parameters,  # a fusion's sources left out
        gate_values=delta.gate_values(),
        fusion_weights=fusion_weights(delta),
        bf16=bf16,
    )
