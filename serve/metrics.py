"""Prometheus metrics of one server process, on a custom CollectorRegistry.

Owns: the backend info metric (tl_engine_backend_info: platform, device kind and count,
tensor parallelism, dtype, attention kernel), the engine gauges, counters and histograms (step
time, prompt tokens per step) (read from the
AsyncEngine's stats snapshot at scrape time, so the engine thread is never touched), latency histograms (time to first
token, time per output token, end-to-end, queue time = submit until the engine thread
admitted the request), request counters by endpoint and status, and structured output's
constrained requests (by kind and compile outcome: the cache hits), compile time and
per-token mask time.
Tested by the /metrics checks in tests/serve/test_serve_app.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, exposition
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector

from tl.core.stats import BackendInfo, EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(
        self, stats: Callable[[], EngineStats | None], backend: Callable[[], BackendInfo | None] | None = None
    ) -> None:
        self._stats = stats
        self._backend = backend

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily | InfoMetricFamily]:
        b = self._backend() if self._backend else None
        if b is not None:
            yield InfoMetricFamily(
                "tl_engine_backend", "Platform, devices, parallelism and kernel of the engine", value=b.labels()
            )
        s = self._stats() or EngineStats()
        blocks = GaugeMetricFamily("tl_engine_kv_blocks", "KV-cache blocks by state", labels=["state"])
        blocks.add_metric(["free"], s.kv_blocks_free)
        blocks.add_metric(["used"], s.kv_blocks_used)
        blocks.add_metric(["cached"], s.kv_blocks_cached)
        yield blocks
        total = s.kv_blocks_free + s.kv_blocks_used + s.kv_blocks_cached
        yield GaugeMetricFamily(
            "tl_engine_kv_cache_usage_ratio",
            "KV-cache blocks held by sequences, of all blocks (0-1; cached blocks count as free: they are evictable)",
            value=s.kv_blocks_used / total if total else 0.0,
        )
        yield GaugeMetricFamily(
            "tl_engine_kv_cache_capacity_tokens",
            "Tokens the KV cache's blocks hold (num_kv_blocks x block_size)",
            value=b.kv_capacity_tokens if b is not None else 0,
        )
        yield GaugeMetricFamily(
            "tl_engine_kv_cache_bytes",
            "The KV cache's memory: keys and values of every layer, in its format (kv_cache_dtype)",
            value=b.kv_cache_bytes if b is not None else 0,
        )
        yield GaugeMetricFamily("tl_engine_queue_depth", "Requests waiting for admission", value=s.queue_depth)
        yield GaugeMetricFamily("tl_engine_active_sequences", "Sequences holding KV blocks", value=s.running)
        yield GaugeMetricFamily("tl_engine_batch_tokens", "Tokens computed by the last step", value=s.batch_tokens)
        yield GaugeMetricFamily(
            "tl_engine_prefix_cache_hit_ratio",
            "Prompt tokens found in the prefix cache",
            value=s.prefix_cache_hit_ratio,
        )
        yield GaugeMetricFamily("tl_engine_compilations", "Compiled step variants", value=s.compilations)
        yield GaugeMetricFamily(
            "tl_engine_multi_step_compilations",
            "Compiled several-decode-steps programs (each shape when first asked for)",
            value=s.multi_step_compilations,
        )
        yield GaugeMetricFamily(
            "tl_engine_compile_pending", "Step variants still compiling in the background", value=s.compile_pending
        )
        for name, doc, value in (
            ("tl_engine_preemptions", "Sequences preempted for KV blocks", s.preemptions),
            ("tl_engine_kv_evictions", "Cached KV blocks evicted", s.evictions),
            ("tl_engine_steps", "Engine steps run", s.steps),
            ("tl_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            ("tl_engine_prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
            ("tl_engine_spec_draft_tokens", "Speculative draft tokens proposed", s.spec_drafts_proposed),
            ("tl_engine_spec_accepted_tokens", "Speculative draft tokens accepted", s.spec_drafts_accepted),
            (
                "tl_engine_capped_steps",
                "Steps whose prompt work the cadence bound cut (prompt tokens or ms while decoding)",
                s.capped_steps,
            ),
            ("tl_engine_aborted_sequences", "Sequences aborted: the client disconnected or stopped", s.aborts),
            ("tl_engine_multi_step_calls", "Steps that ran several decode steps in one call", s.multi_step_calls),
            (
                "tl_engine_overlapped_steps",
                "Calls launched before the previous call's results were waited for (overlap)",
                s.overlapped_steps,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        parts = CounterMetricFamily(
            "tl_engine_step_part_seconds",
            "Wall time of busy steps by part: schedule, pack, launch, device (waiting for results), "
            "unpack, update, between (token delivery)",
            labels=["part"],
        )
        for part, seconds in s.step_part_seconds:
            parts.add_metric([part], seconds)
        yield parts
        for name, doc, h in (
            ("tl_engine_step_seconds", "Runner time of each engine step", s.step_seconds),
            (
                "tl_engine_prompt_tokens_per_step",
                "Prompt-work tokens (prefill chunks, embeddings inputs) of each step",
                s.prompt_tokens_per_step,
            ),
            ("tl_engine_mask_seconds", "Host time filling one constrained token's bitmask", s.mask_seconds),
            (
                "tl_engine_host_gap_seconds",
                "Host time from one step's results to the next step's launch, while busy",
                s.host_gap_seconds,
            ),
        ):
            if h.bounds:
                yield HistogramMetricFamily(name, doc, buckets=h.cumulative(), sum_value=h.total)


class Metrics:
    def __init__(
        self, stats: Callable[[], EngineStats | None], backend: Callable[[], BackendInfo | None] | None = None
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(stats, backend))
        r = self.registry
        self.ttft = Histogram(
            "tl_request_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "tl_request_time_per_output_token_seconds",
            "Mean gap between output tokens",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tl_request_e2e_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "tl_request_queue_time_seconds",
            "Submit until the engine took the request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.grammar_requests = Counter(
            "tl_structured_output_requests",
            "Constrained requests by kind (json, regex, choice, grammar) and compile outcome "
            "(cached, compiled, refused)",
            ["kind", "outcome"],
            registry=r,
        )
        self.grammar_compile = Histogram(
            "tl_structured_output_compile_seconds",
            "Time to compile a constraint not in the cache",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "tl_http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )

    def render(self, accept: str) -> tuple[bytes, str]:
        encoder, content_type = exposition.choose_encoder(accept)
        return encoder(self.registry), content_type
