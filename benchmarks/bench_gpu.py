"""Packs on one GPU against one job at a time and against PEFT scripts, per precision (issue #14, item 4).

32 jobs (`--jobs`) alternate the backbones (job i on backbone i mod B); each backbone's jobs cycle the
methods, then the tasks, so every method trains on every task on every backbone. Each job trains `--steps`
steps on its own K-shot sample (by its seed), batch 16, no evaluation. For each precision (bf16 = bf16
autocast, fp32 = none) and each pack size P (1 = one job at a time) the jobs run as packs of up to P jobs of
one backbone, one pack after another, the backbones' packs in turn (both backbones stay loaded): with two
backbones a "pack of 32" holds 16 jobs. Then, with `--peer peft`, the same jobs as PEFT scripts one after
another on the same device: `bench_peer.py` in a new process each, LoRA for every job as bench_sweep does (PEFT has no Pfeiffer adapter or UniPELT, and its
prefix tuning fails for sequence classification on transformers 5), in the first precision of --precision.

The headline ratio against PEFT is over PEFT's training loop alone (each script's own clock around its
steps: forward, backward, clipping, AdamW), while pelt's wall holds each pack's set-up as well, so it leans
towards PEFT; the ratio over the scripts' whole processes (imports, CUDA start-up, model load) is printed
beside it, labelled "including start-up".

Per setting: wall seconds, training tokens/s (non-padding), jobs/hour, ratios to one at a time and to PEFT,
peak device memory (torch.cuda.max_memory_allocated of the worst pack), each job's own memory (its delta,
gradients and AdamW state), GPU utilisation (nvidia-smi every 0.2 s) and the share of the device's dense
matmul peak at the backbones' shapes, measured in the run (4·N·tokens / wall, N = non-embedding parameters).

    python benchmarks/bench_gpu.py --export-data out/gpu-input     # here: the rows and backbone configs
    PYTHONPATH=$PWD python3 benchmarks/bench_gpu.py --data out/gpu-input/glue \\
        --backbone-configs out/gpu-input/backbones --random-weights --json $OUT/gpu.json   # on the GPU
    python benchmarks/bench_gpu.py --device cpu --jobs 4 --pack-sizes 1,2 --backbones minilm \\
        --methods lora,prefix --steps 2 --k-shot 16 --peer none --random-weights --precision fp32   # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers
from bench_packs import (
    TRAIN_FLOPS_PER_TOKEN,
    Job,
    Workload,
    comma_ints,
    comma_names,
    cpu_description,
    percent,
)
from bench_pelt_core import matmul_peak, nonembedding_parameters

from pelt_core import get_method
from pelt_core.backbones import BACKBONE_ALIASES, Backbone, read_backbone_config, resolve_backbone
from pelt_core.data import infer_task_fields, sample_k_shot
from pelt_core.devices import (
    DeviceError,
    describe_device,
    free_cached_memory,
    is_out_of_memory,
    resolve_device,
)
from pelt_core.pack import Pack

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent.parent / "shared" / "data" / "glue"
PRECISIONS = {"bf16": "true", "fp32": "false"}  # TrainConfig.bf16 of each
PEAK_TOKENS = {"cpu": (448, 2048), "cuda": (2048, 8192, 32768)}  # the peak at tokens x hidden x intermediate
PEER_DEV_ROWS = 16  # a PEFT script evaluates once at its end: a token dev set (pelt's jobs evaluate none)
TARGET_PACKED, TARGET_PEFT = 5.0, 10.0


class Rows:
    """JSON Lines rows with the few `datasets.Dataset` calls a pack makes (column_names, a column by name,
    len, select): the GPU machine has no `datasets`."""

    def __init__(self, rows: list[Any]):
        self.rows = rows

    @property
    def column_names(self) -> list[str]:
        return list(self.rows[0]) if self.rows else []

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str) -> list[Any]:
        return [row.get(name) for row in self.rows]

    def select(self, indices) -> Rows:
        return Rows([self.rows[i] for i in indices])


def read_rows(path: Path) -> Rows:
    if not path.is_file():
        raise SystemExit(f"no training rows at {path} (--data names a GLUE folder with <task>/train.jsonl)")
    return Rows([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def write_rows(path: Path, rows: Rows, fields: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({f: row[f] for f in fields}) + "\n" for row in rows.rows))


@dataclass(frozen=True)
class GpuJob:
    """One benchmark job: its backbone, method, task and seed (which draws its K rows)."""

    backbone: str
    method: str
    task: str
    seed: int


def benchmark_jobs(count: int, backbones: list[str], methods: list[str], tasks: list[str]) -> list[GpuJob]:
    """Job i on backbone i mod B; a backbone's j-th job has method j mod M and task (j div M) mod T."""
    jobs = []
    for i in range(count):
        j = i // len(backbones)
        task = tasks[(j // len(methods)) % len(tasks)]
        jobs.append(GpuJob(backbones[i % len(backbones)], methods[j % len(methods)], task, i))
    return jobs


def packs_of(jobs: list[GpuJob], size: int) -> list[list[GpuJob]]:
    """Each backbone's jobs in packs of up to `size`, in order; the backbones' packs in turn."""
    per_backbone = [[j for j in jobs if j.backbone == b] for b in dict.fromkeys(j.backbone for j in jobs)]
    chunks = [[mine[i : i + size] for i in range(0, len(mine), size)] for mine in per_backbone]
    return [chunk[r] for r in range(max(map(len, chunks))) for chunk in chunks if r < len(chunk)]


@dataclass
class GpuWorkload(Workload):
    """bench_packs' Workload with a precision (bf16 autocast or none) and the backbone's storage dtype."""

    bf16: str = "false"
    backbone_dtype: str = "float32"
    n_params: int = 0  # the backbone's non-embedding parameters (training FLOPs = 4·N·tokens)

    def config(self, job: Job, max_steps: int):
        return replace(super().config(job, max_steps), bf16=self.bf16, backbone_dtype=self.backbone_dtype)


# --------------------------------------------------------------------------------------------------
# Backbones: packaged weights, or random weights from the packaged (or exported) config and tokenizer
# --------------------------------------------------------------------------------------------------
def backbone_source(name: str, configs: str | None) -> tuple[str, str, str | None]:
    """(canonical name, folder, gguf file or None): the exported folder under `configs`, else the package."""
    if configs is None:
        return resolve_backbone(name)
    canonical = BACKBONE_ALIASES.get(name, name)
    if not (Path(configs) / canonical / "config.json").is_file():
        raise SystemExit(f"no config for backbone {name!r} in {configs} (write it with --export-data)")
    return canonical, str(Path(configs) / canonical), None


def build_backbone(name: str, args: argparse.Namespace, peer_folder: Path | None) -> tuple[Backbone, Path]:
    """The backbone on the device in --backbone-dtype (with --random-weights: built from its config, seed 0),
    and the folder of an fp32 checkpoint of the same weights for the PEFT scripts (with `peer_folder`)."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    canonical, path, gguf = backbone_source(name, args.backbone_configs)
    if args.random_weights:
        config = read_backbone_config(path, gguf, name)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, gguf_file=gguf)
        with torch.random.fork_rng(devices=[]):  # the same weights every run, the caller's RNG untouched
            torch.manual_seed(0)
            model = AutoModel.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
        backbone = Backbone(model, tokenizer, canonical, content_hash=f"random:{canonical}", source=path)
    else:
        backbone = Backbone.load(name, dtype="float32")
    peer_path = peer_folder / canonical if peer_folder else None
    if peer_path:
        backbone.model.save_pretrained(peer_path)
        backbone.tokenizer.save_pretrained(peer_path)
    backbone.model.to(getattr(torch, args.backbone_dtype))
    return backbone.to(args.device), peer_path


def export_data(args: argparse.Namespace, jobs: list[GpuJob]) -> None:
    """What a GPU run reads and cannot find there: per task the union of the jobs' K-shot rows (there each
    job samples its K rows from these by its seed), per backbone its config and tokenizer (no weights)."""
    from transformers import AutoTokenizer

    out = Path(args.export_data)
    for task in args.tasks:
        rows = read_rows(Path(args.data) / task / "train.jsonl")
        indices = Rows(list(range(len(rows))))
        seeds = [job.seed for job in jobs if job.task == task]
        picked = sorted({i for seed in seeds for i in sample_k_shot(indices, args.k_shot, seed).rows})
        write_rows(out / "glue" / task / "train.jsonl", rows.select(picked), rows.column_names)
        print(f"{task}: {len(picked)} of {len(rows)} rows -> {out / 'glue' / task / 'train.jsonl'}")
    for name in args.backbones:
        canonical, path, gguf = resolve_backbone(name)
        read_backbone_config(path, gguf, name).save_pretrained(out / "backbones" / canonical)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, gguf_file=gguf)
        tokenizer.save_pretrained(out / "backbones" / canonical)
        print(f"{name}: config and tokenizer -> {out / 'backbones' / canonical}")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{size / 2**20:.1f} MiB in {out}: carry it, and run with")
    print(f"  --data {out}/glue --backbone-configs {out}/backbones --random-weights")


# --------------------------------------------------------------------------------------------------
# Measuring: the matmul peak, GPU utilisation, one pack, one setting, the PEFT scripts
# --------------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_matmul_peak(device: torch.device, dtype_name: str, shapes: list[tuple], seconds: float) -> dict:
    """Best GFLOP/s of torch.matmul at (m × k) @ (k × n) `shapes` on `device` (a CPU: bench_pelt_core's)."""
    if device.type != "cuda":
        return matmul_peak(dtype_name, shapes=shapes, seconds=seconds)
    dtype, per_size = getattr(torch, dtype_name), {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        torch.matmul(a, b)
        synchronize(device)
        rates, deadline = [], time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(rates) < 3:
            started = time.perf_counter()
            for _ in range(10):
                torch.matmul(a, b)
            synchronize(device)
            rates.append(10 * 2 * m * k * n / (time.perf_counter() - started) / 1e9)
        per_size[f"{m}x{k}x{n}"] = max(rates)
    return {"dtype": dtype_name, "gflops": max(per_size.values()), "per_size": per_size}


class GpuSampler:
    """GPU utilisation and memory used (MiB) from one `nvidia-smi -lms 200` between start and stop;
    no samples ("n/a") without nvidia-smi or a GPU."""

    def __init__(self, device: torch.device):
        self.command, self.samples, self._process = None, [], None
        if device.type != "cuda":
            return
        query = ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"]
        try:
            listed = subprocess.run(query, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return
        gpus = [line.split(", ") for line in listed.strip().splitlines()]
        uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
        index = next((i for i, u in gpus if uuid and uuid in u), gpus[0][0] if len(gpus) == 1 else None)
        if index is not None:
            self.command = ["nvidia-smi", "-i", index, "--query-gpu=utilization.gpu,memory.used"]
            self.command += ["--format=csv,noheader,nounits", "-lms", "200"]

    def start(self) -> None:
        self.samples = []
        if self.command:
            pipe = subprocess.PIPE
            self._process = subprocess.Popen(self.command, stdout=pipe, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()

    def _read(self) -> None:
        for line in self._process.stdout:
            try:
                self.samples.append([float(x) for x in line.split(",")])
            except ValueError:
                continue

    def stop(self) -> dict[str, Any]:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            self._reader.join(timeout=5)
            self._process = None
        util = [s[0] / 100 for s in self.samples]
        return {
            "util_mean": sum(util) / len(util) if util else None,
            "util_max": max(util, default=None),
            "memory_used_mib_max": max((s[1] for s in self.samples), default=None),
            "samples": len(self.samples),
        }


def run_one_pack(work: GpuWorkload, jobs: list[GpuJob], steps: int) -> dict[str, Any]:
    """`jobs` joined to one pack and stepped to the end: their tokens and own memory, the pack's steps, its
    out-of-memory retries and peak. A job's failure raises (running out of memory first: it did not fit)."""
    device = work.backbone.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    pack = Pack(work.backbone)
    members = [work.join(pack, Job(job.method, job.task, job.seed), steps) for job in jobs]
    while not all(member.done for member in members):
        pack.step()
    synchronize(device)
    errors = [member.error for member in members if member.error is not None]
    if errors:
        raise next((error for error in errors if is_out_of_memory(error)), errors[0])
    return {
        "tokens": sum(m.result.train_tokens for m in members),
        "job_memory": [m.result.job_memory_bytes for m in members],
        "peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "pack_steps": pack.steps,
        "out_of_memory_retries": pack.out_of_memory,
    }


def run_setting(works: dict, jobs: list[GpuJob], size: int, precision: str, args) -> dict[str, Any]:
    """All jobs in packs of up to `size` (`packs_of`) in one precision: wall, tokens, memory, utilisation."""
    packs, sampler = packs_of(jobs, size), GpuSampler(args.device)
    row = {
        "precision": precision,
        "pack_size": size,
        "packs": len(packs),
        "largest_pack": max(map(len, packs)),
    }
    runs, flops = [], 0.0
    gc.collect()
    sampler.start()
    started = time.perf_counter()
    try:
        for pack in packs:
            work = replace(works[pack[0].backbone], bf16=PRECISIONS[precision])
            runs.append(run_one_pack(work, pack, args.steps))
            flops += TRAIN_FLOPS_PER_TOKEN * work.n_params * runs[-1]["tokens"]
        row |= {"fit": True, "error": None}
    except Exception as exc:  # one setting's failure is reported, and the other settings still run
        kind = "did not fit" if is_out_of_memory(exc) else "failed"
        row |= {"fit": False, "error": f"{kind}: {(str(exc) or type(exc).__name__).splitlines()[0][:300]}"}
    wall = time.perf_counter() - started
    row["gpu"] = sampler.stop()
    gc.collect()
    free_cached_memory(args.device)
    if not row["fit"]:
        return row
    tokens, peaks = sum(run["tokens"] for run in runs), [run["peak"] for run in runs if run["peak"]]
    job_memory = [b for run in runs for b in run["job_memory"]]
    return row | {
        "wall_seconds": wall,
        "tokens": tokens,
        "tokens_per_second": tokens / wall,
        "jobs_per_hour": len(jobs) / wall * 3600,
        "flops": flops,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "peak_memory_per_job_bytes": max(peaks) / row["largest_pack"] if peaks else None,
        "job_memory_bytes_mean": sum(job_memory) / len(job_memory),
        "job_memory_bytes_max": max(job_memory),
        "pack_steps": sum(run["pack_steps"] for run in runs),
        "out_of_memory_retries": sum(run["out_of_memory_retries"] for run in runs),
    }


def warm_up(works: dict[str, GpuWorkload], methods: list[str], task: str, precision: str) -> None:
    """First-call costs (CUDA context, cuBLAS, kernels, the allocator's pool) out of the timings: per
    backbone a pack of every method for 2 steps, then each method alone for 1."""
    for name, work in works.items():
        work = replace(work, bf16=PRECISIONS[precision])
        warm = [GpuJob(name, method, task, 10_000 + i) for i, method in enumerate(methods)]
        run_one_pack(work, warm, 2)
        for job in warm:
            run_one_pack(work, [job], 1)


def run_peer(jobs: list[GpuJob], works: dict, models: dict, precision: str, args, folder: Path) -> dict:
    """The jobs as PEFT scripts one after another (`bench_peer.py --lib peft --method lora`, a new process
    each, on the device): each on its job's K rows for `--steps` steps. Its training seconds are the script's
    own clock around its training loop; its process seconds run from start to exit (start-up included)."""
    sampler, seconds, train_seconds, tokens, failed = GpuSampler(args.device), [], [], 0, []
    learning_rate = get_method("lora").defaults.get("learning_rate", 1e-3)
    sampler.start()
    for job in jobs:
        fields = works[job.backbone].task_fields[job.task]
        columns = [*fields.text_fields, fields.label_field]
        rows = sample_k_shot(works[job.backbone].train_rows[job.task], args.k_shot, job.seed)
        files = {"train": folder / f"job{job.seed}-train.jsonl", "dev": folder / f"job{job.seed}-dev.jsonl"}
        write_rows(files["train"], rows, columns)
        write_rows(files["dev"], rows.select(range(min(PEER_DEV_ROWS, len(rows)))), columns)
        options = {"lib": "peft", "method": "lora", "model": models[job.backbone], **files, "seed": job.seed}
        options |= {"fields": ",".join(fields.text_fields), "max-steps": args.steps, "lr": learning_rate}
        options |= {"batch-size": args.batch_size, "max-length": args.max_length, "device": args.device}
        command = [sys.executable, str(HERE / "bench_peer.py"), *["--bf16"] * (precision == "bf16")]
        command += [item for key, value in options.items() for item in (f"--{key}", str(value))]
        began = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        seconds.append(time.perf_counter() - began)
        if done.returncode:
            failed.append(f"job {job.seed} ({job.backbone}): {done.stderr.strip()[-300:]}")
            print(f"  PEFT script failed: {failed[-1]}", flush=True)
        else:
            result = json.loads(done.stdout.strip().splitlines()[-1])
            tokens += result["tokens"]
            train_seconds.append(result["train_seconds"])
    wall, training = sum(seconds), sum(train_seconds)
    row = {"precision": precision, "pack_size": "PEFT", "packs": len(jobs), "largest_pack": 1, "fit": True}
    return row | {
        "error": None,
        "method": "lora for every job",
        "failed": failed,
        "gpu": sampler.stop(),
        "wall_seconds": training,
        "process_seconds": wall,
        "seconds_each": seconds,
        "train_seconds_each": train_seconds,
        "tokens": tokens,
        "tokens_per_second": tokens / training if training else None,
        "tokens_per_second_including_startup": tokens / wall,
        "jobs_per_hour": (len(jobs) - len(failed)) / training * 3600 if training else None,
        "ratio_vs_peft": 1.0,
        "ratio_vs_peft_including_startup": 1.0,
    }


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------
def cell(value: Any, spec: str, suffix: str = "") -> str:
    """A number in a table cell, "n/a" for none."""
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f} MiB"


def utilisation(gpu: dict[str, Any]) -> str:
    return "n/a" if gpu["util_mean"] is None else f"{percent(gpu['util_mean'])} / {percent(gpu['util_max'])}"


COLUMNS = (  # (header, the cell of a setting's row or of the PEFT scripts' row)
    ("precision", lambda r: r["precision"]),
    ("pack size", lambda r: "PEFT scripts" if r["pack_size"] == "PEFT" else str(r["pack_size"])),
    ("packs (largest)", lambda r: f"{r['packs']} ({r['largest_pack']})"),
    ("wall s", lambda r: r["error"] or cell(r["wall_seconds"], ".1f")),
    ("tok/s", lambda r: cell(r.get("tokens_per_second"), ",.0f")),
    ("jobs/h", lambda r: cell(r.get("jobs_per_hour"), ",.0f")),
    ("× one at a time", lambda r: cell(r.get("ratio_vs_one_at_a_time"), ".2f", "×")),
    ("× PEFT training", lambda r: cell(r.get("ratio_vs_peft"), ".2f", "×")),
    ("× PEFT including start-up", lambda r: cell(r.get("ratio_vs_peft_including_startup"), ".2f", "×")),
    ("peak memory", lambda r: mib(r.get("peak_memory_bytes"))),
    ("peak ÷ largest pack", lambda r: mib(r.get("peak_memory_per_job_bytes"))),
    ("own memory per job", lambda r: mib(r.get("job_memory_bytes_mean"))),
    ("GPU util mean / max", lambda r: utilisation(r["gpu"])),
    ("% of matmul peak", lambda r: percent(r.get("fraction_of_peak"))),
    ("OOM retries", lambda r: cell(r.get("out_of_memory_retries"), "d")),
)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def add_ratios(report: dict[str, Any]) -> None:
    """Each row's tokens/s over one-at-a-time's and over the PEFT scripts' (same precision); its FLOP/s
    over the precision's matmul peak."""
    for row in (r for r in report["settings"] if r["fit"]):
        same = [r for r in report["settings"] if r["precision"] == row["precision"] and r["fit"]]
        alone = next((r for r in same if r["pack_size"] == 1), None)
        peer, peak = report["peft"].get(row["precision"]), report["peaks"][row["precision"]]
        row["ratio_vs_one_at_a_time"] = (
            row["tokens_per_second"] / alone["tokens_per_second"] if alone else None
        )
        row["ratio_vs_peft"] = ratio(row["tokens_per_second"], peer and peer["tokens_per_second"])
        whole = peer and peer["tokens_per_second_including_startup"]
        row["ratio_vs_peft_including_startup"] = ratio(row["tokens_per_second"], whole)
        row["fraction_of_peak"] = row["flops"] / row["wall_seconds"] / (peak["gflops"] * 1e9)


def markdown(report: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    rows = [*report["settings"], *report["peft"].values()]
    return "\n".join(lines + ["| " + " | ".join(f(row) for _, f in COLUMNS) + " |" for row in rows])


def target_lines(report: dict[str, Any]) -> list[str]:
    """Per precision: the largest pack size that fit, against one at a time and against PEFT."""
    lines = []
    for precision in dict.fromkeys(row["precision"] for row in report["settings"]):
        fit = [
            r for r in report["settings"] if r["precision"] == precision and r["fit"] and r["pack_size"] > 1
        ]
        if not fit:
            lines.append(f"{precision}: no pack of more than one job fit")
            continue
        best = max(fit, key=lambda r: r["pack_size"])
        largest = f"{precision}: largest pack that fit ({best['pack_size']})"
        why = "--peer none" if report["args"]["peer"] == "none" else "PEFT ran in the first precision only"
        alone, peft = best["ratio_vs_one_at_a_time"], best["ratio_vs_peft"]
        lines.append(f"{largest} vs one at a time: {cell(alone, '.2f', '×')} (target ≥ {TARGET_PACKED:g}×)")
        whole = best.get("ratio_vs_peft_including_startup")
        peft_text = f"{peft:.2f}× (target ≥ {TARGET_PEFT:g}×)" if peft else f"not measured ({why})"
        lines.append(f"{largest} vs PEFT's training loops: {peft_text}")
        if whole:
            lines.append(f"{largest} vs PEFT's whole processes, including start-up: {whole:.2f}×")
    return lines


def write_outputs(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The JSON and Markdown so far (after every setting: a run cut short keeps what it measured)."""
    add_ratios(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(report) + "\n\n" + "\n".join(target_lines(report)) + "\n")


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--device", default="auto", help="auto (a GPU when torch sees one), cuda, cuda:N or cpu")
    add("--jobs", type=int, default=32)
    add("--pack-sizes", type=comma_ints, default=[1, 8, 16, 32], help="1 = one job at a time")
    add("--backbones", type=comma_names, default=["minilm", "smollm2"], help="alternated by the jobs")
    add("--methods", type=comma_names, default=["lora", "pfeiffer", "prefix", "unipelt"])
    add("--tasks", type=comma_names, default=["sst2", "rte"])
    add("--k-shot", type=int, default=500, help="K training rows per job (its own sample, by its seed)")
    add("--steps", type=int, default=20, help="training steps per job")
    add("--batch-size", type=int, default=16)
    add("--max-length", type=int, default=128)
    add("--precision", type=comma_names, default=["bf16", "fp32"], help="bf16 (autocast) and/or fp32")
    add("--backbone-dtype", choices=("float32", "bfloat16"), default="float32", help="the backbone's storage")
    add("--data", default=str(DEFAULT_DATA), help="a GLUE folder with <task>/train.jsonl")
    add("--export-data", metavar="DIR", help="write the rows and backbone configs a GPU run needs, and stop")
    add("--backbone-configs", metavar="DIR", help="config + tokenizer per backbone (from --export-data)")
    add("--random-weights", action="store_true", help="build backbones from config + tokenizer, random init")
    add("--peer", choices=("peft", "none"), default="peft", help="PEFT scripts, in the first precision")
    add(
        "--peer-jobs",
        type=int,
        help="run the PEFT scripts for the first N jobs only (a rate needs no more; default: every job)",
    )
    add("--peak-seconds", type=float, default=0.5, help="per shape, for the matmul peak")
    add("--workdir", help="where the PEFT scripts' checkpoints and rows go (default: a temporary folder)")
    add("--json")
    add("--markdown")
    args = parser.parse_args(argv)
    if args.peer_jobs is not None and not 1 <= args.peer_jobs <= args.jobs:
        parser.error(f"--peer-jobs must be between 1 and --jobs ({args.jobs}), got {args.peer_jobs}")
    for name in ("jobs", "k_shot", "steps", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.pack_sizes or min(args.pack_sizes) < 1:
        parser.error(f"--pack-sizes must be positive whole numbers, got {args.pack_sizes}")
    if not args.precision or set(args.precision) - set(PRECISIONS):
        parser.error(f"--precision takes bf16 and/or fp32, got {','.join(args.precision)}")
    if args.backbone_configs and not args.random_weights and not args.export_data:
        parser.error("--backbone-configs holds no weights: use it with --random-weights")
    for method in args.methods:
        try:
            get_method(method)
        except Exception as exc:  # the registry's own error names the method and the known ones
            parser.error(f"--methods: {exc}")
    try:
        args.device = resolve_device(args.device)
    except DeviceError as exc:
        parser.error(f"--device: {exc}")
    return args


def environment(device: torch.device) -> dict[str, Any]:
    """The device, the library versions and the CPU model."""
    import numpy

    try:
        import peft
    except ImportError:
        peft = None
    return {
        "device": describe_device(device),
        **{"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__},
        **{
            "peft": peft and peft.__version__,
            "numpy": numpy.__version__,
            "python": platform.python_version(),
        },
        **{"cpu": cpu_description()["model"], "cpus": os.cpu_count()},
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def load_workloads(args: argparse.Namespace, peer_folder: Path | None) -> tuple[dict, dict]:
    """Each backbone's workload (the training rows, their fields) and its checkpoint for the PEFT scripts."""
    rows = {task: read_rows(Path(args.data) / task / "train.jsonl") for task in args.tasks}
    fields = {task: infer_task_fields(data) for task, data in rows.items()}
    works, models = {}, {}
    for name in args.backbones:
        backbone, models[name] = build_backbone(name, args, peer_folder)
        n_params = nonembedding_parameters(backbone)
        settings = {"backbone_dtype": args.backbone_dtype, "n_params": n_params}
        works[name] = GpuWorkload(
            backbone, rows, fields, None, args.k_shot, args.batch_size, args.max_length, **settings
        )
        weights = "random weights" if args.random_weights else "its weights"
        print(
            f"{name}: {backbone.num_parameters / 1e6:.1f}M parameters ({n_params / 1e6:.1f}M non-embedding), "
            f"{backbone.dtype} on {backbone.device}, {weights}",
            flush=True,
        )
    return works, models


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (or, with --export-data, write its inputs); returns the report."""
    args = parse_args(argv)
    jobs = benchmark_jobs(args.jobs, args.backbones, args.methods, args.tasks)
    if args.export_data:
        export_data(args, jobs)
        return {}
    started = time.perf_counter()
    report = {"args": vars(args), "environment": environment(args.device), "jobs": [vars(j) for j in jobs]}
    report |= {"settings": [], "peft": {}, "peaks": {}}
    print("environment: " + json.dumps(report["environment"]), flush=True)

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:5.0f}s] {text}", flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.workdir or scratch)
        works, models = load_workloads(args, folder / "peer-models" if args.peer == "peft" else None)
        for precision in args.precision:
            dtype = "bfloat16" if precision == "bf16" else "float32"
            sizes = [(w.backbone.hidden_size, w.backbone.config.intermediate_size) for w in works.values()]
            shapes = [(t, h, i) for h, i in sizes for t in PEAK_TOKENS[args.device.type]]
            report["peaks"][precision] = device_matmul_peak(args.device, dtype, shapes, args.peak_seconds)
            log(f"{dtype} matmul peak {report['peaks'][precision]['gflops']:,.0f} GFLOP/s")
            warm_up(works, args.methods, args.tasks[0], precision)
            for size in args.pack_sizes:
                row = run_setting(works, jobs, size, precision, args)
                report["settings"].append(row)
                took = (
                    f"{row['wall_seconds']:.1f}s, {row['tokens_per_second']:,.0f} tok/s" if row["fit"] else ""
                )
                log(f"{precision}, packs of {size}: {took or row['error']}")
                write_outputs(args, report)
        if args.peer == "peft":
            precision = args.precision[0]
            peer_jobs = jobs[: args.peer_jobs or len(jobs)]
            peer = run_peer(peer_jobs, works, models, precision, args, folder / "peer-rows")
            report["peft"][precision] = peer
            log(
                f"{len(peer_jobs)} PEFT scripts ({precision}): {peer['wall_seconds']:.1f}s training, "
                f"{peer['process_seconds']:.1f}s as processes"
            )
    write_outputs(args, report)
    print(
        f"\n{len(jobs)} jobs ({', '.join(args.backbones)} alternating; {', '.join(args.methods)} on "
        f"{', '.join(args.tasks)}), K={args.k_shot}, {args.steps} steps each, batch {args.batch_size}, "
        f"max_length {args.max_length}, backbone in {args.backbone_dtype}. A pack holds one backbone's jobs; "
        "packs run one after another, the backbones' packs in turn; walls include each job's set-up.\n"
    )
    print(markdown(report) + "\n\n" + "\n".join(target_lines(report)))
    print(f"\ntotal {time.perf_counter() - started:.0f}s")
    return report


if __name__ == "__main__":
    main()
