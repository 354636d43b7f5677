"""`pelt token create|list|revoke` (run next to the registry: tokens are made and revoked there, never over
the API) and `pelt audit` (the audit trail, over the API with an admin token)."""

from __future__ import annotations

import json
import os

import click

from services.client import PeltClient
from services.commands.common import client_errors, print_table


@click.group("token")
def token_group() -> None:
    """API tokens, made and revoked in the registry (PELT_DATABASE_URL); only their SHA-256 is stored."""


def _cli_actor() -> str:
    """Who the audit trail names for a `pelt token` command: the operating-system user."""
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli"


@token_group.command("create")
@click.argument("name")
@click.option(
    "--scope",
    type=click.Choice(["read", "predict", "write", "admin"]),
    default="write",
    show_default=True,
    help="read: every GET; predict: read + predict (an application that only asks for predictions); "
    "write: predict + submit, cancel, register tasks and methods, compose; "
    "admin: write + register backbones, full job errors, the audit trail",
)
@click.option(
    "--secret-from-env",
    "secret_variable",
    metavar="VAR",
    default=None,
    help="use the secret in environment variable VAR instead of making one (a deployment's first token, "
    "from its secret store): 'pelt_' and 43 or more of A-Z a-z 0-9 _ -; it is not printed",
)
@click.option(
    "--if-none",
    is_flag=True,
    help="create it only when the registry has no token yet (revoked ones count), else do nothing: "
    "for a deployment's start-up step, which runs again at every upgrade",
)
def token_create(name: str, scope: str, secret_variable: str | None, if_none: bool) -> None:
    """Create a token and print its secret (shown once)."""
    from services.registry import AlreadyExistsError, Registry, RegistryValidationError, acting_as

    given = _secret_from_environment(secret_variable) if secret_variable else None
    skipped = f"the registry has API tokens already; token {name} not created"
    with Registry() as registry, acting_as(_cli_actor()):
        if if_none and registry.list_api_tokens():
            click.echo(skipped, err=True)
            return
        try:
            chosen = {} if given is None else {"secret": given}
            record, secret = registry.create_api_token(name, scope=scope, **chosen)
        except RegistryValidationError as exc:
            if if_none and isinstance(exc, AlreadyExistsError) and exc.field == "name":
                click.echo(skipped, err=True)  # another start-up step made it at the same moment
                return
            raise click.ClickException(str(exc)) from None
    if given is not None:
        click.echo(
            f"token {record.name} ({record.scope}) created with the secret in ${secret_variable}", err=True
        )
        return
    click.echo(f"token {record.name} ({record.scope}) created; its secret (shown only now):", err=True)
    click.echo(secret)


def _secret_from_environment(variable: str) -> str:
    """The secret in environment variable `variable`; a missing or empty one is an error naming it."""
    secret = os.environ.get(variable, "").strip()
    if not secret:
        raise click.ClickException(f"--secret-from-env: environment variable {variable} is not set or empty")
    return secret


@token_group.command("list")
def token_list() -> None:
    """Every token: name, scope, prefix, created, last used, revoked."""
    from services.registry import Registry

    with Registry() as registry:
        rows = [
            {
                "name": t.name,
                "scope": t.scope,
                "prefix": t.prefix + "…",
                "created": t.created_at.isoformat(timespec="seconds"),
                "last used": t.last_used_at and t.last_used_at.isoformat(timespec="seconds"),
                "revoked": t.revoked_at and t.revoked_at.isoformat(timespec="seconds"),
            }
            for t in registry.list_api_tokens()
        ]
    print_table(rows, ["name", "scope", "prefix", "created", "last used", "revoked"])


@token_group.command("revoke")
@click.argument("name")
def token_revoke(name: str) -> None:
    """Revoke a token: every request with it is refused from now on."""
    from services.registry import Registry, RegistryValidationError, acting_as

    with Registry() as registry, acting_as(_cli_actor()):
        try:
            registry.revoke_api_token(name)
        except RegistryValidationError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"token {name} revoked")


@click.command("audit")
@click.option("--limit", default=50, show_default=True)
@click.option("--offset", default=0, show_default=True)
@client_errors
def audit_command(limit: int, offset: int) -> None:
    """Who registered, submitted, cancelled, composed, created or revoked what, newest first (an admin token)."""
    with PeltClient() as client:
        events = client.audit(limit=limit, offset=offset)
    rows = [
        {
            "at": e.at.isoformat(timespec="seconds"),
            "actor": e.actor,
            "action": e.action,
            "target": e.target,
            "detail": json.dumps(e.detail, sort_keys=True)[:80] if e.detail else None,
        }
        for e in events
    ]
    print_table(rows, ["at", "actor", "action", "target", "detail"])


__all__ = ["audit_command", "token_group"]
