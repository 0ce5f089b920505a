"""Work spread over a few daemon threads, waited for: start-up's compiles and measurements.

Owns `map_on_daemon_threads`. Daemon threads, not an executor's: an executor's are joined at the
process's exit, so a stop during start-up would wait for every queued compile. Used by
tl/runtime/compiler.py (the step variants) and tl/runtime/verdicts.py (the kernel classes).
Tested by tests/runtime/test_verdicts.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def map_on_daemon_threads(
    fn: Callable[[T], R], items: Sequence[T], threads: int, *, name: str, stop_at_error: bool = False
) -> list[R]:
    """[fn(item) for item in items] on up to `threads` daemon threads named `name`, waited for;
    the first error in items' order is raised here, as an executor's map would. Every item runs,
    unless stop_at_error: then no item starts after an error."""
    todo = list(enumerate(items))
    done: dict[int, R] = {}
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo or (stop_at_error and errors):
                    return
                i, item = todo.pop(0)
            try:
                result = fn(item)
            except BaseException as e:  # noqa: BLE001 -- raised on the calling thread
                with lock:
                    errors[i] = e
                continue
            done[i] = result

    pool = [threading.Thread(target=work, name=name, daemon=True) for _ in range(max(1, min(threads, len(todo))))]
    for t in pool:
        t.start()
    for t in pool:  # start-up needs every result; a stop leaves the build's daemon thread here
        t.join()
    if errors:
        raise errors[min(errors)]
    return [done[i] for i in range(len(items))]
