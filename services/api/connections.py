"""How `pelt serve` treats connections: deadlines for each request's head and body, and a cap on
connections.

uvicorn has no header-read timeout (its keep-alive timer runs only between a response and the next
request's first byte) and no body-read timeout, so a client that sends a request line and then nothing,
one header a minute, or its headers and then a body it never finishes, holds its connection forever; a
thousand of them hold the server's file descriptors. `ClientDeadlines` closes a connection

- whose request head (request line and headers) is not complete within PELT_API_HEADER_TIMEOUT_SECONDS
  of the connection opening, or of the next request's first byte on a kept-alive connection;
- whose request body stops arriving: no byte of it for PELT_API_BODY_IDLE_TIMEOUT_SECONDS (an idle
  timeout between two reads, like nginx's client_body_timeout, not a bound on the whole upload: a 1 GiB
  upload over a slow link is never cut off while its bytes keep coming). Time while the server itself
  has stopped reading (uvicorn's flow control: the app has not yet taken what arrived) or has yet to
  answer `Expect: 100-continue` does not count against the client. It applies as well to the unread
  rest of a body the app answered without reading (a 401, a 413).

A client trickling one byte just inside the idle timeout still holds its connection; the cap bounds what
such clients hold together: PELT_API_MAX_CONNECTIONS caps open connections and requests in progress
(uvicorn's `limit_concurrency`): a request beyond the cap is answered 503 at once.

Behind a reverse proxy (nginx, an ingress) the proxy usually buffers requests and has its own header and
body timeouts (nginx: client_header_timeout, client_body_timeout); keep pelt's as a second line, and size
the cap to the proxy's upstream connections.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.settings import Settings


class ClientDeadlines(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late or whose request body
    stops arriving (see the module doc). Subclasses made by `with_deadlines` set `head_timeout` and
    `body_idle_timeout` (seconds)."""

    head_timeout: float = 10.0
    body_idle_timeout: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    @property
    def body_deadline(self) -> float | None:
        """When (event-loop time) the connection is closed unless more of the body arrives; None when
        no request body is awaited."""
        return None if self._body_timer is None else self._body_timer.when()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._awaiting_head():  # the first bytes of a kept-alive request
            self._start_head_timer()
        super().data_received(data)
        if not self._awaiting_head():
            self._stop_head_timer()
        self._watch_body(arrived=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next request, from bytes already received
        self._watch_body(arrived=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._stop_body_timer()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        """Whether the client has yet to complete a request's head (h11: the client is still idle)."""
        return self.conn.their_state is h11.IDLE

    def _awaiting_body(self) -> bool:
        """Whether the client has yet to complete a request's body."""
        return self.conn.their_state is h11.SEND_BODY

    def _server_holds_the_body_back(self) -> bool:
        """Whether the client may be waiting on the server: it stopped reading (flow control) or has
        not yet sent the 100 Continue the client asked for."""
        cycle = getattr(self, "cycle", None)
        return self.flow.read_paused or bool(cycle is not None and cycle.waiting_for_100_continue)

    def _start_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_late)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            self.logger.info(
                "closing a connection from %s: no complete request head within %.1f s",
                self.client,
                self.head_timeout,
            )
            self.transport.close()

    def _watch_body(self, *, arrived: bool) -> None:
        """(Re)start the body's idle timer when bytes arrived or a body is newly awaited; stop it once
        the body is complete."""
        if not self._awaiting_body():
            self._stop_body_timer()
        elif arrived or self._body_timer is None:
            self._start_body_timer()

    def _start_body_timer(self) -> None:
        self._stop_body_timer()
        self._body_timer = self.loop.call_later(self.body_idle_timeout, self._body_idle)

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_idle(self) -> None:
        self._body_timer = None
        if not self._awaiting_body() or self.transport.is_closing():
            return
        if self._server_holds_the_body_back():  # not the client's delay: give it a full timeout again
            self._start_body_timer()
            return
        self.logger.info(
            "closing a connection from %s: no byte of the request body for %.1f s",
            self.client,
            self.body_idle_timeout,
        )
        self.transport.close()


def with_deadlines(head_seconds: float, body_idle_seconds: float) -> type[ClientDeadlines]:
    """The protocol class for uvicorn's `http=` with these deadlines for a request's head and body."""
    return type(
        "ClientDeadlinesProtocol",
        (ClientDeadlines,),
        {"head_timeout": float(head_seconds), "body_idle_timeout": float(body_idle_seconds)},
    )


def uvicorn_connection_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn.Config options that bound what clients can hold: the head and body deadlines and the cap."""
    return {
        "http": with_deadlines(settings.api_header_timeout_seconds, settings.api_body_idle_timeout_seconds),
        "limit_concurrency": settings.api_max_connections,
    }


__all__ = ["ClientDeadlines", "uvicorn_connection_options", "with_deadlines"]
