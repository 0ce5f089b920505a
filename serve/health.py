"""The health port: GET /healthz, /readyz and /metrics on a tiny HTTP/1.1 server of its own.

Owns what the health port answers; the listener (serve/tiny_http.py) is started first by the
lifespan (so /healthz answers while the model loads) and keeps answering through a drain.
Must not touch the engine: it reads the server's flags and Metrics.
Tested by tests/serve/test_serve_http.py.
"""

from __future__ import annotations

from collections.abc import Callable

from serve.metrics import Metrics
from serve.tiny_http import Answer, TinyHTTPServer


class HealthServer(TinyHTTPServer):
    def __init__(self, metrics: Metrics, is_ready: Callable[[], bool]) -> None:
        super().__init__()
        self.metrics = metrics
        self.is_ready = is_ready

    def answer(self, method: str, path: str, headers: dict[str, str]) -> Answer:
        if path not in ("/healthz", "/readyz", "/metrics"):
            return "404 Not Found", "text/plain", b"not found\n", ()
        if method != "GET":
            return "405 Method Not Allowed", "text/plain", b"method not allowed\n", ()
        if path == "/healthz":
            return "200 OK", "text/plain", b"ok\n", ()
        if path == "/readyz":
            return (
                ("200 OK", "text/plain", b"ready\n", ())
                if self.is_ready()
                else ("503 Service Unavailable", "text/plain", b"not ready\n", ())
            )
        body, ctype = self.metrics.render(headers.get("accept", ""))
        return "200 OK", ctype, body, ()
