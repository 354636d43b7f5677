"""benchmarks/bench_serve.py's input for a machine without GLUE or MiniLM's weights: what it exports is all a
random-weights run reads, and the MiniLM it builds from that config loads as a pelt backbone, the same
weights every time (the two sides and every run serve the same model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_serve import BASES, POOL_ROWS, TRAIN_ROWS, backbone_folder, export_input, task_rows


def fake_glue(folder: Path) -> Path:
    """SST-2 and RTE shaped task folders, more rows than the benchmark copies."""
    for base, fields in BASES:
        (folder / base).mkdir(parents=True)
        (folder / base / "task.json").write_text(json.dumps({"text_fields": list(fields)}))
        for split, count in (("train", TRAIN_ROWS + 5), ("validation", POOL_ROWS + 5)):
            rows = [{**{f: f"{split} {f} {i}" for f in fields}, "label": i % 2} for i in range(count)]
            (folder / base / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_exported_input_holds_the_task_rows_and_a_minilm_config_that_builds_the_same_backbone(tmp_path):
    from pelt_core.backbones import Backbone

    out = tmp_path / "serve-input"
    export_input(out, fake_glue(tmp_path / "glue"))

    for base, fields in BASES:
        assert len((out / "glue" / base / "train.jsonl").read_text().splitlines()) == TRAIN_ROWS
        pool = task_rows(out / "glue" / base, fields)
        first_row = [f"validation {f} 0" for f in fields]
        assert len(pool) == POOL_ROWS and pool[0] == (first_row[0] if len(fields) == 1 else first_row)
    assert not list((out / "backbone").glob("*.safetensors"))  # config and tokenizer only
    args = SimpleNamespace(random_weights=True, input=out)
    first = Backbone.load(str(backbone_folder(args, tmp_path / "a")))
    second = Backbone.load(str(backbone_folder(args, tmp_path / "b")))
    assert first.content_hash == second.content_hash
    assert first.model.config.hidden_size == 384 and first.model.config.num_hidden_layers == 6
