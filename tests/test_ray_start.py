"""The tests' retry of a Ray start that timed out (tests/ray_start.py): such a start is cleaned up and tried
again, any other failure is not retried, and the last attempt's error goes on."""

from __future__ import annotations

import pytest

from tests.ray_start import ATTEMPTS, patient_ray_starts, start_with_retries

TIMED_OUT = Exception("The current node timed out during startup. This could happen because ...")


def test_a_start_that_timed_out_is_cleaned_up_and_tried_again_until_it_comes_up() -> None:
    outcomes, cleaned = [TIMED_OUT, TIMED_OUT, "node"], []

    def start() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert start_with_retries(start, lambda: cleaned.append(1)) == "node"
    assert cleaned == [1, 1]


def test_a_start_that_keeps_timing_out_fails_with_rays_error_after_the_last_attempt() -> None:
    starts = []

    def start() -> None:
        starts.append(1)
        raise TIMED_OUT

    with pytest.raises(Exception, match="timed out during startup"):
        start_with_retries(start, lambda: None)
    assert len(starts) == ATTEMPTS


def test_any_other_failure_of_a_start_is_not_retried() -> None:
    starts = []

    def start() -> None:
        starts.append(1)
        raise ValueError("bad option")

    with pytest.raises(ValueError, match="bad option"):
        start_with_retries(start, lambda: None)
    assert starts == [1]


def test_the_tests_patch_ray_init_and_node_start_and_put_them_back() -> None:
    import ray
    import ray._private.node as ray_node

    init, node_init = ray.init, ray_node.Node.__init__
    with patient_ray_starts():
        assert ray.init is not init and ray_node.Node.__init__ is not node_init
    assert ray.init is init and ray_node.Node.__init__ is node_init
