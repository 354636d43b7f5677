"""The `pelt` command line: the single-job commands of pelt_core plus the service's commands."""

from __future__ import annotations

import os

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pelt")
def main() -> None:
    """pelt: parameter-efficient tuning of one shared backbone for many tasks."""


def _register_local_commands() -> None:
    from pelt_core.cli import LOCAL_COMMANDS
    from services.demo import demo_command, example_data_command

    for command in (*LOCAL_COMMANDS, demo_command, example_data_command):
        main.add_command(command)


def _register_service_commands() -> None:
    from services.commands import SERVICE_COMMANDS
    from services.delta_store.cli import mlflow_group
    from services.dispatcher import dispatcher_command
    from services.registry.cli import db

    main.add_command(db)
    main.add_command(mlflow_group)
    main.add_command(dispatcher_command)
    for command in SERVICE_COMMANDS:
        main.add_command(command)


_register_local_commands()
_register_service_commands()
