"""The chat page: GET / and its files under /static/, answered by the API port.

Owns the bundle in serve/static/ (hand-written HTML, CSS and JS with no build step and no
external asset, so the page works offline), read once at import, and how it is answered:
content type, an ETag per file (304 on a matching If-None-Match), `Cache-Control: no-cache`
(the browser revalidates each load, so a new tl's page is seen at once), and a
Content-Security-Policy under which the page loads and calls nothing but its own origin.
Must not touch the engine: the page talks to the public API (/v1/models,
/v1/chat/completions) from the browser, sending the API key the user gives it, so these paths
need no key. Not in the OpenAPI document: the page is no API.
Tested in Chromium by tests/serve/test_chat_page.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from serve.asgi import Request, Sender
from serve.errors import ApiError

STATIC_DIR = Path(__file__).resolve().parent / "static"
CONTENT_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".svg": b"image/svg+xml",
}
CSP = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    b"base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: bytes
    etag: bytes  # a strong validator: the quoted start of the body's sha256


def _load(name: str) -> Asset:
    body = (STATIC_DIR / name).read_bytes()
    etag = b'"' + hashlib.sha256(body).hexdigest()[:16].encode() + b'"'
    return Asset(body, CONTENT_TYPES[Path(name).suffix], etag)


ASSETS: dict[str, Asset] = {
    "/": _load("index.html"),
    **{f"/static/{p.name}": _load(p.name) for p in sorted(STATIC_DIR.iterdir()) if p.suffix in CONTENT_TYPES},
}
"""Path -> file; /static/index.html too (harmless, and / is its canonical name)."""


def endpoint(path: str) -> str | None:
    """The metrics label of a page path ("/" or "/static"), or None if it is not one."""
    if path not in ASSETS:
        return None
    return "/" if path == "/" else "/static"


async def answer(req: Request, out: Sender) -> None:
    """Answer GET or HEAD of a page path (`endpoint(path)` is not None); 405 for other methods."""
    if req.method not in ("GET", "HEAD"):
        allow = ((b"allow", b"GET, HEAD"),)
        raise ApiError(
            405, "Method not allowed; use GET, HEAD", "invalid_request_error", None, "method_not_allowed", allow
        )
    asset = ASSETS[req.path]
    headers = (
        (b"etag", asset.etag),
        (b"cache-control", b"no-cache"),
        (b"x-content-type-options", b"nosniff"),
        (b"content-security-policy", CSP),
        (b"referrer-policy", b"no-referrer"),
    )
    if asset.etag in (t.strip() for t in req.headers.get("if-none-match", "").encode("latin-1").split(b",")):
        await out.start(304, asset.content_type, headers)
        await out.end()
        return
    await out.start(200, asset.content_type, ((b"content-length", str(len(asset.body)).encode()), *headers))
    await out.end(b"" if req.method == "HEAD" else asset.body)
