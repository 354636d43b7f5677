"""The mixed sweep, trained in packs (part (c) of the workers benchmark; (a) and (b) are bench_workers.py).
Prints numbers and ratios against peers measured in the same run; asserts nothing.

16 jobs (`--jobs`): methods lora, pfeiffer, prefix, bitfit, unipelt cycled over seeds 0-15
(`--sweep-methods`), SST-2 and RTE alternating (dev sets of 872 and 277 rows), K=100, 3 epochs, batch 16,
fp32, one dev evaluation at the end; measured in one run on the same cores:
  - the service with one job per worker slot (pack size 1, one worker per CPU),
  - the service with packs (`--sweep-pack-size`, default 8: one worker per CPU, each a pack of 8),
  - 16 PEFT scripts one after another (the LoRA peer of bench_workers' (b) for every job, on its K rows
    and dev set; `bench_workers.py peer-peft`).
Both service runs warm their workers first (every worker started, the backbone mapped, each method run for
a step). Reports the walls, scripts/packed and slots/packed, and each service run's share of the node's
limit: (4·N·training tokens + 2·N·evaluation tokens) / wall / the fp32 matmul peak at tokens x 384 x 1536
(448, 2048 tokens; measured at the sweep's start on `--slots` threads), N = MiniLM's non-embedding
parameters, tokens = non-padding tokens (MiniLM's tokenizer, max_length 128): training = epochs x each
job's K rows, evaluation = each job's dev set. Targets: share >= 75% (packed), scripts/packed >= 3x.

    python benchmarks/bench_sweep.py --json sweep.json
    python benchmarks/bench_sweep.py --jobs 2 --k 8 --epochs 1   # a smoke test
    python benchmarks/bench_sweep.py --sizes 2,4,8,16 --json sizes.json   # packs against slots, per size
    python benchmarks/bench_sweep.py --sizes 2 --k 8 --epochs 1 --sweep-pack-size 4   # its smoke test

`--sizes` runs, instead, sweeps of each size with packs against one job per slot (one warm service per
mode, the sizes in turn) and prints packed/slots per size: target <= 1.05x at every size (packs never
slower beyond noise: the dispatcher gives every job a CPU of its own before any pack takes a second one).

SST-2 and RTE come from /work/shared/data/glue/{sst2,rte} (override with PELT_GLUE_DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_workers import (
    GLUE,
    MINILM,
    TEXT_FIELDS,
    Service,
    learning_note,
    minilm_path,
    run_peft_script,
    worker_shape,
    write_k_shot_files,
)

SWEEP_METHODS = ("lora", "pfeiffer", "prefix", "bitfit", "unipelt")
SWEEP_TASKS = ("sst2", "rte")  # alternating, job by job
PEAK_TOKENS = (448, 2048)  # the fp32 matmul peak at tokens x hidden x intermediate
# FLOPs per non-padding token, x N (the backbone's non-embedding parameters): training = the forward (2·N)
# and the input-gradient half of the backward (2·N; the frozen backbone takes no weight gradients);
# evaluation = the forward alone
TRAIN_FLOPS_PER_TOKEN, EVAL_FLOPS_PER_TOKEN = 4, 2
TARGET_SHARE = 0.75  # of the node's fp32 limit, for the packed service
TARGET_SPEEDUP = 3.0  # PEFT scripts' wall / the packed service's, as bench_workers (b)'s target
TARGET_PACKED_OVER_SLOTS = 1.05  # --sizes: a packed sweep's wall / one job per slot's, at every size


@dataclass(frozen=True)
class SweepJob:
    """One job of the sweep: its method, its GLUE task and its seed (which draws its K rows)."""

    method: str
    task: str
    seed: int


def sweep_jobs(count: int, methods: list[str]) -> list[SweepJob]:
    """`count` jobs with seeds 0, 1, ...: the methods cycled, SST-2 and RTE alternating."""
    return [SweepJob(methods[i % len(methods)], SWEEP_TASKS[i % len(SWEEP_TASKS)], i) for i in range(count)]


def sweep_work(jobs: list[SweepJob], k: int, epochs: int) -> dict[str, Any]:
    """What the sweep computes, counted as pelt tokenises (MiniLM's tokenizer, max_length 128, non-padding
    tokens): N = MiniLM's non-embedding parameters, training tokens = Σ epochs × each job's K rows,
    evaluation tokens = Σ each job's dev set; and the backbone's hidden and intermediate sizes."""
    from bench_pelt_core import load_glue, load_minilm, nonembedding_parameters

    from pelt_core.data import encode, infer_task_fields, sample_k_shot

    backbone = load_minilm("float32")
    tasks = sorted({job.task for job in jobs})
    train = {task: load_glue(task, "train") for task in tasks}
    fields = {task: infer_task_fields(train[task], text_fields=TEXT_FIELDS[task]) for task in tasks}

    def tokens(rows: Any, task: str) -> int:
        return sum(encode(rows, backbone.tokenizer, fields[task], max_length=128).lengths)

    dev = {task: load_glue(task, "validation") for task in tasks}
    dev_tokens = {task: tokens(dev[task], task) for task in tasks}
    return {
        "n_nonembedding_parameters": nonembedding_parameters(backbone),
        "train_tokens": sum(
            epochs * tokens(sample_k_shot(train[job.task], k, job.seed), job.task) for job in jobs
        ),
        "eval_tokens": sum(dev_tokens[job.task] for job in jobs),
        "dev_rows": {task: len(dev[task]) for task in tasks},
        "hidden": backbone.facts["hidden_size"],
        "intermediate": backbone.facts["intermediate_size"],
    }


def fp32_peak(threads: int, hidden: int, intermediate: int) -> dict[str, Any]:
    """The best fp32 `torch.matmul` GFLOP/s at tokens x hidden x intermediate (PEAK_TOKENS) on `threads`
    torch threads: the node's limit as the service's workers (one thread each) share its cores."""
    import torch
    from bench_pelt_core import matmul_peak

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return matmul_peak("float32", shapes=[(tokens, hidden, intermediate) for tokens in PEAK_TOKENS])
    finally:
        torch.set_num_threads(before)


def warm_up(service: Service, methods: list[str], folder: Path) -> dict[str, int]:
    """Start every worker and map the backbone before the timer, as bench_workers' (b) does: one-step
    jobs on SST-2 with a 16-row dev split, cycling the methods, enough to fill every worker's places (and
    to give a worker of one slot each method). Returns the warm-up jobs and the workers that ran them."""
    dev = folder / "warm-up-dev.jsonl"
    dev.write_text("".join((GLUE / "sst2" / "validation.jsonl").read_text().splitlines(True)[:16]))
    service.register_task("sst2", dev, name="warm-up")
    count = service.workers * max(service.places_per_worker, len(methods))
    job_ids = [
        service.submit(MINILM, [1000 + i], task="warm-up", method=methods[i % len(methods)], max_steps=1)[0]
        for i in range(count)
    ]
    done = service.wait_ended(job_ids, 900)
    failed = [(job.id, job.last_error) for job in done if job.status != "succeeded"]
    if failed:
        raise RuntimeError(f"warm-up jobs failed: {failed[:2]}")
    return {"jobs": count, "workers": len(workers_of(service, job_ids))}


def workers_of(service: Service, job_ids: list[int]) -> set[str]:
    """The worker actors that ran these jobs (lease owners "<worker>#<place>" without the place)."""
    return {(service.registry.get_result(j).worker_id or "").split("#")[0] for j in job_ids}


def sweep_service(
    jobs: list[SweepJob], slots: int, pack_size: int, k: int, epochs: int, methods: list[str], folder: Path
) -> dict[str, Any]:
    """The sweep through the service on `slots` CPUs (one worker each: one job slot, or a pack of
    `pack_size` places), its workers warm: wall-clock from the first submit to the last result."""
    service = Service(folder, slots=slots, backbones=[MINILM], pack_size=pack_size, tasks=SWEEP_TASKS)
    try:
        warm = warm_up(service, methods, folder)
        start_seconds = time.perf_counter() - service.started
        return {
            "pack_size": pack_size,
            "workers": service.workers,
            "places_per_worker": service.places_per_worker,
            **timed_sweep(service, jobs, k, epochs, pack_size),
            "start_seconds": start_seconds,
            "warm_up_jobs": warm["jobs"],
            "warm_workers": warm["workers"],
        }
    finally:
        service.close()


def timed_sweep(
    service: Service, jobs: list[SweepJob], k: int, epochs: int, pack_size: int
) -> dict[str, Any]:
    """One sweep submitted to a warm service: its wall-clock from the first submit to the last result, the
    workers that ran it and its mean dev accuracy per task."""
    started = time.perf_counter()
    job_ids = [
        service.submit(MINILM, [job.seed], task=job.task, method=job.method, k_shot=k, epochs=epochs)[0]
        for job in jobs
    ]
    done = service.wait_ended(job_ids, 3600)
    wall = time.perf_counter() - started
    failed = [(job.id, job.last_error) for job in done if job.status != "succeeded"]
    if failed:
        raise RuntimeError(f"sweep jobs failed (pack size {pack_size}): {failed[:2]}")
    runs = {
        task: [
            service.registry.get_result(j).metrics["accuracy"]
            for j, job in zip(job_ids, jobs, strict=True)
            if job.task == task
        ]
        for task in sorted({job.task for job in jobs})
    }
    return {
        "seconds": wall,
        "workers_used": len(workers_of(service, job_ids)),
        "accuracy": {task: statistics.mean(values) for task, values in runs.items()},
        "accuracies": runs,
    }


def run_size_table(
    sizes: list[int], slots: int, pack_size: int, k: int, epochs: int, methods: list[str], work: Path
) -> dict[str, Any]:
    """Sweeps of each of `sizes` jobs through the service with packs of `pack_size` against one job per
    worker slot, in one run on the same cores: one warm service per mode (its start-up and warm-up
    untimed), the sizes in turn; per size the walls and packed/slots (target <= TARGET_PACKED_OVER_SLOTS:
    packs never slower beyond noise, however few the jobs)."""
    print(
        f"\npacks against one job per slot: sweeps of {', '.join(map(str, sizes))} jobs on {MINILM} "
        f"({', '.join(methods)} cycled, SST-2 and RTE alternating, K={k}, {epochs} epoch(s), batch 16, fp32, "
        f"one dev evaluation each), {slots} slot(s); packs of {pack_size}",
        flush=True,
    )
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for name, size in (("slots", 1), ("packed", pack_size)):
        folder = work / "sizes" / name
        service = Service(folder, slots=slots, backbones=[MINILM], pack_size=size, tasks=SWEEP_TASKS)
        try:
            warm_up(service, methods, folder)
            runs[name] = {
                count: timed_sweep(service, sweep_jobs(count, methods), k, epochs, size) for count in sizes
            }
        finally:
            service.close()
    rows = []
    print(f"  {'jobs':>5} {'slots s':>9} {'packed s':>9} {'packed/slots':>13}  workers (slots, packed)")
    for count in sizes:
        slotted, packed = runs["slots"][count], runs["packed"][count]
        ratio = packed["seconds"] / slotted["seconds"]
        rows.append(
            {
                "jobs": count,
                "slots": slotted,
                "packed": packed,
                "packed_over_slots": ratio,
                "met": ratio <= TARGET_PACKED_OVER_SLOTS,
            }
        )
        print(
            f"  {count:>5} {slotted['seconds']:>9.1f} {packed['seconds']:>9.1f} {ratio:>12.2f}x  "
            f"{slotted['workers_used']}, {packed['workers_used']}; target <= {TARGET_PACKED_OVER_SLOTS:g}x: "
            f"{'met' if ratio <= TARGET_PACKED_OVER_SLOTS else 'NOT met'}",
            flush=True,
        )
    return {"sizes": sizes, "slots": slots, "pack_size": pack_size, "k": k, "epochs": epochs, "rows": rows}


def sweep_scripts(jobs: list[SweepJob], k: int, epochs: int, folder: Path) -> dict[str, Any]:
    """The sweep as PEFT scripts one after another: the LoRA peer for every job (the only peer), each on
    its job's K rows and its task's dev set."""
    model = minilm_path()
    files = {
        task: write_k_shot_files(folder / "k-shot", [j.seed for j in jobs if j.task == task], k, task)
        for task in sorted({job.task for job in jobs})
    }
    seconds, accuracy = [], {task: [] for task in files}
    for job in jobs:
        took, dev_accuracy = run_peft_script(
            files[job.task][job.seed], job.task, job.seed, epochs, folder / "peft" / f"job-{job.seed}", model
        )
        seconds.append(took)
        accuracy[job.task].append(dev_accuracy)
    return {
        "seconds": sum(seconds),
        "seconds_each": seconds,
        "accuracy": {task: statistics.mean(values) for task, values in accuracy.items()},
        "accuracies": accuracy,
    }


def share_of_limit(work: dict[str, Any], seconds: float, peak: dict[str, Any]) -> float:
    """(4·N·training tokens + 2·N·evaluation tokens) / wall-clock / the fp32 peak."""
    flops = work["n_nonembedding_parameters"] * (
        TRAIN_FLOPS_PER_TOKEN * work["train_tokens"] + EVAL_FLOPS_PER_TOKEN * work["eval_tokens"]
    )
    return flops / seconds / (peak["gflops"] * 1e9)


def accuracies(by_task: dict[str, float]) -> str:
    return ", ".join(f"{task} {value:.4f}" for task, value in by_task.items())


def run_sweep(
    count: int, slots: int, pack_size: int, k: int, epochs: int, methods: list[str], work: Path
) -> dict[str, Any]:
    """(c): the mixed sweep through the service with one job per worker slot, then with packs, then as
    PEFT scripts one after another; walls, their ratios and each service run's share of the node's limit."""
    jobs = sweep_jobs(count, methods)
    print(
        f"\n(c) mixed sweep: {count} jobs on {MINILM} ({', '.join(methods)} cycled, SST-2 and RTE "
        f"alternating, seeds 0-{count - 1}, K={k}, {epochs} epochs, batch 16, fp32, one dev evaluation each)",
        flush=True,
    )
    started = time.perf_counter()
    folder = work / "sweep"
    counted = sweep_work(jobs, k, epochs)
    peak = fp32_peak(slots, counted["hidden"], counted["intermediate"])
    per_shape = ", ".join(f"{shape}: {gflops:.0f}" for shape, gflops in peak["per_size"].items())
    print(
        f"  N = {counted['n_nonembedding_parameters'] / 1e6:.2f}M non-embedding parameters; training tokens "
        f"{counted['train_tokens']:,} (epochs x each job's K rows), evaluation tokens {counted['eval_tokens']:,} "
        f"(dev rows: {', '.join(f'{t} {n}' for t, n in counted['dev_rows'].items())}; non-padding, max_length 128)"
        f"\n  fp32 matmul peak (tokens x {counted['hidden']} x {counted['intermediate']}, {peak['threads']} "
        f"threads): {peak['gflops']:.0f} GFLOP/s [{per_shape}]",
        flush=True,
    )
    runs = {}
    for name, size in (("slots", 1), ("packed", pack_size)):
        run = sweep_service(jobs, slots, size, k, epochs, methods, folder / name)
        run["share_of_limit"] = share_of_limit(counted, run["seconds"], peak)
        runs[name] = run
        print(
            f"  service, {run['workers']} worker(s) x {worker_shape(1, size)}: {count} jobs in "
            f"{run['seconds']:.1f} s on {run['workers_used']} worker(s); {100 * run['share_of_limit']:.1f}% of "
            f"the node's fp32 limit (start-up incl. Ray and {run['warm_up_jobs']} warm-up jobs on "
            f"{run['warm_workers']} worker(s): {run['start_seconds']:.1f} s); mean dev accuracy "
            f"{accuracies(run['accuracy'])}{learning_note(run['accuracies'])}",
            flush=True,
        )
    print("  PEFT peer: LoRA for every job (the only PEFT peer here), on each job's K rows and dev set")
    scripts = sweep_scripts(jobs, k, epochs, folder)
    print(
        f"  peers: {count} PEFT scripts one after another in {scripts['seconds']:.1f} s "
        f"({statistics.mean(scripts['seconds_each']):.1f} s each); mean dev accuracy "
        f"{accuracies(scripts['accuracy'])}{learning_note(scripts['accuracies'])}"
    )
    packed, slotted = runs["packed"], runs["slots"]
    scripts_ratio = scripts["seconds"] / packed["seconds"]
    slots_ratio = slotted["seconds"] / packed["seconds"]
    share = packed["share_of_limit"]
    print(
        f"  scripts/packed: {scripts_ratio:.2f}x (target >= {TARGET_SPEEDUP:g}x: "
        f"{'met' if scripts_ratio >= TARGET_SPEEDUP else 'NOT met'}); slots/packed: {slots_ratio:.2f}x\n"
        f"  share of the node's fp32 limit, packed: {100 * share:.1f}% (target >= {100 * TARGET_SHARE:.0f}%: "
        f"{'met' if share >= TARGET_SHARE else 'NOT met'}); one job per slot: "
        f"{100 * slotted['share_of_limit']:.1f}%",
        flush=True,
    )
    print(f"[{time.perf_counter() - started:.0f} s]", flush=True)
    return {
        "jobs": [vars(job) for job in jobs],
        "slots": slots,
        "k": k,
        "epochs": epochs,
        **counted,
        "fp32_peak": peak,
        "service_slots": slotted,
        "service_packed": packed,
        "scripts": scripts,
        "peft_peer": "lora for every job",
        "scripts_over_packed": scripts_ratio,
        "slots_over_packed": slots_ratio,
        "share_of_limit_packed": share,
        "share_of_limit_slots": slotted["share_of_limit"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=16, help="jobs of the sweep")
    parser.add_argument("--slots", type=int, default=os.cpu_count() or 2, help="worker slots = CPUs")
    parser.add_argument(
        "--sweep-methods", default=",".join(SWEEP_METHODS), help="methods the sweep's jobs cycle through"
    )
    parser.add_argument(
        "--sweep-pack-size", type=int, default=8, help="places of each worker's pack (packed run)"
    )
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "pelt-bench-workers"))
    parser.add_argument(
        "--sizes",
        help="instead of the sweep above: sweeps of these many jobs (e.g. 2,4,8,16), packed against one job "
        "per slot, and packed/slots per size",
    )
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)

    print(
        f"bench_sweep: {platform.node()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}, python {platform.python_version()}",
        flush=True,
    )
    started = time.perf_counter()
    methods = [m.strip() for m in args.sweep_methods.split(",") if m.strip()]
    if args.sizes:
        sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
        report = {
            "sizes": run_size_table(
                sizes, args.slots, args.sweep_pack_size, args.k, args.epochs, methods, Path(args.workdir)
            )
        }
    else:
        report = {
            "sweep": run_sweep(
                args.jobs, args.slots, args.sweep_pack_size, args.k, args.epochs, methods, Path(args.workdir)
            )
        }
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; total {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
