"""`PeltClient`'s method searches (services/client.py): start one, follow it to its answer, read, list and
cancel them through /v1/searches."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.api.schemas import DEFAULT_BACKBONE, SearchOut


class SearchesClient:
    """The search calls of `PeltClient` (which gives them `_get`, `_post` and `_draw`)."""

    _get: Callable[..., Any]
    _post: Callable[..., Any]
    _draw: Callable[..., Any]

    def search(
        self,
        task: str,
        budget: float,
        *,
        methods: Sequence[str] | None = None,
        backbone: str = DEFAULT_BACKBONE,
        k_shot: int | None = None,
        dev_rows: int | None = None,
        hyperparameters: Mapping[str, Any] | None = None,
        seeds: int = 3,
        seed: int = 0,
        idempotency_key: str | None = None,
    ) -> SearchOut:
        """Start a budget-aware method search (successive halving through the queue; `budget` in full-job
        equivalents) and return it as planned, its first rung queued; `wait_search` follows it to its
        answer. Refusals (a budget too small for one rung, an unknown method, a K the task cannot
        supply, nothing to search) are a PeltAPIError naming the field, with nothing queued."""
        body = {
            "task": task,
            "budget": budget,
            "methods": None if methods is None else list(methods),
            "backbone": backbone,
            "k_shot": k_shot,
            "dev_rows": dev_rows,
            "hyperparameters": dict(hyperparameters or {}),
            "seeds": seeds,
            "seed": seed,
            # a key of the client's own when none is given: a start tried again never starts two searches
            "idempotency_key": idempotency_key or f"client-{uuid.uuid4().hex}",
        }
        return SearchOut.model_validate(self._post("/v1/searches", body, repeatable=True))

    def get_search(self, search_id: int) -> SearchOut:
        """The search with every trial, the best dev score against the budget spent, and its answer."""
        return SearchOut.model_validate(self._get(f"/v1/searches/{int(search_id)}"))

    def searches(self, task: str | None = None, status: str | None = None) -> list[SearchOut]:
        """Searches, newest first."""
        return [SearchOut.model_validate(s) for s in self._get("/v1/searches", task=task, status=status)]

    def plot_search(
        self, search_id: int, path: str | Path | None = None, *, format: str | None = None
    ) -> str | bytes:
        """The search's best dev score against the budget it spent, drawn by the service (every ended job a
        point, the best so far a step line). Returns the SVG text or the PNG bytes, and writes them to `path`
        when given; the format is the path's suffix (.svg or .png), else `format` ("svg" by default)."""
        return self._draw(f"/v1/searches/{int(search_id)}/plot", path, format)

    def cancel_search(self, search_id: int) -> SearchOut:
        """Stop a search this token started (any, with an admin token) and cancel its unfinished jobs."""
        return SearchOut.model_validate(self._post(f"/v1/searches/{int(search_id)}/cancel", repeatable=True))

    def wait_search(
        self,
        search: SearchOut | int,
        *,
        timeout: float | None = None,
        poll_seconds: float = 2.0,
        on_change: Callable[[SearchOut], None] | None = None,
    ) -> SearchOut:
        """Poll a search until it has ended (succeeded, failed or cancelled) and return it;
        `on_change(search)` sees each new state (rung, spent). TimeoutError after `timeout` s."""
        search_id = search.id if isinstance(search, SearchOut) else int(search)
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = None
        while True:
            current = self.get_search(search_id)
            state = (current.status, current.rung, round(current.spent, 6))
            if on_change is not None and state != seen:
                on_change(current)
            seen = state
            if current.status != "running":
                return current
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"search {search_id} was still running after {timeout} s")
            time.sleep(poll_seconds)


__all__ = ["SearchesClient"]
