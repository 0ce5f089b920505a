"""In-memory ASGI driving for server tests (as Starlette's TestClient does, without threads).

`served(app)` runs the app's start-up on the current loop and shuts it down after;
`call(app, method, path, json=..., headers=...)` sends one request through receive/send
and returns every message the app sent, so tests see each SSE event as it was written.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from serve.app import App


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    chunks: list[bytes] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return jsonlib.loads(self.body)

    def events(self) -> list[str]:
        """SSE data payloads in order (comments skipped); asserts the blank-line framing."""
        text = self.body.decode()
        assert text.endswith("\n\n"), text[-50:]
        out = []
        for block in text.split("\n\n")[:-1]:
            if block.startswith(":"):
                continue
            assert block.startswith("data: ") and "\n" not in block, block
            out.append(block[len("data: ") :])
        return out

    def error(self) -> dict[str, Any]:
        doc = self.json()
        assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
        assert self.headers["content-type"] == "application/json"
        return doc["error"]  # type: ignore[no-any-return]


@asynccontextmanager
async def served(app: App) -> AsyncIterator[App]:
    await app.startup()
    try:
        yield app
    finally:
        await app.shutdown()


async def call(
    app: App,
    method: str,
    path: str,
    json: Any = None,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    disconnect_after: float | None = None,
    on_message: Any = None,
) -> Reply:
    """One request. disconnect_after: seconds after the body until receive() reports a disconnect."""
    if body is None:
        body = b"" if json is None else jsonlib.dumps(json).encode()
    hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if json is not None:
        hdrs.append((b"content-type", b"application/json"))
    hdrs.append((b"content-length", str(len(body)).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": hdrs,
        "scheme": "http",
        "server": ("test", 80),
        "client": ("test", 1),
    }
    sent_body = False
    done = asyncio.Event()
    reply: Reply | None = None

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnect_after is not None:
            try:
                await asyncio.wait_for(done.wait(), disconnect_after)
            except TimeoutError:
                pass
        else:
            await done.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        nonlocal reply
        if msg["type"] == "http.response.start":
            reply = Reply(msg["status"], {k.decode(): v.decode() for k, v in msg["headers"]})
        else:
            assert reply is not None
            if msg.get("body"):
                reply.chunks.append(msg["body"])
                if on_message is not None:
                    on_message(msg["body"])
            if not msg.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    done.set()
    return reply if reply is not None else Reply(0, {})
