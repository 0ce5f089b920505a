"""Starting and stopping a granian server subprocess for tests (one place for the boilerplate).

Owns: free loopback ports, the granian argv for an ASGI target (serve.app:app, or the
tests' own tests/helpers/fake_app.py), waiting for a URL to answer 200, and killing the process group
at the end whatever happened; `serving_model`, tl's server over a model with a few engine keys.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.soak import free_port as free_port  # one picker for every test server (re-exported)
from serve.launch import granian_command

ROOT = Path(__file__).resolve().parents[2]


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
    with replica(model_dir, workdir, engine_toml, model_id) as s:
        yield f"{s.api}/v1"


@contextmanager
def replica(model_dir: Path, workdir: Path, engine_toml: str, model_id: str) -> Iterator[Server]:
    """serving_model's server as a Server (its process, API and health URLs): for tests that stop it."""
    port, hport = free_port(), free_port()
    cfg = workdir / "runtime.toml"
    cfg.write_text(
        f'[engine]\nmodel_dir = "{model_dir}"\nmodel_id = "{model_id}"\nhttp_listen = "127.0.0.1:{port}"\n'
        f'health_listen = "127.0.0.1:{hport}"\n{engine_toml}'
    )
    env = {**os.environ, "TL_CONFIG": str(cfg), "PYTHONPATH": str(ROOT)}
    with running(granian_argv(port), env, f"http://127.0.0.1:{hport}/readyz", timeout_s=600) as proc:
        yield Server(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{hport}")


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    api: str
    health: str

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.health}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise KeyError(name)


@contextmanager
def server(
    tmp_path: Path,
    extra: str = "",
    env: dict[str, str] | None = None,
    expect_ready: bool = True,
    via_cli: bool = False,
    app: str = "tests.helpers.fake_app:app",
) -> Iterator[Server]:
    port, hport = free_port(), free_port()
    cfg = tmp_path / "runtime.toml"
    cfg.write_text(
        f'[engine]\nmodel_dir = "models/succ"\nblock_size = 4\nhttp_listen = "127.0.0.1:{port}"\n'
        f'health_listen = "127.0.0.1:{hport}"\n{extra}'
    )
    full_env = {
        **os.environ,
        "TL_CONFIG": str(cfg),
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    argv = granian_argv(port, app)
    if via_cli:  # what `tl serve --config` runs: checks the config, then execs granian in its place
        argv = [sys.executable, "-c", f"from serve.launch import serve_main; serve_main({str(cfg)!r}, {app!r})"]
    ready = f"http://127.0.0.1:{port}/healthz" if expect_ready else None
    with running(argv, full_env, ready, timeout_s=20) as proc:
        yield Server(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{hport}")
