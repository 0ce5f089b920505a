"""`tl serve --config runtime.toml`: exec granian on the config's http_listen.

Owns only the command line: it validates the config first (so a bad key or value stops
start-up here with its message), sets TL_CONFIG for the worker, and replaces this process
with granian, so SIGTERM reaches granian's main process and the drain runs there. granian
imports the app by its target, `serve.app:app` (an App over tl.build's engine); tests name
another target, an App built with their fake engine. Tested by tests/test_serve_config.py
and tests/test_serve_http.py.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import NoReturn

from serve.app import parse_listen
from serve.config_load import load_config
from tl.build import is_follower

APP = "serve.app:app"


def granian_argv(config_path: str, app: str = APP) -> list[str]:
    """granian's command line serving the ASGI target `app` ("module:attribute") on http_listen."""
    cfg = load_config(config_path)
    host, port = parse_listen(cfg.http_listen)
    parse_listen(cfg.health_listen)
    exe = shutil.which("granian") or os.path.join(os.path.dirname(sys.executable), "granian")
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
        app,
    ]


def serve_main(config_path: str, app: str = APP) -> NoReturn:
    """Never returns: the process becomes granian serving `app` (default serve.app:app), or, as a
    follower of a multi-host job (a known process_id other than 0), follows its leader
    (serve/follower.py) and exits with its status."""
    cfg = load_config(config_path)
    if is_follower(cfg):
        from serve.follower import follower_main

        sys.exit(follower_main(cfg))
    argv = granian_argv(config_path, app)
    os.environ["TL_CONFIG"] = os.path.abspath(config_path)
    os.execv(argv[0], argv)
