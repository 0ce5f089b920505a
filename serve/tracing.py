"""Whether this server traces its requests, and starting the tracer when it does.

Owns the switch (README, "Traces"): tracing is on when OTEL_TRACES_EXPORTER names an exporter
tl has, "otlp" (OTLP over HTTP/protobuf) or "console", alone or as a comma-separated list;
unset, empty or "none" is off (the OpenTelemetry SDK's own default is "otlp": tl's is off, so
that a server nobody asked to trace never imports the SDK). OTEL_SDK_DISABLED=true is off
whatever the exporter. Every other OTEL_* variable (endpoint, headers, service name, resource
attributes, batch sizes, propagators) is read by the SDK itself, as its documentation says.

This module imports no opentelemetry package: serve/otel.py does, and `start` imports that only
when the switch is on. With tracing off the App holds None and each request pays one `is None`
check. With it on but the packages missing, `start` raises TracingUnavailable naming the extra
to install, and the App's start-up fails with it. Tested by tests/serve/test_tracing.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve.otel import Tracing

EXPORTERS = ("otlp", "console")
"""The values of OTEL_TRACES_EXPORTER tl knows."""
EXTRA = "tl[tracing]"
"""The pip extra that brings the OpenTelemetry SDK and its OTLP/HTTP exporter (pyproject.toml)."""


class TracingUnavailable(RuntimeError):
    """Tracing was asked for and cannot run: an unknown exporter, or the SDK is not installed."""


def exporters(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The exporters OTEL_TRACES_EXPORTER names (empty: tracing off). Raises TracingUnavailable
    for a name tl has no exporter for."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    chosen = tuple(dict.fromkeys(n for n in names if n and n != "none"))
    unknown = [n for n in chosen if n not in EXPORTERS]
    if unknown:
        raise TracingUnavailable(
            f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']!r}: tl exports traces with "
            f"{' or '.join(EXPORTERS)} (or 'none' for off), not {', '.join(unknown)}"
        )
    return chosen


def start(environ: Mapping[str, str]) -> Tracing | None:
    """The request tracer the environment asks for, or None (off). Raises TracingUnavailable."""
    chosen = exporters(environ)
    if not chosen:
        return None
    try:
        from serve import otel
    except ImportError as e:
        raise TracingUnavailable(
            f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']!r} turns tracing on, which needs the "
            f"OpenTelemetry SDK: pip install '{EXTRA}' (or unset OTEL_TRACES_EXPORTER); {e}"
        ) from None
    return otel.from_environ(chosen, environ)
