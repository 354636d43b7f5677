"""`pelt backbone register|list|show`: the frozen backbones jobs train on, over the HTTP API (registering
one needs an admin token)."""

from __future__ import annotations

import click

from services.client import PeltClient
from services.commands.common import client_errors, print_table, printable

SHOWN_HASH_CHARS = 12  # of a content hash, in `pelt backbone list` (`show` prints all of it)


@click.group("backbone")
def backbone_group() -> None:
    """Register and inspect backbones (the packaged ones register themselves on first use)."""


@backbone_group.command("register")
@click.argument("name")
@click.argument("source", required=False)
@client_errors
def backbone_register(name: str, source: str | None) -> None:
    """Register NAME from SOURCE (default: NAME): a packaged alias, or a model folder inside one of the
    service's PELT_BACKBONE_DIRS, relative to it or absolute (an admin token). The service loads it once,
    for its content hash and shape; that can take a minute."""
    with PeltClient() as client:
        backbone = client.register_backbone(name, source)
    click.echo(
        f"backbone {printable(backbone.name)} registered from {printable(backbone.source)}, "
        f"content hash {printable(backbone.content_hash)}"
    )


@backbone_group.command("list")
@client_errors
def backbone_list() -> None:
    """Every registered backbone: its source, size and architecture."""
    with PeltClient() as client:
        backbones = client.backbones()
    rows = [
        {
            "name": b.name,
            "source": b.source,
            "parameters": (b.facts or {}).get("num_parameters"),
            "model_type": (b.facts or {}).get("model_type"),
            "content_hash": b.content_hash[:SHOWN_HASH_CHARS] + "…",
        }
        for b in backbones
    ]
    print_table(rows, ["name", "source", "parameters", "model_type", "content_hash"])


@backbone_group.command("show")
@click.argument("name")
@client_errors
def backbone_show(name: str) -> None:
    """One backbone with its facts (hidden size, layers, heads, positions, ...), as JSON."""
    with PeltClient() as client:
        click.echo(client.backbone(name).model_dump_json(indent=2))


__all__ = ["backbone_group"]
