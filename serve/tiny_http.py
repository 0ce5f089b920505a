"""A tiny HTTP/1.1 listener of tl's own, for the ports granian does not serve: one request per
connection (Connection: close), each answered from its request line and headers alone.

Owns the asyncio.start_server listener, reading a request's head (and discarding a body of up
to MAX_BODY_BYTES, so the client reads the answer rather than a reset), writing the answer
(every read and write bounded), and closing. Subclasses say what each request gets:
serve/health.py (the health port) and serve/loading.py (the API port while the model loads).
"""

from __future__ import annotations

import asyncio
import socket

MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 1 << 20
IO_TIMEOUT_S = 10.0

Answer = tuple[str, str, bytes, tuple[tuple[str, str], ...]]  # status line, content type, body, headers


class TinyHTTPServer:
    def __init__(self) -> None:
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        self._server = await asyncio.start_server(
            self._serve, host, port, reuse_port=reuse_port and hasattr(socket, "SO_REUSEPORT")
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            # no bound here: the caller's wait_for is it; on Python 3.12+ this waits for open
            # connections too, each bounded in _serve (read and write, IO_TIMEOUT_S each)
            await self._server.wait_closed()
            self._server = None

    def answer(self, method: str, path: str, headers: dict[str, str]) -> Answer:
        raise NotImplementedError

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=IO_TIMEOUT_S)
            request, *lines = head[:MAX_HEAD_BYTES].decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
            status, ctype, body, extra = self._dispatch(request, headers)
            length = int(headers.get("content-length", "0") or 0)
            if 0 < length <= MAX_BODY_BYTES:
                await asyncio.wait_for(reader.readexactly(length), timeout=IO_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, ValueError):
            writer.close()
            return
        try:
            fields = "".join(f"{k}: {v}\r\n" for k, v in extra)
            writer.write(
                f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n{fields}"
                "connection: close\r\n\r\n".encode("latin-1")
                + body
            )
            await asyncio.wait_for(writer.drain(), timeout=IO_TIMEOUT_S)  # a client that does not read
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    def _dispatch(self, request: str, headers: dict[str, str]) -> Answer:
        parts = request.split(" ")
        if len(parts) != 3:
            return "400 Bad Request", "text/plain", b"bad request\n", ()
        method, target, _ = parts
        return self.answer(method, target.split("?", 1)[0], headers)
