"""Train one PELT job: a pack of one (`pelt_core.pack`), whose loop is one readable step function.

AdamW over the job's own parameters only, linear warmup then linear decay, length-grouped batches with
dynamic padding, bf16 autocast where the hardware has fast bf16, evaluation after every epoch.
A progress callback sees (step, total, loss, tokens/s); a stop flag is checked between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pelt_core.backbones import Backbone
from pelt_core.config import TrainConfig
from pelt_core.data import TaskFields
from pelt_core.model import JobDelta
from pelt_core.pack import Pack
from pelt_core.spec import MethodSpec
from pelt_core.train_setup import (
    Progress,
    TrainingCancelled,
    TrainingError,
    TrainResult,
    bf16_available,
    loss_fn,
)


def train(
    backbone: Backbone,
    method: MethodSpec,
    train_data,
    eval_data=None,
    config: TrainConfig | None = None,
    task: TaskFields | None = None,
    progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_epoch_end: Callable[[dict[str, Any]], None] | None = None,
    metric: str | None = None,
    sources: Mapping[str, JobDelta] | None = None,
) -> TrainResult:
    """Train `method` on `train_data` (a datasets.Dataset) over the frozen `backbone`; returns the delta.

    With `config.dev_rows` it follows the study protocol (`pelt_core.pack`): `eval_data` is then the test
    set, and `metric` (None: the problem type's default) selects the best checkpoint on the dev split.

    A fusion method (`pelt_core.methods.fusion.fusion_method`) takes its source deltas in `sources`, by the
    sha256 its spec records.

    Raises TrainingError on a NaN/inf loss and TrainingCancelled when `should_stop()` turns true.
    """
    pack = Pack(backbone)
    job = pack.join(
        method, train_data, eval_data, config, task, progress, should_stop, on_epoch_end, metric, sources
    )
    while not job.done:
        pack.step()
    if job.error is not None:
        raise job.error
    return job.result


__all__ = [
    "Progress",
    "TrainResult",
    "TrainingCancelled",
    "TrainingError",
    "bf16_available",
    "loss_fn",
    "train",
]
