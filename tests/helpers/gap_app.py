"""`tests.helpers.gap_app:app`, a granian target for tests/serve/test_stop.py: serve.app's App
over the fake engine (tests/helpers/fake_app.py's), whose worker sends SIGTERM to its process group (as `kill -- -PGID`
would) in the gap between granian's lifespan start-up and its HTTP server: after the start-up
has run on granian's loop and before granian builds its worker server (granian/server/mp.py
builds it by the module name ASGIWorker, which the start-up wraps). It then waits there half
a second, so that granian's main process, which passes the stop on to its worker, signals it
in the same gap.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import granian.server.mp as granian_mp

from serve.app import App
from tests.helpers.fake_engine import make_real_async_engine

GAP_WAIT_S = 0.5


class _SignalInTheGap(App):
    async def startup(self) -> None:
        await super().startup()
        build_server = granian_mp.ASGIWorker  # AttributeError if granian moved it: the test fails loudly

        def signal_then_build(*args: Any, **kwargs: Any) -> Any:
            os.killpg(os.getpgid(0), signal.SIGTERM)
            time.sleep(GAP_WAIT_S)
            return build_server(*args, **kwargs)

        granian_mp.ASGIWorker = signal_then_build


app = _SignalInTheGap(engine_factory=make_real_async_engine)
