"""benchmarks/bench_fusion.py on the CPU with a tiny random BERT and made-up GLUE rows: the sources train,
every target and K cell runs every arm for every seed, and the report says what the GPU run will report.
No accuracy is asserted: the rows are noise."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_fusion

WORDS = "a fine film , dull plot but warm cast and a sharp script ; too long".split(" ")  # noqa: SIM905
TASKS = {
    "sst2": ["sentence"],
    "qnli": ["sentence1", "sentence2"],
    "rte": ["sentence1", "sentence2"],
    "mrpc": ["sentence1", "sentence2"],
}


@pytest.fixture
def glue(tmp_path: Path) -> Path:
    """A GLUE folder of made-up rows: QNLI with validation rows only, as GLUE's own folder has."""
    for task, fields in TASKS.items():
        folder = tmp_path / "glue" / task
        folder.mkdir(parents=True)
        facts = {"text_fields": fields, "label_names": ["no", "yes"]}
        (folder / "task.json").write_text(json.dumps(facts))
        rows = [
            {**{f: " ".join(WORDS[i % 7 : i % 7 + 3 + i % 5]) for f in fields}, "label": i % 2}
            for i in range(60)
        ]
        splits = ("validation",) if task == "qnli" else ("train", "validation")
        for split in splits:
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "glue"


def test_every_cell_runs_every_arm_for_every_seed(glue, tmp_path):
    out = tmp_path / "fusion.json"
    code = bench_fusion.main(
        [
            "--quick",
            "--device",
            "cpu",
            "--data",
            str(glue),
            "--seeds",
            "0,1",
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "fusion.md"),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["sources"]) == {"sst2", "qnli", "rte", "mrpc"}
    assert report["sources"]["qnli"]["accuracy"] is None  # its only rows trained it: nothing held out
    assert [(c["target"], c["k"]) for c in report["cells"]] == [
        ("rte", 16),
        ("mrpc", 16),
        ("rte", "full"),
        ("mrpc", "full"),
    ]
    for cell in report["cells"]:
        assert list(cell["arms"]) == list(bench_fusion.ARMS)
        for arm, entry in cell["arms"].items():
            assert [run["seed"] for run in entry["runs"]] == [0, 1]
            assert entry["half_width"] is not None
            if arm.startswith("fusion"):  # the other three tasks' stage-one adapters, and the target's own
                members = set(entry["runs"][0]["fusion_weights"])
                assert len(members) == (4 if arm in ("fusion_own", "fusion_st") else 3)
                others = sorted(task for task in TASKS if task != cell["target"])
                fused = sorted(entry["fused"].values())
                # fusion_st's fourth is the target's own adapter of the `adapter` arm, not its stage-one source
                assert fused == (sorted([*others, cell["target"]]) if arm == "fusion_st" else others)
    table = (tmp_path / "fusion.md").read_text()
    assert "| rte | full |" in table and "71.0 → 76.8" not in table.split("| rte | 16 |")[1].split("\n")[0]


@pytest.mark.parametrize("arms", ["adapter,fusion_magic", "fusion,fusion_st"])
def test_an_unknown_arm_or_one_without_its_adapters_is_refused(glue, arms):
    with pytest.raises(SystemExit):
        bench_fusion.main(["--quick", "--data", str(glue), "--arms", arms])
