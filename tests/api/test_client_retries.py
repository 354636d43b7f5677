"""The Python client tries a request again when the service refused it for now or could not be reached,
never when sending it again could do twice what it did once: a 503 with Retry-After (pelt refused it before
doing anything) and a connection that could not be made are tried again for any request; a lost answer
only for a request safe to repeat; a submit carries an idempotency key of the client's own, so one whose
answer was lost and that is sent again queues one job."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

import services.client as client_module
from services.client import PeltAPIError, PeltClient
from services.client_retries import retry_wait
from services.settings import Settings
from tests.api.conftest import BACKBONE, Api

URL = "http://pelt.test"


def answer(status: int, retry_after: str | None = None, pelt: bool = True, kind: str = "X") -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after else {}
    if pelt:
        return httpx.Response(status, headers=headers, json={"error": {"type": kind, "message": "busy"}})
    return httpx.Response(status, headers=headers, text="<html>bad gateway</html>")


REQUEST = httpx.Request("GET", URL)


@pytest.mark.parametrize(
    ("response", "failure", "repeatable", "wait"),
    [
        (answer(503, "7"), None, False, 7.0),  # pelt refused it before doing anything: any request
        (answer(503, "29"), None, False, 29.0),
        (answer(503, "30"), None, True, None),  # a long wait is the caller's to hear now
        (answer(503, "7", pelt=False), None, True, 7.0),  # a proxy's Retry-After: repeatable only
        (answer(503, "7", pelt=False), None, False, None),
        (None, httpx.ConnectError("refused", request=REQUEST), False, 0.5),  # nothing was sent
        (None, httpx.ConnectTimeout("slow", request=REQUEST), False, 0.5),  # to a service reached before
        (None, httpx.ReadError("reset", request=REQUEST), True, 0.5),  # a lost answer: repeatable only
        (None, httpx.ReadError("reset", request=REQUEST), False, None),
        (None, httpx.ReadTimeout("slow", request=REQUEST), False, None),
        (answer(502, pelt=False), None, True, 0.5),  # a proxy's answer
        (answer(504, pelt=False), None, False, None),
        (answer(503), None, True, None),  # pelt's own 503 without Retry-After: an operator's to fix
        # the registry's database went away during the commit: it may have been written
        (answer(503, kind="RegistryUnavailableError"), None, True, 0.5),
        (answer(503, kind="RegistryUnavailableError"), None, False, None),
        (answer(500), None, True, None),
        (answer(429), None, True, None),
        (answer(200), None, True, None),
    ],
)
def test_which_failures_are_tried_again(response, failure, repeatable, wait):
    assert retry_wait(response, failure, repeatable, attempt=0) == wait


def test_waits_without_retry_after_double_from_half_a_second_up_to_thirty():
    lost = httpx.ReadError("reset", request=REQUEST)
    assert [retry_wait(None, lost, True, attempt) for attempt in range(8)] == [
        0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0
    ]  # fmt: skip


class Clock:
    """time for services.client: sleeping moves the clock on, and is recorded."""

    def __init__(self):
        self.now, self.slept = 1000.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(client_module, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    return clock


def scripted(*outcomes, **settings) -> tuple[PeltClient, list[httpx.Request]]:
    """A client whose requests meet `outcomes` in turn (a Response, or a transport error to raise)."""
    seen: list[httpx.Request] = []
    queue = list(outcomes)

    def handle(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        outcome = queue.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    http = httpx.Client(base_url=URL, transport=httpx.MockTransport(handle))
    return PeltClient(URL, token="t", http=http, settings=Settings(**settings)), seen


def test_a_read_refused_for_now_is_answered_after_retry_after(clock):
    client, seen = scripted(answer(503, "2"), answer(503, "3"), httpx.Response(200, json={"status": "ok"}))
    assert client.health() == {"status": "ok"}
    assert len(seen) == 3 and clock.slept == [2.0, 3.0]


def test_any_request_is_sent_again_when_the_connection_could_not_be_made_to_a_service_that_answered_before(
    clock,
):
    refused = httpx.ConnectError("connection refused")
    ok = httpx.Response(200, json={"status": "ok"})
    client, seen = scripted(ok, refused, refused, httpx.Response(200, json={"name": "b", "source": "/m"}))
    client.health()
    with pytest.raises(ValidationError):  # the answer is no BackboneOut: what matters is that it was sent
        client.register_backbone("b", "/m")
    assert len(seen) == 4 and clock.slept == [0.5, 1.0]


@pytest.mark.parametrize(
    "failure", [httpx.ConnectError("connection refused"), httpx.ConnectTimeout("no route")]
)
def test_a_service_that_never_answered_is_not_waited_for(clock, failure):
    client, seen = scripted(failure)
    with pytest.raises(PeltAPIError, match="is `pelt serve` running"):
        client.health()
    assert len(seen) == 1 and clock.slept == []


def test_a_request_not_safe_to_repeat_whose_answer_was_lost_is_not_sent_again(clock):
    client, seen = scripted(httpx.ReadError("connection reset by peer"))
    with pytest.raises(PeltAPIError, match="cannot reach the pelt service") as error:
        client.register_backbone("b", "/m")
    assert error.value.status == 0 and len(seen) == 1 and clock.slept == []


def test_the_tries_stop_at_the_count_and_at_the_time_they_may_wait(clock):
    client, seen = scripted(*[answer(503, "1")] * 10, client_retries=3)
    with pytest.raises(PeltAPIError) as error:
        client.health()
    assert error.value.status == 503 and len(seen) == 4 and clock.slept == [1.0, 1.0, 1.0]

    client, seen = scripted(*[answer(503, "25")] * 10, client_retry_seconds=60)
    with pytest.raises(PeltAPIError):
        client.health()
    assert clock.slept[3:] == [25.0, 25.0] and len(seen) == 3  # a third wait would pass the 60 s

    started = clock.now  # each request below takes 100 s: only the waits count against the 60
    client, seen = scripted(*[answer(503, "20")] * 3, httpx.Response(200, json={"status": "ok"}))
    client.http.event_hooks["request"].append(lambda request: setattr(clock, "now", clock.now + 100))
    assert client.health() == {"status": "ok"}
    assert len(seen) == 4 and clock.now - started == 4 * 100 + 3 * 20

    client, seen = scripted(answer(503, "1"), client_retries=0)
    with pytest.raises(PeltAPIError):
        client.health()
    assert len(seen) == 1


def test_an_upload_sent_again_sends_its_files_whole(clock, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"sentence": "a film", "label": 1}\n')
    client, seen = scripted(answer(503, "1"), httpx.Response(500, json={"error": {"message": "stop here"}}))
    with pytest.raises(PeltAPIError, match="stop here"):
        client.register_task("t", train)
    assert len(seen) == 2
    assert all(b'{"sentence": "a film", "label": 1}\n' in request.content for request in seen)


class LoseFirstAnswer(httpx.BaseTransport):
    """The service does the request; its answer to the first POST to `path` is lost on the way back."""

    def __init__(self, inner: httpx.BaseTransport, path: str):
        self.inner, self.path, self.lost = inner, path, False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.method == "POST" and request.url.path == self.path and not self.lost:
            self.lost = True
            response.read()
            raise httpx.ReadError("connection reset by peer", request=request)
        return response


def test_a_submit_whose_answer_was_lost_is_sent_again_and_queues_one_job(api: Api, toy_task: str, clock):
    http = TestClient(api.app)
    transport = http._transport = LoseFirstAnswer(http._transport, "/v1/jobs")
    retrying = api.settings.model_copy(update={"client_retries": 5})
    client = PeltClient("http://testserver", token=api.token, http=http, settings=retrying)

    job = client.submit(toy_task, "lora", backbone=BACKBONE, hyperparameters={"epochs": 1})

    assert transport.lost and clock.slept == [0.5]
    (queued,) = api.registry.list_jobs()
    assert queued.id == job.id and queued.idempotency_key.startswith("client-")
