"""Do PELT presets learn a regression task on all-MiniLM-L6-v2? (issue #25, item 10)

A sentence-pair similarity task on a 0-5 scale built from the Rotten Tomatoes snippets that `pelt example-data`
writes (so it runs on what a user has): sentence 2 shares `s` of sentence 1's ten words, shuffled, and the
label is s / 2 plus up to 0.4 of noise. 500 training pairs, 200 evaluation pairs, batch 16, each preset at
its own learning rate; prints Pearson's r after every epoch and the final MSE beside the labels' variance (a
constant predictor at the mean scores r = 0 and MSE = variance).

    HF_HUB_OFFLINE=1 python benchmarks/bench_regression.py --methods prefix,lora --epochs 4 --json out/regression.json

`--json PATH` writes every number (per method: Pearson's r and the loss of every epoch, the final metrics),
with the CPU, torch's version and threads, and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets

from pelt_core import TrainConfig, get_method
from pelt_core.backbones import Backbone
from pelt_core.data import load_table
from services.demo import write_rotten_tomatoes


def similarity_pairs(words: list[str], n: int, seed: int) -> list[dict]:
    """n pairs: sentence 2 keeps `shared` of sentence 1's ten words; label = shared / 2 + noise in [0, 0.4)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        first = [rng.choice(words) for _ in range(10)]
        shared = rng.randint(0, 10)
        second = first[:shared] + [rng.choice(words) for _ in range(10 - shared)]
        rng.shuffle(second)
        label = round(shared / 2 + rng.random() * 0.4, 2)
        rows.append({"sentence1": " ".join(first), "sentence2": " ".join(second), "label": label})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", default="prefix,lora,pfeiffer,bitfit,unipelt")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args()

    import torch

    from pelt_core.train import train

    train_file, _ = write_rotten_tomatoes(Path(tempfile.mkdtemp()))
    words = [w for sentence in load_table(train_file)["sentence"][:2000] for w in sentence.lower().split()]
    train_rows, eval_rows = similarity_pairs(words, 500, 0), similarity_pairs(words, 200, 1)
    variance = statistics.pvariance([row["label"] for row in eval_rows])
    backbone = Backbone.load("all-minilm-l6-v2")
    machine = {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_start": os.getloadavg()[0],
    }
    print(
        f"{machine['cpu']}, torch {machine['torch']}, {machine['threads']} threads, load {machine['load_average_start']:.2f}"
    )
    print(f"{'method':<10} {'pearson per epoch':<36} {'mse':>6}  (labels' variance {variance:.3f})")
    results = {}
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        result = train(
            backbone,
            get_method(method),
            datasets.Dataset.from_list(train_rows),
            datasets.Dataset.from_list(eval_rows),
            TrainConfig(epochs=args.epochs, batch_size=16),
        )
        per_epoch = " ".join(f"{h['pearson']:+.3f}" for h in result.history)
        print(f"{method:<10} {per_epoch:<36} {result.metrics['mse']:>6.3f}", flush=True)
        results[method] = {"history": result.history, "metrics": result.metrics}
    if args.json:
        report = {
            **machine,
            "load_average_end": os.getloadavg()[0],
            "epochs": args.epochs,
            "train_pairs": len(train_rows),
            "eval_pairs": len(eval_rows),
            "label_variance": variance,
            "methods": results,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=float))


def cpu_model() -> str:
    """The CPU's model name and its vector extensions (avx2, avx512f, avx512_bf16, amx_tile)."""
    name, flags = platform.processor() or "unknown CPU", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
    present = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in wanted)
    return f"{name} ({present})"


if __name__ == "__main__":
    main()
