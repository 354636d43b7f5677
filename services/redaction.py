"""Messages for users, without the server's insides: no filesystem paths, no store URIs, one line.

`redact` turns an absolute path of two or more parts into `…/<last part>` and a `scheme://…` URI (an
MLflow store, a database) into `scheme://…`; `public_uri` shows a stored delta's location without the
server's folders; `error_summary` reduces an error (a traceback, say) to the one line a user reads. Both are pure string functions: callers decide where they apply (the
registry for job errors, the API for every error message).
"""

from __future__ import annotations

import re

_URI = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*)://[^\s'\"<>]*")
_SEGMENT = r"[^\s'\"/:,;()<>\[\]{}|`]"
# an absolute path of at least two parts; not after a word character, a dot, a colon or another slash
# (a ratio, a relative path, `runs:/…` and `models:/…` references stay), and not the API's own routes
_PATH = re.compile(rf"(?<![\w.:/~-])~?/(?!v1/)(?:{_SEGMENT}+/)+{_SEGMENT}*")
MAX_SUMMARY_CHARS = 2000


def redact(text: str) -> str:
    """The text with absolute paths cut to their last part and URIs to their scheme."""
    text = _URI.sub(lambda match: f"{match.group(1)}://…", text)
    return _PATH.sub(_last_part, text)


def _last_part(match: re.Match[str]) -> str:
    last = match.group(0).rstrip("/").rsplit("/", 1)[-1]
    return f"…/{last}" if last else "…"


def public_uri(uri: str | None) -> str | None:
    """A stored delta's URI as users see it: MLflow references (`models:/…`, `runs:/…`) as they are; a
    local folder (`file:///…`) or any other `scheme://` location cut to its scheme and last part."""
    if uri is None or "://" not in uri:
        return uri
    scheme, _, rest = uri.partition("://")
    last = rest.rstrip("/").rsplit("/", 1)[-1] if "/" in rest.strip("/") else ""
    return f"{scheme}://…/{last}" if last else f"{scheme}://…"


def error_summary(error: str, limit: int = MAX_SUMMARY_CHARS) -> str:
    """One line a user can read: for a Python traceback its final `Type: message` line(s), else the
    text; whitespace collapsed, paths and URIs redacted, at most `limit` characters."""
    lines = error.strip().splitlines()
    if lines and lines[0].startswith("Traceback (most recent call last)"):
        frames = [index for index, line in enumerate(lines) if line.startswith(" ")]
        lines = lines[frames[-1] + 1 :] if frames else lines[-1:]
    summary = redact(" ".join(" ".join(lines).split()))
    return summary if len(summary) <= limit else summary[: limit - 1] + "…"


__all__ = ["error_summary", "public_uri", "redact"]
