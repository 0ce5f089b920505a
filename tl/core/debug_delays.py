"""Debug delays: make a start-up phase slow on purpose, so that a test can stop the server in it.

Owns the delays: tl/entry/build.py hands over the TL_DEBUG_DELAYS variable (`configure`), comma-
separated `phase=seconds` pairs. Phases:
`load` (before the model is loaded), `compile` (before each step variant is compiled, at
start-up and in the background) and `step` (before each engine step that computes: streams
then run slowly enough to be caught open). Unset (always, outside tests): no delay, nothing
logged. A phase's first delay is logged, so that a test can tell which phase the server is in.
Used by tests/serve/test_stop.py.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("tl.debug")
PHASES = ("load", "compile", "step")
_logged: set[str] = set()
_delays: dict[str, float] = {}


def configure(text: str) -> None:
    """Take the delays TL_DEBUG_DELAYS asks for (ValueError naming the variable if malformed)."""
    _delays.clear()
    _delays.update(parse(text))


def parse(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        phase, sep, seconds = part.partition("=")
        try:
            value = float(seconds) if sep and phase in PHASES else -1.0
        except ValueError:
            value = -1.0
        if not value >= 0:
            raise ValueError(f"TL_DEBUG_DELAYS: {part!r} is not phase=seconds with a phase of {', '.join(PHASES)}")
        out[phase] = value
    return out


def debug_delay(phase: str) -> None:
    """Sleep as long as TL_DEBUG_DELAYS asks for `phase` (usually not at all)."""
    seconds = _delays.get(phase, 0.0)
    if seconds > 0:
        if phase not in _logged:
            _logged.add(phase)
            log.warning("debug delay: %s %.2f s each (TL_DEBUG_DELAYS)", phase, seconds)
        time.sleep(seconds)
