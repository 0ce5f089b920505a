"""tl/core/grammar_pool.py with plain Python jobs held on events: a given-up job's place goes to the
next job at once, its thread drops to nice 19, at most max_overdue are written off, queued jobs
given up on (or left at shutdown) are cancelled, and shutdown waits for nothing."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future

import pytest

from tl.core.grammar_pool import LOWEST_PRIORITY, GrammarPool

pytestmark = pytest.mark.serial  # timing bounds: `make test` runs it alone, after the parallel part


def held(release: threading.Event, value: str) -> Callable[[], tuple[str, int]]:
    """A job that blocks until release, then returns value and the id of the thread it ran on."""

    def job() -> tuple[str, int]:
        assert release.wait(5)
        return value, threading.get_native_id()

    return job


def until_running(f: Future[object]) -> None:
    for _ in range(1000):
        if f.running():
            return
        time.sleep(0.001)
    raise AssertionError("the job never started")


def test_a_given_up_job_gives_its_place_to_the_next() -> None:
    pool = GrammarPool(num_workers=1, max_overdue=1)
    stuck, go = threading.Event(), threading.Event()
    first = pool.submit(held(stuck, "first"))
    second = pool.submit(held(go, "second"))
    until_running(first)
    assert not second.running()  # one place, taken
    pool.give_up(first)
    assert pool.num_overdue == 1
    go.set()
    assert second.result(2)[0] == "second"  # while first is still stuck
    assert not first.done()
    stuck.set()
    value, first_thread = first.result(2)
    assert value == "first"  # its caller is gone, but the outcome is still set
    for _ in range(1000):
        if pool.num_overdue == 0:
            break
        time.sleep(0.001)
    assert pool.num_overdue == 0


@pytest.mark.skipif(sys.platform != "linux", reason="threads have their own nice value on Linux only")
def test_a_written_off_thread_runs_at_the_lowest_priority() -> None:
    pool = GrammarPool(num_workers=1, max_overdue=1)
    stuck = threading.Event()
    ids: list[int] = []

    def job() -> None:
        ids.append(threading.get_native_id())
        assert stuck.wait(5)

    f = pool.submit(job)
    until_running(f)
    pool.give_up(f)
    assert os.getpriority(os.PRIO_PROCESS, ids[0]) == LOWEST_PRIORITY
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != LOWEST_PRIORITY  # only that thread
    stuck.set()
    f.result(2)


def test_past_max_overdue_a_given_up_job_keeps_its_place() -> None:
    pool = GrammarPool(num_workers=1, max_overdue=1)
    stuck = [threading.Event(), threading.Event()]
    first = pool.submit(held(stuck[0], "first"))
    until_running(first)
    pool.give_up(first)
    second = pool.submit(held(stuck[1], "second"))
    until_running(second)
    third = pool.submit(held(threading.Event(), "third"))
    pool.give_up(second)  # the one write-off is taken: second holds on to its place
    time.sleep(0.05)
    assert pool.num_overdue == 1 and not third.running()
    pool.give_up(third)  # queued: cancelled
    assert third.cancelled()
    stuck[1].set()
    assert second.result(2)[0] == "second"
    stuck[0].set()
    assert first.result(2)[0] == "first"


def test_a_thread_takes_the_queued_jobs_while_it_holds_a_place() -> None:
    pool = GrammarPool(num_workers=1, max_overdue=1)
    go = threading.Event()
    futures = [pool.submit(held(go, str(i))) for i in range(3)]
    go.set()
    results = [f.result(2) for f in futures]
    assert [v for v, _ in results] == ["0", "1", "2"]
    assert len({thread for _, thread in results}) == 1


def test_a_failing_job_raises_to_its_caller() -> None:
    def fail() -> None:
        raise ValueError("no grammar")

    pool = GrammarPool(num_workers=2, max_overdue=0)
    with pytest.raises(ValueError, match="no grammar"):
        pool.submit(fail).result(2)
    assert pool.submit(lambda: 7).result(2) == 7  # the pool carries on


def test_shutdown_cancels_the_queue_and_waits_for_no_running_job() -> None:
    pool = GrammarPool(num_workers=1, max_overdue=1)
    stuck = threading.Event()
    running = pool.submit(held(stuck, "running"))
    queued = pool.submit(held(stuck, "queued"))
    until_running(running)
    t0 = time.perf_counter()
    pool.shutdown()
    assert time.perf_counter() - t0 < 0.5
    with pytest.raises(CancelledError):
        queued.result(0)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(held(stuck, "late"))
    grammar_threads = [t for t in threading.enumerate() if t.name == "tl-grammar"]
    assert grammar_threads and all(t.daemon for t in grammar_threads)  # the running one: exit does not join them
    stuck.set()
    assert running.result(2)[0] == "running"


def test_bad_sizes_are_refused_with_their_values() -> None:
    with pytest.raises(ValueError, match="got 0 and 1"):
        GrammarPool(num_workers=0, max_overdue=1)
