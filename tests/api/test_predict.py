"""POST /v1/tasks/{task}/predict refuses what it cannot serve before any model work: too many rows or too
long a text (413), rows of the wrong shape (422), an unknown task or version (404 naming it), and a
token without the predict scope (403). The served path, through Ray Serve, is in test_end_to_end.py."""

from __future__ import annotations

import pytest

from pelt_core.limits import MAX_PREDICT_ROWS, MAX_PREDICT_TEXT_CHARS
from services.client import PeltAPIError
from services.predicting import check_rows, version_reference
from tests.api.conftest import Api


def refused(call) -> PeltAPIError:
    with pytest.raises(PeltAPIError) as error:
        call()
    return error.value


def test_rows_are_texts_or_pairs_within_the_limits():
    assert check_rows(["a film", ["a premise", "a hypothesis"]]) == ["a film", ("a premise", "a hypothesis")]
    for bad in ([], "a film", [3], [["only one"]], [["a", "b", "c"]], [["a", 2]], None):
        with pytest.raises(Exception, match="text") as error:
            check_rows(bad)
        assert (error.value.status, error.value.field) == (422, "texts")
    too_many = pytest.raises(Exception, match=f"at most {MAX_PREDICT_ROWS}")
    with too_many as error:
        check_rows(["x"] * (MAX_PREDICT_ROWS + 1))
    assert error.value.status == 413
    with pytest.raises(Exception, match=f"at most {MAX_PREDICT_TEXT_CHARS:,}") as error:
        check_rows([["fine", "x" * (MAX_PREDICT_TEXT_CHARS + 1)]])
    assert (error.value.status, error.value.field) == (413, "texts")


def test_a_version_is_a_number_or_an_alias_and_best_by_default():
    assert version_reference("sst2", None).alias is None and version_reference("sst2", None).version is None
    assert version_reference("sst2", "7").version == "7"
    assert version_reference("sst2", 7).version == "7"
    assert version_reference("sst2", "best-lora").alias == "best-lora"


def test_what_cannot_be_served_is_refused_before_any_model_work(api: Api, toy_task: str):
    client = api.client()
    error = refused(lambda: client.predict("nope", ["a film"]))
    assert (error.status, error.field) == (404, "task") and "toy" in str(error)
    error = refused(lambda: client.predict(toy_task, ["a film"]))  # no job has finished: no version yet
    assert error.status == 404 and "no trained version yet" in str(error)
    error = refused(lambda: client.predict(toy_task, ["a film"], version=3))
    assert (error.status, error.field) == (404, "version")  # (a task with versions names them: end to end)
    error = refused(lambda: client.predict(toy_task, ["x"] * (MAX_PREDICT_ROWS + 1)))
    assert (error.status, error.field) == (413, "texts")
    error = refused(lambda: client._post(f"/v1/tasks/{toy_task}/predict", {"texts": [{"text": "a"}]}))
    assert error.status == 422 and "texts" in str(error)
    error = refused(
        lambda: client._post(f"/v1/tasks/{toy_task}/predict", {"texts": ["a"], "version": "../x"})
    )
    assert (error.status, error.field) == (422, "version")
    assert api.operations._predictions is None or not api.operations._predictions._handles  # no replica


def test_predicting_needs_the_predict_scope_which_a_read_token_lacks(api: Api, toy_task: str):
    _, reader = api.registry.create_api_token("dashboard", scope="read")
    _, app = api.registry.create_api_token("app", scope="predict")
    error = refused(lambda: api.client(reader).predict(toy_task, ["a film"]))
    assert error.status == 403 and "'predict' scope" in str(error)
    error = refused(lambda: api.client(app).predict(toy_task, ["a film"]))
    assert error.status == 404  # allowed: the task has no version yet
    assert [t.name for t in api.client(app).tasks()] == [toy_task]  # predict includes read
    error = refused(lambda: api.client(app).submit(toy_task, "lora"))
    assert error.status == 403 and "'write' scope" in str(error)
