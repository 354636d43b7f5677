"""Single-job commands that need no service: `pelt methods` and `pelt train`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from pelt_core.config import ConfigError, TrainConfig, parse_assignments, parse_settings, split_overrides
from pelt_core.limits import LimitError, check_against_backbone
from pelt_core.spec import MethodSpec, SpecError
from pelt_core.vocabulary import PROBLEM_TYPES, check_task_metric

if TYPE_CHECKING:  # torch-heavy modules load inside the command that needs them
    from pelt_core.backbones import Backbone
    from pelt_core.data import TaskFields
    from pelt_core.train import TrainResult


def _fail(message: str) -> None:
    raise click.ClickException(message)


def resolve_method(method: str, overrides: dict[str, str]):
    """A preset name or a path to a JSON method spec, with spec overrides applied."""
    from pelt_core.methods import get_method

    path = Path(method)
    if method.endswith(".json") or path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError(f"--method {method}: cannot read a JSON method spec: {exc}") from exc
        return get_method(data, overrides)
    return get_method(method, overrides)


@click.command("methods")
@click.option(
    "--backbone",
    default="all-minilm-l6-v2",
    show_default=True,
    help="Packaged backbone alias or local model directory used for the parameter counts.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def methods_command(backbone: str, as_json: bool) -> None:
    """List every built-in PELT method with its trainable parameters on BACKBONE."""
    from pelt_core.backbones import Backbone, BackboneError
    from pelt_core.methods import BUILTIN_METHODS
    from pelt_core.model import JobDelta

    try:
        loaded = Backbone.load(backbone)
    except BackboneError as exc:
        _fail(str(exc))
    total = loaded.num_parameters
    rows = []
    for name, spec in BUILTIN_METHODS.items():
        counts = JobDelta(spec, loaded, num_labels=2).parameter_counts()
        rows.append(
            {
                "method": name,
                "parameters": counts["pelt"],
                "percent": 100.0 * counts["pelt"] / total,
                "learning_rate": TrainConfig().resolved_learning_rate(spec.defaults),
                "description": spec.description,
            }
        )
    if as_json:
        click.echo(
            json.dumps({"backbone": loaded.name, "backbone_parameters": total, "methods": rows}, indent=2)
        )
        return
    click.echo(f"backbone {loaded.name}: {total:,} parameters (head not counted below)")
    click.echo(f"{'method':<26}{'parameters':>12}{'%':>9}{'lr':>8}  description")
    for row in rows:
        click.echo(
            f"{row['method']:<26}{row['parameters']:>12,}{row['percent']:>8.3f}%{row['learning_rate']:>8.0e}"
            f"  {row['description']}"
        )


@click.command("train")
@click.option(
    "--backbone",
    default="all-minilm-l6-v2",
    show_default=True,
    help="Packaged backbone alias (all-minilm-l6-v2, smollm2-135m) or a local model directory.",
)
@click.option(
    "--train", "train_path", required=True, help="Training data: .jsonl, .csv, .parquet or a datasets folder."
)
@click.option("--validation", "validation_path", help="Evaluation data (same formats).")
@click.option("--method", required=True, help="A built-in method name or a JSON method-spec file.")
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="KEY=VALUE",
    help="Training hyperparameter (lr, epochs, batch_size, seed, k_shot, ...) or method-spec override "
    "(r, bottleneck, prefix_length, role.field, bias). Repeatable.",
)
@click.option(
    "--text-field",
    "text_fields",
    multiple=True,
    help="Text column(s); detected from GLUE-style names if omitted.",
)
@click.option("--label-field", help="Label column; detected if omitted.")
@click.option(
    "--problem-type",
    type=click.Choice(PROBLEM_TYPES),
    help="Detected from the labels if omitted.",
)
@click.option(
    "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Where the delta is written."
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="Where to train: auto (a GPU if torch sees one, else the CPU), cpu, cuda or cuda:N.",
)
@click.option(
    "--metric",
    help="With --set dev_rows=N (the study protocol): the metric that picks the best checkpoint on the dev "
    "split (default: accuracy, micro_f1 or pearson by problem type).",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def train_command(
    backbone,
    train_path,
    validation_path,
    method,
    settings,
    text_fields,
    label_field,
    problem_type,
    out_dir,
    device,
    metric,
    quiet,
) -> None:
    """Train one PELT job locally and write its delta; the last line printed is the metrics as JSON."""
    from tqdm import tqdm

    from pelt_core.backbones import Backbone, BackboneError
    from pelt_core.data import DataError, infer_task_fields, load_split
    from pelt_core.devices import DeviceError, DeviceOutOfMemory
    from pelt_core.train import TrainingError, train

    try:
        train_overrides, spec_overrides = split_overrides(parse_settings(parse_assignments(settings)))
        config = TrainConfig.from_dict(train_overrides)
        spec = resolve_method(method, spec_overrides)
        train_data = load_split(train_path)
        eval_data = load_split(validation_path) if validation_path else None
        task = infer_task_fields(train_data, text_fields or None, label_field, problem_type)
        if metric is not None:
            try:
                metric = check_task_metric(metric, task.problem_type, task.num_labels)
            except ValueError as exc:
                raise ConfigError(f"--metric: {exc}") from None
        loaded = Backbone.load(backbone, dtype=config.backbone_dtype, device=device)
        if (
            "max_length" in train_overrides
        ):  # given: refused above the backbone's positions (else cut to them)
            check_against_backbone({"max_length": config.max_length}, {}, loaded.facts)
    except (SpecError, ConfigError, DataError, BackboneError, LimitError, DeviceError) as exc:
        _fail(str(exc))

    bar = None if quiet else tqdm(total=0, unit="step", file=sys.stderr, dynamic_ncols=True)

    def progress(p):
        if bar is None:
            return
        bar.total = p.total_steps
        bar.n = p.step
        bar.set_postfix(loss=f"{p.loss:.4f}", tok_s=f"{p.tokens_per_second:,.0f}", refresh=False)
        bar.refresh()

    try:
        result = train(
            loaded,
            spec,
            train_data,
            eval_data,
            config,
            task=task,
            progress=progress,
            on_epoch_end=lambda r: click.echo(json.dumps(r), err=True),
            metric=metric,
        )
    except (
        TrainingError,
        DataError,
        SpecError,
        ConfigError,
        DeviceOutOfMemory,
    ) as exc:  # SpecError: a rank above the backbone
        _fail(str(exc))
    finally:
        if bar is not None:
            bar.close()

    click.echo(json.dumps(_save_delta_folder(result, spec, loaded, task, config, out_dir)))


def _save_delta_folder(
    result: TrainResult,
    spec: MethodSpec,
    backbone: Backbone,
    task: TaskFields,
    config: TrainConfig,
    out_dir: str,
) -> dict[str, Any]:
    """Write the trained delta (and its PEFT form, for LoRA) to `out_dir`; the run's summary."""
    from pelt_core.delta import export_peft_lora, save_delta

    summary = {
        "method": spec.name,
        "backbone": backbone.name,
        "device": str(backbone.device),
        "bf16": result.bf16,
        "metrics": result.metrics,
        **(
            {"dev_metrics": result.dev_metrics, "stopped_early": result.stopped_early}
            if result.dev_metrics
            else {}
        ),
        "steps": result.steps,
        "train_seconds": round(result.train_seconds, 2),
        "tokens_per_second": round(result.tokens_per_second, 1),
        "peak_memory_bytes": result.peak_memory_bytes,
        "pelt_parameters": result.parameter_counts["pelt"],
        "trainable_percent": result.trainable_percent,
        "gates": result.gate_values,
        "labels": task.label_names,
        "out": str(out_dir),
    }
    saved = save_delta(
        result.delta,
        backbone,
        out_dir,
        extra={
            "metrics": result.metrics,
            "train": config.to_dict(),
            "task": {"text_fields": list(task.text_fields), "label_field": task.label_field},
        },
    )
    summary["sha256"] = saved.sha256
    try:
        export_peft_lora(result.delta, backbone, Path(out_dir) / "peft")
        summary["peft_export"] = str(Path(out_dir) / "peft")
    except ValueError:
        pass  # only LoRA deltas have a PEFT form
    return summary


LOCAL_COMMANDS = [methods_command, train_command]
