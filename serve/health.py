"""The health port: GET /healthz, /readyz and /metrics on a tiny HTTP/1.1 server of its own.

Owns the asyncio.start_server listener that lifespan starts first (so /healthz answers while
the model loads) and that keeps answering through a drain. One request per connection
(Connection: close). Must not touch the engine: it reads the server's flags and Metrics.
Tested by tests/serve/test_serve_http.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from serve.metrics import Metrics

MAX_HEAD_BYTES = 16 * 1024


class HealthServer:
    def __init__(self, metrics: Metrics, is_ready: Callable[[], bool]) -> None:
        self.metrics = metrics
        self.is_ready = is_ready
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            # no bound here: the lifespan shutdown's wait_for (HEALTH_CLOSE_S) is it; on Python 3.12+
            # this waits for open connections too, each bounded in _serve (read and write, 10 s each)
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            status, ctype, body = self._answer(head[:MAX_HEAD_BYTES].decode("latin-1"))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            writer.close()
            return
        try:
            writer.write(
                f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n".encode("latin-1")
                + body
            )
            await asyncio.wait_for(writer.drain(), timeout=10)  # a client that does not read
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    def _answer(self, head: str) -> tuple[str, str, bytes]:
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return "400 Bad Request", "text/plain", b"bad request\n"
        method, target, _ = parts
        path = target.split("?", 1)[0]
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        if path not in ("/healthz", "/readyz", "/metrics"):
            return "404 Not Found", "text/plain", b"not found\n"
        if method != "GET":
            return "405 Method Not Allowed", "text/plain", b"method not allowed\n"
        if path == "/healthz":
            return "200 OK", "text/plain", b"ok\n"
        if path == "/readyz":
            return (
                ("200 OK", "text/plain", b"ready\n")
                if self.is_ready()
                else ("503 Service Unavailable", "text/plain", b"not ready\n")
            )
        body, ctype = self.metrics.render(headers.get("accept", ""))
        return "200 OK", ctype, body
