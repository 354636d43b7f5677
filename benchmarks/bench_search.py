"""The method search against the full grid over the same methods and ranges, per task, in one run.
Prints numbers and ratios measured in the same run; asserts nothing.

What runs (one `pelt serve` on this machine, its default workers, a fresh data directory; every job
through the service's queue, as a user's would):
  - the grid: every method (`--methods`, default bitfit, lora, pfeiffer, prefix) at each learning rate
    of `--lr-factors` x its preset's (default 1/3, 1, 3: the ends and middle of the range the search
    draws from, log-uniform over [preset / 3, preset x 3]), `--grid-seeds` seeds each (default 4);
  - `pelt search` on the same task, methods and fixed settings, with a budget of `--budget-share`
    (default 1/3) of the grid's compute on its first `--search-seeds` seeds (3: the seeds the search's
    answer carries, so the comparison is of equals; the grid's 4th seed only serves the agreement below).
The protocol is the study's: K training rows (`--k`, 500), a dev split of `--dev-rows` (200) evaluated
after every epoch, the best checkpoint kept, `--epochs` (4) full epochs, batch 16; the GLUE validation
split is the test set. The sizes (LoRA rank, adapter bottleneck, prefix length) stay at the presets' on
both sides (`r=8` fixed for the search, which fixes every size): a grid over three sizes as well would
cost three times as much.

Reported per task:
  - the grid's configuration with the best mean dev score over seeds 0-2 (what a user of the grid would
    pick) and its test mean; the grid's best test mean over seeds 0-2 (an oracle: picked on test);
  - the search's chosen configuration and its test mean over its 3 seeds, with the 95% interval;
  - compute: full-job equivalents (a job at the full epochs = 1) and worker-seconds (each job's
    started-to-finished time on its worker), the search's over the 3-seed grid's;
  - agreement of the leaderboard's "not separable from the top" mark (Welch's t-test at 95%, as the
    leaderboard's) between two halves of the grid's seeds ({0, 1} and {2, 3}): the share of the grid's
    configurations marked the same way in both halves, ranked by mean test score as the leaderboard is.
Targets: the search within 1 point of the grid's pick at <= 1/3 of its compute on every task.

    python benchmarks/bench_search.py --json search.json
    python benchmarks/bench_search.py --tasks sst2 --k 64 --dev-rows 32 --epochs 1 --grid-seeds 4 \\
        --methods bitfit,lora --budget-share 0.5          # a smoke run (minutes)

GLUE task folders (train.jsonl, validation.jsonl, task.json) come from /work/shared/data/glue
(PELT_GLUE_DIR overrides).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GLUE = Path(os.environ.get("PELT_GLUE_DIR", "/work/shared/data/glue"))
TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class GridRun:
    """One finished grid job: its configuration, seed, scores and the worker time it took."""

    method: str
    learning_rate: float
    seed: int
    dev: float | None
    test: float | None
    worker_seconds: float


def configuration_name(method: str, learning_rate: float) -> str:
    return f"{method} lr={learning_rate:.3g}"


def by_configuration(runs: Iterable[GridRun], seeds: Iterable[int]) -> dict[str, list[GridRun]]:
    """The runs of the given seeds, grouped by configuration (method and learning rate)."""
    wanted = set(seeds)
    groups: dict[str, list[GridRun]] = {}
    for run in runs:
        if run.seed in wanted:
            groups.setdefault(configuration_name(run.method, run.learning_rate), []).append(run)
    return groups


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present and len(present) == len(values) else None


def grid_summary(runs: Sequence[GridRun], seeds: Sequence[int], direction: str = "max") -> dict[str, Any]:
    """The grid over `seeds`: each configuration's mean dev and test score (None where a seed is missing
    or failed), the configuration a user picks (best mean dev) and the oracle (best mean test)."""
    sign = 1.0 if direction == "max" else -1.0
    rows = {}
    for name, group in by_configuration(runs, seeds).items():
        complete = len({run.seed for run in group}) == len(seeds)
        rows[name] = {
            "dev_mean": _mean([run.dev for run in group]) if complete else None,
            "test_mean": _mean([run.test for run in group]) if complete else None,
            "seeds": sorted(run.seed for run in group),
        }
    scored = {name: row for name, row in rows.items() if row["dev_mean"] is not None}
    picked = max(scored, key=lambda name: (sign * scored[name]["dev_mean"], name), default=None)
    tested = {name: row for name, row in scored.items() if row["test_mean"] is not None}
    oracle = max(tested, key=lambda name: (sign * tested[name]["test_mean"], name), default=None)
    return {"configurations": rows, "picked": picked, "oracle": oracle}


def separable_marks(
    runs: Sequence[GridRun], seeds: Sequence[int], direction: str = "max"
) -> dict[str, bool | None]:
    """Per configuration over `seeds`: whether the leaderboard would mark it *not separable* from the
    top row (the best mean test score), by its own test (Welch's t at 95%); the top row itself: True;
    None where a configuration has fewer than two seeds."""
    from services.registry.leaderboard import tied

    sign = 1.0 if direction == "max" else -1.0
    values = {
        name: [run.test for run in group if run.test is not None]
        for name, group in by_configuration(runs, seeds).items()
    }
    values = {name: scores for name, scores in values.items() if scores}
    if not values:
        return {}
    top = max(values, key=lambda name: (sign * statistics.fmean(values[name]), name))
    return {name: True if name == top else tied(values[top], scores) for name, scores in values.items()}


def mark_agreement(first: Mapping[str, bool | None], second: Mapping[str, bool | None]) -> dict[str, Any]:
    """How many configurations carry the same "not separable from the top" mark in both halves."""
    both = [name for name in first if name in second and first[name] is not None and second[name] is not None]
    same = [name for name in both if first[name] == second[name]]
    return {
        "configurations": len(both),
        "agree": len(same),
        "share": len(same) / len(both) if both else None,
        "not_separable_first": sorted(name for name in both if first[name]),
        "not_separable_second": sorted(name for name in both if second[name]),
    }


def worker_seconds(job: Any) -> float:
    """The job's time on its worker, started to finished (0 for a job that never started)."""
    if job.started_at is None or job.finished_at is None:
        return 0.0
    return max(0.0, (job.finished_at - job.started_at).total_seconds())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_tile"})
    return []


class ServiceProcess:
    """`pelt serve` on a free loopback port with a fresh data directory, as a user starts it."""

    def __init__(self, work: Path, extra_args: Sequence[str] = ()) -> None:
        self.data_dir = work / "data"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        os.environ["PELT_DATA_DIR"] = str(self.data_dir)  # the client finds the local token there
        self.log = (work / "serve.log").open("w")
        script = Path(sys.executable).with_name(
            "pelt"
        )  # none where pelt runs from a source tree (PYTHONPATH)
        pelt = (
            [str(script)]
            if script.is_file()
            else [sys.executable, "-c", "from services.cli import main; main()"]
        )
        self.process = subprocess.Popen(
            [*pelt, "serve", "--host", "127.0.0.1", "--port", str(self.port), *extra_args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )

    def client(self, timeout: float = 180.0) -> Any:
        from services.client import PeltClient

        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pelt serve exited with {self.process.returncode}; see {self.log.name}")
            try:
                client = PeltClient(self.url)
                client.health()
                return client
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def submit_grid(client: Any, task: str, args: argparse.Namespace, fixed: Mapping[str, Any]) -> list[int]:
    """Every grid job of a task, queued: methods x learning rates x seeds."""
    ids = []
    for method in args.methods:
        preset = float(client.method(method).spec["defaults"]["learning_rate"])
        for factor in args.lr_factors:
            for seed in range(args.grid_seeds):
                job = client.submit(
                    task,
                    method,
                    hyperparameters={**fixed, "learning_rate": float(f"{preset * factor:.3g}")},
                    seed=seed,
                    k_shot=args.k,
                )
                ids.append(job.id)
    return ids


def wait_jobs(client: Any, ids: Sequence[int], poll_seconds: float = 15.0) -> list[Any]:
    """Poll until every job has ended; prints the count when it changes."""
    said = None
    while True:
        jobs = [client.job(job_id) for job_id in ids]
        ended = sum(job.status in TERMINAL for job in jobs)
        if ended != said:
            print(f"  {time.strftime('%H:%M:%S')} {ended}/{len(jobs)} jobs ended", flush=True)
            said = ended
        if ended == len(jobs):
            return jobs
        time.sleep(poll_seconds)


def grid_runs(client: Any, jobs: Sequence[Any]) -> list[GridRun]:
    runs = []
    for job in jobs:
        dev = test = None
        if job.status == "succeeded":
            result = client.result(job.id)
            dev, test = result.dev_primary_metric, result.primary_metric
        runs.append(
            GridRun(
                job.method,
                float(job.hyperparameters["learning_rate"]),
                job.seed,
                dev,
                test,
                worker_seconds(job),
            )
        )
    return runs


def report_task(
    task: str, runs: list[GridRun], search: Any, search_jobs: list[Any], args: argparse.Namespace
) -> dict[str, Any]:
    compared_seeds = list(range(args.search_seeds))
    direction = search.metric_direction
    grid = grid_summary(runs, compared_seeds, direction)
    grid_all = grid_summary(runs, list(range(args.grid_seeds)), direction)
    half = args.grid_seeds // 2
    first = separable_marks(runs, list(range(half)), direction)
    second = separable_marks(runs, list(range(half, 2 * half)), direction)
    grid_jobs = [run for run in runs if run.seed in compared_seeds]
    grid_equivalents = float(len(grid_jobs))
    grid_seconds = sum(run.worker_seconds for run in grid_jobs)
    search_seconds = sum(worker_seconds(job) for job in search_jobs)
    chosen = search.chosen or {}
    picked = grid["configurations"].get(grid["picked"] or "", {})
    oracle = grid["configurations"].get(grid["oracle"] or "", {})
    chosen_name = (
        configuration_name(chosen["method"], float(chosen["hyperparameters"].get("learning_rate", 0)))
        if chosen
        else None
    )
    gap = (
        100 * (chosen["test_mean"] - picked["test_mean"])
        if chosen and picked.get("test_mean") is not None
        else None
    )
    return {
        "task": task,
        "metric": search.metric,
        "grid": {
            "configurations": len(grid["configurations"]),
            "seeds_compared": compared_seeds,
            "picked": grid["picked"],
            "picked_dev_mean": picked.get("dev_mean"),
            "picked_test_mean": picked.get("test_mean"),
            "oracle": grid["oracle"],
            "oracle_test_mean": oracle.get("test_mean"),
            "picked_over_all_seeds": grid_all["picked"],
            "full_job_equivalents": grid_equivalents,
            "worker_seconds": grid_seconds,
            "failed_jobs": sum(run.dev is None for run in runs),
            "rows": grid["configurations"],
        },
        "search": {
            "id": search.id,
            "status": search.status,
            "last_error": search.last_error,
            "budget": search.budget,
            "schedule": search.schedule,
            "configurations": search.configurations,
            "chosen": chosen_name,
            "chosen_hyperparameters": chosen.get("hyperparameters"),
            "test_mean": chosen.get("test_mean"),
            "ci_low": chosen.get("ci_low"),
            "ci_high": chosen.get("ci_high"),
            "seeds": chosen.get("seeds"),
            "full_job_equivalents": search.spent,
            "worker_seconds": search_seconds,
            "jobs": len(search_jobs),
        },
        "search_minus_grid_pick_points": gap,
        "compute_ratio_equivalents": search.spent / grid_equivalents if grid_equivalents else None,
        "compute_ratio_worker_seconds": search_seconds / grid_seconds if grid_seconds else None,
        "agreement": mark_agreement(first, second)
        | {"halves": [list(range(half)), list(range(half, 2 * half))]},
    }


def points(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def print_table(reports: list[dict[str, Any]]) -> None:
    print(
        "\n| task | grid pick (dev) | its test | grid oracle test | search's choice | its test [95% CI] "
        "| search - grid pick | compute (equiv.) | compute (worker-s) | marks agree |"
    )
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in reports:
        g, s, a = r["grid"], r["search"], r["agreement"]
        interval = f" [{points(s['ci_low'])}, {points(s['ci_high'])}]" if s["ci_low"] is not None else ""
        gap = (
            "-"
            if r["search_minus_grid_pick_points"] is None
            else f"{r['search_minus_grid_pick_points']:+.1f}"
        )
        equivalents = f"{s['full_job_equivalents']:.1f} / {g['full_job_equivalents']:.0f}"
        seconds = f"{s['worker_seconds']:.0f} / {g['worker_seconds']:.0f}"
        ratio_e = "-" if r["compute_ratio_equivalents"] is None else f"{r['compute_ratio_equivalents']:.2f}x"
        ratio_s = (
            "-" if r["compute_ratio_worker_seconds"] is None else f"{r['compute_ratio_worker_seconds']:.2f}x"
        )
        agree = "-" if a["share"] is None else f"{a['agree']}/{a['configurations']}"
        print(
            f"| {r['task']} | {g['picked']} | {points(g['picked_test_mean'])} | {points(g['oracle_test_mean'])} "
            f"| {s['chosen']} | {points(s['test_mean'])}{interval} | {gap} "
            f"| {equivalents} = {ratio_e} | {seconds} = {ratio_s} | {agree} |"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="sst2,mrpc,rte")
    parser.add_argument("--methods", default="bitfit,lora,pfeiffer,prefix")
    parser.add_argument("--lr-factors", default="0.333,1,3")
    parser.add_argument("--k", type=int, default=500)
    parser.add_argument("--dev-rows", type=int, default=200)
    parser.add_argument("--epochs", type=float, default=4)
    parser.add_argument("--grid-seeds", type=int, default=4)
    parser.add_argument("--search-seeds", type=int, default=3)
    parser.add_argument("--budget-share", type=float, default=1 / 3)
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary folder, removed")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.methods = [m for m in args.methods.split(",") if m]
    args.lr_factors = [float(f) for f in args.lr_factors.split(",") if f]
    if args.grid_seeds < args.search_seeds:
        parser.error("--grid-seeds must be at least --search-seeds (the grid is compared on those seeds)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the service stops with it (finally)
    from services.study.plan import register_task_folder

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-search-"))
    if args.work and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    print(f"machine: {cpu_name()} ({', '.join(cpu_flags())}), {os.cpu_count()} CPUs; work in {work}")
    service = ServiceProcess(work)
    started = time.time()
    try:
        client = service.client()
        fixed = {"epochs": args.epochs, "batch_size": 16, "dev_rows": args.dev_rows}
        searches, grids = {}, {}
        for task in args.tasks:
            register_task_folder(client, task, GLUE / task)
            grid_jobs = len(args.methods) * len(args.lr_factors) * args.search_seeds
            budget = round(args.budget_share * grid_jobs, 6)
            searches[task] = client.search(
                task,
                budget,
                methods=args.methods,
                k_shot=args.k,
                dev_rows=args.dev_rows,
                hyperparameters={"epochs": args.epochs, "batch_size": 16, "r": 8},
                seeds=args.search_seeds,
                seed=0,
            )
            print(
                f"{task}: search {searches[task].id}, budget {budget:g} of the {grid_jobs}-job grid, "
                f"{searches[task].configurations} configurations, rungs {searches[task].schedule['rungs']}",
                flush=True,
            )
        for task in args.tasks:  # after every search's first rung: short jobs first
            grids[task] = submit_grid(client, task, args, fixed)
            print(f"{task}: {len(grids[task])} grid jobs queued", flush=True)
        reports = []
        for task in args.tasks:
            print(f"{task}: waiting for the grid", flush=True)
            jobs = wait_jobs(client, grids[task])
            search = client.wait_search(searches[task], poll_seconds=15)
            search_jobs = [client.job(trial.job_id) for trial in search.trials]
            reports.append(report_task(task, grid_runs(client, jobs), search, search_jobs, args))
        wall = time.time() - started
    finally:
        service.close()
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": {"cpu": cpu_name(), "flags": cpu_flags(), "cpus": os.cpu_count()},
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "wall_seconds": wall,
                    "tasks": reports,
                },
                indent=2,
                default=str,
            )
        )
    print_table(reports)
    print(f"\nwall {wall / 60:.1f} min for everything ({cpu_name()}, {os.cpu_count()} CPUs)")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
