"""Compilation of the step's variants: ahead of time, the first few before ready, the rest behind.

Owns: JAX's persistent compilation cache (`enable_compile_cache`), the table of compiled step
variants (one per (token bucket, seq bucket)), compiling a variant ahead of time (the step
program's `compile`, tl/runtime/step.py: trace and lower over abstract arguments, then XLA
compiles off the GIL), the plan's start-up variants compiled before the runner is ready (two
threads: XLA compiles one module on one core), the rest on one background thread (one sequence's variants first, by
tokens: a lone request's prefill and decode steps, what a fresh server meets first; then each
larger sequence bucket's), progress log lines with counts, and `pick`. While the background
compilation runs, a step whose own variant is not compiled yet runs in the smallest compiled
one that holds it (padding only: the same tokens, written to the same slots), so no request
waits on a compile once the start-up variants are in; with no warm-up asked for (the CLI's
one-shot generate, `bench runner`, tests), a step's own variant is compiled then and there.
`compiling_now` tells a multi-host peer's heartbeat whether this process is compiling.
Must not: decide the variants (tl/runtime/execution.py does), pack inputs, touch the KV cache.
Tested by tests/runtime/test_compiler.py and tests/runtime/test_runner.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from tl.core.debug_delays import debug_delay
from tl.runtime.daemon_threads import map_on_daemon_threads

log = logging.getLogger("tl.runtime.compiler")

Variant = tuple[int, int]
"""(token bucket, seq bucket) of one compiled step."""

_compile_cache_dir: str | None = None
_active_lock = threading.Lock()
_active = 0  # compiles in progress in this process, every StepCompiler's (`compiling_now`)


def enable_compile_cache(path: str) -> None:
    """Turn on JAX's persistent compilation cache (process-wide; the first directory wins)."""
    global _compile_cache_dir
    if not path or _compile_cache_dir is not None:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _compile_cache_dir = path


def compiling_now() -> bool:
    """A step variant is being compiled in this process now (start-up, background or on demand):
    a multi-host peer's heartbeat says so (tl/entry/multihost.py), its collectives held up legitimately."""
    return _active > 0


def _count_active(delta: int) -> None:
    global _active
    with _active_lock:
        _active += delta


class StepCompiler:
    """The compiled variants of one runner's step. `compile(variant)` returns what the runner
    calls for it (any callable; its own type is the runner's business)."""

    def __init__(self, compile: Callable[[Variant], Any], variants: Sequence[Variant]) -> None:
        self._compile = compile
        self.variants = tuple(sorted(variants))
        self._done: dict[Variant, Any] = {}
        self._lock = threading.Lock()  # one compile of a variant at a time, never two of the same
        self._count_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.background_error: BaseException | None = None
        self.borrowing = False  # steps may run in a larger compiled variant than their own
        self._requested: list[Variant] = []  # `request`'s queue, in order
        self._worker: threading.Thread | None = None
        self._active = 0  # compiles in progress (any thread)

    @property
    def num_compiled(self) -> int:
        return len(self._done)

    @property
    def compiled(self) -> tuple[Variant, ...]:
        return tuple(sorted(self._done))

    def pick(self, tokens: int, seqs: int) -> tuple[Variant, Any]:
        """The variant that runs a step of tokens x seqs (both already bucketed): its own where
        compiled; when `borrowing` (a background compilation was started: it is under way, or
        stopped on an error), the compiled variant with the fewest tokens (then sequences) that
        holds it; else (no warm-up: the CLI, benchmarks timing each variant) its own, compiled
        now."""
        own = (tokens, seqs)
        fn = self._done.get(own)
        if fn is not None:
            return own, fn
        if self.borrowing:
            best = None
            for v in list(self._done):
                if v[0] >= tokens and v[1] >= seqs and (best is None or v < best):
                    best = v
            if best is not None:
                return best, self._done[best]
        return own, self.ensure(own)

    @property
    def busy(self) -> bool:
        """A variant is being compiled now (start-up, background or on demand)."""
        return self._active > 0

    def _compiled(self, v: Variant) -> Any:
        with self._count_lock:
            self._active += 1
        _count_active(1)
        try:
            return self._compile(v)
        finally:
            _count_active(-1)
            with self._count_lock:
                self._active -= 1

    @property
    def compiling(self) -> bool:
        """The background compilation is running."""
        return self._thread is not None and self._thread.is_alive()

    def ensure(self, v: Variant) -> Any:
        """Variant v's compiled step, compiling it now if needed."""
        fn = self._done.get(v)
        if fn is not None:
            return fn
        # Unbounded by design: a caller that needs v (no warm-up asked for, or a multi-host
        # follower's frame) waits for the compile in progress, itself one XLA compile long.
        with self._lock:
            if v not in self._done:
                self._done[v] = self._compiled(v)
            return self._done[v]

    def compile_startup(self, startup: Sequence[Variant], threads: int = 2) -> float:
        """Compile the start-up variants (in parallel); seconds taken."""
        t0 = time.perf_counter()
        todo = [v for v in startup if v not in self._done]

        def one(v: Variant) -> None:
            debug_delay("compile")
            fn = self._compiled(v)
            with self._lock:
                self._done.setdefault(v, fn)

        map_on_daemon_threads(one, todo, threads, name="tl-compile-startup", stop_at_error=True)
        took = time.perf_counter() - t0
        log.info(
            "compiled %d of %d step variants before ready in %.1f s: %s",
            self.num_compiled,
            len(self.variants),
            took,
            ", ".join(f"{t}x{s}" for t, s in sorted(todo)),
        )
        return took

    def warm_up(self, startup: Sequence[Variant], background: bool = False) -> None:
        """Compile ahead of time: the start-up variants now, then the rest here (background False:
        serving then never compiles) or on a background thread (steps meanwhile run in the
        smallest compiled variant that holds them)."""
        self.compile_startup(startup)
        if background:
            self.start_background()
        else:
            self.compile_rest()

    def compile_rest(self) -> None:
        """Compile every variant not compiled yet, here (blocking): one sequence's variants first,
        by tokens (a lone request's prefill chunks and decodes: what a fresh server meets
        first), then each larger sequence bucket's."""
        t0 = time.perf_counter()
        for v in sorted(self.variants, key=lambda v: (v[1], v[0])):
            if self._stop.is_set():
                return
            if v in self._done:
                continue
            t1 = time.perf_counter()
            debug_delay("compile")
            self.ensure(v)
            log.info(
                "compiled step variant %dx%d (%d of %d) in %.1f s",
                v[0],
                v[1],
                self.num_compiled,
                len(self.variants),
                time.perf_counter() - t1,
            )
        if self.num_compiled == len(self.variants):
            log.info("all %d step variants compiled (%.1f s)", len(self.variants), time.perf_counter() - t0)

    @property
    def num_requested_pending(self) -> int:
        """Variants `request` was asked for and has not compiled yet."""
        with self._count_lock:
            return sum(v not in self._done for v in self._requested)

    def request(self, v: Variant, wait_while: Callable[[], bool]) -> None:
        """Compile variant v later, on this table's own daemon thread (variants in the order asked,
        each once), starting each only while `wait_while()` is False (another table's background
        compilation: one compile at a time on a CPU host); a compile error is logged and kept."""
        with self._count_lock:
            if v in self._done or v in self._requested:
                return
            self._requested.append(v)
            if self._worker is not None:
                return
            self._worker = threading.Thread(target=self._compile_requested, args=(wait_while,), daemon=True)
            self._worker.name = "tl-compile-requested"
        self._worker.start()

    def _compile_requested(self, wait_while: Callable[[], bool]) -> None:
        i = 0
        while not self._stop.is_set():
            with self._count_lock:
                if i == len(self._requested):
                    self._worker = None
                    return
                v = self._requested[i]
            if v in self._done:
                i += 1
                continue
            if wait_while():
                self._stop.wait(0.1)  # polled: the other compilation ends when its last compile does
                continue
            try:
                t0 = time.perf_counter()
                self.ensure(v)
                log.info("compiled several decode steps for %dx%d in %.1f s", v[0], v[1], time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 -- steps of that shape keep running one at a time
                self.background_error = e
                log.exception("compiling several decode steps for %dx%d failed", v[0], v[1])
            i += 1

    def start_background(self) -> None:
        """compile_rest on a daemon thread; an error there is logged and kept (steps then run in
        what compiled)."""
        if self._thread is not None:
            return
        self.borrowing = True

        def run() -> None:
            try:
                self.compile_rest()
            except BaseException as e:  # noqa: BLE001 -- serving goes on in the compiled variants
                self.background_error = e
                log.exception("background compilation stopped")

        self._thread = threading.Thread(target=run, name="tl-compile", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background compilation is over (at most `timeout`; None: the
        benchmarks and tests that measure after it, never the server); True when it is."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, wait: bool = True) -> None:
        """Stop the background compilation after the variant in progress (waiting for it, or not:
        the runner's close does not wait; waiting is for tests, one XLA compile at most)."""
        self._stop.set()
        if wait:
            self.wait()


class LazyPrograms:
    """Small helper programs compiled when first asked for, keyed by their argument shapes (the
    runner's feed of fed-back tokens: one per pair of step shapes met), on one daemon thread, so
    no step waits on one: `get` returns None until the key's program is in. background False
    (tests, benchmarks): compiled then and there."""

    def __init__(self, name: str, background: bool = True) -> None:
        self.name = name
        self.background = background
        self.num_compiled = 0
        self._done: dict[Any, Any] = {}
        self._queue: list[tuple[Any, Callable[[], Any]]] = []
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def get(self, key: Any, lower: Callable[[], Any]) -> Any:
        """The compiled program of `key` (lower(): its jax.stages.Lowered), or None while it
        compiles; a compile that fails is logged and the key stays None (callers go without)."""
        with self._lock:
            if key in self._done:
                return self._done[key]
            if not self.background:
                self._done[key] = self._compile(key, lower)
                return self._done[key]
            if any(k == key for k, _ in self._queue):
                return None
            self._queue.append((key, lower))
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name=f"tl-compile-{self.name}", daemon=True)
                self._worker.start()
        return None

    def _compile(self, key: Any, lower: Callable[[], Any]) -> Any:
        _count_active(1)
        try:
            compiled = lower().compile()
            self.num_compiled += 1
            return compiled
        except Exception:  # noqa: BLE001 -- the caller runs without this program
            log.exception("compiling %s %s failed", self.name, key)
            return None
        finally:
            _count_active(-1)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if not self._queue:
                    self._worker = None
                    return
                key, lower = self._queue[0]
            compiled = self._compile(key, lower)
            with self._lock:
                self._done[key] = compiled
                self._queue.pop(0)

    def stop(self, wait_s: float = 2.0) -> None:
        """No more compiles after the one in progress, which is waited for up to wait_s (one
        small program: tens of ms; a process that exits while XLA compiles on a daemon thread
        can abort in C++)."""
        self._stop.set()
        worker = self._worker
        if worker is not None:
            worker.join(wait_s)
