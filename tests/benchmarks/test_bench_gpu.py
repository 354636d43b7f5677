"""benchmarks/bench_gpu.py on the CPU with the tiniest settings: the rows it exports for a GPU run, a run from
them (random weights, no `datasets`), the report's rows and ratios, and how it mixes and packs its jobs.
No timing is asserted: only that every setting ran and reported what the GPU run will report."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_gpu


def argv(text: str) -> list[str]:
    """Command-line words from one string."""
    return text.split()


TINY = argv("--device cpu --jobs 4 --backbones minilm --methods lora,prefix --k-shot 16")
WORDS = argv("a fine film , dull plot but warm cast and a sharp script ; too long")


@pytest.fixture
def glue(tmp_path: Path) -> Path:
    """A GLUE folder with 40 made-up rows for SST-2 (one sentence) and RTE (a pair)."""
    for task, fields in (("sst2", ["sentence"]), ("rte", ["sentence1", "sentence2"])):
        rows = [
            {**{f: " ".join(WORDS[i % 7 : i % 7 + 3 + i % 5]) for f in fields}, "label": i % 2}
            for i in range(40)
        ]
        (tmp_path / "glue" / task).mkdir(parents=True)
        (tmp_path / "glue" / task / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "glue"


def test_the_export_holds_every_jobs_k_shot_rows_and_each_backbones_config_and_tokenizer(glue, tmp_path):
    bench_gpu.main([*TINY, "--data", str(glue), "--export-data", str(tmp_path / "export")])
    jobs = bench_gpu.benchmark_jobs(4, ["minilm"], ["lora", "prefix"], ["sst2", "rte"])
    for task in ("sst2", "rte"):
        source = bench_gpu.read_rows(glue / task / "train.jsonl")
        exported = bench_gpu.read_rows(tmp_path / "export" / "glue" / task / "train.jsonl").rows
        for job in (job for job in jobs if job.task == task):
            assert all(row in exported for row in bench_gpu.sample_k_shot(source, 16, job.seed).rows)
        assert len(exported) < len(source.rows)
    backbone = tmp_path / "export" / "backbones" / "all-minilm-l6-v2"
    assert (backbone / "config.json").is_file() and (backbone / "tokenizer.json").is_file()
    assert not list(backbone.glob("*.safetensors"))


def test_a_tiny_run_from_the_export_reports_one_row_per_setting_with_throughput_and_ratios(
    glue, tmp_path, monkeypatch
):
    bench_gpu.main([*TINY, "--data", str(glue), "--export-data", str(tmp_path / "export")])
    monkeypatch.setitem(sys.modules, "datasets", None)  # the GPU machine has none
    report_file, table, export = tmp_path / "gpu.json", tmp_path / "gpu.md", tmp_path / "export"
    bench_gpu.main(
        TINY
        + argv("--pack-sizes 1,2 --steps 2 --peer none --random-weights --precision fp32 --peak-seconds 0.05")
        + argv(
            f"--json {report_file} --markdown {table} --data {export}/glue --backbone-configs {export}/backbones"
        )
    )
    report = json.loads(report_file.read_text())
    assert [(row["precision"], row["pack_size"]) for row in report["settings"]] == [("fp32", 1), ("fp32", 2)]
    for row in report["settings"]:
        assert row["fit"] and row["error"] is None
        assert row["tokens_per_second"] > 0 and row["jobs_per_hour"] > 0 and row["fraction_of_peak"] > 0
        assert row["job_memory_bytes_mean"] > 0 and row["peak_memory_bytes"] is None  # a CPU: n/a
        assert row["ratio_vs_peft"] is None and row["gpu"]["util_mean"] is None
    assert report["settings"][0]["ratio_vs_one_at_a_time"] == 1.0
    assert report["settings"][1]["ratio_vs_one_at_a_time"] > 0
    assert [row["packs"] for row in report["settings"]] == [4, 2]
    assert report["environment"]["device"]["type"] == "cpu" and report["peft"] == {}
    text = table.read_text()
    assert text.count("\n| fp32 |") == 2
    assert (
        "fp32: largest pack that fit (2) vs one at a time:" in text and "not measured (--peer none)" in text
    )


def test_with_the_peft_peer_rows_compare_to_its_training_loops_and_separately_to_its_whole_processes(
    glue, tmp_path
):
    report = bench_gpu.main(
        argv("--device cpu --jobs 2 --backbones minilm --methods prefix --k-shot 16 --pack-sizes 1 --steps 2")
        + argv(
            f"--precision fp32 --peer peft --peer-jobs 1 --random-weights --peak-seconds 0.05 --data {glue}"
        )
    )
    peer, row = report["peft"]["fp32"], report["settings"][0]
    assert peer["failed"] == [] and len(peer["seconds_each"]) == len(peer["train_seconds_each"]) == 1
    assert peer["tokens"] > 0 and peer["method"] == "lora for every job"
    # the headline rate is over the script's training loop; its process (imports, model load) takes longer
    assert 0 < peer["wall_seconds"] < peer["process_seconds"]
    assert peer["tokens_per_second"] > peer["tokens_per_second_including_startup"]
    assert row["ratio_vs_peft"] == pytest.approx(row["tokens_per_second"] / peer["tokens_per_second"])
    assert row["ratio_vs_peft_including_startup"] > row["ratio_vs_peft"]


def test_a_pack_size_that_runs_out_of_memory_is_reported_as_not_fitting_and_the_run_goes_on(
    glue, tmp_path, monkeypatch
):
    real = bench_gpu.run_one_pack

    def out_of_memory_when_packed(work, jobs, steps):
        if len(jobs) > 1 and steps == 3:  # the timed packs of 2 (the warm-up trains 2 steps)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(work, jobs, steps)

    monkeypatch.setattr(bench_gpu, "run_one_pack", out_of_memory_when_packed)
    table = tmp_path / "gpu.md"
    report = bench_gpu.main(
        TINY
        + argv(
            "--pack-sizes 1,2,4 --steps 3 --peer none --random-weights --precision fp32 --peak-seconds 0.05"
        )
        + argv(f"--data {glue} --markdown {table}")
    )
    one, two, four = report["settings"]
    assert one["fit"] and one["tokens_per_second"] > 0
    for row in (two, four):
        assert not row["fit"] and row["error"].startswith("did not fit: CUDA out of memory")
    assert "| did not fit: CUDA out of memory" in table.read_text()
    assert "fp32: no pack of more than one job fit" in table.read_text()


def test_jobs_alternate_backbones_and_each_backbone_trains_every_method_on_every_task():
    jobs = bench_gpu.benchmark_jobs(
        32, ["minilm", "smollm2"], ["lora", "pfeiffer", "prefix", "unipelt"], ["sst2", "rte"]
    )
    assert [job.backbone for job in jobs[:4]] == ["minilm", "smollm2", "minilm", "smollm2"]
    assert len({job.seed for job in jobs}) == 32
    for backbone in ("minilm", "smollm2"):
        mix = Counter((job.method, job.task) for job in jobs if job.backbone == backbone)
        assert len(mix) == 8 and set(mix.values()) == {2}


def test_packs_hold_one_backbones_jobs_and_the_backbones_take_turns():
    jobs = bench_gpu.benchmark_jobs(10, ["minilm", "smollm2"], ["lora"], ["sst2"])
    packs = bench_gpu.packs_of(jobs, 2)
    assert [len(pack) for pack in packs] == [2, 2, 2, 2, 1, 1]
    assert [pack[0].backbone for pack in packs] == ["minilm", "smollm2"] * 3
    assert all(len({job.backbone for job in pack}) == 1 for pack in packs)
    assert sorted(job.seed for pack in packs for job in pack) == list(range(10))
    assert [len(pack) for pack in bench_gpu.packs_of(jobs, 32)] == [5, 5]


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--precision", "fp16", "--precision takes bf16 and/or fp32"),
        ("--pack-sizes", "0,8", "--pack-sizes must be positive"),
        ("--steps", "0", "--steps must be at least 1"),
        ("--methods", "lora,nope", "--methods: unknown method 'nope'"),
        ("--peer-jobs", "0", "--peer-jobs must be between 1 and --jobs (32)"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(flag, value, says, capsys):
    with pytest.raises(SystemExit):
        bench_gpu.parse_args([flag, value])
    assert says in capsys.readouterr().err
