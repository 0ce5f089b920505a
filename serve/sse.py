"""Server-sent events framing: `data: <json>\n\n` per event, `data: [DONE]`, and `: ping` comments.

Owns only bytes; every event ends with a blank line (one newline would merge events).
Tested through the streams of tests/serve/test_serve_app.py.
"""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
HEADERS = ((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"))


def event(payload: bytes, name: str = "") -> bytes:
    """One SSE event carrying a JSON document (which never contains a raw newline); `name`: its
    `event:` line (Anthropic's streams name every event)."""
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + payload + b"\n\n"
