"""A follower of a multi-host group: `tl serve` on a process whose process_id is known and not 0.

Owns the follower's process: the health port (GET /healthz always; /readyz 200 once the runner
is built, its start-up variants compiled and the leader reachable; /metrics), no API, and the
exit status: 0 when the leader stops the group (the end of its drain), 3 when the group failed
(tl/entry/multihost.py), 1 when its health port did not start (one ERROR line names the cause).
SIGTERM alone does not stop a follower: the leader is draining on the same signal and still
needs it for the requests in flight; the leader's stop (or its loss) ends it.
Must not touch the engine's internals: tl.entry.build's run_follower does the work.
Tested by tests/entry/test_multihost.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable

from serve.health import HealthServer
from serve.metrics import Metrics
from serve.process import parse_listen, setup_logging
from tl.core.config import EngineConfig
from tl.entry.build import run_follower

log = logging.getLogger("serve.follower")
HEALTH_START_S = 10.0
"""The follower's health port must listen within this, or the follower exits with status 1."""


def follower_main(cfg: EngineConfig) -> int:
    """Serve the health port on a thread and follow the leader on this one; the exit status."""
    setup_logging()
    ready: list[Callable[[], bool]] = []
    health = HealthServer(Metrics(lambda: None), lambda: bool(ready) and ready[0]())
    host, port = parse_listen(cfg.health_listen)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    failed: list[BaseException] = []

    def serve_health() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(health.start(host, port))
        except BaseException as e:  # noqa: BLE001 -- reported on the main thread
            failed.append(e)
            return
        finally:
            started.set()
        loop.run_forever()

    threading.Thread(target=serve_health, name="tl-health", daemon=True).start()
    if not started.wait(HEALTH_START_S) or failed:  # a listen that fails fails at once; 10 s is a wedge
        cause = failed[0] if failed else f"not listening within {HEALTH_START_S:.0f} s"
        log.error("follower: the health port %s did not start (%s); exiting with status 1", cfg.health_listen, cause)
        if failed:  # its thread is done with the loop
            loop.close()
        logging.shutdown()
        return 1
    log.info("follower: health port listening on %s", cfg.health_listen)
    signal.signal(signal.SIGTERM, lambda *_: log.info("follower: SIGTERM; waiting for the leader to stop the group"))
    code = run_follower(cfg, ready.append)
    logging.shutdown()
    os._exit(code)  # jax.distributed's exit-time barrier would wait on processes already gone
