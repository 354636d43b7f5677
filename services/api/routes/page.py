"""The web page: its static shell (`services/api/static/`: index.html, app.js, app.css) at `/` and
`/static/<file>`, public like /health. The shell holds no data; the page asks for a token and calls the
/v1 API with it (`Authorization: Bearer`), so everything it shows is what that token may read.

Every answer carries a Content-Security-Policy that allows nothing from outside the service (no inline
scripts or styles either), `X-Content-Type-Options: nosniff` and `Referrer-Policy: no-referrer`; the HTML
is never cached. Only the files in the static folder are served, by name: no path reaches elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from services.errors import ServiceError

router = APIRouter(include_in_schema=False)  # not an API route: no token, not in /openapi.json

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
INDEX = "index.html"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def static_files() -> dict[str, Path]:
    """The page's assets by name: the files of the static folder with a known media type."""
    return {p.name: p for p in sorted(STATIC_DIR.iterdir()) if p.is_file() and p.suffix in MEDIA_TYPES}


def _page_file(path: Path, cache: str) -> Response:
    headers = {**PAGE_HEADERS, "Cache-Control": cache}
    return Response(path.read_bytes(), media_type=MEDIA_TYPES[path.suffix], headers=headers)


@router.get("/")
def page() -> Response:
    """The page's HTML shell (no data in it)."""
    return _page_file(STATIC_DIR / INDEX, "no-store")


@router.get("/static/{name}")
def asset(name: str) -> Response:
    """One of the page's scripts or style sheets, by file name."""
    path = static_files().get(name)
    if path is None or name == INDEX:
        raise ServiceError(f"no page asset named {name!r}", status=404, field="name")
    return _page_file(path, "no-cache")  # revalidated, so a new release's script is picked up


__all__ = ["CONTENT_SECURITY_POLICY", "PAGE_HEADERS", "STATIC_DIR", "router", "static_files"]
