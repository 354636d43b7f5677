"""A pack: several jobs train together through one frozen backbone, one forward and one backward per step.

Each step takes every training member's next micro-batch (its own K-shot sample, seed, batch size and
schedule), puts the rows into as few forwards as keep padding and activations small (`length_groups`),
runs them through the shared backbone with every row going through its own job's modules
(`pelt_core.runtime` routes), takes each job's loss on its own rows and sums a forward's losses for one
backward, then steps each job's own optimizer with its own learning rate and gradient clipping. Members that reached an evaluation point evaluate their dev split
in shared no-grad passes of the same step, one chunk per step, while the others go on training.

Members join (`Pack.join`) and leave between steps: a job leaves when it finishes, is stopped, or fails
(a non-finite loss, an error in its own forward); its pack-mates go on. A job's result does not depend on
its pack-mates: rows never mix inside the backbone, its gradients come from its own loss only, and its
dropout masks come from its own generator (with dropout off it equals the job trained alone to fp32
tolerance: tests/core/test_pack.py). `pelt_core.train.train` is a pack of one.

A job with `dev_rows` follows UniPELT's low-resource protocol: its dev split (drawn from the training
rows by seed) is evaluated every epoch, its best checkpoint by the task's metric is kept, `patience`
evaluations without improvement stop it early, and its evaluation data, evaluated once with the best
checkpoint, is its test set (left out with `evaluate_test=false`: a search's early rungs, ranked on dev).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from pelt_core.backbones import Backbone
from pelt_core.config import TrainConfig
from pelt_core.data import (
    Encoded,
    TaskFields,
    collate,
    infer_task_fields,
    length_grouped_batches,
    sample_k_shot,
    sample_study_split,
)
from pelt_core.devices import DeviceOutOfMemory, free_cached_memory, is_out_of_memory, reset_peak_memory
from pelt_core.methods.fusion import value_penalty
from pelt_core.metrics import DEFAULT_METRIC, compute_metrics
from pelt_core.model import JobDelta, PeltModel
from pelt_core.spec import MethodSpec
from pelt_core.train_setup import (
    Progress,
    Selection,
    TrainingCancelled,
    TrainingError,
    TrainResult,
    autocast_context,
    bf16_available,
    encode_split,
    finished_result,
    linear_schedule,
    loss_fn,
    new_delta,
    scale_regression_targets,
    total_train_steps,
)

# Rows of several jobs share one batch while padding them to the longest costs at most this much more
# than padding each job's rows to its own longest; beyond it they go in separate forwards of the same step.
PADDING_SLACK = 1.25
# Padded tokens per forward (training; evaluation keeps no activations for a backward and takes 4x): on a
# CPU, a pack of 8 MiniLM jobs trained at 0.71x its jobs' own speed with 4096, 0.92x with 2048 and 1.00x with
# 1024 (activations outgrowing the caches; benchmarks/bench_packs.py, AMD EPYC); a GPU wants big matrices.
FORWARD_TOKENS = {"cpu": 1024, "cuda": 65536}
EVAL_FORWARD_FACTOR = 4
# After a step runs out of device memory, forwards hold half as many tokens (not fewer than this) from then on.
MIN_FORWARD_TOKENS = 256
DROPOUT_SEED_OFFSET = 7_919  # a job's dropout generator: seeded from its seed, apart from its init seed


@dataclass
class PackMember:
    """One job in a pack: its modules, data, optimiser and schedule, and where it is."""

    key: str
    method: MethodSpec
    task: TaskFields
    config: TrainConfig
    delta: JobDelta
    train_set: Encoded
    eval_set: Encoded | None  # evaluated every epoch: the dev split (or the only evaluation data)
    test_set: Encoded | None  # the protocol's test set: evaluated once, with the best checkpoint
    selection: Selection | None  # the protocol's best checkpoint and early stopping
    optimizer: torch.optim.Optimizer
    parameters: list[torch.nn.Parameter]
    lr_at: Callable[[int], float]
    learning_rate: float
    total_steps: int
    steps_per_epoch: int
    progress: Callable[[Progress], None] | None = None
    should_stop: Callable[[], bool] | None = None
    on_epoch_end: Callable[[dict[str, Any]], None] | None = None
    step: int = 0
    epoch: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    result: TrainResult | None = None
    error: BaseException | None = None
    _batches: Iterator[list[int]] | None = None
    _eval_chunks: list[list[int]] | None = None  # what is left of the running evaluation
    _eval_on: Encoded | None = None  # the split it evaluates: eval_set, or test_set at the end
    _eval_outputs: list[tuple[np.ndarray, np.ndarray, float]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def evaluating(self) -> bool:
        return self._eval_chunks is not None

    def next_batch(self) -> list[int]:
        """The indices of this job's next training micro-batch (a new epoch's order when one ends)."""
        while True:
            if self._batches is None:
                seed = self.config.seed * 1000 + self.epoch
                self._batches = iter(
                    length_grouped_batches(self.train_set.lengths, self.config.batch_size, seed)
                )
            indices = next(self._batches, None)
            if indices is not None:
                return indices
            self._batches = None

    def epoch_ended(self) -> bool:
        """After a step: whether that step ended an epoch (or the run)."""
        return self.step >= self.total_steps or self.step % self.steps_per_epoch == 0


class Pack:
    """Jobs training together on one frozen backbone (see the module docstring)."""

    def __init__(self, backbone: Backbone, forward_tokens: int | None = None):
        self.backbone = backbone
        self.device = next(backbone.model.parameters()).device
        # padded tokens one forward may hold (its rows' activations stay alive until its backward)
        self.forward_tokens = forward_tokens or FORWARD_TOKENS.get(self.device.type, FORWARD_TOKENS["cuda"])
        self.model = PeltModel(backbone, {})
        self.members: list[PackMember] = []
        self.use_bf16: bool | None = None  # decided by the first member; every member must agree
        self.steps = 0  # pack steps taken
        self.job_steps = 0  # steps its members took, counted per member (> steps: they shared passes)
        self.out_of_memory = 0  # steps that ran out of device memory together (then redone in smaller pieces)
        self._joined = 0
        self._fused_out_of_memory = False

    def __len__(self) -> int:
        return len(self.members)

    def join(
        self,
        method: MethodSpec,
        train_data,
        eval_data=None,
        config: TrainConfig | None = None,
        task: TaskFields | None = None,
        progress: Callable[[Progress], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_epoch_end: Callable[[dict[str, Any]], None] | None = None,
        metric: str | None = None,
        sources: Mapping[str, JobDelta] | None = None,
    ) -> PackMember:
        """Add a job; it trains from the next step. Raises (ConfigError, DataError, SpecError, ...) for a
        job that cannot start; the pack is unchanged then. `metric`: what the protocol (`dev_rows`)
        selects the best checkpoint by (None: the problem type's default). `sources`: a fusion's source
        deltas by sha256 (`pelt_core.methods.fusion`)."""
        config = config or TrainConfig()
        config.validate()
        use_bf16 = wants_bf16(config, self.backbone)
        if self.members and use_bf16 != self.use_bf16:
            raise ValueError(
                "a pack trains in one precision: this job's bf16 setting differs from its pack's"
            )
        task = task or infer_task_fields(train_data)
        test_data, selection = None, None
        if config.dev_rows is not None:  # the study protocol: the evaluation data is the test set
            test_data = eval_data if config.evaluate_test else None
            train_data, eval_data = sample_study_split(
                train_data, config.k_shot, config.dev_rows, config.seed
            )
            selection = Selection(metric or DEFAULT_METRIC[task.problem_type], config.patience)
        else:
            train_data = sample_k_shot(train_data, config.k_shot, config.seed)
        delta = new_delta(self.backbone, method, task, config, sources).to(self.device)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed + DROPOUT_SEED_OFFSET)
        delta.use_generator(generator)
        train_set = encode_split(self.backbone, task, config, train_data, "training data")
        eval_set = encode_split(self.backbone, task, config, eval_data, "evaluation data")
        test_set = encode_split(self.backbone, task, config, test_data, "test data")
        scale_regression_targets(delta, task, train_set)
        total_steps = total_train_steps(config, len(train_set))
        learning_rate = config.resolved_learning_rate(method.defaults)
        parameters = [p for p in delta.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            delta.parameter_groups(learning_rate),  # a group per module learning-rate multiplier
            lr=learning_rate,
            weight_decay=config.weight_decay,
            fused=self.device.type in ("cpu", "cuda"),
        )
        member = PackMember(
            key=f"job{self._joined}",
            method=method,
            task=task,
            config=config,
            delta=delta,
            train_set=train_set,
            eval_set=eval_set,
            test_set=test_set,
            selection=selection,
            optimizer=optimizer,
            parameters=parameters,
            lr_at=linear_schedule(learning_rate, int(config.warmup_ratio * total_steps), total_steps),
            learning_rate=learning_rate,
            total_steps=total_steps,
            steps_per_epoch=math.ceil(len(train_set) / config.batch_size),
            progress=progress,
            should_stop=should_stop,
            on_epoch_end=on_epoch_end,
        )
        self._joined += 1
        if not self.members:  # a pack's peak memory is measured from when it starts (on a GPU)
            reset_peak_memory(self.device)
        self.use_bf16 = use_bf16
        self.model.deltas[member.key] = delta
        self.members.append(member)
        return member

    # -- one step ---------------------------------------------------------------------------------------
    def step(self) -> list[PackMember]:
        """One step of every member: a training step for those training, an evaluation chunk for those
        evaluating. Returns the members that ended in it (each with its `result` or `error`)."""
        for member in self.members:
            if member.should_stop is not None and member.should_stop():
                member.error = TrainingCancelled(f"stopped at step {member.step} of {member.total_steps}")
        active = [m for m in self.members if not m.done]
        training = [m for m in active if not m.evaluating]
        evaluating = [m for m in active if m.evaluating]
        self.steps += 1 if active else 0
        self.job_steps += len(active)
        if training:
            self._train_step(training)
        if evaluating:
            self._eval_step(evaluating)
        ended = [m for m in self.members if m.done]
        for member in ended:
            self.leave(member)
        return ended

    def _train_step(self, members: list[PackMember]) -> None:
        started = time.perf_counter()
        pad_id = self.backbone.tokenizer.pad_token_id
        batches = [(m, collate(m.train_set, m.next_batch(), pad_id)) for m in members]
        for member, _ in batches:
            for group in member.optimizer.param_groups:
                group["lr"] = member.lr_at(member.step) * group["lr_multiplier"]
        self.model.train()
        dropout_states = [
            m.delta.generator.get_state() if m.delta.generator is not None else None for m in members
        ]
        finite = self._fused_step(batches)
        if finite is None:  # whose forward broke? each member alone tells (the others' steps still count)
            if self._fused_out_of_memory:  # the rows did not fit together: smaller forwards from now on
                self._shrink_forwards()
            for member, state in zip(members, dropout_states, strict=True):
                if state is not None:  # the redone step draws the masks the failed one drew
                    member.delta.generator.set_state(state)
            for member, _ in batches:
                member.optimizer.zero_grad(set_to_none=True)
                member.error = None if isinstance(member.error, TrainingError) else member.error
            finite = self._isolated_steps(batches)
        elapsed = time.perf_counter() - started
        for member, _ in batches:
            member.train_seconds += elapsed
        for member, loss in finite:
            try:  # its clipping, optimizer, progress callback: its own failures
                self._optimizer_step(member, loss, next(b for m, b in batches if m is member))
            except Exception as exc:
                member.error = self._own_error(exc, "optimizer step")

    def _fused_step(
        self, batches: list[tuple[PackMember, dict[str, torch.Tensor]]]
    ) -> list[tuple[PackMember, torch.Tensor]] | None:
        """Forward and backward of every member's rows, a length group at a time (one forward's activations
        alive at a time); the members with a finite loss, or None when a forward or backward raised (whose
        fault is not known). Returning frees the failed attempt's tensors before any retry."""
        finite = []
        self._fused_out_of_memory = False
        try:
            for group in length_groups([batch for _, batch in batches], self.forward_tokens):
                losses = self._forward_losses([batches[i] for i in group])
                group_finite = [(m, loss) for m, loss in losses if self._check_finite(m, loss)]
                if group_finite:
                    torch.stack([loss for _, loss in group_finite]).sum().backward()
                finite += group_finite
        except Exception as exc:
            self._fused_out_of_memory = is_out_of_memory(exc)
            return None
        return finite

    def _forward_losses(
        self, batches: list[tuple[PackMember, dict[str, torch.Tensor]]]
    ) -> list[tuple[PackMember, torch.Tensor]]:
        """Each member's loss on its own rows, from one backbone forward of all their rows."""
        losses = []
        for member, logits, labels in self._routed_forward(batches):
            loss = loss_fn(member.task.problem_type, logits, member.delta.head.standardized(labels))
            penalty = value_penalty(member.delta)  # a fusion's λ‖I − V‖²; None for every other method
            losses.append((member, loss if penalty is None else loss + penalty))
        return losses

    def _routed_forward(
        self, batches: list[tuple[PackMember, dict[str, torch.Tensor]]]
    ) -> list[tuple[PackMember, torch.Tensor, torch.Tensor]]:
        """(member, its logits, its labels) from one backbone forward of every member's rows."""
        pad_id = self.backbone.tokenizer.pad_token_id
        members = [member for member, _ in batches]
        inputs, labels = merge_batches([batch for _, batch in batches], pad_id, self.device)
        routes = [(m.key, len(y)) for m, y in zip(members, labels, strict=True)]
        with autocast_context(self.device, bool(self.use_bf16)):
            logits = self.model(**inputs, routes=routes)
        if not isinstance(logits, list):
            logits = [logits]
        return list(zip(members, logits, labels, strict=True))

    def _isolated_steps(
        self, batches: list[tuple[PackMember, dict[str, torch.Tensor]]]
    ) -> list[tuple[PackMember, torch.Tensor]]:
        """The step again, one member at a time: a member whose own forward or backward raises fails
        with that error; the others get the step they would have had."""
        finite = []
        for member, batch in batches:
            try:
                [(_, loss)] = self._forward_losses([(member, batch)])
                if self._check_finite(member, loss):
                    loss.backward()
                    finite.append((member, loss))
            except Exception as exc:
                member.optimizer.zero_grad(set_to_none=True)
                member.error = self._own_error(exc, "training step")
        return finite

    def _shrink_forwards(self) -> None:
        """A shared pass ran out of device memory: free the cache, and let forwards hold half as many tokens
        from now on (jobs stay in the pack; their steps run in more, smaller pieces)."""
        free_cached_memory(self.device)
        self.out_of_memory += 1
        self.forward_tokens = max(MIN_FORWARD_TOKENS, self.forward_tokens // 2)

    def _own_error(self, exc: Exception, doing: str) -> Exception:
        """A member's own failure as its job reports it: running out of device memory becomes a
        DeviceOutOfMemory (the job may fit elsewhere: the service retries it), anything else stays."""
        if not is_out_of_memory(exc):
            return exc
        free_cached_memory(self.device)
        packed = len(self.members) > 1
        return DeviceOutOfMemory(
            f"out of memory on {self.device} in a {doing} of its own (pack of {len(self.members)} "
            f"job(s), forwards of at most {self.forward_tokens} padded tokens): "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; a smaller batch_size or "
            f"max_length, bf16{', or a smaller pack' if packed else ''} would fit"
        )

    def _check_finite(self, member: PackMember, loss: torch.Tensor) -> bool:
        if torch.isfinite(loss):
            return True
        fastest = max(group["lr_multiplier"] for group in member.optimizer.param_groups)
        modules = f" (its fastest modules at {fastest:g}x that: lr_multiplier)" if fastest != 1.0 else ""
        member.error = TrainingError(
            f"loss became {loss.item()} at step {member.step} (epoch {member.epoch}); "
            f"try a lower learning rate than {member.learning_rate:g}{modules}"
        )
        return False

    def _optimizer_step(self, member: PackMember, loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(member.parameters, member.config.max_grad_norm)
        member.optimizer.step()
        member.optimizer.zero_grad(set_to_none=True)
        member.train_seconds += time.perf_counter() - started  # its own update is training time too
        member.step += 1
        member.tokens += int(batch["attention_mask"].sum())
        if member.progress is not None:
            speed = member.tokens / max(member.train_seconds, 1e-9)
            epoch = member.step / member.steps_per_epoch
            member.progress(
                Progress(
                    member.step, member.total_steps, epoch, loss.item(), speed, member.lr_at(member.step - 1)
                )
            )
        if not member.epoch_ended():
            return
        member.epoch += 1
        member._batches = None
        finished = member.step >= member.total_steps
        if (
            member.eval_set is not None
            and len(member.eval_set)
            and (member.config.eval_every_epoch or finished)
        ):
            self._start_evaluation(member, member.eval_set)
        elif finished:
            self._end_training(member)

    # -- evaluation -------------------------------------------------------------------------------------
    def _start_evaluation(self, member: PackMember, split: Encoded) -> None:
        """From the next step on, the member evaluates `split` one chunk per step instead of training."""
        order = length_grouped_batches(split.lengths, member.config.eval_batch_size, 0, shuffle=False)
        member._eval_on, member._eval_chunks, member._eval_outputs = split, order, []

    def _eval_step(self, members: list[PackMember]) -> None:
        """The next evaluation chunk of every evaluating member, through shared no-grad forwards (one member
        at a time if a shared forward fails, so that only the member at fault fails)."""
        started = time.perf_counter()
        pad_id = self.backbone.tokenizer.pad_token_id
        batches = [(m, collate(m._eval_on, m._eval_chunks.pop(0), pad_id)) for m in members]
        self.model.eval()
        outputs = []
        try:
            for group in length_groups([b for _, b in batches], self.forward_tokens * EVAL_FORWARD_FACTOR):
                outputs += self._eval_forward([batches[i] for i in group])
        except Exception as exc:
            outputs = []
            if is_out_of_memory(exc):
                self._shrink_forwards()
            for member, batch in batches:
                try:
                    outputs += self._eval_forward([(member, batch)])
                except Exception as exc:
                    member.error = self._own_error(exc, "evaluation pass")
        for member, output in outputs:
            member._eval_outputs.append(output)
        elapsed = time.perf_counter() - started
        for member in members:
            member.eval_seconds += elapsed
            if not member._eval_chunks and not member.done:
                try:
                    self._end_evaluation(member)
                except Exception as exc:  # its metrics or its on_epoch_end callback
                    member.error = exc

    @torch.no_grad()
    def _eval_forward(
        self, batches: list[tuple[PackMember, dict[str, torch.Tensor]]]
    ) -> list[tuple[PackMember, tuple[np.ndarray, np.ndarray, float]]]:
        """(member, (its logits, its labels, its summed loss)) from one no-grad forward."""
        outputs = []
        for member, logits, labels in self._routed_forward(batches):
            loss = float(loss_fn(member.task.problem_type, logits, labels))
            outputs.append((member, (logits.float().cpu().numpy(), labels.cpu().numpy(), loss * len(labels))))
        return outputs

    def _end_evaluation(self, member: PackMember) -> None:
        outputs, split = member._eval_outputs, member._eval_on
        logits = np.concatenate([o[0] for o in outputs])
        labels = np.concatenate([o[1] for o in outputs])
        scores = compute_metrics(member.task.problem_type, logits, labels)
        scores["loss"] = sum(o[2] for o in outputs) / max(len(split), 1)
        member._eval_on, member._eval_chunks, member._eval_outputs = None, None, []
        if split is member.test_set:  # the protocol's last evaluation, with the best checkpoint
            self._finish(member, test_metrics=scores)
            return
        record = {"epoch": member.epoch, "step": member.step, **scores}
        member.history.append(record)
        if member.on_epoch_end is not None:
            member.on_epoch_end(record)
        stop = member.selection is not None and member.selection.observe(record, member.delta)
        if stop or member.step >= member.total_steps:
            self._end_training(member)

    def _end_training(self, member: PackMember) -> None:
        """Training is over (its last step, or early stopping): under the protocol the best checkpoint
        comes back and the test set is evaluated with it; then the job finishes."""
        if member.selection is not None:
            member.selection.restore(member.delta)
            if member.test_set is not None and len(member.test_set):
                self._start_evaluation(member, member.test_set)
                return
        self._finish(member)

    # -- leaving ----------------------------------------------------------------------------------------
    def _finish(self, member: PackMember, test_metrics: dict[str, float] | None = None) -> None:
        member.delta.eval()
        member.delta.head.fold_target_scaling()  # a finished regressor predicts in its labels' units
        member.result = finished_result(
            member.delta,
            member.task,
            self.backbone,
            member.history,
            member.step,
            member.tokens,
            member.train_seconds,
            member.eval_seconds,
            bool(self.use_bf16),
            member.optimizer,
            selection=member.selection,
            test_metrics=test_metrics,
            test_left_out=member.selection is not None and not member.config.evaluate_test,
        )

    def leave(self, member: PackMember) -> None:
        """Take a member out (it ended): its modules out of the shared model, its optimizer state freed."""
        self.members.remove(member)
        del self.model.deltas[member.key]
        member.delta.use_generator(None)
        member.optimizer.state.clear()  # the optimizer's moments go with the job, not with the delta
        if not self.members:
            self.use_bf16 = None
            self.model.eval()  # the shared backbone back in its resting mode (no dropout)


def wants_bf16(config: TrainConfig | None, backbone: Backbone) -> bool:
    """Whether a job with this config trains under bf16 autocast on this backbone's device."""
    choice = (config or TrainConfig()).bf16
    device = next(backbone.model.parameters()).device
    return choice == "true" or (choice == "auto" and bf16_available(device))


def length_groups(
    batches: list[dict[str, torch.Tensor]], max_tokens: int | None = None, slack: float = PADDING_SLACK
) -> list[list[int]]:
    """Indices of `batches` in groups that share one forward: longest first, a batch joins the group while
    padding everyone to the group's longest costs at most `slack` × padding each batch to its own, and the
    group stays within `max_tokens` padded tokens (a batch larger than that alone is a group of its own)."""
    widths = [batch["input_ids"].shape[1] for batch in batches]
    rows = [batch["input_ids"].shape[0] for batch in batches]
    order = sorted(range(len(batches)), key=lambda i: -widths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            width = widths[group[0]]  # the longest of the group
            own = sum(rows[j] * widths[j] for j in group) + rows[i] * widths[i]
            padded = width * (sum(rows[j] for j in group) + rows[i])
            if padded <= slack * own and (max_tokens is None or padded <= max_tokens):
                group.append(i)
                continue
        groups.append([i])
    return groups


def merge_batches(
    batches: list[dict[str, torch.Tensor]], pad_id: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Several jobs' collated batches as one (right-padded to the longest), and each job's labels."""
    width = max(batch["input_ids"].shape[1] for batch in batches)
    merged: dict[str, torch.Tensor] = {}
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        if name not in batches[0]:
            continue
        fill = pad_id if name == "input_ids" else 0
        pieces = [F.pad(batch[name], (0, width - batch[name].shape[1]), value=fill) for batch in batches]
        merged[name] = (torch.cat(pieces) if len(pieces) > 1 else pieces[0]).to(device)
    return merged, [batch["labels"].to(device) for batch in batches]
