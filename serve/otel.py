"""OpenTelemetry spans of HTTP requests: the tracer provider, its exporters, one request's spans.

Imported only when tracing is on (serve/tracing.py decides, and imports this module then).
Owns the TracerProvider (resource from OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, service
name "tl" when neither names one; sampler from OTEL_TRACES_SAMPLER), its exporters behind
batch processors (OTEL_BSP_*): "otlp" is OTLP over HTTP/protobuf, configured by the
OTEL_EXPORTER_OTLP_* variables (endpoint, headers, timeout), "console" prints them;
continuing the caller's trace (W3C `traceparent`, or what OTEL_PROPAGATORS names); and the
spans of one request:

    POST /v1/chat/completions   SERVER: http.request.method, http.route, url.path,
      |                         http.response.status_code, tl.request_id
      +- tl.queue               submitted (AsyncEngine.submit) .. first scheduled
      +- tl.prefill             first scheduled .. first token: tl.prompt_tokens, tl.cached_tokens
      +- tl.decode              first token .. finish: tl.output_tokens, tl.finish_reason

one queue/prefill/decode triple per engine request (a choice; each has tl.choice) of a
generation route; other routes have the server span alone. A failure goes on the span where
it happened as an exception event: the choice's last span (which ends when the request does)
with status ERROR, and the server span, ERROR when the request answered a 5xx, as its status
or as a stream's error event.

Every span is made when the request ends (RequestTrace.end, on the event loop, after the
response is sent), with explicit start and end times from timestamps decided elsewhere, each in
one place: the arrival (serve/app.py), the submit (RequestHandle.submitted_at), the first
scheduling (the scheduler's TokenOut.scheduled_s), the first token (serve/generate.py's
Choice.first_token_at, the TTFT histogram's) and the finish (Choice.finished_at, the e2e
histogram's). All are time.monotonic() seconds, turned into epoch nanoseconds here. The engine
thread never sees a span. Tested by tests/serve/test_tracing.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from serve.errors import ApiError
from serve.tracing import TracingUnavailable

if TYPE_CHECKING:
    from serve.asgi import Request
    from serve.generate import Choice, Job

DEFAULT_SERVICE_NAME = "tl"
ToNs = Callable[[float], int]


class Tracing:
    """The server's tracer: `request` starts one request's record, `shutdown` flushes the exporters."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("tl.serve")

    def request(self, req: Request, route: str, arrived: float) -> RequestTrace:
        """The record of one request that arrived at `arrived` (time.monotonic()) on `route`."""
        return RequestTrace(self.tracer, req, route, arrived)

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporters (blocking: up to their timeouts)."""
        self.provider.shutdown()


def from_environ(exporters: tuple[str, ...], environ: Mapping[str, str]) -> Tracing:
    """A tracer exporting to each of `exporters` (serve/tracing.py's names), as OTEL_* configure."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # App.shutdown stops it, bounded
    for name in exporters:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, environ)))
    return Tracing(provider)


def _exporter(name: str, environ: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol not in (None, "", "http/protobuf"):
        raise TracingUnavailable(f"tl exports OTLP over HTTP (http/protobuf) only, not {protocol!r}")
    return OTLPSpanExporter()


class RequestTrace:
    """One request's spans. Until `end` it only collects (the jobs it ran, the errors raised to
    serve/app.py); `end` makes and ends every span at once."""

    __slots__ = ("_tracer", "_req", "_route", "_arrived", "_jobs", "_failures")

    def __init__(self, tracer: Tracer, req: Request, route: str, arrived: float) -> None:
        self._tracer = tracer
        self._req = req
        self._route = route
        self._arrived = arrived
        self._jobs: list[Job] = []
        self._failures: list[BaseException] = []

    def job(self, job: Job) -> None:
        """The request runs `job` (serve/routes.py's generations): its choices get spans."""
        self._jobs.append(job)

    def fail(self, err: BaseException) -> None:
        """The request failed with `err` (an ApiError answered, or an unhandled exception: a 500)."""
        self._failures.append(err)

    def end(self, status: int) -> None:
        """The request ended with `status` (499: the client left before any response): every span."""
        end_s = time.monotonic()
        offset_ns = time.time_ns() - time.monotonic_ns()

        def to_ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        req = self._req
        attributes: dict[str, str | int] = {
            "http.request.method": req.method,
            "http.route": self._route,
            "url.path": req.path,
            "http.response.status_code": status,
            "tl.request_id": req.request_id,
        }
        span = self._tracer.start_span(
            f"{req.method} {self._route}",
            context=propagate.extract(req.headers),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=to_ns(self._arrived),
        )
        inside = trace.set_span_in_context(span)
        # ordered, each once: a choice's failure is often the error the request raised too (kept
        # as a copy without its traceback, serve/generate.py Job.feed), so one per type and message
        failures = {(type(e), str(e)): e for e in self._failures}
        for job in self._jobs:
            for c in job.choices:
                _choice_spans(self._tracer, inside, c, end_s, to_ns)
                if c.failure is not None:
                    failures.setdefault((type(c.failure), str(c.failure)), c.failure)
        for err in failures.values():
            span.record_exception(err, timestamp=to_ns(end_s))
        worst = max([status, *(_status_of(e) for e in failures.values())])
        if worst >= 500:
            span.set_attribute("error.type", str(worst))
            span.set_status(Status(StatusCode.ERROR, _describe(failures.values()) or f"HTTP {worst}"))
        span.end(end_time=to_ns(end_s))


def _choice_spans(tracer: Tracer, parent: Context, c: Choice, end_s: float, to_ns: ToNs) -> None:
    """A choice's queue, prefill and decode spans, as far as it got; the last carries its failure."""
    submitted = c.handle.submitted_at
    finished = c.finished_at if c.finished_at is not None else end_s
    scheduled = max(c.scheduled_s, submitted) if c.scheduled_s else None  # 0.0: never scheduled
    first = c.first_token_at
    phases: list[tuple[str, float, float, dict[str, str | int]]] = [
        ("tl.queue", submitted, scheduled or finished, {"tl.choice": c.index})
    ]
    if scheduled is not None:
        prefill: dict[str, str | int] = {
            "tl.choice": c.index,
            "tl.prompt_tokens": c.prompt_len,
            "tl.cached_tokens": c.num_cached_tokens,
        }
        phases.append(("tl.prefill", scheduled, first or finished, prefill))
    if first is not None:
        decode: dict[str, str | int] = {"tl.choice": c.index, "tl.output_tokens": c.num_tokens}
        if c.finish is not None:
            decode["tl.finish_reason"] = c.finish
        phases.append(("tl.decode", first, finished, decode))
    for i, (name, start, end, attributes) in enumerate(phases):
        span = tracer.start_span(name, context=parent, attributes=attributes, start_time=to_ns(start))
        if c.failure is not None and i == len(phases) - 1:
            span.record_exception(c.failure, timestamp=to_ns(end))
            span.set_status(Status(StatusCode.ERROR, _describe([c.failure])))
        span.end(end_time=to_ns(end))


def _status_of(err: BaseException) -> int:
    """The HTTP status an error is answered with: an ApiError's own, anything else 500."""
    return err.status if isinstance(err, ApiError) else 500


def _describe(failures: Iterable[BaseException]) -> str:
    """'500 server_error: engine step failed: boom' for each failure."""
    return "; ".join(f"{_status_of(e)} {_kind(e)}: {e}" for e in failures)


def _kind(err: BaseException) -> str:
    return (err.code or err.type) if isinstance(err, ApiError) else type(err).__name__
