"""The names users write, in one place: problem types, metrics (with the spellings other tools use) and
composition operations. Torch-free: the CLI, the API schemas, the registry and the trainer all import
these lists, so a name accepted anywhere is accepted everywhere. Numeric bounds live in `limits`."""

from __future__ import annotations

from dataclasses import dataclass

SINGLE_LABEL = "single_label_classification"
MULTI_LABEL = "multi_label_classification"
REGRESSION = "regression"
PROBLEM_TYPES = (SINGLE_LABEL, MULTI_LABEL, REGRESSION)
PROBLEM_TYPE_ALIASES = {"classification": SINGLE_LABEL, "multi_label": MULTI_LABEL}

DIRECTIONS = ("max", "min")

# the columns `pelt train`, `pelt task register` and the API take for a task's text and label when none are
# named: GLUE-style names, the most specific first (`find_text_fields`)
TEXT_FIELD_CANDIDATES = (
    ("sentence1", "sentence2"),
    ("question1", "question2"),
    ("premise", "hypothesis"),
    ("question", "sentence"),
    ("text_a", "text_b"),
    ("sentence",),
    ("text",),
    ("review",),
    ("content",),
)
LABEL_FIELD_CANDIDATES = ("label", "labels", "score", "target", "category", "class")


def find_text_fields(columns: list[str] | tuple[str, ...]) -> tuple[str, ...] | None:
    """The first of TEXT_FIELD_CANDIDATES whose columns are all there, or None."""
    return next((c for c in TEXT_FIELD_CANDIDATES if all(name in columns for name in c)), None)


@dataclass(frozen=True)
class Metric:
    """One evaluation metric as pelt_core's results name it, and what else users may call it."""

    name: str
    direction: str  # "max": higher is better, "min": lower is better
    problem_types: tuple[str, ...]  # the problem types whose evaluation reports it
    aliases: tuple[str, ...] = ()  # the spellings other libraries use (scikit-learn, GLUE, `evaluate`)
    binary_only: bool = False  # reported for single-label tasks with exactly two classes only
    doc: str = ""


_CLASSIFICATION = (SINGLE_LABEL, MULTI_LABEL)

METRICS: tuple[Metric, ...] = (
    Metric("accuracy", "max", _CLASSIFICATION, ("acc",), doc="share of rows (multi-label: all labels) right"),
    Metric(
        "f1", "max", (SINGLE_LABEL,), ("binary_f1",), binary_only=True, doc="F1 of the second class (index 1)"
    ),
    Metric("macro_f1", "max", _CLASSIFICATION, ("f1_macro",), doc="mean of the per-class F1"),
    Metric("micro_f1", "max", (MULTI_LABEL,), ("f1_micro",), doc="F1 over all label decisions"),
    Metric(
        "matthews",
        "max",
        (SINGLE_LABEL,),
        ("matthews_correlation", "mcc"),
        doc="Matthews correlation (multi-class form)",
    ),
    Metric("pearson", "max", (REGRESSION,), ("pearsonr", "pearson_correlation"), doc="Pearson's r"),
    Metric("spearman", "max", (REGRESSION,), ("spearmanr", "spearman_correlation"), doc="Spearman's rho"),
    Metric("mse", "min", (REGRESSION,), ("mean_squared_error",), doc="mean squared error"),
    Metric("mae", "min", (REGRESSION,), ("mean_absolute_error",), doc="mean absolute error"),
    Metric("loss", "min", PROBLEM_TYPES, ("eval_loss",), doc="the training loss on the dev split"),
)
METRICS_BY_NAME = {metric.name: metric for metric in METRICS}
METRIC_DIRECTIONS = {metric.name: metric.direction for metric in METRICS}
METRIC_ALIASES = {alias: metric.name for metric in METRICS for alias in metric.aliases}
DEFAULT_METRIC = {SINGLE_LABEL: "accuracy", MULTI_LABEL: "micro_f1", REGRESSION: "pearson"}
METRIC_HELP = ", ".join(
    metric.name + (f" ({', '.join(metric.aliases)})" if metric.aliases else "") for metric in METRICS
)
DEFAULT_METRIC_HELP = ", ".join(f"{metric} for {problem}" for problem, metric in DEFAULT_METRIC.items())

# The keyword options each composition operation takes (besides its deltas and backbone).
COMPOSE_OPTIONS: dict[str, tuple[str, ...]] = {
    "merge": ("weights", "how", "density", "seed", "scale", "combine", "lora_rank"),
    "average": ("lora_rank",),
    "merge_lora_svd": ("weights", "rank"),
    "multi_task": (),
}
COMPOSE_OPERATIONS = tuple(COMPOSE_OPTIONS)


def canonical_problem_type(name: str) -> str:
    """`name` or its alias as one of PROBLEM_TYPES; ValueError naming the choices otherwise."""
    problem = PROBLEM_TYPE_ALIASES.get(name, name)
    if problem not in PROBLEM_TYPES:
        raise ValueError(f"{name!r} is not a problem type; use one of {', '.join(PROBLEM_TYPES)}")
    return problem


def canonical_metric(name: str) -> str:
    """The metric `name` stands for (`matthews_correlation` -> `matthews`); ValueError listing the table."""
    canonical = name if name in METRICS_BY_NAME else METRIC_ALIASES.get(name)
    if canonical is None:
        raise ValueError(f"{name!r} is not a metric pelt reports; known (aliases in brackets): {METRIC_HELP}")
    return canonical


def metric_direction(name: str) -> str:
    """'max' or 'min' for a metric name or alias."""
    return METRIC_DIRECTIONS[canonical_metric(name)]


def reported_metrics(problem_type: str, num_labels: int | None = None) -> tuple[str, ...]:
    """The metrics an evaluation of this problem type reports (`num_labels` decides binary-only ones;
    None: not yet known, so they count)."""
    problem = canonical_problem_type(problem_type)
    return tuple(
        metric.name
        for metric in METRICS
        if problem in metric.problem_types
        and not (metric.binary_only and problem == SINGLE_LABEL and num_labels not in (None, 2))
    )


def check_task_metric(metric: str, problem_type: str, num_labels: int | None = None) -> str:
    """The canonical name of `metric` if an evaluation of this task reports it; ValueError saying which
    metrics apply otherwise (a task whose primary metric is never reported could rank no job)."""
    canonical = canonical_metric(metric)
    problem = canonical_problem_type(problem_type)
    allowed = reported_metrics(problem, num_labels)
    if canonical not in allowed:
        if METRICS_BY_NAME[canonical].binary_only and problem == SINGLE_LABEL:
            why = f"{metric!r} is reported for two classes only, and this task has {num_labels}"
        else:
            why = f"{metric!r} is not reported for {problem}"
        raise ValueError(f"{why}: use one of {', '.join(allowed)}")
    return canonical


def metrics_table_markdown() -> str:
    """The metric table as README shows it (a test keeps README and this equal)."""
    lines = ["| metric | what | also accepted | better | reported for |", "|---|---|---|---|---|"]
    for metric in METRICS:
        kinds = ", ".join(p.replace("_classification", "") for p in metric.problem_types)
        if metric.binary_only:
            kinds += " (two classes)"
        aliases = ", ".join(f"`{a}`" for a in metric.aliases)
        better = "higher" if metric.direction == "max" else "lower"
        lines.append(f"| `{metric.name}` | {metric.doc} | {aliases} | {better} | {kinds} |")
    return "\n".join(lines)
