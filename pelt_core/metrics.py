"""Evaluation metrics computed locally (nothing is fetched from a hub)."""

from __future__ import annotations

import numpy as np

from pelt_core.vocabulary import DEFAULT_METRIC, METRIC_DIRECTIONS, metric_direction

__all__ = ["DEFAULT_METRIC", "METRIC_DIRECTIONS", "compute_metrics", "metric_direction"]


def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    return float((pred == gold).mean()) if len(gold) else 0.0


def f1_binary(pred: np.ndarray, gold: np.ndarray, positive: int = 1) -> float:
    tp = float(((pred == positive) & (gold == positive)).sum())
    fp = float(((pred == positive) & (gold != positive)).sum())
    fn = float(((pred != positive) & (gold == positive)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def macro_f1(pred: np.ndarray, gold: np.ndarray, num_labels: int) -> float:
    return float(np.mean([f1_binary(pred, gold, c) for c in range(num_labels)]))


def matthews(pred: np.ndarray, gold: np.ndarray, num_labels: int) -> float:
    """Matthews correlation coefficient (multi-class form of Gorodkin 2004)."""
    confusion = np.zeros((num_labels, num_labels), dtype=np.float64)
    np.add.at(confusion, (gold.astype(int), pred.astype(int)), 1)
    t, p = confusion.sum(1), confusion.sum(0)
    c, s = np.trace(confusion), confusion.sum()
    denominator = np.sqrt(s * s - (p * p).sum()) * np.sqrt(s * s - (t * t).sum())
    return float((c * s - (t * p).sum()) / denominator) if denominator else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x.astype(np.float64), y.astype(np.float64)
    if len(x) < 2 or x.std() == 0 or y.std() == 0:
        return 0.0
    return float(np.corrcoef(x, y)[0, 1])


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    from scipy.stats import rankdata

    return pearson(rankdata(x), rankdata(y))


def compute_metrics(problem_type: str, logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """All metrics that apply to the problem type, from raw logits and gold labels."""
    if problem_type == "single_label_classification":
        num_labels = logits.shape[-1]
        pred = logits.argmax(-1)
        gold = labels.astype(int)
        result = {
            "accuracy": accuracy(pred, gold),
            "macro_f1": macro_f1(pred, gold, num_labels),
            "matthews": matthews(pred, gold, num_labels),
        }
        if num_labels == 2:
            result["f1"] = f1_binary(pred, gold)
        return result
    if problem_type == "multi_label_classification":
        pred = (logits > 0).astype(int)
        gold = labels.astype(int)
        tp = float((pred & gold).sum())
        fp = float((pred & (1 - gold)).sum())
        fn = float(((1 - pred) & gold).sum())
        micro = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
        per_label = [f1_binary(pred[:, c], gold[:, c]) for c in range(gold.shape[1])]
        return {
            "micro_f1": micro,
            "macro_f1": float(np.mean(per_label)),
            "accuracy": float((pred == gold).all(1).mean()),
        }
    if problem_type == "regression":
        pred = logits.reshape(-1).astype(np.float64)
        gold = labels.reshape(-1).astype(np.float64)
        return {
            "pearson": pearson(pred, gold),
            "spearman": spearman(pred, gold),
            "mse": float(((pred - gold) ** 2).mean()),
            "mae": float(np.abs(pred - gold).mean()),
        }
    raise ValueError(f"unknown problem type {problem_type!r}")
