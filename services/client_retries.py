"""When `PeltClient` (services/client.py) sends a request again: after what answer or failure, and after how
long. A request is sent again only when that cannot do twice what it did once (`retry_wait`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

RETRY_BASE_SECONDS = 0.5  # the first wait before a try again without Retry-After; doubled each time
RETRY_MAX_WAIT_SECONDS = 30.0  # no single wait is longer; a Retry-After of this or more is not waited for
LOST_ANSWER_STATUSES = (502, 503, 504)  # from a proxy, or the service without a Retry-After


def retry_wait(
    response: httpx.Response | None, failure: Exception | None, repeatable: bool, attempt: int
) -> float | None:
    """Seconds to wait before trying a request again, or None when it is not tried again: the answer
    stands, or sending the request again might do twice what it did once.

    - a 503 with Retry-After and pelt's error body: pelt refused it before doing anything (busy, starting,
      other writers held the database): any request, after Retry-After (a proxy's: repeatable requests
      only); a Retry-After of RETRY_MAX_WAIT_SECONDS or more (replicas waiting for a node that can hold
      them, a failed start) is the caller's to hear now, not to wait out;
    - the connection could not be made (refused, timed out connecting): nothing was sent: any request;
    - a lost answer (the connection dropped, a read timed out, a 502/503/504 without Retry-After, as a proxy
      answers; pelt's RegistryUnavailableError without Retry-After: its database went away during the
      commit): only a `repeatable` request, since the service may have done it.
    Waits double from RETRY_BASE_SECONDS (Retry-After when given), at most RETRY_MAX_WAIT_SECONDS."""
    backoff = min(RETRY_MAX_WAIT_SECONDS, RETRY_BASE_SECONDS * 2**attempt)
    if failure is not None:
        never_sent = isinstance(failure, httpx.ConnectError | httpx.ConnectTimeout)
        return backoff if never_sent or repeatable else None
    assert response is not None
    retry_after = response.headers.get("Retry-After")
    if response.status_code == 503 and retry_after and retry_after.strip().isdigit():
        if float(retry_after) >= RETRY_MAX_WAIT_SECONDS or not (repeatable or pelt_error(response)):
            return None
        return float(retry_after)
    lost = not pelt_error(response) or error_type(response) == "RegistryUnavailableError"
    if response.status_code in LOST_ANSWER_STATUSES and repeatable and lost:
        return backoff
    return None  # pelt's own refusal without Retry-After (a store an operator must upgrade) stands


def pelt_error(response: httpx.Response) -> bool:
    """Whether the answer is pelt's own error body ({"error": {...}}), not a proxy's page."""
    try:
        return isinstance(response.json().get("error"), dict)
    except (ValueError, AttributeError):
        return False


def error_type(response: httpx.Response) -> str | None:
    """The `type` of pelt's error body, if the answer is one."""
    if not pelt_error(response):
        return None
    kind = response.json()["error"].get("type")
    return kind if isinstance(kind, str) else None


def rewind_files(files: Mapping[str, Any] | None) -> None:
    """Every file of an upload back at its start (a try again sends them whole)."""
    for value in (files or {}).values():
        handle = value[1] if isinstance(value, tuple) else value
        if hasattr(handle, "seek"):
            handle.seek(0)


__all__ = [
    "LOST_ANSWER_STATUSES",
    "RETRY_BASE_SECONDS",
    "RETRY_MAX_WAIT_SECONDS",
    "error_type",
    "pelt_error",
    "retry_wait",
    "rewind_files",
]
