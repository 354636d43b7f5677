"""How deep a JSON text nests, measured on its bytes before any parser sees it.

Parsers recurse once per level: Python's json module ends in a RecursionError near 40,000 brackets, and
pyarrow's JSON reader (the JSON Lines reader of the registry's probe and of `datasets`) crashes the
whole process (SIGSEGV) on a 40 KB row nested 20,000 deep. Callers refuse a text nested deeper than
their limit first: the API's bodies (`limits.MAX_JSON_DEPTH`), uploaded and training JSON Lines rows
(`limits.MAX_JSON_ROW_DEPTH`).

Pure Python (no pyarrow): the service imports it on its request path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# a JSON string (escapes included, an unterminated one to the end of the text) or a bracket
_TOKENS = re.compile(rb'"(?:[^"\\\n]++|\\.)*+"?|[\[\]{}]')


def json_depth(text: str | bytes, stop_above: int | None = None) -> int:
    """The deepest nesting of arrays and objects in a JSON text (brackets inside strings do not count);
    scanning stops once it passes `stop_above`."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    depth = deepest = 0
    for match in _TOKENS.finditer(data):
        token = match.group(0)
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
            if stop_above is not None and deepest > stop_above:
                break
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


def too_deep_line(chunk: bytes, limit: int) -> int | None:
    """The index (0-based) of the first line of a JSON Lines chunk nested deeper than `limit`, or None.
    Fast for ordinary data: only a chunk, then a line, with more than `limit` opening brackets is scanned."""
    if chunk.count(b"[") + chunk.count(b"{") <= limit:
        return None
    for index, line in enumerate(chunk.split(b"\n")):
        if line.count(b"[") + line.count(b"{") > limit and json_depth(line, stop_above=limit) > limit:
            return index
    return None


def first_too_deep_line(lines: Iterable[bytes], limit: int) -> int | None:
    """The number (1-based) of the first line nested deeper than `limit` among `lines`, or None."""
    for number, line in enumerate(lines, start=1):
        if too_deep_line(line, limit) is not None:
            return number
    return None


__all__ = ["first_too_deep_line", "json_depth", "too_deep_line"]
