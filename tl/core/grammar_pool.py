"""GrammarPool: the threads that compile structured output's grammars, where a compile that
overruns its deadline gives its place back.

Owns: a FIFO of jobs, up to `num_workers` of them running at once (each on a daemon thread of
its own, which then takes the next queued job), and the write-off of a job its caller gave up
on (cancelled if still queued). llguidance (1.9) cannot be interrupted, and its limits
(LLParserLimits) bound a grammar's size, not its build time: a JSON object of 10,000 optional
integer properties is within them and builds in 38 s (quadratic: 1,000 in 0.4 s, 3,000 in
2.8 s; Xeon, 2 cores), and no limit short of rejecting a 3,000-property object catches it
sooner. So `give_up` does not stop the job: its thread stops counting against num_workers (the next queued job starts on
a new thread at once), is lowered to the least CPU priority (nice 19, so it only takes cores
nothing else wants), and exits when llguidance returns. At most `max_overdue` threads are
written off at a time, each logged; past that a given-up job keeps its place, so the pool never
runs more than num_workers + max_overdue compiles.

Measured (2-core Xeon, shared): three slow schemas (0.36-0.56 s each alone) in flight, then a
plain one, against a 0.1 s bound. concurrent.futures with two threads: the plain one waits out
its bound behind them and is refused, 8 runs of 8. Two places with this write-off: the freed
place comes as the plain one's own bound ends, refused 7 of 8. Four places (AsyncEngine's):
compiled in 1.8-66 ms, 8 of 8. Nice 19 matters on few cores: a Python loop beside three
runaway compiles ran at 27-29% of its idle speed, at 72-95% once they were lowered. A
subprocess could be killed, but the compiled matcher (an llguidance LLMatcher, which
tl.text.grammar.Grammar holds) cannot leave the process that built it: rebuilding it in-process
would cost the compile again.

The threads are daemons and `shutdown` waits for none of them (concurrent.futures' pool joins
its workers at interpreter exit even after shutdown(wait=False): one 3,000-property compile
held the process 2.4 s past its end). Must not import
jax. Tested by tests/core/test_grammar_pool.py, and with real slow schemas by
tests/core/test_async_engine.py.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger("tl.core.grammar_pool")
T = TypeVar("T")

LOWEST_PRIORITY = 19
"""The nice value of a written-off thread (Linux: a thread has its own)."""


@dataclass(slots=True, eq=False)
class _Job:
    """One submitted call; `native_id` and `started_s` are set by the thread that runs it."""

    run: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)
    native_id: int | None = None
    started_s: float = 0.0
    overdue: bool = False


class GrammarPool:
    """Runs compiles on daemon threads; `give_up` writes off one that overran (see the module)."""

    def __init__(self, num_workers: int, max_overdue: int, name: str = "tl-grammar") -> None:
        if num_workers < 1 or max_overdue < 0:
            raise ValueError(f"num_workers must be >= 1 and max_overdue >= 0, got {num_workers} and {max_overdue}")
        self.num_workers = num_workers
        self.max_overdue = max_overdue
        self.name = name
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._running: dict[Future[Any], _Job] = {}
        self._num_on_time = 0  # running jobs that hold a worker's place
        self._num_overdue = 0  # running jobs written off
        self._closed = False

    @property
    def num_overdue(self) -> int:
        """Threads written off whose compile has not returned yet."""
        return self._num_overdue

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue fn; it starts at once while fewer than num_workers jobs hold a place."""
        job = _Job(fn)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the pool is shut down")
            self._queue.append(job)
            nxt = self._take()
        if nxt is not None:
            self._start(nxt)
        return job.future

    def give_up(self, future: Future[Any]) -> None:
        """The caller stopped waiting for future: cancelled if still queued; if running, its
        thread is written off (unless max_overdue already are) and the next queued job starts."""
        if future.cancel():
            return
        with self._lock:
            job = self._running.get(future)
            if job is None or job.overdue:
                return
            elapsed_s = time.monotonic() - job.started_s
            if self._num_overdue >= self.max_overdue:
                log.warning(
                    "%s: a compile overran (%.2f s) but %d threads are written off already: it keeps its place",
                    self.name,
                    elapsed_s,
                    self._num_overdue,
                )
                return
            job.overdue = True
            self._num_on_time -= 1
            self._num_overdue += 1
            num_overdue = self._num_overdue
            if job.native_id is not None:  # under the lock: the thread cannot have exited; else it lowers itself
                _lower_priority(job.native_id)
            nxt = self._take()
        log.warning(
            "%s: a compile overran (%.2f s) and runs on at nice %d; %d of at most %d threads written off",
            self.name,
            elapsed_s,
            LOWEST_PRIORITY,
            num_overdue,
            self.max_overdue,
        )
        if nxt is not None:
            self._start(nxt)

    def shutdown(self) -> None:
        """Cancel the queued jobs and take no more; running compiles are not waited for."""
        with self._lock:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
        for job in queued:
            job.future.cancel()

    def _take(self) -> _Job | None:
        """Under the lock: the next queued job that starts now (it takes a place), if any."""
        while self._queue and self._num_on_time < self.num_workers:
            job = self._queue.popleft()
            if job.future.set_running_or_notify_cancel():
                self._num_on_time += 1
                self._running[job.future] = job
                return job
        return None

    def _start(self, job: _Job) -> None:
        threading.Thread(target=self._work, args=(job,), name=self.name, daemon=True).start()

    def _work(self, first: _Job) -> None:
        """One thread: its job, then the queued ones while it holds a place."""
        job: _Job | None = first
        while job is not None:
            with self._lock:
                job.native_id = threading.get_native_id()
                job.started_s = time.monotonic()
                overdue = job.overdue
            if overdue:
                _lower_priority(job.native_id)
            try:
                result = job.run()
            except BaseException as e:  # the caller's to see, as concurrent.futures does
                job.future.set_exception(e)
            else:
                job.future.set_result(result)
            job = self._finish(job)

    def _finish(self, job: _Job) -> _Job | None:
        """Release job's place (or its write-off) and take the next job, unless written off."""
        with self._lock:
            del self._running[job.future]
            if not job.overdue:
                self._num_on_time -= 1
                return None if self._closed else self._take()
            self._num_overdue -= 1
        log.warning("%s: a written-off compile returned after %.2f s", self.name, time.monotonic() - job.started_s)
        return None  # this thread runs at nice 19: a fresh one serves the queue


def _lower_priority(native_id: int) -> None:
    """Nice 19 for one thread. Linux only: elsewhere PRIO_PROCESS would read the id as a process."""
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, native_id, LOWEST_PRIORITY)
    except OSError as e:  # the thread already exited, or a sandbox forbids it: the write-off stands
        log.warning("could not lower the priority of thread %d: %s", native_id, e)
