"""What the `pelt` service commands share: the service's refusals as click errors, `--set KEY=VALUE`
and comma-separated options parsed, and tables printed."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any

import click

from services.client import PeltAPIError


def client_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """A refused request ends the command with the service's message (exit status 1), printed on one line
    (`printable`: a message that quotes stored or uploaded text cannot forge a line or restyle the terminal)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except PeltAPIError as exc:
            message = printable(exc.message)
            raise click.ClickException(f"{message} (HTTP {exc.status})" if exc.status else message) from None

    return wrapper


def parse_set_options(assignments: tuple[str, ...], *, compose: bool = False) -> dict[str, Any]:
    """`--set key=value` pairs. Numbers of known fields are read through the table of limits
    (pelt_core/limits.py: hyperparameters and method-spec fields, or `compose`'s options), so "inf", "nan"
    or a value out of range is refused here, naming the key; other values are read as JSON when they parse
    (true, [1, 2]; never NaN or Infinity), else kept as text."""
    from pelt_core.config import ConfigError, parse_assignments, parse_settings
    from pelt_core.limits import COMPOSE_RANGES, LimitError
    from pelt_core.spec import SpecError

    try:
        pairs = parse_assignments(assignments)
        if not compose:
            parsed = parse_settings(pairs)
            return {
                key: _json_or_text(raw) if parsed[key] is raw else parsed[key] for key, raw in pairs.items()
            }
        values: dict[str, Any] = {}
        for key, raw in pairs.items():
            if key == "weights":
                parts = raw.strip().strip("[]").split(",")
                values[key] = [
                    COMPOSE_RANGES["weights"].parse(part, f"weights[{i}]") for i, part in enumerate(parts)
                ]
            elif key in COMPOSE_RANGES:
                values[key] = COMPOSE_RANGES[key].parse(raw, key)
            else:
                values[key] = _json_or_text(raw)
        return values
    except (SpecError, ConfigError, LimitError) as exc:
        raise click.BadParameter(str(exc), param_hint="--set") from None


def _json_or_text(raw: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(constant)

    try:
        value = json.loads(raw, parse_constant=refuse)
    except ValueError:  # JSONDecodeError too
        return raw
    return (
        raw if isinstance(value, float) and not math.isfinite(value) else value
    )  # 1e400: text, refused later


def parse_ints(text: str | None, option: str, allow_full: bool = False) -> list[Any]:
    """A comma-separated list of integers (`allow_full`: "full", as the help documents it, is None: every
    row). Any other word is refused; "all" or "none" with an error naming the documented "full"."""
    if not text:
        return []
    out: list[Any] = []
    for part in text.split(","):
        part = part.strip()
        if allow_full and part.lower() == "full":
            out.append(None)
            continue
        try:
            out.append(int(part))
        except ValueError:
            if allow_full and part.lower() in ("all", "none", "max", "*"):
                raise click.BadParameter(
                    f"{part!r} is not a K value: write 'full' for the whole training set", param_hint=option
                ) from None
            accepted = "an integer or 'full' (the whole training set)" if allow_full else "an integer"
            raise click.BadParameter(f"{part!r} is not {accepted}", param_hint=option) from None
    return out


class KShot(click.ParamType):
    """`--k-shot`: a K of 1 or more, or "full", the whole training set (as `full_value`: None where a job
    takes it, "full" where a leaderboard filters by it); "all" and its kind are refused naming "full"."""

    name = "K|full"

    def __init__(self, full_value: str | None = None) -> None:
        self.full_value = full_value

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        text = str(value).strip().lower()
        if text == "full":
            return self.full_value
        try:
            k = int(text)
        except ValueError:
            k = 0
        if k >= 1:
            return k
        if text in ("all", "none", "max", "*"):
            self.fail(f"{value!r} is not a K value: write 'full' for the whole training set", param, ctx)
        self.fail(f"{value!r} is not a K of 1 or more, nor 'full' (the whole training set)", param, ctx)


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """`columns` of `rows` as aligned text ("-" for None, floats to 4 places); "(none)" when empty."""
    if not rows:
        click.echo("(none)")
        return
    text = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in text)) for i, c in enumerate(columns)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in text:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return printable(str(value))


def printable(text: str) -> str:
    """`text` with every character Python does not count as printable escaped (controls, format characters,
    line and paragraph separators: a newline as `\\n`, ESC as `\\x1b`, U+202E as `\\u202e`): a stored
    value printed in a table stays on its line and cannot forge another or restyle the terminal."""
    if text.isprintable():
        return text
    return "".join(
        char if char.isprintable() or char == " " else char.encode("unicode_escape").decode("ascii")
        for char in text
    )


__all__ = ["client_errors", "parse_ints", "parse_set_options", "print_table", "printable"]
