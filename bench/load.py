"""HTTP load client: stream one OpenAI-compatible request and time it; summarise many.

Owns: the SSE parser (`data:` lines, events split by blank lines, `[DONE]`), one streamed
request over `/v1/completions` or `/v1/chat/completions` with asyncio + aiohttp, the
per-request timings (TTFT, inter-token gaps), percentile math, and a run summary. Knows
nothing about which test is running (bench/load_tests.py) or how it is reported
(bench/http_bench.py). Imports no tl and no jax. Tested by tests/bench/test_bench_harness.py
against a fake streaming server.

Why aiohttp: the load generator shares the machine with the server it measures, so its own CPU
is taken from the server. Streaming 32 x 128 tokens from tl, httpx spent 98-109 us of client
CPU an event and aiohttp 38-39 (SSE parsing and json.loads included), which at 64 streams is
about 1 s of a core less per 44 s run.

Token counting: each non-empty content delta counts as one token; when the server sends a
usage chunk (requested with `stream_options.include_usage`), its `completion_tokens` is
the exact count and wins. TTFT is request start to the first non-empty content delta.
Inter-token latency (ITL) is the gap between successive content deltas; a delta that
carries k > 1 tokens (known only in aggregate from usage) is one gap, as vLLM's
benchmark_serving counts it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp


class SSEParser:
    """Incremental Server-Sent Events parser: feed lines, get each event's data string."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """One line without its terminator; returns a completed event's data, if any."""
        line = line.rstrip("\r")
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None  # comment / keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def close(self) -> str | None:
        """Flush an event left unterminated at the end of the stream."""
        return self.feed("")


def parse_sse(lines: Iterable[str]) -> list[str]:
    parser, out = SSEParser(), []
    for line in lines:
        ev = parser.feed(line)
        if ev is not None:
            out.append(ev)
    last = parser.close()
    return out + ([last] if last is not None else [])


def chunk_text(chunk: dict[str, Any]) -> str:
    """The content a completions or chat-completions stream chunk carries ('' if none)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    return (c.get("delta") or {}).get("content") or ""


@dataclass(slots=True)
class RequestResult:
    """One streamed request, timed from send (t_start, perf_counter seconds)."""

    t_start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty content delta
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server says
    t_end: float = 0.0
    error: str = ""
    text_len: int = 0
    text: str = ""  # the streamed content, joined

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def num_output_tokens(self) -> int:
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.chunk_times)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.t_start if self.chunk_times else None

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def latency_s(self) -> float:
        return self.t_end - self.t_start

    def to_json(self) -> dict[str, object]:
        ttft = self.ttft_s
        return {
            "ok": self.ok,
            "error": self.error,
            "ttft_ms": None if ttft is None else round(ttft * 1e3, 3),
            "latency_ms": round(self.latency_s * 1e3, 3),
            "output_tokens": self.num_output_tokens,
            "prompt_tokens": self.usage_prompt_tokens,
            "deltas": len(self.chunk_times),
            "itl_ms": [round(x * 1e3, 3) for x in self.itl_s],
        }


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to send: base URL (…/v1 is appended), model name, API flavour."""

    base_url: str
    model: str
    api: str = "completions"  # or "chat"
    ignore_eos: bool = True
    extra_body: tuple[tuple[str, object], ...] = ()
    api_key: str = ""  # sent as `Authorization: Bearer …` when set

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def url(self) -> str:
        path = "chat/completions" if self.api == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/v1/{path}"


def request_body(ep: Endpoint, prompt: str, max_tokens: int, system: str | None = None) -> dict[str, object]:
    """Greedy, streamed, usage requested; `system` goes first (a system turn, or prepended text)."""
    body: dict[str, object] = {
        "model": ep.model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ep.ignore_eos:
        body["ignore_eos"] = True
    if ep.api == "chat":
        msgs = [{"role": "system", "content": system}] if system is not None else []
        body["messages"] = msgs + [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = (system or "") + prompt
    body.update(dict(ep.extra_body))
    return body


async def stream_request(
    client: aiohttp.ClientSession, ep: Endpoint, body: dict[str, object], res: RequestResult | None = None
) -> RequestResult:
    """Send one streamed request; never raises for HTTP or protocol errors (they go in .error).

    Pass `res` to see partial timings if the caller cancels it (a deadline).
    """
    res = res or RequestResult(t_start=time.perf_counter())
    try:
        async with client.post(ep.url, json=body, headers=ep.headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            parser = SSEParser()
            async for line in _lines(r.content):
                data = parser.feed(line)
                if data is not None and _on_event(res, data):
                    break
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.t_end = time.perf_counter()
    return res


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The body's lines without their "\n", as its chunks arrive (no line-length limit)."""
    buf = b""
    async for chunk in stream.iter_any():
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace")
    if buf:
        yield buf.decode("utf-8", "replace")


def _on_event(res: RequestResult, data: str) -> bool:
    """Record one event; True at `[DONE]`."""
    now = time.perf_counter()
    if data.strip() == "[DONE]":
        return True
    chunk = json.loads(data)
    if "error" in chunk and not chunk.get("choices"):
        res.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
        return True
    text = chunk_text(chunk)
    if text:
        res.chunk_times.append(now)
        res.text_len += len(text)
        res.text += text
    usage = chunk.get("usage")
    if usage:
        res.usage_completion_tokens = usage.get("completion_tokens")
        res.usage_prompt_tokens = usage.get("prompt_tokens")
        res.usage_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return False


async def first_model(client: aiohttp.ClientSession, base_url: str, headers: dict[str, str] | None = None) -> str:
    """The first model id listed at GET /v1/models."""
    async with client.get(f"{base_url.rstrip('/')}/v1/models", headers=headers) as r:
        r.raise_for_status()
        return str(json.loads(await r.text())["data"][0]["id"])


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, float]:
    """Aggregate one run: throughput over its wall time, TTFT/ITL/latency percentiles in ms."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    lat = [r.latency_s for r in ok]
    out_tokens = sum(r.num_output_tokens for r in ok)
    # Decode rate per stream: tokens after the first over the time after the first token.
    tpot = [
        (r.t_end - r.chunk_times[0]) / (r.num_output_tokens - 1)
        for r in ok
        if r.chunk_times and r.num_output_tokens > 1
    ]
    ms = 1e3
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else math.nan,
        "request_s": len(ok) / wall_s if wall_s > 0 else math.nan,
        "ttft_p50_ms": percentile(ttft, 50) * ms,
        "ttft_p99_ms": percentile(ttft, 99) * ms,
        "itl_p50_ms": percentile(itl, 50) * ms,
        "itl_p99_ms": percentile(itl, 99) * ms,
        "tpot_mean_ms": (sum(tpot) / len(tpot)) * ms if tpot else math.nan,
        "latency_p50_ms": percentile(lat, 50) * ms,
        "latency_p99_ms": percentile(lat, 99) * ms,
    }
