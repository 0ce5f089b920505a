"""The API port while the model loads: granian takes the port only once the lifespan start-up
is over, so until then tl answers there itself, as a router or load balancer expects of a
worker that is starting: every request, GET /health and /healthz included, 503
`model_loading` in OpenAI's error shape with Retry-After (liveness is the health port's
/healthz, which answers from the first moment).

Owns that answer. serve/app.py opens it on http_listen (SO_REUSEPORT) before the model loads
and stops it listening just before the start-up completes and granian binds the port; a port
it cannot take is logged and left to granian. Tested by tests/serve/test_serve_http.py.
"""

from __future__ import annotations

from serve import errors
from serve.tiny_http import Answer, TinyHTTPServer

_LOADING = errors.loading()
ANSWER: Answer = (
    "503 Service Unavailable",
    "application/json",
    _LOADING.body(),
    tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in _LOADING.headers),
)


class LoadingServer(TinyHTTPServer):
    def answer(self, method: str, path: str, headers: dict[str, str]) -> Answer:
        return ANSWER
