"""The numbers UniPELT's paper reports for its low-resource setting (Mao et al., ACL 2022, Table 1:
BERT-base, GLUE, the mean over 5 seeds of the original GLUE dev set used as test set), keyed as pelt
names the methods. "average" is the paper's mean over its GLUE tasks (eight of them, not our three)."""

from __future__ import annotations

# pelt's method names for the paper's rows, in the paper's order
PAPER_METHODS = {
    "full": "Fine-tuning",
    "bitfit": "BitFit",
    "pfeiffer": "Adapter",
    "prefix": "Prefix-tuning",
    "lora": "LoRA",
    "unipelt_ap": "UniPELT (AP)",
    "unipelt": "UniPELT (APL)",
}
SINGLE_METHODS = ("bitfit", "pfeiffer", "prefix", "lora")  # what UniPELT is measured against
MIXTURES = ("unipelt_ap", "unipelt", "unipelt_apl")

PAPER_AVERAGE: dict[int, dict[str, float]] = {
    100: {"full": 60.02, "bitfit": 48.64, "pfeiffer": 58.24, "prefix": 47.99, "lora": 49.26,
          "unipelt_ap": 60.80, "unipelt": 62.59},
    500: {"full": 68.93, "bitfit": 60.30, "pfeiffer": 68.02, "prefix": 67.32, "lora": 65.86,
          "unipelt_ap": 69.79, "unipelt": 69.98},
    1000: {"full": 71.93, "bitfit": 66.51, "pfeiffer": 70.95, "prefix": 71.81, "lora": 72.28,
           "unipelt_ap": 72.61, "unipelt": 73.31},
}  # fmt: skip

# per task, K=100 only (SST-2 and RTE: accuracy; MRPC: F1)
PAPER_TASKS: dict[int, dict[str, dict[str, float]]] = {
    100: {
        "sst2": {"bitfit": 62.94, "pfeiffer": 80.48, "prefix": 60.87, "lora": 81.56,
                 "unipelt_ap": 77.22, "unipelt": 82.36},
        "rte": {"bitfit": 47.65, "pfeiffer": 52.78, "prefix": 55.96, "lora": 55.02,
                "unipelt_ap": 55.52, "unipelt": 55.45},
        "mrpc": {"bitfit": 81.09, "pfeiffer": 81.40, "prefix": 81.22, "lora": 81.66,
                 "unipelt_ap": 81.86, "unipelt": 81.71},
    }
}  # fmt: skip


def paper_value(method: str, k: int, task: str | None = None) -> float | None:
    """The paper's number for a method at K (a task's, or the average when `task` is None)."""
    method = "unipelt" if method == "unipelt_apl" else method
    if task is None:
        return PAPER_AVERAGE.get(k, {}).get(method)
    return PAPER_TASKS.get(k, {}).get(task, {}).get(method)
