"""Small raw-ASGI helpers: reading a bounded body, sending whole responses, watching for disconnects.

Owns the HTTP plumbing the routes share, nothing about the API. granian reports a client
that left only through receive() returning http.disconnect (send() never raises), so
DisconnectWatcher keeps a task awaiting receive() once the body is read.
Tested through tests/serve/test_serve_app.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from serve.errors import ApiError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = tuple[tuple[bytes, bytes], ...]

JSON = b"application/json"


class ClientGone(Exception):
    """The client disconnected before the request body was read."""


class Request:
    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers: dict[str, str] = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())
        }
        self.request_id = _request_id(self.headers.get("x-request-id"))

    async def body(self, limit: int) -> bytes:
        too_big = ApiError(
            413, f"Request body exceeds {limit} bytes", "invalid_request_error", None, "request_too_large"
        )
        declared = self.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        parts: list[bytes] = []
        size = 0
        while True:
            # no bound of ours: the client paces its upload (counted in flight, a drain waits for it
            # up to drain_timeout_s; then granian's stop ends the connection, its kill timeout at worst)
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_big
            parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts)


def _request_id(given: str | None) -> str:
    if given and len(given) <= 200 and given.isprintable() and given.isascii():
        return given
    return f"req-{uuid.uuid4().hex}"


class Sender:
    """Wraps send: remembers whether the response started and its status; adds X-Request-Id."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self.request_id = request_id.encode("latin-1")
        self.started = False
        self.finished = False
        self.status = 0

    async def start(self, status: int, content_type: bytes, headers: Headers = ()) -> None:
        self.started = True
        self.status = status
        all_headers = [(b"content-type", content_type), (b"x-request-id", self.request_id), *headers]
        await self._send({"type": "http.response.start", "status": status, "headers": all_headers})

    async def chunk(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        if not self.finished:
            self.finished = True
            await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def whole(self, status: int, body: bytes, content_type: bytes = JSON, headers: Headers = ()) -> None:
        await self.start(status, content_type, ((b"content-length", str(len(body)).encode()), *headers))
        await self.end(body)

    async def error(self, err: ApiError, anthropic: bool = False) -> None:
        """The error document: OpenAI's shape, or Anthropic's on its routes."""
        await self.whole(err.status, err.anthropic_body() if anthropic else err.body(), JSON, err.headers)


class DisconnectWatcher:
    """Awaits receive() in a task; `gone` is set when the client disconnects. Stop it when done.

    The task's coroutine is a plain function of the event and the callbacks, never of the
    watcher: a cancelled task keeps its CancelledError, whose traceback keeps the coroutine's
    frame, so a `self` there would make watcher -> task -> frame -> watcher a reference cycle
    holding the callbacks' request (a Job, every token) until a full collection."""

    def __init__(self, receive: Receive) -> None:
        self.gone = asyncio.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._task = asyncio.create_task(_watch(receive, self.gone, self._callbacks))

    def on_gone(self, fn: Callable[[], None]) -> None:
        if self.gone.is_set():
            fn()
        else:
            self._callbacks.append(fn)

    def stop(self) -> None:
        self._callbacks.clear()
        self._task.cancel()


async def _watch(receive: Receive, gone: asyncio.Event, callbacks: list[Callable[[], None]]) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            gone.set()
            for fn in callbacks:
                fn()
            return
