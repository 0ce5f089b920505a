"""Starting and stopping a granian server subprocess for tests (one place for the boilerplate).

Owns: free loopback ports, the granian argv for an ASGI target (serve.app:app, or the
tests' own tests/fake_app.py), waiting for a URL to answer 200, and killing the process group
at the end whatever happened; `serving_model`, tl's server over a model with a few engine keys.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.soak import free_port as free_port  # one picker for every test server (re-exported)
from serve.launch import granian_command

ROOT = Path(__file__).resolve().parent.parent


def granian_argv(port: int, app: str = "serve.app:app", kill_timeout: int = 40) -> list[str]:
    """The granian command line tl serves with (serve/launch.py's), on 127.0.0.1:port."""
    return granian_command("127.0.0.1", port, app, kill_timeout)


@contextmanager
def running(
    argv: Sequence[str], env: Mapping[str, str], ready_url: str | None, timeout_s: float
) -> Iterator[subprocess.Popen[bytes]]:
    """Run argv in its own session; wait until ready_url answers 200 (if given); kill it at the end."""
    proc = subprocess.Popen(
        list(argv), cwd=ROOT, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + timeout_s
        while ready_url is not None:
            assert proc.poll() is None, proc.stdout.read().decode()  # type: ignore[union-attr]
            try:
                if httpx.get(ready_url, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server did not answer {ready_url}"
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


@contextmanager
def serving_model(model_dir: Path, workdir: Path, engine_toml: str, model_id: str = "smol") -> Iterator[str]:
    """tl's server (serve.app:app under granian) on free loopback ports over model_dir, with
    engine_toml's [engine] keys besides the model and the listeners; yields the API's /v1 URL
    once /readyz answers 200."""
    port, hport = free_port(), free_port()
    cfg = workdir / "runtime.toml"
    cfg.write_text(
        f'[engine]\nmodel_dir = "{model_dir}"\nmodel_id = "{model_id}"\nhttp_listen = "127.0.0.1:{port}"\n'
        f'health_listen = "127.0.0.1:{hport}"\n{engine_toml}'
    )
    env = {**os.environ, "TL_CONFIG": str(cfg), "PYTHONPATH": str(ROOT)}
    with running(granian_argv(port), env, f"http://127.0.0.1:{hport}/readyz", timeout_s=600):
        yield f"http://127.0.0.1:{port}/v1"
