"""What every serving process shares, the server's workers and a multi-host follower alike: the
listen address's form, the log's format, and the bounds of a stop.

Owns `parse_listen`, `setup_logging` and the stop's timings (`STOP_BOUND_S` and its parts): imported
by serve/app.py, serve/launch.py and serve/follower.py, so a launcher or a follower does not import
the app's routes. Must not import the app.
"""

from __future__ import annotations

import logging

ABORT_GRACE_S = 2.0
"""After the drain deadline aborts what is left, this long for the error events to go out."""
STOP_NOW_GRACE_S = 1.0
"""After a second signal aborts everything, this long for the error events to go out."""
ENGINE_STOP_S = 5.0
"""The engine thread's own bound on its stop (it stops between steps)."""
ENGINE_STOP_WAIT_S = ENGINE_STOP_S + 1.0
"""The lifespan shutdown waits this long for the engine's stop (its own bound, 1 s to return)."""
HEALTH_CLOSE_S = 2.0
"""The lifespan shutdown waits this long for the health port to close."""
TRACING_STOP_S = 2.0
"""The last spans' export (tracing on), beside the health port's close: at most this long."""
STOP_MARGIN_S = 3.0
"""Unbounded here, given a margin: granian stopping its HTTP server after the hand-over (and
signals.py's PARENT_GRACE_S before it, with a drain_timeout_s under it), the interpreter's exit."""
STOP_BOUND_S = ABORT_GRACE_S + ENGINE_STOP_WAIT_S + max(HEALTH_CLOSE_S, TRACING_STOP_S) + STOP_MARGIN_S
"""A stop takes at most drain_timeout_s plus this (13 s): the abort grace, the engine's stop, the
health port's close (the spans' export beside it), the margin. granian's main process kills a
worker still alive then (serve/launch.py); README, "Stopping", lists the same parts."""


def parse_listen(addr: str) -> tuple[str, int]:
    """ "host:port" or ":port" (all interfaces) -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address must be host:port, got {addr!r}")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def setup_logging() -> None:
    for name in ("serve", "tl"):
        lg = logging.getLogger(name)
        if not lg.handlers:
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            lg.addHandler(h)
            lg.setLevel(logging.INFO)
