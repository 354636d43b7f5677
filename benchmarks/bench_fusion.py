"""AdapterFusion against the target's own adapter on GLUE (issue #33, item 4).

Stage one trains a Pfeiffer adapter per source task (seed 0): SST-2 (its first `--source-rows` training rows),
QNLI (its validation rows: the only QNLI rows there are), RTE and MRPC (their training sets). Stage two, per
target (RTE, MRPC) and K (500, the full set), per seed, trains under the study protocol (the training rows
shuffled by seed, the first K train, the next `--dev-rows` are the dev split evaluated after every epoch, the
best checkpoint by accuracy is kept, early stopping after `--patience` evaluations without a gain; GLUE's
validation split is the test set reported):

    adapter        the target's own Pfeiffer adapter alone (its preset: 1e-3)
    fusion         AdapterFusion of the other three tasks' adapters, frozen (the paper's rate, 5e-5)
    fusion_1e-3    the same at 1e-3 (a small backbone and few steps: does the paper's rate starve it?)
    fusion_own     the fusion plus the target's own adapter trained alongside (fusion 5e-5, adapter 1e-3)
    fusion_st      the paper's "F. w/ ST-A": the other tasks' adapters and the target's own adapter of the
                   `adapter` arm (same seed, same rows), all frozen, fused at 5e-5

A cell's jobs train as one pack (`fusion_st` in a second one, after the adapters it fuses) (one backbone forward for all of them). JSON and Markdown are rewritten after
every cell, so a run cut short keeps what it measured. Test accuracy ×100 per arm: mean ± the half-width of
the 95% Student-t interval over seeds.

    python benchmarks/bench_fusion.py --json fusion.json --markdown fusion.md     # here (slow on a CPU)
    python benchmarks/bench_fusion.py --export-input out/fusion-input              # for a GPU machine:
    PYTHONPATH=$PWD python3 benchmarks/bench_fusion.py --data out/fusion-input/glue \\
        --backbone out/fusion-input/minilm --json $OUT/fusion.json --markdown $OUT/fusion.md   # there
    python benchmarks/bench_fusion.py --quick --data DIR --json q.json   # a smoke run on a tiny random BERT
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from bench_gpu import Rows, read_rows, write_rows

from pelt_core import TrainConfig, get_method
from pelt_core.backbones import Backbone
from pelt_core.data import infer_task_fields
from pelt_core.delta import save_delta
from pelt_core.devices import describe_device, resolve_device
from pelt_core.methods.fusion import Source, fusion_method
from pelt_core.pack import Pack

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent.parent / "shared" / "data" / "glue"
ARMS = ("adapter", "fusion", "fusion_1e-3", "fusion_own", "fusion_st")
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
# Pfeiffer et al. 2021, Table 1 (BERT-base, full training sets, mean over runs): the direction to compare
# ("ST-A" and "F. w/ ST-A": the fusion of all 16 tasks' adapters, the target's own among them; accuracy)
PAPER = {"rte": {"adapter": 71.04, "fusion": 76.82}, "mrpc": {"adapter": 85.16, "fusion": 90.29}}


def task_rows(data: Path, task: str, split: str) -> Rows:
    return read_rows(data / task / f"{split}.jsonl")


def task_fields(data: Path, task: str, rows: Rows):
    facts = json.loads((data / task / "task.json").read_text())
    return infer_task_fields(rows, text_fields=facts["text_fields"], label_names=facts["label_names"])


def load_backbone(args: argparse.Namespace, device: torch.device) -> Backbone:
    if args.quick:
        from pelt_core.testing import tiny_bert

        return tiny_bert(tempfile.mkdtemp()).to(device)
    if args.backbone is None:
        return Backbone.load("minilm", dtype="float32").to(device)
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(args.backbone, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(args.backbone, local_files_only=True)
    return Backbone(model, tokenizer, "all-MiniLM-L6-v2", source=args.backbone).to(device)


def config(args: argparse.Namespace, **fields: Any) -> TrainConfig:
    return TrainConfig(batch_size=args.batch_size, eval_batch_size=128, bf16="false", **fields)


def run_pack(backbone: Backbone, jobs: list[dict[str, Any]]) -> list[Any]:
    """Train the jobs as one pack; their members in the jobs' order (each with `result` or `error`)."""
    pack = Pack(backbone)
    members = [pack.join(**job) for job in jobs]
    while any(not m.done for m in members):
        pack.step()
    for member, job in zip(members, jobs, strict=True):
        if member.error is not None:
            raise SystemExit(f"{job['method'].name} failed: {member.error!r}")
    return members


def train_sources(args: argparse.Namespace, backbone: Backbone, folder: Path) -> dict[str, dict[str, Any]]:
    """A Pfeiffer adapter per source task, seed 0, saved (its sha256 identifies it in the fusions)."""
    jobs, names = [], []
    for task in args.sources:
        split = "validation" if task == "qnli" else "train"
        rows = task_rows(args.data, task, split)
        rows = rows.select(range(min(len(rows), args.source_rows)))
        held_out = None if task == "qnli" else task_rows(args.data, task, "validation")
        jobs.append(
            dict(
                method=get_method("pfeiffer"),
                train_data=rows,
                eval_data=held_out,
                config=config(args, epochs=args.source_epochs, seed=0),
                task=task_fields(args.data, task, rows),
            )
        )
        names.append(task)
    started = time.perf_counter()
    members = run_pack(backbone, jobs)
    sources = {}
    for task, member in zip(names, members, strict=True):
        saved = save_delta(member.result.delta, backbone, folder / task)
        sources[task] = {
            "delta": member.result.delta.eval(),
            "sha256": saved.sha256,
            "rows": len(jobs[names.index(task)]["train_data"]),
            "accuracy": member.result.metrics.get("accuracy"),
        }
        print(f"source {task}: {sources[task]['rows']} rows, held-out accuracy {sources[task]['accuracy']}")
    print(f"sources trained in {time.perf_counter() - started:.1f} s", flush=True)
    return sources


def arm_job(
    arm: str, target: str, sources: dict[str, dict[str, Any]], own: dict[str, Any] | None = None
) -> tuple[Any, float | None, dict | None]:
    """(method spec, learning rate or None for its default, source deltas by sha256 or None) of an arm;
    `own`: the target's own adapter (`fusion_st`), as a source."""
    if arm == "adapter":
        return get_method("pfeiffer"), None, None
    chosen = {task: sources[task] for task in sources if task != target}
    if own is not None:
        chosen[target] = own
    spec = fusion_method(
        [Source(task, source["sha256"], source["delta"].method) for task, source in chosen.items()],
        own_adapter=arm == "fusion_own",
    )
    by_sha = {source["sha256"]: source["delta"] for source in chosen.values()}
    return spec, (1e-3 if arm == "fusion_1e-3" else None), by_sha


def run_cell(args, backbone, sources, target: str, k: int | None, folder: Path) -> dict[str, Any]:
    train_rows = task_rows(args.data, target, "train")
    test_rows = task_rows(args.data, target, "validation")
    task = task_fields(args.data, target, train_rows)
    epochs = args.epochs_k if k is not None else args.epochs_full

    def job(arm: str, seed: int, own: dict[str, Any] | None = None) -> dict[str, Any]:
        method, learning_rate, by_sha = arm_job(arm, target, sources, own)
        settings = dict(epochs=epochs, seed=seed, k_shot=k, dev_rows=args.dev_rows, patience=args.patience)
        return dict(
            method=method,
            train_data=train_rows,
            eval_data=test_rows,
            config=config(args, learning_rate=learning_rate, **settings),
            task=task,
            sources=by_sha,
        )

    started = time.perf_counter()
    keys = [(arm, seed) for seed in args.seeds for arm in args.arms if arm != "fusion_st"]
    members = run_pack(backbone, [job(arm, seed) for arm, seed in keys])
    if "fusion_st" in args.arms:  # the paper's variant: each seed's own adapter joins the frozen sources
        owns = {}
        for (arm, seed), member in zip(keys, members, strict=True):
            if arm == "adapter":
                delta = member.result.delta
                saved = save_delta(delta, backbone, folder / f"{target}-{k}-{seed}")
                owns[seed] = {"delta": delta.eval(), "sha256": saved.sha256}
        later = [("fusion_st", seed) for seed in args.seeds]
        members += run_pack(backbone, [job(arm, seed, owns[seed]) for arm, seed in later])
        keys += later
    cell: dict[str, Any] = {
        "target": target,
        "k": k if k is not None else "full",
        "epochs": epochs,
        "arms": {},
    }
    for (arm, seed), member in zip(keys, members, strict=True):
        result = member.result
        entry = cell["arms"].setdefault(arm, {"runs": []})
        if member.method.fusion is not None:  # which task each fused module came from
            entry["fused"] = {role: s.task for s in member.method.fusion.sources for role in s.roles}
        entry["runs"].append(
            {
                "seed": seed,
                "test_accuracy": result.metrics.get("accuracy"),
                "test_f1": result.metrics.get("f1"),
                "dev": result.dev_metrics,
                "steps": result.steps,
                "trainable": result.parameter_counts.get("trainable"),
                "fusion_weights": result.fusion_weights,
            }
        )
    for entry in cell["arms"].values():
        scores = [100 * run["test_accuracy"] for run in entry["runs"]]
        entry["mean"] = statistics.fmean(scores)
        entry["half_width"] = (
            T95.get(len(scores) - 1, 1.96) * statistics.stdev(scores) / len(scores) ** 0.5
            if len(scores) > 1
            else None
        )
    cell["seconds"] = time.perf_counter() - started
    print(
        f"{target} K={cell['k']}: "
        + ", ".join(f"{arm} {cell_text(e)}" for arm, e in cell["arms"].items())
        + f" ({cell['seconds']:.0f} s)",
        flush=True,
    )
    return cell


def cell_text(entry: dict[str, Any]) -> str:
    if entry["half_width"] is None:
        return f"{entry['mean']:.1f} (1 seed)"
    return f"{entry['mean']:.1f} ± {entry['half_width']:.1f}"


def markdown(report: dict[str, Any]) -> str:
    arms = report["arms"]
    lines = [
        f"Backbone {report['backbone']}, device {report['device']}, seeds {report['seeds']}; "
        "test accuracy ×100, mean ± 95% t-interval half-width over seeds.",
        "",
        "| target | K | epochs | " + " | ".join(arms) + " | paper (BERT-base, full): ST-A → F. w/ ST-A |",
        "|---|---|---:|" + "---:|" * len(arms) + "---|",
    ]
    for cell in report["cells"]:
        paper = PAPER.get(cell["target"], {})
        direction = f"{paper['adapter']:.1f} → {paper['fusion']:.1f}" if paper and cell["k"] == "full" else ""
        values = [cell_text(cell["arms"][arm]) if arm in cell["arms"] else "" for arm in arms]
        lines.append(
            f"| {cell['target']} | {cell['k']} | {cell['epochs']} | "
            + " | ".join(values)
            + f" | {direction} |"
        )
    sources = ", ".join(
        f"{task} ({s['rows']} rows, held-out accuracy {s['accuracy'] * 100:.1f})"
        if s["accuracy"] is not None
        else f"{task} ({s['rows']} rows)"
        for task, s in report["sources"].items()
    )
    lines += ["", f"Source adapters (Pfeiffer, seed 0): {sources}."]
    return "\n".join(lines) + "\n"


def export_input(args: argparse.Namespace) -> None:
    """What a GPU machine without the packages or GLUE needs: MiniLM in fp16 and the tasks' rows."""
    from transformers import AutoModel, AutoTokenizer

    from pelt_core.backbones import resolve_backbone

    out = Path(args.export_input)
    _, path, _ = resolve_backbone("minilm")
    model = AutoModel.from_pretrained(path, dtype=torch.float16)
    model.save_pretrained(out / "minilm")
    AutoTokenizer.from_pretrained(path, local_files_only=True).save_pretrained(out / "minilm")
    for task in sorted({*args.targets, *args.sources}):
        (out / "glue" / task).mkdir(parents=True, exist_ok=True)
        (out / "glue" / task / "task.json").write_text((args.data / task / "task.json").read_text())
        for split in ("train", "validation"):
            if (args.data / task / f"{split}.jsonl").is_file():
                rows = task_rows(args.data, task, split)
                if task not in args.targets and split == "train":
                    rows = rows.select(range(min(len(rows), args.source_rows)))
                write_rows(out / "glue" / task / f"{split}.jsonl", rows, rows.column_names)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add(
        "--data",
        type=Path,
        default=DEFAULT_DATA,
        help="a GLUE folder: <task>/task.json, train/validation.jsonl",
    )
    add(
        "--backbone",
        help="a folder with MiniLM's config, tokenizer and weights (default: the packaged model)",
    )
    add("--targets", default="rte,mrpc")
    add("--sources", default="sst2,qnli,rte,mrpc", help="the source tasks (a target never fuses itself)")
    add("--k", default="500,full", help="K per target cell, 'full' for the whole training set")
    add("--seeds", default="0,1,2")
    add("--arms", default=",".join(ARMS))
    add("--epochs-k", type=float, default=10.0, help="epochs at K (the paper's fusion trains 10)")
    add("--epochs-full", type=float, default=5.0)
    add("--dev-rows", type=int, default=200)
    add("--patience", type=int, default=3)
    add("--batch-size", type=int, default=16)
    add("--source-rows", type=int, default=10000, help="at most this many rows train a source adapter")
    add("--source-epochs", type=float, default=2.0)
    add("--device", default="auto")
    add("--json", type=Path)
    add("--markdown", type=Path)
    add("--export-input", help="write MiniLM (fp16) and the tasks' rows to this folder, then stop")
    add("--quick", action="store_true", help="a tiny random BERT and a handful of rows: a smoke run")
    args = parser.parse_args(argv)
    args.targets, args.sources = args.targets.split(","), args.sources.split(",")
    args.arms = args.arms.split(",")
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {', '.join(unknown)}; known: {', '.join(ARMS)}")
    if "fusion_st" in args.arms and "adapter" not in args.arms:
        parser.error("--arms: fusion_st fuses the adapter arm's adapters: name adapter too")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    ks = [None if k == "full" else int(k) for k in args.k.split(",")]
    if args.export_input:
        export_input(args)
        return 0
    if args.quick:
        ks = [16 if k is not None else None for k in ks]
        args.source_rows, args.dev_rows, args.epochs_k, args.epochs_full, args.source_epochs = 48, 16, 1, 1, 1
    device = resolve_device(args.device)
    backbone = load_backbone(args, device)
    report: dict[str, Any] = {
        "backbone": backbone.name,
        "device": describe_device(device),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "seeds": args.seeds,
        "arms": args.arms,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "cells": [],
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        sources = train_sources(args, backbone, Path(folder))
        report["sources"] = {t: {k: v for k, v in s.items() if k != "delta"} for t, s in sources.items()}
        for k in ks:
            for target in args.targets:
                report["cells"].append(run_cell(args, backbone, sources, target, k, Path(folder)))
                report["seconds"] = time.perf_counter() - started
                if args.json:
                    args.json.write_text(json.dumps(report, indent=2))
                if args.markdown:
                    args.markdown.write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
