"""Packs against the same jobs trained one at a time, and both against the fp32 matmul peak.

One process, one thread count, every number in one run on the same rows (all-MiniLM-L6-v2, fp32):

1. the fp32 `torch.matmul` peak at the backbone's own shapes (tokens × hidden × intermediate);
2. training: for each pack size N, N jobs of mixed methods (each its own seed and K-shot sample, SST-2 and
   RTE alternating, a fixed number of steps, no evaluation) joined into one `pelt_core.pack.Pack` and
   stepped to the end, against the same N jobs trained with `pelt_core.train.train` one after another;
3. evaluation: a dev pass of N jobs in one pack against N passes one at a time;
4. with --profile, where one packed step of 8 mixed jobs (--profile-jobs) spends its time (torch.profiler).

FLOP/s count training as 4·N·tokens and evaluation as 2·N·tokens, N = the backbone's non-embedding
parameters, tokens = non-padding tokens (../shared/DESIGN.md, "Reading the packs numbers").

    HF_HUB_OFFLINE=1 python benchmarks/bench_packs.py --json out/packs.json --plot out/packs.png --profile
    python benchmarks/bench_packs.py --pack-sizes 1,2 --steps 2 --k 16 --eval-rows 32   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from bench_pelt_core import load_glue, load_minilm, matmul_peak, nonembedding_parameters

from pelt_core import TrainConfig, get_method
from pelt_core.backbones import Backbone
from pelt_core.data import TaskFields, infer_task_fields
from pelt_core.pack import Pack, PackMember
from pelt_core.train import TrainResult, train

METHODS = ("lora", "pfeiffer", "prefix", "bitfit", "unipelt")
TASKS = ("sst2", "rte")
PEAK_TOKENS = (448, 2048, 7168)
# FLOPs per token, × N: training = forward 2·N + the input-gradient half of the backward 2·N (the frozen
# backbone computes no weight gradients); evaluation = forward only.
TRAIN_FLOPS_PER_TOKEN = 4
EVAL_FLOPS_PER_TOKEN = 2
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@dataclass(frozen=True)
class Job:
    """One benchmark job: which method, on which task's training rows, with which seed."""

    method: str
    task: str
    seed: int


@dataclass
class Workload:
    """What every measurement shares: the backbone, each task's rows and fields, the fixed settings."""

    backbone: Backbone
    train_rows: dict[str, Any]
    task_fields: dict[str, TaskFields]
    eval_rows: Any
    k: int
    batch_size: int
    max_length: int
    forward_tokens: int | None = None  # a pack's cap on padded tokens per backbone forward (None: pelt's)

    def config(self, job: Job, max_steps: int) -> TrainConfig:
        """The job's settings: its seed and K-shot sample, fp32, no evaluation between epochs."""
        return TrainConfig(
            k_shot=self.k,
            batch_size=self.batch_size,
            max_length=self.max_length,
            seed=job.seed,
            max_steps=max_steps,
            bf16="false",
            eval_every_epoch=False,
        )

    def join(self, pack: Pack, job: Job, max_steps: int, evaluate: bool = False) -> PackMember:
        """`job` joined to `pack` (with the dev rows to evaluate after its last step if `evaluate`)."""
        return pack.join(
            get_method(job.method),
            self.train_rows[job.task],
            self.eval_rows if evaluate else None,
            self.config(job, max_steps),
            task=self.task_fields[job.task],
        )

    def train_alone(self, job: Job, max_steps: int, evaluate: bool = False) -> TrainResult:
        """`job` trained by itself with `pelt_core.train.train`."""
        return train(
            self.backbone,
            get_method(job.method),
            self.train_rows[job.task],
            self.eval_rows if evaluate else None,
            self.config(job, max_steps),
            task=self.task_fields[job.task],
        )


def mixed_jobs(count: int, methods: list[str], tasks: list[str], first_seed: int) -> list[Job]:
    """`count` jobs cycling through the methods, the tasks alternating, seeds first_seed, first_seed + 1, ..."""
    return [Job(methods[i % len(methods)], tasks[i % len(tasks)], first_seed + i) for i in range(count)]


def describe_jobs(jobs: list[Job]) -> str:
    """The method mix of a set of jobs, e.g. "lora×2 pfeiffer×1"."""
    counts = Counter(job.method for job in jobs)
    return " ".join(f"{method}×{n}" for method, n in counts.items())


# --------------------------------------------------------------------------------------------------
# Training and evaluation, packed and one at a time
# --------------------------------------------------------------------------------------------------
class ForwardCounter:
    """Counts backbone forwards (a forward pre-hook): how many shared passes a pack step took."""

    def __init__(self, backbone: Backbone):
        self.count = 0
        self._handle = backbone.model.register_forward_pre_hook(self._seen)

    def _seen(self, module, args) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


def run_pack(work: Workload, jobs: list[Job], max_steps: int, evaluate: bool = False) -> dict:
    """All jobs joined to one pack, stepped until every one ended: its members, pack steps, backbone
    forwards, the seconds spent joining and the wall time (joins included). Raises if any job failed."""
    counter = ForwardCounter(work.backbone)
    try:
        started = time.perf_counter()
        pack = Pack(work.backbone, forward_tokens=work.forward_tokens)
        members = [work.join(pack, job, max_steps, evaluate) for job in jobs]
        joined = time.perf_counter()
        while not all(member.done for member in members):
            pack.step()
        wall = time.perf_counter() - started
    finally:
        counter.close()
    failed = [f"{job.method}: {m.error}" for job, m in zip(jobs, members, strict=True) if m.error]
    if failed:
        raise RuntimeError("packed jobs failed: " + "; ".join(failed))
    return {
        "members": members,
        "wall_seconds": wall,
        "join_seconds": joined - started,
        "pack_steps": pack.steps,
        "backbone_forwards": counter.count,
    }


def train_packed(work: Workload, jobs: list[Job], steps: int) -> dict:
    """The jobs trained in one pack: wall time (joins included), tokens, pack steps, backbone forwards."""
    run = run_pack(work, jobs, steps)
    members = run.pop("members")
    return run | {"tokens": sum(member.result.train_tokens for member in members)}


def train_one_at_a_time(work: Workload, jobs: list[Job], steps: int) -> dict:
    """The same jobs with `train()`, one after another: wall time (each job's setup included) and tokens."""
    started = time.perf_counter()
    results = [work.train_alone(job, steps) for job in jobs]
    return {
        "wall_seconds": time.perf_counter() - started,
        "tokens": sum(result.train_tokens for result in results),
    }


def eval_packed(work: Workload, jobs: list[Job]) -> dict:
    """N jobs take one training step, then evaluate the dev rows together: the pack's evaluation clock
    (`PackMember.eval_seconds`, shared passes: every member counts the same seconds) and the dev tokens."""
    members = run_pack(work, jobs, 1, evaluate=True)["members"]
    return {
        "eval_seconds": max(member.eval_seconds for member in members),
        "tokens": sum(sum(member.eval_set.lengths) for member in members),
    }


def eval_one_at_a_time(work: Workload, jobs: list[Job]) -> dict:
    """The same jobs with `train()` one after another: the sum of their evaluation clocks."""
    results = [work.train_alone(job, 1, evaluate=True) for job in jobs]
    return {"eval_seconds": sum(result.eval_seconds for result in results)}


def warm_up(work: Workload, methods: list[str]) -> None:
    """First-call costs (allocations, kernels, thread pools) out of the timings: one packed step of every
    method with a short evaluation, then one step of each method alone."""
    jobs = [Job(method, "sst2", seed) for seed, method in enumerate(methods)]
    few = replace(work, eval_rows=work.eval_rows.select(range(min(16, len(work.eval_rows)))))
    eval_packed(few, jobs)
    for job in jobs:
        work.train_alone(job, 1)


# --------------------------------------------------------------------------------------------------
# Profile of one packed step
# --------------------------------------------------------------------------------------------------
MATMUL_OPS = {"aten::addmm", "aten::mm", "aten::matmul", "aten::linear"}
ATTENTION_MARKS = ("bmm", "softmax", "scaled_dot_product", "scaleddotproduct", "attention")
ROUTING_OPS = {
    "aten::cat",
    "aten::slice",
    "aten::slice_backward",
    "aten::narrow",
    "aten::split",
    "aten::split_with_sizes",
    "aten::index",
    "aten::index_select",
    "aten::index_put_",
    "aten::index_add_",
}
ROUTING_BACKWARDS = ("SliceBackward", "CatBackward", "IndexBackward", "SplitBackward", "NarrowBackward")
OPTIMIZER_MARKS = ("adamw", "optimizer.", "_foreach_", "vector_norm", "clip_grad")
PROFILE_CATEGORIES = (
    "backbone linear matmuls",
    "PELT module matmuls",
    "attention",
    "routing copies",
    "optimizer steps",
    "other ops",
)


def backbone_weight_shapes(backbone: Backbone) -> set[tuple[int, int]]:
    """The shapes of the backbone layers' linear weights, both orientations."""
    layers = backbone.model.get_submodule(backbone.arch.layers_path)
    shapes = set()
    for module in layers.modules():
        if isinstance(module, torch.nn.Linear):
            out_features, in_features = module.weight.shape
            shapes |= {(out_features, in_features), (in_features, out_features)}
    return shapes


def named_category(name: str) -> str | None:
    """The category an op or autograd node's name alone gives (attention, routing, optimizer), if any."""
    lowered = name.lower()
    if any(mark in lowered for mark in ATTENTION_MARKS):
        return "attention"
    if name in ROUTING_OPS or any(node in name for node in ROUTING_BACKWARDS):
        return "routing copies"
    if any(mark in lowered for mark in OPTIMIZER_MARKS):
        return "optimizer steps"
    return None


def op_category(event, weight_shapes: set[tuple[int, int]]) -> str:
    """A profiler event's category by op-name heuristics (approximate). A matmul whose last 2-D operand has
    a backbone weight's shape is the backbone's, any other matmul a PELT module's; any other op takes the
    first category named by itself or an enclosing op or autograd node (the zero-fill under a slice's
    backward is routing, a copy inside the optimizer step is the optimizer's); a copy_ left over counts as
    routing, anything else (norms, activations, dropout, element-wise ops) as other."""
    if event.name in MATMUL_OPS:
        matrices = [tuple(shape) for shape in event.input_shapes or [] if len(shape) == 2]
        backbone = bool(matrices) and matrices[-1] in weight_shapes
        return "backbone linear matmuls" if backbone else "PELT module matmuls"
    enclosing = event
    while enclosing is not None:
        category = named_category(enclosing.name)
        if category is not None:
            return category
        enclosing = enclosing.cpu_parent
    return "routing copies" if event.name == "aten::copy_" else "other ops"


def profile_step(work: Workload, jobs: list[Job], top: int = 15) -> dict:
    """One packed step of `jobs` under torch.profiler, after one unprofiled step (timed too, to show the
    profiler's own cost): the top ops by self CPU time and the step's time by category, Python overhead =
    the profiled wall − the self time of every op."""
    from torch.profiler import ProfilerActivity, profile

    pack = Pack(work.backbone, forward_tokens=work.forward_tokens)
    for job in jobs:
        work.join(pack, job, 2)
    started = time.perf_counter()
    pack.step()
    unprofiled = time.perf_counter() - started
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        started = time.perf_counter()
        pack.step()
        wall = time.perf_counter() - started
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    weight_shapes = backbone_weight_shapes(work.backbone)
    seconds = dict.fromkeys(PROFILE_CATEGORIES, 0.0)
    for event in prof.events():
        seconds[op_category(event, weight_shapes)] += event.self_cpu_time_total / 1e6
    seconds["Python overhead (wall − ops)"] = max(0.0, wall - sum(seconds.values()))
    return {
        "jobs": describe_jobs(jobs),
        "wall_seconds": wall,
        "unprofiled_wall_seconds": unprofiled,
        "seconds": seconds,
        "top_ops": table,
    }


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------
def cpu_description() -> dict:
    """The CPU model and whether it has the flags that decide fp32/bf16 speed (lscpu, else /proc/cpuinfo)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip().lower() == "flags":
            flags = set(value.split())
    return {"model": model, "flags": {flag: flag in flags for flag in CPU_FLAGS}}


def percent(value: float | None) -> str:
    """A fraction as a percentage with one decimal, "-" for none."""
    return "-" if value is None else f"{100 * value:.1f}%"


def fraction_of_peak(flops_per_token: int, n_params: int, tokens: int, seconds: float, peak: dict) -> float:
    """Achieved FLOP/s (flops_per_token · N · tokens / seconds) over the peak's."""
    return flops_per_token * n_params * tokens / seconds / (peak["gflops"] * 1e9)


def training_row(size: int, jobs: list[Job], packed: dict, alone: dict, n_params: int, peak: dict) -> dict:
    """One pack size's training numbers: tokens/s of the node both ways, their ratio, shares of the peak."""
    packed_tps = packed["tokens"] / packed["wall_seconds"]
    alone_tps = alone["tokens"] / alone["wall_seconds"]
    return {
        "pack_size": size,
        "jobs": describe_jobs(jobs),
        "packed": packed,
        "one_at_a_time": alone,
        "packed_tokens_per_second": packed_tps,
        "one_at_a_time_tokens_per_second": alone_tps,
        "ratio": packed_tps / alone_tps,
        "packed_fraction_of_fp32_peak": fraction_of_peak(
            TRAIN_FLOPS_PER_TOKEN, n_params, packed["tokens"], packed["wall_seconds"], peak
        ),
        "one_at_a_time_fraction_of_fp32_peak": fraction_of_peak(
            TRAIN_FLOPS_PER_TOKEN, n_params, alone["tokens"], alone["wall_seconds"], peak
        ),
    }


def eval_row(size: int, jobs: list[Job], packed: dict, alone: dict, n_params: int, peak: dict) -> dict:
    """One dev pass's numbers, as `training_row` (2·N·tokens, the same dev tokens on both sides)."""
    tokens = packed["tokens"]
    return {
        "pack_size": size,
        "jobs": describe_jobs(jobs),
        "packed": packed,
        "one_at_a_time": alone,
        "packed_tokens_per_second": tokens / packed["eval_seconds"],
        "one_at_a_time_tokens_per_second": tokens / alone["eval_seconds"],
        "ratio": alone["eval_seconds"] / packed["eval_seconds"],
        "packed_fraction_of_fp32_peak": fraction_of_peak(
            EVAL_FLOPS_PER_TOKEN, n_params, tokens, packed["eval_seconds"], peak
        ),
        "one_at_a_time_fraction_of_fp32_peak": fraction_of_peak(
            EVAL_FLOPS_PER_TOKEN, n_params, tokens, alone["eval_seconds"], peak
        ),
    }


def markdown_table(rows: list[dict]) -> str:
    """Rows of `training_row` or `eval_row` as a markdown table."""
    lines = [
        "| pack size | jobs | packed tok/s | one-at-a-time tok/s | ratio | % of fp32 peak packed | % one-at-a-time |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['pack_size']} | {row['jobs']} | {row['packed_tokens_per_second']:.0f} | "
            f"{row['one_at_a_time_tokens_per_second']:.0f} | {row['ratio']:.2f} | "
            f"{percent(row['packed_fraction_of_fp32_peak'])} | {percent(row['one_at_a_time_fraction_of_fp32_peak'])} |"
        )
    return "\n".join(lines)


def print_profile(profile: dict) -> None:
    """The top ops and the step's time by category."""
    print(
        f"\nProfile of one packed step ({profile['jobs']}): {profile['wall_seconds'] * 1000:.0f} ms under the "
        f"profiler, {profile['unprofiled_wall_seconds'] * 1000:.0f} ms for the step before it without:\n"
    )
    print(profile["top_ops"])
    print("By category (self CPU time; op-name and shape heuristics, approximate):\n")
    print("| category | ms | % of the step |\n|---|---:|---:|")
    for category, seconds in profile["seconds"].items():
        print(f"| {category} | {seconds * 1000:.1f} | {100 * seconds / profile['wall_seconds']:.1f}% |")


def plot(rows: list[dict], path: str) -> None:
    """Training tokens/s against pack size, packed and one at a time, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    sizes = [row["pack_size"] for row in rows]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(sizes, [row["packed_tokens_per_second"] for row in rows], "o-", label="packed")
    axes.plot(sizes, [row["one_at_a_time_tokens_per_second"] for row in rows], "s--", label="one at a time")
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [str(size) for size in sizes])
    axes.set_xlabel("jobs (pack size)")
    axes.set_ylabel("training tokens/s of the node")
    axes.set_ylim(bottom=0)
    axes.legend()
    axes.grid(alpha=0.3)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot written to {path}")


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------
def comma_ints(text: str) -> list[int]:
    """ "1,2,4" -> [1, 2, 4]."""
    return [int(x) for x in text.split(",") if x.strip()]


def comma_names(text: str) -> list[str]:
    """ "lora, prefix" -> ["lora", "prefix"]."""
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads for everything (default 2)")
    parser.add_argument("--pack-sizes", type=comma_ints, default=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--methods", type=comma_names, default=list(METHODS), help="cycled through by the jobs"
    )
    parser.add_argument("--tasks", type=comma_names, default=list(TASKS), help="alternated by the jobs")
    parser.add_argument(
        "--k", type=int, default=100, help="K training rows per job (its own sample, by seed)"
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps per job")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="the first job's seed; job i has seed + i")
    parser.add_argument("--eval-rows", type=int, default=872, help="SST-2 validation rows per dev pass")
    parser.add_argument("--eval-sizes", type=comma_ints, default=[1, 8], help="jobs per dev pass")
    parser.add_argument("--peak-tokens", type=comma_ints, default=list(PEAK_TOKENS))
    parser.add_argument(
        "--forward-tokens",
        type=int,
        help="padded tokens per backbone forward of a pack (default: pelt's cap, 1,024 on a CPU; "
        "a large number such as 1000000: one forward per packed step)",
    )
    parser.add_argument("--profile", action="store_true", help="profile one packed step of mixed jobs")
    parser.add_argument("--profile-jobs", type=int, default=8, help="jobs in the profiled pack (default 8)")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--plot", help="draw tokens/s against pack size into this PNG")
    return parser.parse_args()


def load_workload(args: argparse.Namespace) -> Workload:
    """MiniLM in fp32, the tasks' training rows (SST-2's always: the dev passes train on it) and dev rows."""
    train_rows = {task: load_glue(task, "train") for task in {*args.tasks, "sst2"}}
    eval_rows = load_glue("sst2", "validation")
    return Workload(
        backbone=load_minilm("float32"),
        train_rows=train_rows,
        task_fields={task: infer_task_fields(rows) for task, rows in train_rows.items()},
        eval_rows=eval_rows.select(range(min(args.eval_rows, len(eval_rows)))),
        k=args.k,
        batch_size=args.batch_size,
        max_length=args.max_length,
        forward_tokens=args.forward_tokens,
    )


def print_results(args, work: Workload, report: dict) -> None:
    """The tables and how to read them."""
    peak, hidden, intermediate = report["fp32_peak"], report["hidden"], report["intermediate"]
    print(f"\nTraining ({args.steps} steps per job, tokens/s of the node = all jobs' tokens / wall):\n")
    print(markdown_table(report["training"]))
    print(
        f"\nEvaluation (a dev pass of {len(work.eval_rows)} SST-2 rows per job, the trainer's eval clock):\n"
    )
    print(markdown_table(report["evaluation"]))
    per_shape = ", ".join(f"{shape}: {gflops:.0f}" for shape, gflops in peak["per_size"].items())
    print(
        f"\nfp32 matmul peak (torch.matmul, tokens x {hidden} x {intermediate}, {peak['threads']} threads, "
        f"best of start/end {peak['start']:.0f}/{peak['end']:.0f}): {peak['gflops']:.0f} GFLOP/s [{per_shape}]"
    )
    print(
        f"FLOP/s = {TRAIN_FLOPS_PER_TOKEN}·N·tokens / wall for training, {EVAL_FLOPS_PER_TOKEN}·N·tokens / "
        f"seconds for evaluation; N = the backbone's non-embedding parameters "
        f"({report['n_nonembedding_parameters'] / 1e6:.2f}M), tokens = non-padding tokens. Jobs: methods "
        f"{', '.join(args.methods)} cycled, tasks {', '.join(args.tasks)} alternated, seeds {args.seed}, "
        f"{args.seed}+1, ...; walls include each job's setup (sampling, tokenising, building its modules)."
    )
    forwards = ", ".join(
        f"{row['pack_size']}: {row['packed']['backbone_forwards'] / max(row['packed']['pack_steps'], 1):.1f}"
        for row in report["training"]
    )
    print(f"backbone forwards per packed step (rows far apart in length go in separate forwards): {forwards}")
    for row in report["training"]:
        if row["packed"]["tokens"] != row["one_at_a_time"]["tokens"]:
            print(
                f"note: {row['pack_size']} jobs trained on {row['packed']['tokens']} tokens packed but "
                f"{row['one_at_a_time']['tokens']} one at a time (each side's tok/s uses its own count)"
            )
    if report["profile"]:
        print_profile(report["profile"])


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    cpu = cpu_description()
    work = load_workload(args)
    n_params = nonembedding_parameters(work.backbone)
    hidden, intermediate = work.backbone.facts["hidden_size"], work.backbone.facts["intermediate_size"]
    flags = ", ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in cpu["flags"].items())
    print(f"CPU: {cpu['model']} ({flags})")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}; "
        f"K={args.k}, {args.steps} steps per job, batch {args.batch_size}, max_length {args.max_length}, fp32, "
        f"{args.forward_tokens or 'pelt default'} padded tokens per packed forward",
        flush=True,
    )
    shapes = [(tokens, hidden, intermediate) for tokens in args.peak_tokens]
    peak_start = matmul_peak("float32", shapes=shapes)
    print(f"fp32 matmul peak {peak_start['gflops']:.0f} GFLOP/s at start", flush=True)

    warm_up(work, args.methods)
    training = []
    for size in args.pack_sizes:
        jobs = mixed_jobs(size, args.methods, args.tasks, args.seed)
        packed = train_packed(work, jobs, args.steps)
        alone = train_one_at_a_time(work, jobs, args.steps)
        training.append((size, jobs, packed, alone))
        print(
            f"[{time.perf_counter() - started:5.0f}s] {size} jobs: packed {packed['wall_seconds']:.1f}s, "
            f"one at a time {alone['wall_seconds']:.1f}s",
            flush=True,
        )
    evaluation = []
    for size in args.eval_sizes:
        jobs = mixed_jobs(size, args.methods, ["sst2"], args.seed)
        evaluation.append((size, jobs, eval_packed(work, jobs), eval_one_at_a_time(work, jobs)))
        print(f"[{time.perf_counter() - started:5.0f}s] dev pass of {size} jobs done", flush=True)
    profile = None
    if args.profile:
        profile = profile_step(work, mixed_jobs(args.profile_jobs, args.methods, args.tasks, args.seed))

    # the peak again at the end: a busy machine at either moment understates it, so keep the better one
    peak_end = matmul_peak("float32", shapes=shapes)
    peak = max(peak_start, peak_end, key=lambda p: p["gflops"]) | {
        "start": peak_start["gflops"],
        "end": peak_end["gflops"],
    }
    report = {
        "args": vars(args),
        "cpu": cpu,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "n_nonembedding_parameters": n_params,
        "hidden": hidden,
        "intermediate": intermediate,
        "fp32_peak": peak,
        "training": [training_row(*entry, n_params, peak) for entry in training],
        "evaluation": [eval_row(*entry, n_params, peak) for entry in evaluation],
        "profile": profile,
    }
    print_results(args, work, report)
    print(
        f"\ntotal {time.perf_counter() - started:.0f}s; load average at the end {os.getloadavg()[0]:.2f} "
        "(anything else on these cores makes every number noisy)"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report["training"], args.plot)


if __name__ == "__main__":
    main()
