"""Registry queue benchmark: submit latency of a 1,000-job sweep, and claim-and-complete throughput
with concurrent claimer processes, on SQLite and on PostgreSQL. Prints numbers; asserts nothing.

    python benchmarks/bench_queue.py                          # both databases, 4 claimers
    python benchmarks/bench_queue.py --backend sqlite --sweeps 3
    python benchmarks/bench_queue.py --postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/test
    python benchmarks/bench_queue.py --backend sqlite --json out/queue.json   # every number, and the CPU

PostgreSQL: --postgres-url, else PELT_BENCH_DATABASE_URL, else PELT_TEST_DATABASE_URL; the benchmark
creates a scratch database (pelt_bench_<random>) on that server and drops it afterwards.
Each claimer is a separate OS process (multiprocessing 'spawn') with its own Registry; a claim and a
completion are one transaction each, as a worker's would be (the heartbeat is left out).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from services.registry import Registry, upgrade
from services.registry.testing import claim_until_empty, scratch_postgres, sqlite_url, write_jsonl

METHODS = [
    "bitfit",
    "houlsby",
    "pfeiffer",
    "prefix",
    "lora",
    "lora_ffn",
    "parallel_adapter",
    "mam",
    "unipelt",
    "unipelt_ap",
]
SEEDS = list(range(10))
K_VALUES = [16, 32, 64, 128, 256, 512, 1024, 1500, 2000, None]  # 10 × 10 × 10 = 1,000 jobs per sweep
TRAIN_ROWS = 2000


@contextmanager
def database(backend: str, postgres_url: str | None, folder: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield sqlite_url(folder / "bench.db")
        return
    assert postgres_url is not None
    with scratch_postgres(postgres_url, prefix="pelt_bench_") as url:
        yield url


def prepare(url: str, folder: Path) -> None:
    upgrade(url)
    rows = [{"sentence": f"s{i}", "label": i % 2} for i in range(TRAIN_ROWS)]
    splits = {  # a validation split of its own, so that K=2000 leaves no dev rows to hold out of train
        "train": write_jsonl(folder / "train.jsonl", rows),
        "validation": write_jsonl(folder / "validation.jsonl", rows[:200]),
    }
    with Registry(url) as registry:
        registry.register_task("bench", splits, text_fields="sentence")
        registry.register_backbone("bench-backbone", "hf:bench", "sha256:" + "0" * 64)


def submit_thousand(registry: Registry, key: str) -> Any:
    """One sweep of 1,000 jobs of the bench task (10 methods x 10 seeds x 10 K values) under `key`."""
    return registry.submit_sweep(
        "bench", METHODS, SEEDS, K_VALUES, "bench-backbone", {"epochs": 1}, idempotency_key=key
    )


def bench_submit(url: str, sweeps: int) -> dict[str, float]:
    """Latency of submit_sweep for 1,000 jobs (validation, sweep, jobs and their events, one transaction)."""
    latencies = []
    with Registry(url) as registry:
        for index in range(sweeps):
            began = time.perf_counter()
            sweep = submit_thousand(registry, f"sweep-{index}")
            latencies.append(time.perf_counter() - began)
            assert len(sweep.job_ids) == 1000
        began = time.perf_counter()
        submit_thousand(registry, "sweep-0")
        repeat = time.perf_counter() - began
    return {
        "min_ms": 1000 * min(latencies),
        "median_ms": 1000 * statistics.median(latencies),
        "max_ms": 1000 * max(latencies),
        "repeat_ms": 1000 * repeat,
    }


def bench_claims(url: str, claimers: int) -> dict[str, float]:
    """Claim-and-complete throughput of `claimers` processes draining the queue."""
    context = multiprocessing.get_context("spawn")
    start, out = context.Barrier(claimers), context.Queue()
    processes = [
        context.Process(target=claim_until_empty, args=(url, f"claimer-{i}", start, out, True), daemon=True)
        for i in range(claimers)
    ]
    for process in processes:
        process.start()
    try:
        reports = [out.get(timeout=1800) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    done = sum(len(claimed) for _, claimed, _, _ in reports)
    seconds = max(end for *_, end in reports) - min(began for *_, began, _ in reports)
    with Registry(url) as registry:
        counts = registry.job_counts()
    assert counts["succeeded"] == done and counts["queued"] == counts["running"] == 0, counts
    ids = [job_id for _, claimed, _, _ in reports for job_id in claimed]
    assert len(ids) == len(set(ids)), "a job was claimed twice"
    return {
        "jobs": done,
        "seconds": seconds,
        "jobs_per_s": done / seconds,
        "per_claimer": sorted(len(claimed) for _, claimed, _, _ in reports),
    }


def run(backend: str, postgres_url: str | None, claimers: int, sweeps: int) -> dict[str, dict]:
    with (
        tempfile.TemporaryDirectory(prefix="pelt-bench-") as tmp,
        database(backend, postgres_url, Path(tmp)) as url,
    ):
        prepare(url, Path(tmp))
        submit = bench_submit(url, sweeps)
        print(
            f"{backend:10s} submit_sweep 1,000 jobs: median {submit['median_ms']:.0f} ms "
            f"(min {submit['min_ms']:.0f}, max {submit['max_ms']:.0f}; {sweeps} sweeps); "
            f"idempotent repeat {submit['repeat_ms']:.0f} ms"
        )
        claims = bench_claims(url, claimers)
        print(
            f"{backend:10s} claim+complete, {claimers} claimer processes: {claims['jobs_per_s']:.0f} jobs/s "
            f"({claims['jobs']} jobs in {claims['seconds']:.1f} s; per claimer {claims['per_claimer']})"
        )
        return {"submit_sweep_1000_jobs": submit, "claims": {"claimers": claimers, **claims}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--postgres-url", default=None)
    parser.add_argument("--claimers", type=int, default=4)
    parser.add_argument("--sweeps", type=int, default=3, help="1,000-job sweeps to submit (and then drain)")
    parser.add_argument("--json", help="also write every number, the CPU and the versions to this file")
    args = parser.parse_args()
    postgres_url = (
        args.postgres_url
        or os.environ.get("PELT_BENCH_DATABASE_URL")
        or os.environ.get("PELT_TEST_DATABASE_URL")
    )

    from bench_packs import cpu_description  # here, not above: each claimer process imports this script

    cpu = cpu_description()
    print(
        f"python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, {os.cpu_count()} CPUs "
        f"({cpu['model']})"
    )
    report: dict = {
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "date": time.strftime("%Y-%m-%d"),
        "backends": {},
    }
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    for backend in backends:
        if backend == "postgresql" and not postgres_url:
            print(
                "postgresql skipped: give --postgres-url or set PELT_BENCH_DATABASE_URL / PELT_TEST_DATABASE_URL"
            )
            continue
        report["backends"][backend] = run(backend, postgres_url, args.claimers, args.sweeps)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
