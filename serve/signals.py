"""Stop signals inside granian's worker process: who hears them, and when granian is told.

Owns: SIGTERM and SIGINT in the worker from the moment granian sets up its event loop (before
the lifespan start-up begins) to the process's end, the rule that tells a first stop request
from a second one, and the hand-over to granian's own worker shutdown.

granian's worker installs loop handlers for both signals that set its `WorkerSignal` (the
event its HTTP server and its lifespan shutdown wait on) at once, whatever the app is doing.
`take_over_granian()` (called when serve.app is imported, which granian's worker does before
it sets up those handlers) replaces granian's `set_loop_signals`: it creates granian's event
itself, but the handlers are ours, so a stop signal reaches the App (drain, or a start-up
given up) and granian's event is set only by `StopSignals.hand_over()`.

The handlers are the process's own (`signal.signal`), not the loop's (`add_signal_handler`):
granian runs its loop in separate stretches (the lifespan start-up, then the serving, then
the shutdown), and uvloop, granian's loop where installed, loses a signal that arrives
between two of them (its handler only notes the signal, and the note is read when a later
signal wakes the loop: a SIGTERM just after /readyz turned 200 left the worker serving
forever). A process handler runs in the main thread at its next Python instruction, loop
running or not, and hands the signal to the loop with `call_soon_threadsafe`, which keeps
it until the loop runs again. Tested by tests/serve/test_stop.py, a signal in that gap included.

The rules (README, "Stopping"):
- the first SIGTERM or SIGINT asks for a stop (`on_stop`): the App drains, or gives up a
  start-up in progress;
- one process-group delivery (systemd, `kill -- -PGID`, Ctrl-C in a terminal) reaches the
  worker twice, directly and through granian's main process (which terminates its worker
  when it is signalled itself), so a signal within SAME_STOP_S of the first is the same
  request; a later one asks to stop at once (`on_second`);
- the worker never ends sooner than PARENT_GRACE_S after the first signal: granian's main
  process must have marked the stop as its own by then (else it logs an "unexpected exit" of
  its worker and exits 1);
- a signal after the hand-over (the lifespan shutdown is slow) ends the process at once,
  status 0.
Must not import jax or the engine. Tested by tests/serve/test_stop.py over real granian.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("serve")

SAME_STOP_S = 1.0
"""Signals this close to the first are one stop request (a group delivery arrives twice)."""
PARENT_GRACE_S = 0.25
"""The worker lasts at least this long after the first signal (granian's main reacts first)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GranianEvent(Protocol):
    """granian's WorkerSignal: set() stops the worker's server, then its lifespan shutdown runs."""

    def set(self) -> None: ...


class StopSignals:
    """The worker's stop signals (one per process: `STOP`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.first_at: float | None = None
        self.second = False
        self.handed_over = False
        self._event: GranianEvent | None = None
        self._on_stop: Callable[[], None] | None = None
        self._on_second: Callable[[], None] | None = None

    @property
    def requested(self) -> bool:
        """A stop signal has arrived."""
        return self.first_at is not None

    def bind(self, loop: asyncio.AbstractEventLoop, event: GranianEvent | None) -> None:
        """Hear SIGTERM and SIGINT from now on, each handled on `loop` (when it next runs, if it
        is not running now); `event` is granian's (None: no granian, hand_over then stops the
        loop's process with SIGINT's default action). Call from the main thread."""
        self._event = event

        def arrived(sig: int, frame: object) -> None:
            at = self._clock()  # the arrival, not the loop's later turn, dates the signal
            try:
                loop.call_soon_threadsafe(self._heard, sig, at)
            except RuntimeError:  # the loop is closed: the process is ending anyway
                pass

        for sig in STOP_SIGNALS:
            signal.signal(sig, arrived)
            signal.siginterrupt(sig, False)  # SA_RESTART, as the loops' own handlers set it

    def on(self, stop: Callable[[], None], second: Callable[[], None]) -> None:
        """What a stop request and a second one do (the App's drain and its stop at once); a
        request heard before this is passed on now."""
        self._on_stop, self._on_second = stop, second
        if self.requested:
            stop()

    def _heard(self, sig: int, now: float) -> None:
        name = signal.Signals(sig).name
        if self.first_at is None:
            self.first_at = now
            log.info("%s: stop requested", name)
            if self._on_stop is not None:
                self._on_stop()
            return
        if now - self.first_at < SAME_STOP_S:
            return  # the same request, delivered again through granian's main process
        if self.handed_over:
            log.warning("%s again during the shutdown: exiting now", name)
            _exit_now(0)
        if not self.second:
            self.second = True
            log.warning("%s again: stopping at once", name)
            if self._on_second is not None:
                self._on_second()

    async def hand_over(self) -> None:
        """Tell granian to stop its server and run the lifespan shutdown (once), no sooner than
        PARENT_GRACE_S after the first signal."""
        if self.handed_over:
            return
        self.handed_over = True
        if self.first_at is not None:
            await asyncio.sleep(max(0.0, self.first_at + PARENT_GRACE_S - self._clock()))
        if self._event is not None:
            self._event.set()
        else:  # not under granian: the process's own SIGINT
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.raise_signal(signal.SIGINT)


STOP = StopSignals()
"""This process's stop signals (granian runs one App per worker process)."""


def _exit_now(status: int) -> None:
    logging.shutdown()
    sys.stderr.flush()
    os._exit(status)


def take_over_granian() -> None:
    """Make granian's worker hand its stop signals to STOP (see the module's docstring). A
    granian without the hook point leaves its own handlers: a stop then skips the drain."""
    try:
        import granian._signals as granian_signals
    except ImportError:
        return
    original = getattr(granian_signals, "set_loop_signals", None)
    worker_signal = getattr(granian_signals, "WorkerSignal", None)
    if original is None or worker_signal is None or getattr(original, "_tl_wrapped", False):
        return

    def set_loop_signals(loop: asyncio.AbstractEventLoop) -> GranianEvent:
        event: GranianEvent = worker_signal()  # granian's own handlers never installed
        STOP.bind(loop, event)
        return event

    set_loop_signals._tl_wrapped = True  # type: ignore[attr-defined]
    granian_signals.set_loop_signals = set_loop_signals
