"""POST /v1/tasks/{task}/predict refuses what it cannot serve before any model work: too many rows or too
long a text (413), rows of the wrong shape (422), an unknown task or version (404 naming it), and a
token without the predict scope (403); and how the replicas' answers and refusals become statuses (fakes in
place of Ray Serve). The served path, through Ray Serve, is in test_end_to_end.py."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from pelt_core.limits import MAX_PREDICT_ROWS, MAX_PREDICT_TEXT_CHARS
from pelt_core.serving import DeltaKey
from services.client import PeltAPIError
from services.errors import ServiceError
from services.predicting import Planned, PredictionService, check_rows, replica_shortfall, version_reference
from services.settings import Settings
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


def test_rows_take_the_shape_of_the_tasks_text_fields():
    assert check_rows([["p", "h"]], ["premise", "hypothesis"]) == [("p", "h")]
    with pytest.raises(Exception, match=r"\[premise, hypothesis\] pairs") as error:
        check_rows(["a single text"], ["premise", "hypothesis"])
    assert (error.value.status, error.value.field) == (422, "texts")
    with pytest.raises(Exception, match=r"single texts \(sentence\)"):
        check_rows([["a", "pair"]], ["sentence"])


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
    error = refused(lambda: client.predict(toy_task, [("a", "pair")]))
    assert (error.status, error.field) == (422, "texts") and "single texts (sentence)" in str(error)
    with pytest.raises(TypeError, match="a list of texts"):
        client.predict(toy_task, "a film")  # a string is not a list of one-character texts
    error = refused(lambda: client._post(f"/v1/tasks/{toy_task}/predict", {"texts": [{"text": "a"}]}))
    assert error.status == 422 and "texts" in str(error)
    error = refused(
        lambda: client._post(f"/v1/tasks/{toy_task}/predict", {"texts": ["a"], "version": "../x"})
    )
    assert (error.status, error.field) == (422, "version")
    assert api.operations.predictions._methods == {} and api.operations.predictions._starting == {}  # none


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


def test_pelt_predict_splits_a_file_by_rows_and_by_bytes():
    from services.commands.predict import chunks

    assert [len(chunk) for chunk in chunks(["x"] * 600)] == [MAX_PREDICT_ROWS, MAX_PREDICT_ROWS, 88]
    sizes = [len(chunk) for chunk in chunks(["y" * 9_000] * 100, max_bytes=100_000)]
    assert sum(sizes) == 100 and max(sizes) == 11  # 11 rows of ~9 KB fit in 100 KB
    assert [len(chunk) for chunk in chunks(["z" * 50, "z"], max_bytes=10)] == [1, 1]  # a big row alone


# --- how the replicas' answers and refusals become HTTP statuses (fakes in place of Ray Serve) ----------


class FakeResponse:
    def __init__(self, outcome):
        self.outcome, self.cancelled = outcome, False

    def __await__(self):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        if self.outcome == "hang":
            yield from asyncio.sleep(3600).__await__()
        return self.outcome

    def cancel(self):
        self.cancelled = True


class FakeMethod:
    def __init__(self, outcome):
        self.response = FakeResponse(outcome)

    def remote(self, request):
        return self.response


def planned(outcome) -> Planned:
    info = SimpleNamespace(task="t", version="3", method="lora", kind="job", sha256="ab" * 32)
    return Planned(info, "tiny", DeltaKey("t", 3, "ab" * 32), ["a film"], FakeMethod(outcome))


def service(**settings) -> PredictionService:
    return PredictionService(operations=None, settings=Settings(**settings))


@pytest.mark.parametrize(
    ("failure", "status", "words"),
    [
        ({"phase": "load", "type": "DeltaIntegrityError", "error": "sha256 differs"}, 500, "not served"),
        ({"phase": "input", "type": "ValueError", "error": "give pairs"}, 422, "give pairs"),
        ({"phase": "forward", "type": "RuntimeError", "error": "boom"}, 500, "failed to predict"),
        ({"phase": "load", "type": "MlflowException", "error": "store down"}, 503, "try again"),
    ],
)
def test_a_request_the_replica_could_not_answer_gets_the_status_of_where_it_failed(failure, status, words):
    from services.errors import classify

    error = service()._failure(planned(None).info, failure)
    view = classify(error)
    assert view.status == status and words in view.message


def test_replicas_that_are_busy_or_too_slow_answer_503_with_retry_after_and_the_call_is_cancelled():
    from ray.serve.exceptions import BackPressureError

    with pytest.raises(ServiceError) as error:
        asyncio.run(
            service()._await(planned(BackPressureError(num_queued_requests=9, max_queued_requests=8)))
        )
    assert (error.value.status, error.value.retry_after) == (503, 1)
    slow = planned("hang")
    with pytest.raises(ServiceError, match="PELT_PREDICT_TIMEOUT_SECONDS") as error:
        asyncio.run(service(predict_timeout_seconds=0.05)._await(slow))
    assert error.value.status == 503 and slow.method.response.cancelled
    assert asyncio.run(service()._await(planned({"rows": [{"label": "x"}]}))) == {"rows": [{"label": "x"}]}


def test_replicas_that_fail_to_start_answer_503_and_are_not_started_again_at_once(monkeypatch):
    predictions = service(predict_timeout_seconds=30)
    starts = []

    def deploy(backbone):
        starts.append(backbone.name)
        raise RuntimeError("the backbone would not load")

    monkeypatch.setattr(predictions, "_deploy", deploy)
    backbone = SimpleNamespace(name="tiny")
    for _ in range(3):
        with pytest.raises(ServiceError, match="would not load") as error:
            predictions._method(backbone)
        assert error.value.status == 503 and error.value.retry_after >= 1
    assert starts == ["tiny"]  # retried only after START_RETRY_SECONDS
    monkeypatch.setattr(predictions, "_deploy", lambda backbone: "handle")
    predictions._start_errors["tiny"] = (0.0, "expired")
    assert predictions._method(backbone) == "handle" and predictions._method(backbone) == "handle"


def test_replicas_no_node_can_hold_now_answer_503_naming_the_setting_at_once_while_their_start_waits(
    monkeypatch,
):
    cpu_only = {"CPU": 2.0, "memory": 8e9}
    assert replica_shortfall(Settings(), cpu_only, cpu_only) is None
    on_gpu = Settings(predict_gpus_per_replica=0.5)
    why = replica_shortfall(on_gpu, cpu_only | {"GPU": 0.0}, cpu_only | {"GPU": 1.0})
    assert "PELT_PREDICT_GPUS_PER_REPLICA asks for 0.5 GPU per replica" in why and "0 GPU free of 1" in why
    assert replica_shortfall(on_gpu, cpu_only | {"GPU": 0.5}, cpu_only | {"GPU": 1.0}) is None
    beside_two_workers = {"GPU": 1.0 - 0.4 - 0.4}  # 0.19999999999999996: Ray's 0.2
    assert replica_shortfall(Settings(predict_gpus_per_replica=0.2), beside_two_workers, {"GPU": 1.0}) is None
    serving_nodes = Settings(predict_resource="pelt_predict")
    assert "PELT_PREDICT_RESOURCE" in replica_shortfall(serving_nodes, cpu_only, cpu_only)
    assert replica_shortfall(serving_nodes, cpu_only | {"pelt_predict": 99.0}, cpu_only) is None
    assert "PELT_PREDICT_CPUS_PER_REPLICA" in replica_shortfall(
        Settings(predict_cpus_per_replica=4), cpu_only, cpu_only
    )

    # the start goes on (Serve waits for a node; an autoscaler may add one), and requests hear why at once
    predictions = service(predict_timeout_seconds=300)
    release = threading.Event()

    def deploy(backbone):
        with predictions._lock:
            predictions._start_waits[backbone.name] = why
        release.wait(60)
        return "handle"

    monkeypatch.setattr(predictions, "_deploy", deploy)
    backbone = SimpleNamespace(name="tiny")
    for _ in range(2):  # the request that started it, then one more: neither waits out the 300 s
        with pytest.raises(ServiceError, match="wait for a node that can hold them") as error:
            predictions._method(backbone)
        assert error.value.status == 503 and "PELT_PREDICT_GPUS_PER_REPLICA" in str(error.value)
    release.set()
    wait_for(lambda: "tiny" not in predictions._starting)
    assert predictions._method(backbone) == "handle" and "tiny" not in predictions._start_waits


def wait_for(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_replica_holds_its_backbone_on_a_gpu_exactly_when_it_reserves_one():
    from workers.serving import ReplicaConfig, predict_application

    config = ReplicaConfig("tiny", "/models/tiny", "ab" * 32)
    for device, gpus in (("cpu", 0.5), ("cuda", 0.0)):
        with pytest.raises(ValueError, match="reserves a share"):
            predict_application(
                ReplicaConfig("tiny", "/models/tiny", "ab" * 32, device=device), None, gpus_per_replica=gpus
            )
    assert predict_application(config, None) is not None
    with pytest.raises(ValueError, match="less than or equal to 1"):
        Settings(predict_gpus_per_replica=2)


def test_a_process_with_too_many_predictions_in_flight_refuses_the_next_at_once():
    predictions = service(predict_max_queued=2)
    predictions._waiting = 2
    with pytest.raises(ServiceError, match="PELT_PREDICT_MAX_QUEUED") as error:
        asyncio.run(predictions.predict("t", ["a film"]))
    assert (error.value.status, error.value.retry_after) == (503, 1)


def test_a_resolved_version_answers_for_its_resolve_time_then_is_resolved_again(monkeypatch):
    calls = []
    operations = SimpleNamespace(get_task=lambda task: SimpleNamespace(text_fields=["sentence"]))

    def service_counting(seconds: float) -> PredictionService:
        predictions = PredictionService(operations, Settings(predict_resolve_seconds=seconds))
        monkeypatch.setattr(
            predictions, "_resolve", lambda task, version: calls.append(version) or len(calls)
        )
        monkeypatch.setattr(predictions, "_backbone_of", lambda info: "tiny")
        return predictions

    predictions = service_counting(30)
    now = [100.0]
    monkeypatch.setattr("services.predicting.time.monotonic", lambda: now[0])
    resolve = lambda version: predictions._kept(  # noqa: E731
        ("version", "t", version), lambda: predictions._resolved("t", version)
    )
    assert resolve(None) == (1, "tiny")
    assert resolve(None) == (1, "tiny")  # kept
    assert resolve("best-lora") == (2, "tiny")  # another reference: resolved on its own
    now[0] += 31
    assert resolve(None) == (3, "tiny")  # resolved again: a new best is served from now on
    never = service_counting(0)
    for _ in range(2):
        never._kept(("version", "t", None), lambda: never._resolved("t", None))
    assert len(calls) == 5
