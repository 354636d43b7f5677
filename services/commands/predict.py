"""`pelt predict TASK TEXT...`: predictions from a task's stored delta, served by a running service; or
`--file rows.jsonl` (JSON Lines in, JSON Lines out)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from pelt_core.limits import MAX_PREDICT_ROWS
from services.client import PeltClient
from services.commands.common import client_errors

CHUNK_BYTES = 512 * 1024  # JSON bytes of one request's rows: half the service's default body bound


def read_rows(path: Path, text_fields: list[str]) -> Iterator[tuple[dict[str, Any], str | tuple[str, str]]]:
    """(the line's object, its text or pair) for each line of a JSON Lines file: an object with the
    task's text fields (or `text` and, for a pair task, `text_pair`), or a bare JSON string."""
    pair = len(text_fields) == 2
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise click.BadParameter(
                    f"line {number}: not JSON ({exc.msg})", param_hint="--file"
                ) from None
            if isinstance(row, str) and not pair:
                yield {"text": row}, row
                continue
            if not isinstance(row, dict):
                raise click.BadParameter(
                    f"line {number}: an object with {' and '.join(text_fields)} (or text"
                    f"{' and text_pair' if pair else ''}), got {type(row).__name__}",
                    param_hint="--file",
                )
            names = (
                text_fields
                if all(name in row for name in text_fields)
                else ["text", "text_pair"][: len(text_fields)]
            )
            values = [row.get(name) for name in names]
            if not all(isinstance(value, str) for value in values):
                raise click.BadParameter(
                    f"line {number}: needs the string field(s) {' and '.join(text_fields)} (or text"
                    f"{' and text_pair' if pair else ''})",
                    param_hint="--file",
                )
            yield row, (values[0], values[1]) if pair else values[0]


def chunks(rows: list[Any], max_bytes: int = CHUNK_BYTES) -> Iterator[list[Any]]:
    """Rows in requests of at most MAX_PREDICT_ROWS rows and about `max_bytes` of JSON each (the service
    takes 1 MiB bodies by default); a row above `max_bytes` alone goes in a request of its own."""
    chunk: list[Any] = []
    size = 0
    for row in rows:
        row_bytes = len(json.dumps(row, ensure_ascii=False).encode()) + 2
        if chunk and (len(chunk) == MAX_PREDICT_ROWS or size + row_bytes > max_bytes):
            yield chunk
            chunk, size = [], 0
        chunk.append(row)
        size += row_bytes
    if chunk:
        yield chunk


def predict_rows(
    client: PeltClient, task: str, rows: list[Any], version: str | None
) -> tuple[Any, list[dict]]:
    """The predictions of every row, a request per chunk, every chunk answered by the version the first
    one was (a new best landing halfway does not mix versions); and the last answer."""
    answer, predictions = None, []
    for chunk in chunks(rows):
        answer = client.predict(task, chunk, version=version if answer is None else answer.version)
        predictions.extend(answer.predictions)
    return answer, predictions


def describe(prediction: dict[str, Any]) -> str:
    if "label" in prediction:
        return f"{prediction['label']} {prediction['score']:.3f}"
    if "labels" in prediction:
        return ",".join(prediction["labels"]) or "(none)"
    return f"{prediction['value']:.4g}"


@click.command("predict")
@click.argument("task")
@click.argument("texts", nargs=-1)
@click.option(
    "--version", default=None, help="an alias (best, best-lora, ...) or a version number; default best"
)
@click.option(
    "--pair",
    is_flag=True,
    help="the TEXTs are pairs: TEXT TEXT_PAIR TEXT TEXT_PAIR ... (a task trained on sentence pairs)",
)
@click.option(
    "--file",
    "file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="JSON Lines: each line an object with the task's text fields (or text, text_pair) or a JSON string",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="with --file: write JSON Lines here (default: standard output): each line's object plus its prediction",
)
@client_errors
def predict_command(
    task: str, texts: tuple[str, ...], version: str | None, pair: bool, file: Path | None, out: Path | None
) -> None:
    """Label TEXTs (or a --file of rows) with TASK's best delta (or --version), served by the running
    service: one line per text with its label and score, and the version that answered."""
    if bool(texts) == bool(file):
        raise click.UsageError("give TEXTs or --file (one of them)")
    if out is not None and file is None:
        raise click.BadParameter("needs --file", param_hint="--out")
    with PeltClient() as client:
        if file is not None:
            fields = client.task(task).text_fields
            read = list(read_rows(file, fields))
            answer, predictions = predict_rows(client, task, [text for _, text in read], version)
            lines = [
                json.dumps({**row, "prediction": prediction}, ensure_ascii=False)
                for (row, _), prediction in zip(read, predictions, strict=True)
            ]
            target = out.open("w", encoding="utf-8") if out else sys.stdout
            try:
                for line in lines:
                    target.write(line + "\n")
            finally:
                if out:
                    target.close()
            if answer is not None:
                click.echo(
                    f"{len(lines)} rows from {answer.task} version {answer.version} ({answer.method})"
                    + (f" into {out}" if out else ""),
                    err=True,
                )
            return
        if pair:
            if len(texts) % 2:
                raise click.BadParameter(
                    "--pair takes TEXT TEXT_PAIR twos: an odd number given", param_hint="TEXTS"
                )
            rows: list[Any] = [(texts[i], texts[i + 1]) for i in range(0, len(texts), 2)]
        else:
            rows = list(texts)
        answer, predictions = predict_rows(client, task, rows, version)
        for row, prediction in zip(rows, predictions, strict=True):
            shown = row if isinstance(row, str) else " | ".join(row)
            click.echo(f"{describe(prediction):<24} {shown}")
        click.echo(f"({answer.task} version {answer.version}, {answer.method})")
