"""`pelt task register|list|show`: register and inspect tasks over the HTTP API (`pelt task add`, the old
name of `register`, still works; it is hidden from the help)."""

from __future__ import annotations

import click

from pelt_core.vocabulary import DEFAULT_METRIC_HELP, METRIC_HELP, PROBLEM_TYPES
from services.client import PeltClient
from services.commands.common import client_errors, print_table


@click.group("task")
def task_group() -> None:
    """Register and inspect tasks (a dataset + what to predict + how to score it)."""


@task_group.command("register")
@click.argument("name")
@click.option("--train", type=click.Path(exists=True, dir_okay=False), help="JSON Lines, CSV/TSV or Parquet")
@click.option("--validation", type=click.Path(exists=True, dir_okay=False))
@click.option("--test", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--dataset", type=click.Path(exists=True, file_okay=False), help="a datasets save_to_disk folder"
)
@click.option(
    "--text-field",
    "text_fields",
    multiple=True,
    help="text column (once or twice); default: detected from GLUE-style names, as `pelt train` does",
)
@click.option("--label-field", default="label", show_default=True)
@click.option(
    "--problem-type",
    default=None,
    type=click.Choice(PROBLEM_TYPES),
    help="default: told by the labels (lists: multi-label; numbers with a fractional part: regression; "
    "else single-label classification)",
)
@click.option(
    "--metric",
    default=None,
    help=f"the task's primary metric, by name or alias (in brackets); default: {DEFAULT_METRIC_HELP}; "
    f"it must apply to the problem type: {METRIC_HELP}",
)
@click.option("--label-names", default=None, help="comma-separated class names, in label-index order")
@click.option("--max-length", default=128, show_default=True)
@click.option("--description", default="")
@client_errors
def task_register(
    name: str,
    train: str | None,
    validation: str | None,
    test: str | None,
    dataset: str | None,
    text_fields: tuple[str, ...],
    label_field: str,
    problem_type: str | None,
    metric: str | None,
    label_names: str | None,
    max_length: int,
    description: str,
) -> None:
    """Upload a task's data and register it (fields and labels are checked against the data)."""
    with PeltClient() as client:
        task = client.register_task(
            name,
            train,
            validation,
            test,
            dataset=dataset,
            text_fields=list(text_fields) or None,
            label_field=label_field,
            problem_type=problem_type,
            metric=metric,
            label_names=None if label_names is None else label_names.split(","),
            max_length=max_length,
            description=description,
        )
    click.echo(
        f"task {task.name}: {task.train_size} training rows, splits {task.split_sizes}, "
        f"labels {task.label_names}, metric {task.metric}"
    )


task_add = click.Command(
    "add",
    callback=task_register.callback,
    params=task_register.params,
    help=task_register.help,
    hidden=True,  # the old name of `register`: kept for existing scripts, out of the help
)
task_group.add_command(task_add)


@task_group.command("list")
@client_errors
def task_list() -> None:
    """Every task."""
    with PeltClient() as client:
        rows = [t.model_dump() for t in client.tasks()]
    print_table(rows, ["name", "train_size", "problem_type", "metric", "label_names"])


@task_group.command("show")
@click.argument("name")
@client_errors
def task_show(name: str) -> None:
    """One task, as JSON."""
    with PeltClient() as client:
        click.echo(client.task(name).model_dump_json(indent=2))


__all__ = ["task_group"]
