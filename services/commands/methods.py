"""`pelt method register|list|show`: the service's methods, the built-in presets and users' own method specs,
over the HTTP API (`pelt methods`, in pelt_core, counts the built-ins' parameters locally, no service)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from services.client import PeltClient
from services.commands.common import client_errors, print_table, printable


@click.group("method")
def method_group() -> None:
    """Register and inspect methods: the built-in presets and your own method specs (JSON)."""


@method_group.command("register")
@click.argument("spec_file", metavar="SPEC.json", type=click.Path(dir_okay=False))
@click.option("--replace", is_flag=True, help="replace your method of the same name (a built-in never is)")
@client_errors
def method_register(spec_file: str, replace: bool) -> None:
    """Register a method spec, a JSON file such as {"name": ..., "modules": {...}} (the format `pelt train
    --method SPEC.json` takes); the service checks it and names the offending field."""
    spec = read_spec(Path(spec_file))
    with PeltClient() as client:
        method = client.register_method(spec, replace=replace)
    click.echo(f"method {printable(method.name)} registered (fingerprint {method.fingerprint})")


def read_spec(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; a file that cannot be read, text that is not JSON (NaN and Infinity
    included), or anything but an object is refused, naming the file, before any request."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not a number JSON allows")

    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise click.BadParameter(f"{path}: cannot read it: {exc.strerror}", param_hint="SPEC.json") from None
    try:
        spec = json.loads(raw, parse_constant=refuse)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise click.BadParameter(f"{path}: not a JSON method spec: {exc}", param_hint="SPEC.json") from None
    if not isinstance(spec, dict):
        raise click.BadParameter(
            f'{path}: a method spec is a JSON object ({{"name": ..., "modules": {{...}}}}), '
            f"not a {type(spec).__name__}",
            param_hint="SPEC.json",
        )
    return spec


@method_group.command("list")
@click.option(
    "--builtin/--user", "builtin", default=None, help="only the built-in presets, or only users' specs"
)
@client_errors
def method_list(builtin: bool | None) -> None:
    """Every method the service knows, with the fingerprint of its current spec (jobs record it)."""
    with PeltClient() as client:
        methods = client.methods(builtin=builtin)
    rows = [{**m.model_dump(), "builtin": "yes" if m.builtin else "no"} for m in methods]
    print_table(rows, ["name", "builtin", "fingerprint", "description"])


@method_group.command("show")
@click.argument("name")
@client_errors
def method_show(name: str) -> None:
    """One method with its spec, as JSON."""
    with PeltClient() as client:
        click.echo(client.method(name).model_dump_json(indent=2))


__all__ = ["method_group", "read_spec"]
