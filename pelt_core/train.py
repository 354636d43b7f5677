"""Train one PELT job: one readable function, no framework.

AdamW over the job's own parameters only, linear warmup then linear decay, length-grouped batches with
dynamic padding, bf16 autocast where the hardware has fast bf16, evaluation after every epoch.
A progress callback sees (step, total, loss, tokens/s); a stop flag is checked between steps.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from pelt_core.backbones import Backbone
from pelt_core.config import ConfigError, TrainConfig
from pelt_core.data import (
    Encoded,
    TaskFields,
    encode,
    infer_task_fields,
    iterate,
    length_grouped_batches,
    sample_k_shot,
)
from pelt_core.limits import LimitError, check_train_steps, fitted_max_length
from pelt_core.metrics import compute_metrics
from pelt_core.model import JobDelta, PeltModel
from pelt_core.predictions import evaluating
from pelt_core.spec import MethodSpec


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
    metrics: dict[str, float]  # final evaluation (empty without evaluation data)
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per epoch
    steps: int = 0
    train_seconds: float = 0.0  # optimisation steps only (evaluation excluded)
    eval_seconds: float = 0.0
    train_tokens: int = 0
    tokens_per_second: float = 0.0
    peak_memory_bytes: int = 0
    parameter_counts: dict[str, int] = field(default_factory=dict)
    trainable_percent: float = 0.0
    gate_values: dict[str, float] = field(default_factory=dict)
    bf16: bool = False


def bf16_available(device: torch.device) -> bool:
    """Whether bf16 autocast makes training faster here.

    On CPUs only AMX pays: with AVX512-BF16 alone, bf16 matmuls measured about half as fast as fp32
    (84 vs 162 GFLOP/s on one core; benchmarks/bench_pelt_core.py prints both peaks).
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


@torch.no_grad()
def evaluate(
    model: PeltModel, data: Encoded, task: TaskFields, batch_size: int, use_bf16: bool
) -> dict[str, float]:
    """Metrics (and mean loss) over a whole split, in sorted-length batches."""
    device = next(model.parameters()).device
    pad_id = model.backbone.tokenizer.pad_token_id
    logits_all, labels_all, loss_sum = [], [], 0.0
    with evaluating(model):
        for batch in iterate(
            data, length_grouped_batches(data.lengths, batch_size, 0, shuffle=False), pad_id
        ):
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch.pop("labels")
            with autocast_context(device, use_bf16):
                logits = model(**batch)
            loss_sum += float(loss_fn(task.problem_type, logits, labels)) * len(labels)
            logits_all.append(logits.float().cpu().numpy())
            labels_all.append(labels.cpu().numpy())
    metrics = compute_metrics(task.problem_type, np.concatenate(logits_all), np.concatenate(labels_all))
    metrics["loss"] = loss_sum / max(len(data), 1)
    return metrics


def train(
    backbone: Backbone,
    method: MethodSpec,
    train_data,
    eval_data=None,
    config: TrainConfig | None = None,
    task: TaskFields | None = None,
    progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_epoch_end: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train `method` on `train_data` (a datasets.Dataset) over the frozen `backbone`; returns the delta.

    Raises TrainingError on a NaN/inf loss and TrainingCancelled when `should_stop()` turns true.
    """
    config = config or TrainConfig()
    config.validate()
    task = task or infer_task_fields(train_data)
    train_data = sample_k_shot(train_data, config.k_shot, config.seed)
    device = next(backbone.model.parameters()).device
    use_bf16 = config.bf16 == "true" or (config.bf16 == "auto" and bf16_available(device))

    # -- the job's own modules on the shared backbone, the data, the optimiser and its schedule -----------
    delta = new_delta(backbone, method, task, config).to(device)
    model = PeltModel(backbone, delta)
    parameters = [p for p in delta.parameters() if p.requires_grad]
    train_set, eval_set = encode_splits(backbone, task, config, train_data, eval_data)
    steps_per_epoch = math.ceil(len(train_set) / config.batch_size)
    total_steps = total_train_steps(config, len(train_set))
    learning_rate = config.resolved_learning_rate(method.defaults)
    optimizer = torch.optim.AdamW(
        parameters, lr=learning_rate, weight_decay=config.weight_decay, fused=device.type in ("cpu", "cuda")
    )
    lr_at = linear_schedule(learning_rate, int(config.warmup_ratio * total_steps), total_steps)

    # -- the loop -----------------------------------------------------------------------------------------
    history: list[dict[str, Any]] = []
    step, epoch, tokens, eval_seconds, started = 0, 0, 0, 0.0, time.perf_counter()
    model.train()
    while step < total_steps:
        batches = length_grouped_batches(train_set.lengths, config.batch_size, config.seed * 1000 + epoch)
        for batch in iterate(train_set, batches, backbone.tokenizer.pad_token_id):
            if should_stop is not None and should_stop():
                raise TrainingCancelled(f"stopped at step {step} of {total_steps}")
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch.pop("labels")
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            with autocast_context(device, use_bf16):
                logits = model(**batch)
            loss = loss_fn(task.problem_type, logits, labels)
            if not torch.isfinite(loss):
                raise TrainingError(
                    f"loss became {loss.item()} at step {step} (epoch {epoch}); "
                    f"try a lower learning rate than {learning_rate:g}"
                )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += int(batch["attention_mask"].sum())
            if progress is not None:
                speed = tokens / max(time.perf_counter() - started - eval_seconds, 1e-9)
                progress(
                    Progress(step, total_steps, step / steps_per_epoch, loss.item(), speed, lr_at(step - 1))
                )
            if step >= total_steps:
                break
        epoch += 1
        if eval_set is not None and (config.eval_every_epoch or step >= total_steps):
            eval_started = time.perf_counter()
            scores = evaluate(model, eval_set, task, config.eval_batch_size, use_bf16)
            record = {"epoch": epoch, "step": step, **scores}
            eval_seconds += time.perf_counter() - eval_started
            history.append(record)
            if on_epoch_end is not None:
                on_epoch_end(record)
    train_seconds = time.perf_counter() - started - eval_seconds  # optimisation time only

    model.eval()
    return finished_result(
        delta, task, backbone, history, step, tokens, train_seconds, eval_seconds, use_bf16
    )


# --------------------------------------------------------------------------------------------------
# Set-up and accounting around the loop
# --------------------------------------------------------------------------------------------------
def new_delta(backbone: Backbone, method: MethodSpec, task: TaskFields, config: TrainConfig) -> JobDelta:
    """The job's freshly initialised modules and head (seeded by `config.seed`), on the CPU."""
    pooling = config.pooling if config.pooling != "auto" else ("last" if backbone.arch.is_decoder else "mean")
    torch.manual_seed(config.seed)
    return JobDelta(
        method, backbone, task.num_labels, task.problem_type, pooling, config.head_dropout, task.label_names
    )


def encode_splits(
    backbone: Backbone, task: TaskFields, config: TrainConfig, train_data, eval_data
) -> tuple[Encoded, Encoded | None]:
    """Training and evaluation data tokenised once (padded per batch later), cut to the backbone's positions
    as the service does."""
    max_length = fitted_max_length(config.max_length, backbone.facts)
    train_set = encode(train_data, backbone.tokenizer, task, max_length, where="training data")
    if eval_data is None:
        return train_set, None
    return train_set, encode(eval_data, backbone.tokenizer, task, max_length, where="evaluation data")


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
) -> TrainResult:
    """A finished run's result: the last evaluation's metrics, the delta's sizes and gates, speed, memory."""
    metrics = {k: v for k, v in history[-1].items() if k not in ("epoch", "step")} if history else {}
    counts = delta.parameter_counts()
    return TrainResult(
        delta=delta,
        task=task,
        metrics=metrics,
        history=history,
        steps=steps,
        train_seconds=train_seconds,
        eval_seconds=eval_seconds,
        train_tokens=tokens,
        tokens_per_second=tokens / max(train_seconds, 1e-9),
        peak_memory_bytes=peak_memory_bytes(next(delta.parameters()).device),
        parameter_counts=counts,
        trainable_percent=100.0 * counts["pelt"] / backbone.num_parameters,
        gate_values=delta.gate_values(),
        bf16=bf16,
    )
