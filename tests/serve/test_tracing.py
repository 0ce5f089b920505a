"""Traces of requests (serve/tracing.py, serve/otel.py): off by default and then free, the span
tree of a generation with its attributes, a caller's traceparent continued, errors recorded, and
the spans exported over OTLP/HTTP by a real granian server to a receiver this test runs.

The in-memory tests drive the App over the real tl.core.engine.Engine with the succ runner and
hand it a tracer whose exporter is the SDK's InMemorySpanExporter. Every test stops what it starts.
"""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import serve
from serve import tracing
from serve.app import App
from serve.otel import Tracing
from tests.helpers.asgi_client import call, served
from tests.helpers.fake_engine import make_real_async_engine
from tests.helpers.granian_server import ROOT, free_port, granian_argv, running
from tl.core.config import EngineConfig
from tl.core.engine import Engine

CHAT = "/v1/chat/completions"
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"


def chat(content: str = "abcdefghi", **kw: Any) -> dict[str, Any]:
    return {
        "model": "succ",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "temperature": 0,
        **kw,
    }


def traced_app() -> tuple[App, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = App(
        EngineConfig(model_dir="models/succ", block_size=4),
        make_real_async_engine,
        handle_signals=False,
        start_health=False,
    )
    app.tracing = Tracing(provider)
    return app, exporter


def run(app: App, body: Callable[[App], Awaitable[None]]) -> None:
    async def main() -> None:
        async with served(app):
            await asyncio.wait_for(body(app), 20)

    asyncio.run(main())


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def test_the_switch_is_off_by_default_and_names_what_it_cannot_do() -> None:
    assert tracing.exporters({}) == () and tracing.start({}) is None
    assert tracing.exporters({"OTEL_TRACES_EXPORTER": "none"}) == ()
    assert tracing.exporters({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) == ()
    assert tracing.exporters({"OTEL_TRACES_EXPORTER": "otlp, console,otlp"}) == ("otlp", "console")
    with pytest.raises(tracing.TracingUnavailable, match="not zipkin"):
        tracing.exporters({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(tracing.TracingUnavailable, match="http/protobuf"):
        tracing.start({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})


def test_tracing_off_imports_no_opentelemetry() -> None:
    code = "import sys, serve.app; print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_only_serve_otel_imports_opentelemetry() -> None:
    """The engine (its thread included) never sees a span: one module of tl's talks to the SDK."""
    importers = []
    for pkg in ("tl", "serve", "kernels"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                if any(n.split(".")[0] == "opentelemetry" for n in names):
                    importers.append(str(path.relative_to(ROOT)))
    assert sorted(set(importers)) == ["serve/otel.py"]


def test_missing_sdk_fails_the_start_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "serve.otel")
    monkeypatch.delattr(serve, "otel")  # else `from serve import otel` finds the loaded one
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # what an absent package raises
    with pytest.raises(tracing.TracingUnavailable, match=r"pip install 'tl\[tracing\]'"):
        tracing.start({"OTEL_TRACES_EXPORTER": "otlp"})
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    app = App(EngineConfig(model_dir="models/succ"), make_real_async_engine, handle_signals=False, start_health=False)
    with pytest.raises(tracing.TracingUnavailable):
        asyncio.run(app.startup())
    assert app.engine is None


def test_a_generation_makes_the_span_tree_continuing_the_callers_trace() -> None:
    app, exporter = traced_app()

    async def body(app: App) -> None:
        first = await call(app, "POST", CHAT, chat(), headers={"traceparent": TRACEPARENT, "x-request-id": "r-1"})
        assert first.status == 200
        spans = by_name(exporter.get_finished_spans())
        assert set(spans) == {"POST /v1/chat/completions", "tl.queue", "tl.prefill", "tl.decode"}
        server = spans["POST /v1/chat/completions"]
        assert server.kind is SpanKind.SERVER and server.context is not None
        assert server.context.trace_id == TRACE_ID and server.parent is not None
        assert server.parent.span_id == PARENT_ID and server.parent.is_remote
        assert dict(server.attributes or {}) == {
            "http.request.method": "POST",
            "http.route": CHAT,
            "url.path": CHAT,
            "http.response.status_code": 200,
            "tl.request_id": "r-1",
        }
        assert server.status.status_code is StatusCode.UNSET
        queue, prefill, decode = spans["tl.queue"], spans["tl.prefill"], spans["tl.decode"]
        for s in (queue, prefill, decode):
            assert s.parent is not None and s.parent.span_id == server.context.span_id
            assert s.context is not None and s.context.trace_id == TRACE_ID
        times = [server.start_time, queue.start_time, queue.end_time, prefill.end_time, decode.end_time]
        assert all(t is not None for t in times) and times == sorted(times)  # type: ignore[type-var]
        assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
        assert decode.end_time is not None and server.end_time is not None and decode.end_time <= server.end_time
        usage = first.json()["usage"]
        assert dict(prefill.attributes or {}) == {
            "tl.choice": 0,
            "tl.prompt_tokens": usage["prompt_tokens"],
            "tl.cached_tokens": 0,
        }
        assert dict(decode.attributes or {}) == {"tl.choice": 0, "tl.output_tokens": 3, "tl.finish_reason": "length"}

        exporter.clear()  # the same prompt again, streamed, no caller: its own trace, its prompt cached
        again = await call(app, "POST", CHAT, chat(stream=True))
        assert again.status == 200 and again.events()[-1] == "[DONE]"
        spans = by_name(exporter.get_finished_spans())
        root = spans["POST /v1/chat/completions"]
        assert root.parent is None and root.context is not None and root.context.trace_id != TRACE_ID
        cached = (spans["tl.prefill"].attributes or {})["tl.cached_tokens"]
        assert isinstance(cached, int) and 0 < cached < usage["prompt_tokens"]

        exporter.clear()  # an unknown route: no span (only the API's routes are traced)
        assert (await call(app, "GET", "/nowhere")).status == 404
        assert exporter.get_finished_spans() == ()

    run(app, body)


def test_errors_are_recorded_on_the_spans() -> None:
    app, exporter = traced_app()

    async def body(app: App) -> None:
        bad = await call(app, "POST", CHAT, body=b"{not json")  # a 4xx: an exception event, no ERROR
        assert bad.status == 400
        (span,) = exporter.get_finished_spans()
        assert span.status.status_code is StatusCode.UNSET
        assert [e.name for e in span.events] == ["exception"]
        assert (span.attributes or {})["http.response.status_code"] == 400

        exporter.clear()  # the engine's step fails: a 500, ERROR on the server span and the choice's
        assert app.engine is not None
        eng = app.engine.engine
        assert isinstance(eng, Engine)
        original = eng.runner.execute

        def boom(plan: object) -> object:
            eng.runner.execute = original  # type: ignore[method-assign]
            raise RuntimeError("boom")

        eng.runner.execute = boom  # type: ignore[method-assign]
        failed = await call(app, "POST", CHAT, chat())
        assert failed.status == 500
        spans = by_name(exporter.get_finished_spans())
        server = spans["POST /v1/chat/completions"]
        assert server.status.status_code is StatusCode.ERROR and "boom" in (server.status.description or "")
        assert (server.attributes or {})["error.type"] == "500"
        (event,) = server.events
        assert event.name == "exception" and "boom" in str((event.attributes or {})["exception.message"])
        last = spans["tl.prefill"] if "tl.prefill" in spans else spans["tl.queue"]  # as far as it got
        assert "tl.decode" not in spans
        assert last.status.status_code is StatusCode.ERROR and [e.name for e in last.events] == ["exception"]

        exporter.clear()  # mid-stream: a 200 whose error event is a 500: still ERROR, on the decode span too
        steps = 0

        def boom_at_third_step(plan: Any) -> Any:
            nonlocal steps
            steps += 1
            if steps < 3:
                return original(plan)
            return boom(plan)

        eng.runner.execute = boom_at_third_step  # type: ignore[method-assign]
        streamed = await call(app, "POST", CHAT, chat(max_tokens=300, stream=True))
        assert streamed.status == 200 and "server_error" in streamed.events()[-2]
        spans = by_name(exporter.get_finished_spans())
        server = spans["POST /v1/chat/completions"]
        assert (server.attributes or {})["http.response.status_code"] == 200
        assert server.status.status_code is StatusCode.ERROR and [e.name for e in server.events] == ["exception"]
        decode = spans["tl.decode"]
        assert decode.status.status_code is StatusCode.ERROR and "tl.finish_reason" not in (decode.attributes or {})

    run(app, body)


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:
        data = self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/v1/traces":
            type(self).bodies.append(data)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def receiver() -> Iterator[tuple[str, list[bytes]]]:
    """An OTLP/HTTP receiver on 127.0.0.1: its endpoint, and the bodies POSTed to /v1/traces."""
    handler = type("Receiver", (_Receiver,), {"bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_spans_are_exported_over_otlp_http(tmp_path: Path) -> None:
    port, hport = free_port(), free_port()
    cfg = tmp_path / "runtime.toml"
    cfg.write_text(
        f'[engine]\nmodel_dir = "models/succ"\nblock_size = 4\nhttp_listen = "127.0.0.1:{port}"\n'
        f'health_listen = "127.0.0.1:{hport}"\n'
    )
    with receiver() as (endpoint, bodies):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
            "TL_CONFIG": str(cfg),
            "PYTHONPATH": str(ROOT),
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_SERVICE_NAME": "tl-otlp-test",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        with running(
            granian_argv(port, "tests.helpers.fake_app:app"), env, f"http://127.0.0.1:{port}/healthz", timeout_s=20
        ):
            r = httpx.post(f"http://127.0.0.1:{port}{CHAT}", json=chat(), headers={"traceparent": TRACEPARENT})
            assert r.status_code == 200
            deadline = time.monotonic() + 10
            while not bodies and time.monotonic() < deadline:
                time.sleep(0.02)
    assert bodies, "no OTLP export arrived"
    spans, services = [], set()
    for body in bodies:
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            services |= {a.value.string_value for a in rs.resource.attributes if a.key == "service.name"}
            spans += [s for ss in rs.scope_spans for s in ss.spans]
    assert services == {"tl-otlp-test"}
    assert {s.name for s in spans} == {"POST /v1/chat/completions", "tl.queue", "tl.prefill", "tl.decode"}
    assert {s.trace_id for s in spans} == {TRACE_ID.to_bytes(16, "big")}
