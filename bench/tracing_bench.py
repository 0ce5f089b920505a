"""What request tracing costs, off and on: `python -m bench.tracing_bench [--requests N] [--rounds R]`.

Needs the tracing extra (pip install -e '.[tracing]') and runs no model. Measures on this CPU:

1. Off: the per-request check serve/app.py makes (`self.tracing is not None and route`), and the
   per-token price of carrying TokenOut.scheduled_s (a TokenOut built with and without it).
2. On, on the event loop: RequestTrace.end for one finished single-choice generation (the server
   span and tl.queue, tl.prefill, tl.decode) into a BatchSpanProcessor whose exporter drops them;
   and, off the loop on the exporter's thread, the OTLP protobuf encoding of those four spans.
3. End to end: the mean wall time of sequential non-streamed chat requests (8 prompt tokens, 8
   output tokens) through the App in memory (the real Engine over the tests' succ runner,
   tests/helpers/fake_engine.py), tracing off vs on (the dropping exporter), alternating rounds, best round.

Prints its config and the numbers; README "Traces" quotes a run.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from serve.asgi import Request
from serve.otel import Tracing
from tl.core.request import TokenOut

ROOT = Path(__file__).resolve().parents[1]


class Dropping(SpanExporter):
    """Takes every batch and keeps the last (for the encoding measure)."""

    def __init__(self) -> None:
        self.last: Sequence[ReadableSpan] = ()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.last = spans
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _request() -> Request:
    scope = {
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")],
    }
    return Request(scope, None)  # type: ignore[arg-type]  # receive is never called here


def _job(now: float) -> Any:
    handle = SimpleNamespace(submitted_at=now - 0.5)
    choice = SimpleNamespace(
        index=0,
        handle=handle,
        scheduled_s=now - 0.4,
        first_token_at=now - 0.3,
        finished_at=now - 0.01,
        prompt_len=8,
        num_cached_tokens=4,
        num_tokens=8,
        finish="length",
        failure=None,
    )
    return SimpleNamespace(choices=[choice])


def per_call_us(fn: Any, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def micro(number: int) -> dict[str, float]:
    tracing: Any = None
    route = ("/v1/chat/completions", ())
    off_check = per_call_us(lambda: tracing is not None and route, number * 10)
    plain = per_call_us(lambda: TokenOut(3, 42, -0.5, (), None, num_cached_tokens=4), number * 10)
    carried = per_call_us(lambda: TokenOut(3, 42, -0.5, (), None, num_cached_tokens=4, scheduled_s=12.5), number * 10)
    exporter = Dropping()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 16))
    on = Tracing(provider)
    req = _request()

    def one() -> None:
        now = time.monotonic()
        t = on.request(req, "/v1/chat/completions", now - 0.6)
        t.job(_job(now))
        t.end(200)

    end_us = per_call_us(one, number)
    provider.force_flush()
    spans = list(exporter.last)[-4:]
    encode_us = per_call_us(lambda: encode_spans(spans).SerializeToString(), number)
    provider.shutdown()
    return {
        "off: check per request (us)": off_check,
        "off: TokenOut without scheduled_s (us)": plain,
        "off: TokenOut with scheduled_s (us)": carried,
        "on: spans made per request, on the loop (us)": end_us,
        "on: OTLP encoding per request, exporter thread (us)": encode_us,
    }


async def _requests(app: Any, n: int) -> float:
    from asgi_client import call

    body = {
        "model": "succ",
        "messages": [{"role": "user", "content": "abcdefgh"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    for _ in range(n):
        r = await call(app, "POST", "/v1/chat/completions", json=body)
        assert r.status == 200, r.body
    return (time.perf_counter() - t0) / n * 1e6


def end_to_end(n: int, rounds: int) -> dict[str, float]:
    sys.path.insert(0, str(ROOT / "tests"))  # the tests' engine without a model: bench only, never imported
    from asgi_client import served
    from fake_engine import make_real_async_engine

    from serve.app import App
    from tl.core.config import EngineConfig

    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(Dropping(), max_queue_size=1 << 16))
    results: dict[str, list[float]] = {"off": [], "on": []}

    def app(tracing: Tracing | None) -> App:
        built = App(EngineConfig(model_dir="models/succ", block_size=4), make_real_async_engine, False, False)
        built.tracing = tracing
        return built

    async def main() -> None:
        apps = {"off": app(None), "on": app(Tracing(provider))}
        async with served(apps["off"]), served(apps["on"]):
            for mode in results:  # warm both paths
                await _requests(apps[mode], 10)
            for _ in range(rounds):  # alternating: the machine's load falls on both alike
                for mode in results:
                    results[mode].append(await _requests(apps[mode], n))

    asyncio.run(main())  # the traced App's shutdown stops the provider
    off, on = min(results["off"]), min(results["on"])
    return {
        "e2e: request, tracing off (us, best round)": off,
        "e2e: request, tracing on (us, best round)": on,
        "e2e: median off (us)": statistics.median(results["off"]),
        "e2e: median on (us)": statistics.median(results["on"]),
        "e2e: on - off, best rounds (us)": on - off,
    }


def run(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tracing_bench")
    ap.add_argument("--requests", type=int, default=200, help="sequential requests per end-to-end round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--number", type=int, default=2000, help="calls per micro-benchmark repeat")
    args = ap.parse_args(argv)
    print(f"config: {vars(args)} cpu: {cpu_name()} python: {platform.python_version()} seed: none (no sampling)")
    for name, value in {**micro(args.number), **end_to_end(args.requests, args.rounds)}.items():
        print(f"{name:55s} {value:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
