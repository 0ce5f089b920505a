"""`tl serve --config runtime.toml`: exec granian on the config's http_listen.

Owns only the command line: it validates the config first (so a bad key or value stops
start-up here with its message), sets TL_CONFIG for the worker, and replaces this process
with granian, so SIGTERM reaches granian's main process and the drain runs there.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import NoReturn

from serve.app import parse_listen
from serve.config_load import load_config


def granian_argv(config_path: str) -> list[str]:
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
        "serve.app:app",
    ]


def serve_main(config_path: str) -> NoReturn:
    """Never returns: the process becomes granian serving serve.app:app."""
    argv = granian_argv(config_path)
    os.environ["TL_CONFIG"] = os.path.abspath(config_path)
    os.execv(argv[0], argv)
