"""`pelt study`: UniPELT's low-resource study through the service (`services.study`)."""

from __future__ import annotations

import shlex
import sys

import click

from services.client import PeltClient
from services.commands.common import client_errors, parse_ints, parse_set_options

DEFAULT_METHODS = "bitfit,pfeiffer,prefix,lora,unipelt_ap,unipelt"


@click.command("study")
@click.option(
    "--task",
    "tasks",
    multiple=True,
    required=True,
    metavar="NAME[=FOLDER]",
    help="a registered task, or NAME=FOLDER to register a GLUE-style folder (train.jsonl, validation.jsonl, "
    "task.json) first if no task has that name. Repeatable.",
)
@click.option("--k", "k_values", default="100,500,1000", show_default=True, help="K values, comma-separated")
@click.option("--seeds", default="0,1,2", show_default=True, help="seeds, comma-separated")
@click.option("--methods", default=DEFAULT_METHODS, show_default=True, help="methods, comma-separated")
@click.option("--backbone", default="all-minilm-l6-v2", show_default=True)
@click.option(
    "--dev-rows", type=click.IntRange(min=1), default=1000, show_default=True, help="dev split size"
)
@click.option(
    "--patience",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="early stopping: dev evaluations without improvement (0: none)",
)
@click.option(
    "--epochs",
    "epochs",
    default=None,
    metavar="E | K=E,...",
    help="epochs of every job (E), or of the jobs of each K (100=20,500=6,1000=4); default: --set epochs or 3",
)
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="KEY=VALUE",
    help="a training hyperparameter for every job (epochs=20, lr=1e-3, batch_size=16, ...). Repeatable.",
)
@click.option(
    "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="where the report goes"
)
@click.option(
    "--no-wait",
    is_flag=True,
    help="queue what is missing and write the report from the runs ended so far, without waiting",
)
@click.option("--poll-seconds", type=click.FloatRange(min=0.1), default=10.0, show_default=True)
@client_errors
def study_command(
    tasks: tuple[str, ...],
    k_values: str,
    seeds: str,
    methods: str,
    backbone: str,
    dev_rows: int,
    patience: int,
    epochs: str | None,
    settings: tuple[str, ...],
    out_dir: str,
    no_wait: bool,
    poll_seconds: float,
) -> None:
    """Run UniPELT's low-resource study: tasks × K × seeds × methods, each job on K training rows with a
    dev split held out by seed (best checkpoint, early stopping) and the task's validation split as the
    test set; then write the report (the paper's table layout beside the paper's numbers, the metric
    against K, JSON). Run it again to resume, or with more methods or seeds to extend it: only the jobs
    that the registry does not hold yet are queued."""
    from services.study import (
        StudyPlan,
        collect_runs,
        register_task_folder,
        submit_study,
        wait_for,
        write_report,
    )
    from services.study.plan import study_jobs

    names, folders = [], {}
    for given in tasks:
        name, _, folder = given.partition("=")
        names.append(name.strip())
        if folder:
            folders[name.strip()] = folder
    training = parse_set_options(settings)
    if "evaluate_test" in training:
        raise click.BadParameter(
            "a study reports every run's test score: its jobs always evaluate the test set",
            param_hint="--set",
        )
    epochs_by_k: dict[int, float] = {}
    k_list = tuple(parse_ints(k_values, "--k"))
    if epochs is not None:
        try:
            if "=" in epochs:
                for pair in epochs.split(","):
                    k, _, value = pair.partition("=")
                    epochs_by_k[int(k)] = float(value)
            else:
                epochs_by_k = dict.fromkeys(k_list, float(epochs))
        except ValueError:
            raise click.BadParameter(
                f"{epochs!r}: a number, or K=E pairs such as 100=20,500=6", param_hint="--epochs"
            ) from None
        unknown = sorted(set(epochs_by_k) - set(k_list))
        if unknown:
            raise click.BadParameter(f"K={unknown[0]} is not among --k {k_values}", param_hint="--epochs")
    plan = StudyPlan(
        tasks=tuple(names),
        k_values=k_list,
        seeds=tuple(parse_ints(seeds, "--seeds")),
        methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
        backbone=backbone,
        dev_rows=dev_rows,
        patience=patience or None,
        training=training,
        epochs_by_k=epochs_by_k,
    )
    command = "pelt " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["study"] else "pelt study …"
    with PeltClient() as client:
        for name, folder in folders.items():
            if register_task_folder(client, name, folder):
                click.echo(f"registered task {name} from {folder}")
        job_ids, queued = submit_study(client, plan)  # a repeat queues nothing
        click.echo(f"study: {len(job_ids)} of {plan.job_count} jobs in the registry, {queued} queued now")
        if no_wait:
            jobs = study_jobs(client, plan, job_ids)
        else:
            jobs = wait_for(client, plan, job_ids, echo=click.echo, poll_seconds=poll_seconds)
        runs = collect_runs(client, jobs)
        metrics = {name: client.task(name).metric for name in plan.tasks}
    for path in write_report(out_dir, plan, runs, command, metrics):
        click.echo(f"wrote {path}")
