"""How `pelt serve` treats connections: deadlines for each request's head and body and for the client
reading its answer, a minimum upload rate, and a cap on connections with a small share of it for
connections that have not authenticated.

uvicorn has no header-read timeout (its keep-alive timer runs only between a response and the next
request's first byte), no body-read timeout and no send timeout, so a client that sends a request line
and then nothing, one header a minute, its headers and then a body it never finishes, or that asks for a
large answer and never reads it, holds its connection (and the answer, buffered) forever; a thousand of
them hold the server's file descriptors. `ClientDeadlines` closes a connection

- whose request head (request line and headers) is not complete within PELT_API_HEADER_TIMEOUT_SECONDS
  of the connection opening, or of the next request's first byte on a kept-alive connection;
- whose request body stops arriving: no byte of it for PELT_API_BODY_IDLE_TIMEOUT_SECONDS (an idle
  timeout between two reads, like nginx's client_body_timeout, not a bound on the whole upload: a 1 GiB
  upload over a slow link is never cut off while its bytes keep coming). Time while the server itself
  has stopped reading (uvicorn's flow control: the app has not yet taken what arrived) or has yet to
  answer `Expect: 100-continue` does not count against the client. It applies as well to the unread
  rest of a body the app answered without reading;
- whose request body arrives slower than PELT_API_MIN_UPLOAD_BYTES_PER_SECOND over the client's last
  PELT_API_MIN_UPLOAD_RATE_WINDOW_SECONDS, judged once the body has been awaited that long (`UploadRate`:
  a sliding window, so a fast start banks no credit for a trickle later; time the server holds the body
  back does not count). 0 turns the rule off;
- whose answer the client stops reading: the server has more to write than the transport takes (uvicorn's
  `pause_writing`) and none of it has gone out for PELT_API_SEND_IDLE_TIMEOUT_SECONDS (like nginx's
  send_timeout; each read the client makes pushes the deadline back). The connection is aborted, so the
  buffered answer is dropped at once.

PELT_API_MAX_CONNECTIONS caps open connections and requests in progress (uvicorn's `limit_concurrency`):
a request beyond the cap is answered 503 at once. Of them, at most PELT_API_MAX_UNAUTHENTICATED_CONNECTIONS
may be connections that have not yet carried a request with a valid token (`mark_authenticated`, called
by `services.api.middleware.TokenAuthMiddleware`): a new connection beyond that share closes the oldest
idle one of them (none with a request in progress), so strangers holding sockets open cannot keep a
token holder out; and one is closed PELT_API_HEADER_TIMEOUT_SECONDS after it opened (once the public
request it may be making, /health or the page, is answered) unless it has authenticated by then: polling
/health on a kept-alive connection holds it no longer. A refused request (401, 403, 413 or the upload slots' 503) is answered with
`Connection: close` and its connection closed, without parsing its body.

Such a close is a lingering close (as nginx's lingering_close), wherever the client may still be sending:
its request body is not complete, or bytes of it wait unparsed. Closing a socket with unread bytes makes
the kernel answer with a reset (RFC 7230, section 6.6), and a client that is still writing its upload
then fails with ECONNRESET or EPIPE, and may lose the answer already sent (Windows drops it). Instead,
once the answer is written, the server shuts down its side (a FIN: the client reads the answer and then
its end), reads and discards whatever still arrives, without parsing it, and closes when the client
closes its side, when no byte came for LINGER_IDLE_SECONDS (2 s, nginx's lingering_timeout is 5 s), or
at the latest LINGER_TOTAL_SECONDS (10 s, nginx's lingering_time is 30 s) after the answer or once
LINGER_MAX_BYTES (64 MiB) were discarded, whichever comes first; only a close at those bounds can still
reset a client that keeps sending. A lingering connection still counts in the cap; no other deadline
holds it longer, and none but these bounds (and the unauthenticated share's eviction) cut it short.

Behind a reverse proxy (nginx, an ingress) the proxy usually buffers requests and has its own header,
body and send timeouts (nginx: client_header_timeout, client_body_timeout, send_timeout); keep pelt's as
a second line, and size the cap to the proxy's upstream connections.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.settings import Settings

CONNECTION_STATE_KEY = "pelt.connection"  # where a request's ASGI scope["state"] holds its connection
LINGER_IDLE_SECONDS = 2.0  # a lingering close ends once no byte came for this long
LINGER_TOTAL_SECONDS = 10.0  # ... and at the latest this long after it began
LINGER_MAX_BYTES = 64 * 2**20  # ... or once this many bytes were discarded


class CloseAfterResponse:
    """The transport as a request's cycle (uvicorn's `RequestResponseCycle`) sees it: its `close()`, which
    uvicorn calls after a last response (`Connection: close`) or a failed one, is the protocol's
    `close_after_response`; everything else is the connection's transport."""

    def __init__(self, protocol: ClientDeadlines) -> None:
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_after_response()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._protocol.transport, name)


class UploadRate:
    """Whether a request body keeps arriving at `bytes_per_second` or more, judged over the client's last
    `window_seconds` once the body has been awaited that long (the grace): a fast start banks no credit
    for a trickle later. The client's time leaves out time the server holds the body back; each call says
    whether it does from then on (`held`). A rate of 0 is never too slow. Times are the caller's clock."""

    def __init__(self, bytes_per_second: float, window_seconds: float, now: float) -> None:
        self.bytes_per_second, self.window_seconds = bytes_per_second, window_seconds
        self._clock = 0.0  # the client's seconds since the body was first awaited
        self._last, self._held = now, False
        self._received = 0
        # (client's time, bytes received by then), one per 1/16 of a window at most: what arrives between
        # two samples counts for the later one, which only makes the rule more lenient
        self._samples: deque[tuple[float, int]] = deque([(0.0, 0)])

    def arrived(self, count: int, *, now: float, held: bool) -> None:
        """`count` more bytes of the body arrived at `now`."""
        self._advance(now, held)
        self._received += count
        if self._clock - self._samples[-1][0] >= self.window_seconds / 16:
            self._samples.append((self._clock, self._received))

    def too_slow(self, *, now: float, held: bool) -> bool:
        """Whether fewer than `bytes_per_second` x `window_seconds` bytes arrived over the client's last
        window (never before a whole window of the client's time has passed)."""
        self._advance(now, held)
        if self.bytes_per_second <= 0 or self._clock < self.window_seconds:
            return False
        horizon = self._clock - self.window_seconds
        while len(self._samples) > 1 and self._samples[1][0] <= horizon:
            self._samples.popleft()
        return self._received - self._samples[0][1] < self.bytes_per_second * self.window_seconds

    def _advance(self, now: float, held: bool) -> None:
        if not self._held:
            self._clock += max(0.0, now - self._last)
        self._last, self._held = now, held


class ClientDeadlines(H11Protocol):
    """uvicorn's h11 protocol with the deadlines, the minimum upload rate and the unauthenticated share
    of the cap of the module doc. `connection_protocol` makes the subclass of one server, with its
    settings (seconds, bytes per second, a count) and its own registry of unauthenticated connections."""

    head_timeout: float = 10.0
    body_idle_timeout: float = 60.0
    send_idle_timeout: float = 60.0
    min_upload_bytes_per_second: float = 0.0  # 0: no minimum rate
    min_upload_rate_window: float = 30.0
    max_unauthenticated: int | None = None  # None: no share of their own
    linger_idle_timeout: float = LINGER_IDLE_SECONDS
    linger_total_timeout: float = LINGER_TOTAL_SECONDS
    linger_max_bytes: int = LINGER_MAX_BYTES
    # this server's connections that have not authenticated, oldest first (a dict keeps insertion order)
    unauthenticated: ClassVar[dict[ClientDeadlines, None]] = {}

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        # every request's scope["state"] is a copy of app_state: it carries this connection to the app
        super().__init__(config, server_state, {**app_state, CONNECTION_STATE_KEY: self}, _loop)
        self.authenticated = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._rate_timer: asyncio.TimerHandle | None = None
        self._upload_rate: UploadRate | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._send_progress_at = 0.0  # when the server's write buffer last shrank (event-loop time)
        self._send_buffered = 0  # its size then
        self._stranger_timer: asyncio.TimerHandle | None = None  # the unauthenticated connection's deadline
        self._stranger_expired = False
        self._lingering = False  # the answer is out and the connection closing: what arrives is discarded
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_ends_at = 0.0  # the total bound (event-loop time)
        self._linger_last_byte_at = 0.0
        self._linger_discarded = 0

    @property
    def body_deadline(self) -> float | None:
        """When (event-loop time) the connection is closed unless more of the body arrives; None when
        no request body is awaited."""
        return None if self._body_timer is None else self._body_timer.when()

    @property
    def send_deadline(self) -> float | None:
        """When (event-loop time, to within a check interval) the connection is closed unless the client
        reads more of its answer; None while the transport takes everything the server writes."""
        return None if self._send_timer is None else self._send_progress_at + self.send_idle_timeout

    @property
    def linger_deadline(self) -> float | None:
        """When (event-loop time) a lingering close ends at the latest; None when the connection is not
        lingering."""
        return self._linger_ends_at if self._lingering else None

    def mark_authenticated(self) -> None:
        """A request on this connection carried a valid token: it leaves the unauthenticated share."""
        self.authenticated = True
        self.unauthenticated.pop(self, None)
        if self._stranger_timer is not None:
            self._stranger_timer.cancel()
            self._stranger_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()
        self._admit_unauthenticated()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._discard(len(data))
            return
        if self._head_timer is None and self._awaiting_head():  # the first bytes of a kept-alive request
            self._start_head_timer()
        super().data_received(data)
        if not self._awaiting_head():
            self._stop_head_timer()
        self._watch_body(arrived=len(data))

    def handle_events(self) -> None:
        super().handle_events()  # may make the next request's cycle: its close() is ours
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not isinstance(cycle.transport, CloseAfterResponse):
            cycle.transport = CloseAfterResponse(self)

    def on_response_complete(self) -> None:
        if self._lingering:  # that answer was the last: no keep-alive timer, no next request
            self.server_state.total_requests += 1
            return
        super().on_response_complete()  # may start the next request, from bytes already received
        self._watch_body(arrived=0)
        if self._stranger_expired:
            self._close_stranger()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_progress_at = self.loop.time()
            self._send_buffered = self.transport.get_write_buffer_size()
            self._send_timer = self.loop.call_later(self._send_check_interval(), self._check_send)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._stop_body_timer()
        self._stop_rate_watch()
        self._stop_send_timer()
        self._stop_linger_timer()
        if self._stranger_timer is not None:
            self._stranger_timer.cancel()
            self._stranger_timer = None
        self.unauthenticated.pop(self, None)
        super().connection_lost(exc)

    def close_after_response(self) -> None:
        """Close the connection, as uvicorn does after a last (or failed) response: with a lingering close
        (the module doc) where the answer is complete and the client may still be sending."""
        if self._lingering:
            return
        cycle = getattr(self, "cycle", None)
        answered = cycle is not None and cycle.response_complete
        if answered and not self.transport.is_closing() and self._client_may_send():
            self._start_lingering()
        else:
            self.transport.close()

    # --- the unauthenticated share of the cap ---------------------------------------------------------

    def _admit_unauthenticated(self) -> None:
        """Count this new connection as unauthenticated, with its deadline; beyond the share, close the
        oldest idle ones."""
        self.unauthenticated[self] = None
        self._stranger_timer = self.loop.call_later(self.head_timeout, self._stranger_late)
        if self.max_unauthenticated is None:
            return
        excess = len(self.unauthenticated) - self.max_unauthenticated
        for older in list(self.unauthenticated):
            if excess <= 0:
                break
            if older is self or older._request_in_progress():
                continue
            self.unauthenticated.pop(older, None)
            older.logger.info(
                "closing a connection from %s: it never authenticated, and %d newer ones came",
                older.client,
                self.max_unauthenticated,
            )
            older.transport.close()
            excess -= 1

    def _request_in_progress(self) -> bool:
        cycle = getattr(self, "cycle", None)
        return cycle is not None and not cycle.response_complete

    def _stranger_late(self) -> None:
        """The connection has not authenticated within the header timeout of opening: close it now, or
        once the public request it is making (/health, the page) is answered."""
        self._stranger_timer = None
        if not self.authenticated:
            self._stranger_expired = True
            self._close_stranger()

    def _close_stranger(self) -> None:
        if (
            self.authenticated
            or self._request_in_progress()
            or self._lingering
            or self.transport.is_closing()
        ):
            return
        self.logger.info(
            "closing a connection from %s: no valid token within %.1f s of opening",
            self.client,
            self.head_timeout,
        )
        self.transport.close()

    # --- the request head -----------------------------------------------------------------------------

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

    # --- the request body: idle timeout and minimum rate ----------------------------------------------

    def _watch_body(self, *, arrived: int) -> None:
        """(Re)start the body's idle timer when bytes arrived or a body is newly awaited, and count them
        for its rate; stop both once the body is complete."""
        if not self._awaiting_body():
            self._stop_body_timer()
            self._stop_rate_watch()
            return
        if arrived or self._body_timer is None:
            self._start_body_timer()
        if self.min_upload_bytes_per_second > 0:
            now, held = self.loop.time(), self._server_holds_the_body_back()
            if self._upload_rate is None:
                window = self.min_upload_rate_window
                self._upload_rate = UploadRate(self.min_upload_bytes_per_second, window, now)
                self._rate_timer = self.loop.call_later(window / 8, self._check_rate)
            if arrived:
                self._upload_rate.arrived(arrived, now=now, held=held)

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

    def _stop_rate_watch(self) -> None:
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None
        self._upload_rate = None

    def _check_rate(self) -> None:
        self._rate_timer = None
        rate = self._upload_rate
        if rate is None or not self._awaiting_body() or self.transport.is_closing():
            return
        if rate.too_slow(now=self.loop.time(), held=self._server_holds_the_body_back()):
            self.logger.info(
                "closing a connection from %s: its request body arrived slower than %g bytes/s over %.1f s",
                self.client,
                self.min_upload_bytes_per_second,
                self.min_upload_rate_window,
            )
            self.transport.close()
            return
        self._rate_timer = self.loop.call_later(self.min_upload_rate_window / 8, self._check_rate)

    # --- the answer: send idle timeout ----------------------------------------------------------------

    def _send_check_interval(self) -> float:
        return min(1.0, self.send_idle_timeout / 4)

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _check_send(self) -> None:
        """While writing is paused: note any progress (the write buffer shrank); abort the connection
        once none was made for the send idle timeout."""
        self._send_timer = None
        if not self.flow.write_paused:
            return
        now, buffered = self.loop.time(), self.transport.get_write_buffer_size()
        if buffered < self._send_buffered:
            self._send_progress_at = now
        self._send_buffered = buffered
        if now - self._send_progress_at >= self.send_idle_timeout:
            self.logger.info(
                "closing a connection from %s: its answer (%d bytes still buffered) was not read for %.1f s",
                self.client,
                buffered,
                self.send_idle_timeout,
            )
            self.transport.abort()  # not close(): that would keep the buffer until it is sent
            return
        self._send_timer = self.loop.call_later(self._send_check_interval(), self._check_send)

    # --- the lingering close after a last answer -------------------------------------------------------

    def _client_may_send(self) -> bool:
        """Whether the client may still be sending: its request body is not complete, or bytes of it (or
        of a next request) wait unparsed."""
        return self.conn.their_state is h11.SEND_BODY or bool(self.conn.trailing_data[0])

    def _start_lingering(self) -> None:
        """Shut the server's side once the answer is written (FIN, where the transport can) and read and
        discard what still arrives, until the client's end or a bound of the module doc."""
        self._lingering = True
        self._stop_head_timer()
        self._stop_body_timer()
        self._stop_rate_watch()
        self._unset_keepalive_if_required()
        now = self.loop.time()
        self._linger_ends_at, self._linger_last_byte_at = now + self.linger_total_timeout, now
        self._linger_timer = self.loop.call_later(
            min(self.linger_idle_timeout, self.linger_total_timeout), self._check_linger
        )
        if self.transport.can_write_eof():
            self.transport.write_eof()  # after what is still buffered of the answer
        self.flow.resume_reading()  # what the client sends must be read to be discarded

    def _discard(self, count: int) -> None:
        self._linger_discarded += count
        self._linger_last_byte_at = self.loop.time()
        if self._linger_discarded > self.linger_max_bytes:
            self._end_lingering(f"it sent more than {self.linger_max_bytes} bytes after its answer")

    def _check_linger(self) -> None:
        self._linger_timer = None
        now = self.loop.time()
        idle_ends_at = self._linger_last_byte_at + self.linger_idle_timeout
        if now >= idle_ends_at:
            self._end_lingering(None)  # it went quiet: the ordinary end of a lingering close
        elif now >= self._linger_ends_at:
            self._end_lingering(f"it kept sending for {self.linger_total_timeout:.1f} s after its answer")
        else:
            self._linger_timer = self.loop.call_at(
                min(idle_ends_at, self._linger_ends_at), self._check_linger
            )

    def _end_lingering(self, reason: str | None) -> None:
        self._stop_linger_timer()
        if self.transport.is_closing():
            return
        if reason is not None:
            self.logger.info("closing a connection from %s: %s", self.client, reason)
        self.transport.close()

    def _stop_linger_timer(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None


def connection_protocol(settings: Settings) -> type[ClientDeadlines]:
    """The protocol class for uvicorn's `http=` of one server, with these settings' deadlines, minimum
    upload rate and unauthenticated share (a new class each call: its registry is that server's)."""
    return type(
        "ClientDeadlinesProtocol",
        (ClientDeadlines,),
        {
            "head_timeout": float(settings.api_header_timeout_seconds),
            "body_idle_timeout": float(settings.api_body_idle_timeout_seconds),
            "send_idle_timeout": float(settings.api_send_idle_timeout_seconds),
            "min_upload_bytes_per_second": float(settings.api_min_upload_bytes_per_second),
            "min_upload_rate_window": float(settings.api_min_upload_rate_window_seconds),
            "max_unauthenticated": settings.api_max_unauthenticated_connections,
            "unauthenticated": {},
        },
    )


def uvicorn_connection_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn.Config options that bound what clients can hold: the protocol with its deadlines and
    shares, and the cap."""
    return {"http": connection_protocol(settings), "limit_concurrency": settings.api_max_connections}


__all__ = [
    "CONNECTION_STATE_KEY",
    "LINGER_IDLE_SECONDS",
    "LINGER_MAX_BYTES",
    "LINGER_TOTAL_SECONDS",
    "ClientDeadlines",
    "CloseAfterResponse",
    "UploadRate",
    "connection_protocol",
    "uvicorn_connection_options",
]
