"""`tl serve --config runtime.toml`: this process becomes granian's main process on the
config's http_listen.

Owns granian's settings in their two forms: the bare `granian` command line
(`granian_command`, which the tests use) and `serve_main`'s in-process main process (one worker,
HTTP/1, no websockets in both), the worker kill timeout (drain_timeout_s + STOP_BOUND_S: a wedged worker
cannot hold the main process longer), and `serve_main`: it validates the config first (so a
bad key or value stops start-up here with its message), sets TL_CONFIG for the worker, and
runs granian's main process in this one (`GranianMain`: granian's own, except that a second
stop signal is passed on to the worker, which granian's main alone would not do: the worker
then stops at once). The drain runs in the worker (serve/app.py, serve/signals.py). granian
imports the app by its target, `serve.app:app` (an App over tl.entry.build's engine); tests name
another target, an App built with their fake engine. Tested by tests/serve/test_serve_config.py,
tests/serve/test_serve_http.py and tests/serve/test_stop.py.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import sys
from typing import Any, NoReturn

from serve.config_load import load_config
from serve.process import STOP_BOUND_S, parse_listen
from tl.core.config import EngineConfig
from tl.entry.build import is_follower

APP = "serve.app:app"
log = logging.getLogger("serve")


def kill_timeout_s(cfg: EngineConfig) -> int:
    """Seconds granian's main process gives a stopping worker before it kills it."""
    return math.ceil(cfg.drain_timeout_s + STOP_BOUND_S)


def granian_argv(config_path: str, app: str = APP) -> list[str]:
    """granian's command line serving the ASGI target `app` ("module:attribute") on http_listen
    (`granian ...`: the same server as serve_main's, less the second signal's pass-on)."""
    cfg = load_config(config_path)
    host, port = parse_listen(cfg.http_listen)
    parse_listen(cfg.health_listen)
    return granian_command(host, port, app, kill_timeout_s(cfg))


def granian_command(host: str, port: int, app: str, kill_timeout: int) -> list[str]:
    """granian's command line: one worker, HTTP/1, no websockets, the worker kill timeout."""
    beside = os.path.join(os.path.dirname(sys.executable), "granian")  # this Python's own granian first
    exe = beside if os.path.exists(beside) else (shutil.which("granian") or beside)
    return [
        exe,
        "--interface",
        "asgi",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
        "--http",
        "1",
        "--no-ws",
        "--workers-kill-timeout",
        str(kill_timeout),
        app,
    ]


def serve_main(config_path: str, app: str = APP) -> NoReturn:
    """Never returns: the process becomes granian's main process serving `app` (default
    serve.app:app) and exits with its status, or, as a follower of a multi-host job (a known
    process_id other than 0), follows its leader (serve/follower.py) and exits with its status."""
    cfg = load_config(config_path)
    if is_follower(cfg):
        from serve.follower import follower_main

        sys.exit(follower_main(cfg))
    host, port = parse_listen(cfg.http_listen)
    parse_listen(cfg.health_listen)
    os.environ["TL_CONFIG"] = os.path.abspath(config_path)
    from granian.constants import HTTPModes, Interfaces
    from granian.errors import FatalError

    main = _granian_main()(
        app,
        address=host,
        port=port,
        interface=Interfaces.ASGI,
        workers=1,
        http=HTTPModes.http1,
        websockets=False,
        workers_kill_timeout=kill_timeout_s(cfg),
    )
    try:
        main.serve()
    except FatalError:
        sys.exit(1)
    sys.exit(0)


def _granian_main() -> type[Any]:
    """granian's main process (its Server class), passing a second stop signal on to the workers."""
    from granian.server import Server

    class GranianMain(Server):  # type: ignore[misc,valid-type]
        def signal_handler_interrupt(self, *args: Any, **kwargs: Any) -> None:
            if self.interrupt_signal:  # granian's main only waits for its workers from now on
                for worker in list(self.wrks):
                    pid = worker.inner.pid
                    if pid and worker.is_alive():
                        os.kill(pid, signal.SIGTERM)
                log.warning("a second stop signal: passed on to the worker (it stops at once)")
            super().signal_handler_interrupt(*args, **kwargs)

    return GranianMain
