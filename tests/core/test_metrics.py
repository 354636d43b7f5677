"""pelt's metrics agree with independent implementations (scikit-learn, SciPy) on fixed inputs — ties,
constant predictions, one-class inputs, absent classes — and on random ones. Where pelt defines a case the
others leave undefined, the test says what pelt reports and why."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from sklearn import metrics as sk

from pelt_core.metrics import compute_metrics


def one_hot_logits(pred: list[int], num_labels: int) -> np.ndarray:
    """Logits whose argmax is `pred`."""
    logits = np.zeros((len(pred), num_labels))
    logits[np.arange(len(pred)), pred] = 1.0
    return logits


def single_label(pred: list[int], gold: list[int], num_labels: int) -> dict[str, float]:
    return compute_metrics("single_label_classification", one_hot_logits(pred, num_labels), np.array(gold))


def sklearn_single_label(pred: list[int], gold: list[int], num_labels: int) -> dict[str, float]:
    """The same metrics by scikit-learn, over every class of the task (pelt's macro-F1 averages all of
    them, an absent class counting 0, not only the classes the dev set happens to hold)."""
    labels = list(range(num_labels))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scikit-learn warns where a ratio is 0/0
        expected = {
            "accuracy": sk.accuracy_score(gold, pred),
            "macro_f1": sk.f1_score(gold, pred, labels=labels, average="macro", zero_division=0.0),
            "matthews": sk.matthews_corrcoef(gold, pred),
        }
        if num_labels == 2:
            expected["f1"] = sk.f1_score(gold, pred, labels=labels, pos_label=1, zero_division=0.0)
    return expected


SINGLE_LABEL_CASES = {
    "balanced, some errors": ([0, 1, 1, 0, 1, 0], [0, 1, 0, 0, 1, 1], 2),
    "all right": ([0, 1, 1, 0], [0, 1, 1, 0], 2),
    "all wrong": ([1, 0, 0, 1], [0, 1, 1, 0], 2),
    "constant prediction": ([1, 1, 1, 1, 1], [0, 1, 0, 1, 1], 2),
    "constant prediction of the absent class": ([0, 0, 0], [1, 1, 1], 2),
    "one class in gold and prediction": ([1, 1, 1], [1, 1, 1], 2),
    "three classes": ([0, 1, 2, 2, 1, 0, 2], [0, 2, 2, 1, 1, 0, 0], 3),
    "a class neither holds": ([0, 1, 0, 1], [0, 1, 1, 1], 3),
}


@pytest.mark.parametrize(("pred", "gold", "num_labels"), SINGLE_LABEL_CASES.values(), ids=SINGLE_LABEL_CASES)
def test_single_label_metrics_match_scikit_learn(pred, gold, num_labels):
    assert single_label(pred, gold, num_labels) == pytest.approx(sklearn_single_label(pred, gold, num_labels))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 4).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, n - 1), min_size=1, max_size=40),
            st.lists(st.integers(0, n - 1), min_size=1, max_size=40),
            st.just(n),
        )
    )
)
def test_single_label_metrics_match_scikit_learn_on_random_labels(case):
    pred, gold, num_labels = case
    size = min(len(pred), len(gold))
    pred, gold = pred[:size], gold[:size]
    assert single_label(pred, gold, num_labels) == pytest.approx(sklearn_single_label(pred, gold, num_labels))


def multi_label(pred: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    logits = np.where(pred == 1, 2.0, -2.0)
    return compute_metrics("multi_label_classification", logits, gold)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 0]], [[1, 0, 0], [0, 1, 0], [1, 0, 1], [0, 0, 1]]),
        ([[0, 0], [0, 0]], [[0, 0], [0, 0]]),  # nothing predicted, nothing true: no decision to score
        ([[1, 1], [1, 1]], [[0, 1], [0, 1]]),  # one label always wrong
    ],
)
def test_multi_label_metrics_match_scikit_learn(pred, gold):
    pred, gold = np.array(pred), np.array(gold)
    expected = {
        "micro_f1": sk.f1_score(gold, pred, average="micro", zero_division=0.0),
        "macro_f1": sk.f1_score(gold, pred, average="macro", zero_division=0.0),
        "accuracy": sk.accuracy_score(gold, pred),  # every label of a row right
    }
    assert multi_label(pred, gold) == pytest.approx(expected)


def regression(pred: list[float], gold: list[float]) -> dict[str, float]:
    return compute_metrics("regression", np.array(pred).reshape(-1, 1), np.array(gold))


REGRESSION_CASES = {
    "close": ([0.1, 1.9, 3.2, 4.8, 2.5], [0.0, 2.0, 3.0, 5.0, 2.0]),
    "ties in both": ([1.0, 1.0, 2.0, 3.0, 3.0, 3.0], [0.5, 1.0, 1.0, 2.0, 4.0, 4.0]),
    "anti-correlated": ([5.0, 4.0, 3.0, 2.0], [1.0, 2.0, 3.0, 4.5]),
    "two rows": ([1.0, 2.0], [3.0, 1.0]),
}


@pytest.mark.parametrize(("pred", "gold"), REGRESSION_CASES.values(), ids=REGRESSION_CASES)
def test_regression_metrics_match_scipy_and_scikit_learn(pred, gold):
    expected = {
        "pearson": stats.pearsonr(pred, gold).statistic,
        "spearman": stats.spearmanr(pred, gold).statistic,
        "mse": sk.mean_squared_error(gold, pred),
        "mae": sk.mean_absolute_error(gold, pred),
    }
    assert regression(pred, gold) == pytest.approx(expected)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-100, 100, allow_nan=False), st.floats(-100, 100, allow_nan=False)),
        min_size=3,
        max_size=40,
    ).filter(lambda rows: len({p for p, _ in rows}) > 1 and len({g for _, g in rows}) > 1)
)
def test_regression_metrics_match_scipy_on_random_values(rows):
    pred, gold = [p for p, _ in rows], [g for _, g in rows]
    if np.std(pred) < 1e-6 or np.std(gold) < 1e-6:  # nearly constant: correlation is rounding noise
        return
    got = regression(pred, gold)
    assert got["pearson"] == pytest.approx(stats.pearsonr(pred, gold).statistic, abs=1e-9)
    assert got["spearman"] == pytest.approx(stats.spearmanr(pred, gold).statistic, abs=1e-9)
    assert got["mse"] == pytest.approx(sk.mean_squared_error(gold, pred))


def test_a_constant_regression_prediction_scores_zero_correlation_where_scipy_has_none():
    """SciPy answers NaN (with a warning) for a constant input; pelt reports 0: a constant predictor
    explains nothing, and a NaN would break ranking and the `best` alias. The errors still match."""
    pred, gold = [2.5, 2.5, 2.5, 2.5], [1.0, 2.0, 3.0, 5.0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.isnan(stats.pearsonr(pred, gold).statistic)
        assert np.isnan(stats.spearmanr(pred, gold).statistic)
    got = regression(pred, gold)
    assert got["pearson"] == 0.0 and got["spearman"] == 0.0
    assert got["mse"] == pytest.approx(sk.mean_squared_error(gold, pred))
    assert got["mae"] == pytest.approx(sk.mean_absolute_error(gold, pred))
