"""Server-sent events framing: `data: <json>\n\n` per event, `data: [DONE]`, and `: ping` comments.

Owns only bytes; every event ends with a blank line (one newline would merge events).
Tested through the streams of tests/test_serve_app.py.
"""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
HEADERS = ((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"))


def event(payload: bytes) -> bytes:
    """One SSE event carrying a JSON document (which never contains a raw newline)."""
    return b"data: " + payload + b"\n\n"
