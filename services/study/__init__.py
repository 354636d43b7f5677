"""UniPELT's low-resource study (Mao et al., ACL 2022, Table 1) run through the service: `pelt study`.

- `plan`: what a study is (a grid of tasks × K × methods × seeds under the protocol), registering
  GLUE-style task folders, queueing the cells no job fills yet, waiting, and reading the runs back;
- `paper`: the paper's BERT-base numbers that the report prints beside ours;
- `report`: the report: the paper's table layout per K (mean ± std per task, the average), the answer to
  the paper's claim, the metric-against-K plot, and the same data as JSON.
"""

from services.study.plan import (
    StudyPlan,
    StudyRun,
    collect_runs,
    register_task_folder,
    submit_study,
    wait_for,
)
from services.study.report import write_report

__all__ = [
    "StudyPlan",
    "StudyRun",
    "collect_runs",
    "register_task_folder",
    "submit_study",
    "wait_for",
    "write_report",
]
