"""How `pelt serve` treats connections: a deadline for each request's head, and a cap on connections.

uvicorn has no header-read timeout (its keep-alive timer runs only between a response and the next
request's first byte), so a client that sends a request line and then nothing, or one header a minute,
holds its connection forever; a thousand of them hold the server's file descriptors. `HeadDeadline`
closes a connection whose request head (request line and headers) is not complete within
PELT_API_HEADER_TIMEOUT_SECONDS of the connection opening, or of the next request's first byte on a
kept-alive connection. PELT_API_MAX_CONNECTIONS caps open connections and requests in progress
(uvicorn's `limit_concurrency`): a request beyond the cap is answered 503 at once.

Behind a reverse proxy (nginx, an ingress) the proxy usually buffers requests and has its own header
timeout (nginx: client_header_timeout); keep pelt's as a second line, and size the cap to the proxy's
upstream connections.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.settings import Settings


class HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late (see the module doc).
    Subclasses made by `with_head_deadline` set `head_timeout` (seconds)."""

    head_timeout: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._awaiting_head():  # the first bytes of a kept-alive request
            self._start_head_timer()
        super().data_received(data)
        if not self._awaiting_head():
            self._stop_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        """Whether the client has yet to complete a request's head (h11: the client is still idle)."""
        return self.conn.their_state is h11.IDLE

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
            self.logger.info("closing a connection from %s: no complete request head within %.1f s",
                             self.client, self.head_timeout)
            self.transport.close()


def with_head_deadline(seconds: float) -> type[HeadDeadline]:
    """The protocol class for uvicorn's `http=` with this deadline for a request's head."""
    return type("HeadDeadlineProtocol", (HeadDeadline,), {"head_timeout": float(seconds)})


def uvicorn_connection_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn.Config options that bound what clients can hold: the head deadline and the cap."""
    return {"http": with_head_deadline(settings.api_header_timeout_seconds),
            "limit_concurrency": settings.api_max_connections}


__all__ = ["HeadDeadline", "uvicorn_connection_options", "with_head_deadline"]
