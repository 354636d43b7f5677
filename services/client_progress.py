"""How `PeltClient.wait` shows its jobs: a progress bar per job on a terminal, a line per change elsewhere."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.api.schemas import JobOut


def draw_progress(bars: dict[int, Any], jobs: Mapping[int, JobOut]) -> None:
    """One bar per job on a terminal (percent done; step/total, loss, tokens/s after it); elsewhere (a log,
    CI) a line per job whenever its status changes or it passes another quarter of its steps."""
    import sys

    from tqdm import tqdm

    for position, (job_id, job) in enumerate(jobs.items()):
        detail = job.progress_detail or {}
        percent = 100 if job.status == "succeeded" else int(100 * (job.progress or 0.0))
        facts = {"status": job.status}
        if detail.get("total"):
            facts["step"] = f"{detail.get('step', 0)}/{detail['total']}"
        if detail.get("loss") is not None:
            facts["loss"] = f"{detail['loss']:.3f}"
        if detail.get("tokens_per_second"):
            facts["tok/s"] = f"{detail['tokens_per_second']:.0f}"
        label = f"job {job_id} {job.method:<10}"
        if not sys.stderr.isatty():
            state = (job.status, percent // 25)
            if bars.get(job_id) != state:
                bars[job_id] = state
                print(
                    f"{label} {percent:3d}%  " + "  ".join(f"{k} {v}" for k, v in facts.items()),
                    file=sys.stderr,
                    flush=True,
                )
            continue
        if job_id not in bars:
            bars[job_id] = tqdm(
                total=100,
                desc=label,
                unit="%",
                position=position,
                dynamic_ncols=True,
                leave=True,
                bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed} {postfix}",
            )
        bar = bars[job_id]
        bar.n = percent
        bar.set_postfix(facts, refresh=True)


__all__ = ["draw_progress"]
