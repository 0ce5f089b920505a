"""The peer server `bench http --peer` starts itself: llama.cpp's `llama-server` on the same GGUF,
at its best setting for each test.

Owns: `PeerSpec` (the executable, the model file, threads, context a slot), `slots_for` (the
slots a case runs best at: one, `-np 1`, for prefill and one stream, where llama-server's whole
context and batch go to the one sequence; N, `-np N -c N*ctx`, for N streams; the Poisson test's
`poisson_slots`), and `Peer` (started on a free 127.0.0.1 port in its own process group, ready
when /health answers 200, started again only when a case needs another slot count, stopped by
its process group; its output in `<out>/peer-<slots>.log`). Imports no tl and no jax.
Tested by tests/bench/test_bench_harness.py with a stand-in executable.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.load_tests import Case


@dataclass(frozen=True, slots=True)
class PeerSpec:
    executable: str
    model: str  # the GGUF file
    threads: int
    ctx: int = 4096  # context a slot
    poisson_slots: int = 16  # the open-loop test has no fixed concurrency
    ready_s: float = 300.0

    def args(self, slots: int, port: int) -> list[str]:
        return [
            self.executable,
            *("-m", self.model, "--host", "127.0.0.1", "--port", str(port)),
            *("-t", str(self.threads), "-np", str(slots), "-c", str(slots * self.ctx)),
        ]


def slots_for(case: Case, spec: PeerSpec) -> int:
    """The -np a case runs best at: its concurrency (1 for prefill and one stream)."""
    return case.concurrency if case.rate is None else spec.poisson_slots


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Peer:
    """One llama-server at a time, at the slot count the current case asks for."""

    def __init__(self, spec: PeerSpec, out: Path) -> None:
        self.spec, self.out = spec, out
        self.proc: subprocess.Popen[bytes] | None = None
        self.slots = 0
        self.url = ""

    def ensure(self, slots: int) -> str:
        """The base URL of a ready peer with `slots` slots (started again if it has another count)."""
        if self.proc is not None and self.proc.poll() is None and self.slots == slots:
            return self.url
        self.stop()
        port = _free_port()
        cmd = self.spec.args(slots, port)
        log = open(self.out / f"peer-{slots}.log", "ab")  # noqa: SIM115 (the child holds it)
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            log.close()
            raise RuntimeError(f"cannot start the peer {self.spec.executable!r}: {e}") from None
        log.close()
        self.slots, self.url = slots, f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.spec.ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the peer exited with status {self.proc.returncode} before it was ready "
                    f"(command: {' '.join(cmd)}; log: {self.out / f'peer-{slots}.log'})"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        print(f"peer: {' '.join(cmd)}", flush=True)
                        return self.url
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the peer was not ready in {self.spec.ready_s:g} s (command: {' '.join(cmd)})")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
