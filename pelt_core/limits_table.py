"""The README's table of limits, rendered from `pelt_core.limits` (README.md carries this text verbatim; a test
checks it)."""

from __future__ import annotations

from pelt_core.limits import (
    COMPOSE_RANGES,
    DEFAULT_COMPOSE_MEMORY_BYTES,
    DEFAULT_MAX_SWEEP_JOBS,
    MAX_COMPOSE_ALIASES,
    MAX_COMPOSE_SOURCES,
    MAX_MODULES,
    MAX_PAGE_LIMIT,
    MAX_PREDICT_ROWS,
    MAX_PREDICT_TEXT_CHARS,
    MAX_TRAIN_STEPS,
    SPEC_RANGES,
    SWEEP_LIST_LENGTH,
    TRAIN_RANGES,
    _gib,
)


def limits_table_markdown() -> str:
    """The ranges above as the README's Markdown table (README.md carries this text verbatim)."""
    lines = ["| field | range | what |", "|---|---|---|"]
    for title, table in (
        ("training hyperparameters", TRAIN_RANGES),
        ("method spec, every module", SPEC_RANGES),
        ("compose options", COMPOSE_RANGES),
    ):
        lines.append(f"| *{title}* | | |")
        lines += [
            f"| `{name}` | {_markdown(bound.describe())} | {_markdown(bound.doc)} |"
            for name, bound in table.items()
        ]
    lines += [
        "| *against the backbone* | | |",
        "| `max_length` | <= its positions | |",
        "| LoRA rank (`r`, a linear bottleneck's `size`) | <= min(d_in, d_out) | of the matrix it modifies |",
        "| prefix length (`prefix_length`) | <= its positions | |",
        "| `layers` | < its layer count | |",
        "| *counts* | | |",
        f"| steps of a job | <= {MAX_TRAIN_STEPS:,} | `max_steps`, or `epochs` x batches per epoch |",
        f"| modules of a method | <= {MAX_MODULES} | |",
        f"| sources of a composition | <= {MAX_COMPOSE_SOURCES} | aliases: <= {MAX_COMPOSE_ALIASES} |",
        f"| jobs of a sweep | <= {DEFAULT_MAX_SWEEP_JOBS:,} | `PELT_MAX_SWEEP_JOBS`; each list <= {SWEEP_LIST_LENGTH:,}"
        " entries |",
        "| a job's memory estimate | <= the largest worker that could run it, as the dispatcher reports them; "
        "before that the machine's memory (`PELT_WORKER_MEMORY_BYTES`) | backbone, parameters with AdamW "
        "state, activations; checked at submission and by the worker that takes the job, against its own "
        "machine |",
        f"| a composition's memory estimate | <= {_gib(DEFAULT_COMPOSE_MEMORY_BYTES)} | `PELT_COMPOSE_MEMORY_BYTES`: "
        "the sources' stored bytes x 4 (DARE 6, multi_task 2) + 6 x the largest, + the dense ΔW of LoRA "
        "modules for TIES/DARE; computed in a child process bounded by that + 3 GiB |",
        f"| rows of one list answer | <= {MAX_PAGE_LIMIT:,} | `limit` of `GET /v1/jobs` and `GET /v1/audit`; "
        "clients page with `offset` beyond it |",
        f"| rows of one prediction request | <= {MAX_PREDICT_ROWS:,} | `POST /v1/tasks/{{task}}/predict`, "
        f"`pelt predict` (which splits a longer `--file`); each text <= {MAX_PREDICT_TEXT_CHARS:,} characters "
        "(a pair: each side), tokens beyond `max_length` 128 cut |",
    ]
    return "\n".join(lines) + "\n"


def _markdown(text: str) -> str:
    return text.replace("|", "\\|")
