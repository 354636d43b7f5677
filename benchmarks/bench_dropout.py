"""What the backbone's dropout costs a training step, and what pelt's cheaper masks save.

One process, one backbone (all-MiniLM-L6-v2, fp32), one job's steps on one GLUE task's training rows, three
ways, interleaved round by round so every side shares the same clock span and the same machine load:

- `pelt`:  pelt's default: the backbone's dropout with 16-bit masks, attention as matmul → softmax → matmul
  (`pelt_core/dropout.py`);
- `torch`: the same dropout drawn by torch (`F.dropout`, one random number per element) and attention by
  transformers' sdpa with dropout, which leaves its fused kernel for the math path;
- `off`:   the backbone's dropout at p = 0 (attention then uses sdpa's fused kernel): what dropout costs.

Each side's seconds span forward, backward, clipping and the AdamW step (pelt's step clock); the printed
ratios are tokens per second of one side over another's (the median round). It reads the GLUE data under
PELT_GLUE_DIR (default ../shared/data/glue):

    HF_HUB_OFFLINE=1 python benchmarks/bench_dropout.py --task rte --json out/dropout.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator

import torch
from bench_packs import cpu_description
from bench_pelt_core import load_glue, load_minilm
from torch import nn

import pelt_core.dropout as pelt_dropout
import pelt_core.runtime as pelt_runtime
from pelt_core import TrainConfig, get_method
from pelt_core.train import train

SIDES = ("pelt", "torch", "off")


@contextlib.contextmanager
def dropout_side(backbone, side: str) -> Iterator[None]:
    """Run the block with the backbone's dropout drawn the `side` way; everything is put back after."""
    cheap, applies = pelt_dropout._cheap, pelt_runtime._cheap_dropout_applies
    ps = {module: module.p for module in backbone.model.modules() if isinstance(module, nn.Dropout)}
    try:
        if side == "torch":
            pelt_dropout._cheap = lambda x, p: False
            pelt_runtime._cheap_dropout_applies = lambda query, kwargs, generators: False
        elif side == "off":
            for module in ps:
                module.p = 0.0
        yield
    finally:
        pelt_dropout._cheap, pelt_runtime._cheap_dropout_applies = cheap, applies
        for module, p in ps.items():
            module.p = p


def one_run(
    backbone, train_rows, method: str, steps: int, batch_size: int, max_length: int, seed: int
) -> dict:
    """One job's `steps` training steps; its tokens and seconds by pelt's step clock."""
    last: dict = {}

    def progress(update) -> None:
        last["tokens_per_second"] = update.tokens_per_second

    config = TrainConfig(
        max_steps=steps,
        batch_size=batch_size,
        max_length=max_length,
        seed=seed,
        eval_every_epoch=False,
        bf16="false",
    )
    result = train(backbone, get_method(method), train_rows, None, config, progress=progress)
    seconds = result.train_tokens / last["tokens_per_second"]
    return {"tokens": result.train_tokens, "seconds": seconds, "tokens_per_second": last["tokens_per_second"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="rte")
    parser.add_argument("--method", default="lora")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every side once")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write every run and the ratios here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    cpu = cpu_description()
    backbone = load_minilm("float32")
    rows = load_glue(args.task, "train")
    for side in SIDES:  # one warm-up run each, not counted
        with dropout_side(backbone, side):
            one_run(backbone, rows, args.method, 3, args.batch_size, args.max_length, 0)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    started = time.time()
    for round_index in range(args.rounds):
        for side in SIDES:
            with dropout_side(backbone, side):
                run = one_run(
                    backbone, rows, args.method, args.steps, args.batch_size, args.max_length, round_index
                )
            runs[side].append(run)
            print(f"round {round_index} {side:5}: {run['tokens_per_second']:.0f} tok/s", flush=True)
    median = {side: statistics.median(run["tokens_per_second"] for run in runs[side]) for side in SIDES}
    ratios = {"pelt/torch": median["pelt"] / median["torch"], "off/pelt": median["off"] / median["pelt"]}
    load = os.getloadavg()
    print(
        f"\n{args.task} {args.method}, {args.steps} steps x {args.rounds} rounds, batch {args.batch_size}, "
        f"{args.threads} threads, {cpu['model']}, load {load[0]:.1f}"
    )
    print("| side | median tok/s |\n|---|---:|")
    for side in SIDES:
        print(f"| {side} | {median[side]:.0f} |")
    print(
        f"\npelt's masks against torch's dropout: {ratios['pelt/torch']:.2f}x; "
        f"dropout off against pelt's masks: {ratios['off/pelt']:.2f}x"
    )
    if args.json:
        record = {
            "args": vars(args),
            "cpu": cpu,
            "started": started,
            "load_average": load,
            "runs": runs,
            "median_tokens_per_second": median,
            "ratios": ratios,
        }
        with open(args.json, "w") as out:
            json.dump(record, out, indent=2)


if __name__ == "__main__":
    main()
