"""The bound on a multi-host group's start-up (`group_start_timeout_s`) and what its expiry does.

Owns: `start_deadline`, one bounded stage of start-up watched from its own thread, and exit
status 4 (`EXIT_GROUP_START`). The stages (tl/entry/build.py): the leader waiting for every
follower to connect to its step channel and for jax.distributed to form; the leader, once its
own model is loaded and compiled, waiting for every follower to report ready; a follower
waiting for the leader's step channel and for jax.distributed. On expiry: one ERROR line that
names what is missing (`missing()`: the process ids, e.g. "process 2 of 3 did not connect"),
then the process exits with status 4 at once.
Why a thread and not a timeout on each wait: jax.distributed.initialize blocks in C++ until
every process has registered, where no exception reaches it, and on its own deadline it
aborts the process (SIGABRT) naming no one; tl/runtime/backend.py passes it this bound plus a margin
so that this line comes first.
Must not import jax. Tested by tests/entry/test_multihost.py.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

log = logging.getLogger("tl.entry.group_start")

EXIT_GROUP_START = 4  # the group did not form within group_start_timeout_s


def processes(ids: Sequence[int], num_processes: int) -> str:
    """ "process 2 of 3", "processes 1, 3 of 4": the missing ones, named for the log."""
    return f"process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))} of {num_processes}"


@contextmanager
def start_deadline(
    timeout_s: float, missing: Callable[[], str], on_expiry: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Run the block under the bound: if it has not finished within timeout_s, log
    "group start-up: <missing()> within <timeout_s> s (group_start_timeout_s)" at ERROR and
    exit with status 4 (or, for tests, call on_expiry(line) instead)."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(timeout_s):
            return
        line = f"group start-up: {missing()} within {timeout_s:.1f} s (group_start_timeout_s)"
        if on_expiry is not None:
            on_expiry(line)
            return
        log.error("%s; exiting with status %d", line, EXIT_GROUP_START)
        logging.shutdown()
        os._exit(EXIT_GROUP_START)

    threading.Thread(target=watch, name="tl-group-start", daemon=True).start()
    try:
        yield
    finally:
        done.set()
