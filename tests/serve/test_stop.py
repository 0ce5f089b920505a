"""A stop signal always stops the server: `tl serve`'s process (granian's main process and its
worker) on the tiny JAX model, stopped at each moment of its life by SIGTERM or SIGINT,
delivered to the main process alone or to the whole process group.

The moments are forced, not hit by luck: TL_DEBUG_DELAYS (tl/core/debug_delays.py) makes the
model load or each step variant's compile sleep and logs it, and the test signals once that
line appears (or once /readyz is 200 while the background compiles are still sleeping). Each
case asserts the exit status (0) and the time from the signal to the exit: within the worker's
own bound (serve/app.py's grace and shutdown bounds), far below drain_timeout_s plus
STOP_BOUND_S, after which granian would kill the worker; one case drains to a short
drain_timeout_s's deadline and asserts that whole bound. Streams open at the stop either
complete or end with an error event and [DONE]. Every server is killed at the end whatever
happened.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from serve.process import STOP_BOUND_S
from tests.helpers.granian_server import ROOT, free_port

DRAIN_S = 20.0  # long: a case that ends quickly did not wait for the drain deadline
QUICK_S = 8.0  # a stop with nothing in flight: the parent's grace, the engine's stop, the exit


@dataclass
class Served:
    proc: subprocess.Popen[str]
    api: str
    health: str
    lines: list[str] = field(default_factory=list)

    def wait_line(self, pattern: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            if any(rx.search(ln) for ln in list(self.lines)):
                return
            assert self.proc.poll() is None, "the server exited:\n" + self.log()
            time.sleep(0.02)
        raise AssertionError(f"no log line like {pattern!r} within {timeout_s} s:\n{self.log()}")

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.health}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, "the server exited:\n" + self.log()
            time.sleep(0.05)
        raise AssertionError("not ready:\n" + self.log())

    def signal(self, sig: signal.Signals, group: bool) -> float:
        """Deliver sig to the main process or its whole group; the monotonic time it was sent."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            os.kill(self.proc.pid, sig)
        return time.monotonic()

    def exited_within(self, since: float, bound_s: float) -> tuple[int, float]:
        try:
            status = self.proc.wait(max(0.1, since + bound_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {bound_s} s after the signal:\n{self.log()}") from None
        return status, time.monotonic() - since

    def log(self) -> str:
        return "\n".join(self.lines[-60:])


@contextmanager
def tl_serve(
    model_dir: Path,
    tmp_path: Path,
    delays: str,
    extra: str = "",
    drain_s: float = DRAIN_S,
    app: str = "serve.app:app",
) -> Iterator[Served]:
    port, hport = free_port(), free_port()
    cfg = tmp_path / f"stop-{port}.toml"
    cfg.write_text(
        "[engine]\n"
        f'model_dir = "{model_dir}"\n'
        f'http_listen = "127.0.0.1:{port}"\nhealth_listen = "127.0.0.1:{hport}"\n'
        f"drain_timeout_s = {drain_s}\n"
        "block_size = 4\nnum_kv_blocks = 256\nmax_num_seqs = 4\nmax_num_batched_tokens = 32\n"
        "prefill_chunk = 32\ntoken_buckets = [1, 8, 32]\nseq_buckets = [1, 4]\n"
        'attention_kernel = "reference"\nmatmul_kernel = "xla"\nweight_pages = "default"\n'
        'model_id = "tiny"\n' + extra
    )
    env = {**os.environ, "TL_DEBUG_DELAYS": delays, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", f"from serve.launch import serve_main; serve_main({str(cfg)!r}, {app!r})"]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    served = Served(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{hport}")

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            served.lines.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield served
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()


CASES = [
    # (moment, delays, signal, group)
    ("model load", "load=30", signal.SIGTERM, False),
    ("model load", "load=30", signal.SIGINT, True),
    ("start-up compiles", "compile=30", signal.SIGTERM, True),
    ("start-up compiles", "compile=30", signal.SIGTERM, False),
    ("background compiles", "compile=4", signal.SIGTERM, False),
    ("background compiles", "compile=4", signal.SIGTERM, True),
    ("background compiles", "compile=4", signal.SIGINT, False),
]


@pytest.mark.parametrize(
    ("moment", "delays", "sig", "group"),
    CASES,
    ids=[f"{c[0]}-{c[2].name}-{'group' if c[3] else 'main'}" for c in CASES],
)
def test_a_stop_signal_stops_the_server_at_every_moment(
    tiny_dir: Path, tmp_path: Path, moment: str, delays: str, sig: signal.Signals, group: bool
) -> None:
    with tl_serve(tiny_dir, tmp_path, delays) as srv:
        if moment == "background compiles":
            srv.wait_ready(120)
            assert "all " not in " ".join(srv.lines), "the background compiles are already done"
        else:
            srv.wait_line(f"debug delay: {delays.split('=')[0]}", 120)
            # the API port before granian takes it: 503 model_loading (serve/loading.py), so a
            # router polling /health, or a client, hears "not yet" rather than a refused connection
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
            for method, path in (("GET", "/health"), ("GET", "/healthz"), ("POST", "/v1/chat/completions")):
                r = httpx.request(method, srv.api + path, json=chat if method == "POST" else None, timeout=5)
                assert r.status_code == 503 and r.headers["retry-after"] == "5", (path, r.text)
                assert r.json()["error"] == {
                    "message": "The model is loading",
                    "type": "server_error",
                    "param": None,
                    "code": "model_loading",
                }
        sent = srv.signal(sig, group)
        status, took = srv.exited_within(sent, QUICK_S)
        assert status == 0, srv.log()
        text = srv.log()
        # No "Killing worker" check: granian's main can log it spuriously when its watcher thread
        # reaps the worker first (a waitpid race); QUICK_S, far below the kill timeout
        # (drain_timeout_s + STOP_BOUND_S), already shows the worker stopped by itself.
        assert "Unexpected exit" not in text, text
        if moment == "background compiles":
            assert "draining: 0 requests in flight" in text, text


def test_a_stop_signal_between_the_start_up_and_the_serving_stops_the_server(tiny_dir: Path, tmp_path: Path) -> None:
    """granian runs its loop in stretches: the lifespan start-up, then (once its HTTP server is
    built) the serving. tests/helpers/gap_app.py signals its process group between the two. Under
    uvloop, granian's default loop, a signal taken by the loop's own handler there was lost
    (noted, but read only when a later signal woke the loop) and the server served on after
    /readyz turned 200 (why the "background compiles" cases above failed now and then): the
    stop must be heard, drain and exit 0."""
    with tl_serve(tiny_dir, tmp_path, "", app="tests.helpers.gap_app:app") as srv:
        srv.wait_line(r"serving \S+ \(context \d+\) ready", 60)
        status, took = srv.exited_within(time.monotonic(), QUICK_S)
        assert status == 0, srv.log()
        text = srv.log()
        assert "SIGTERM: stop requested" in text and "draining: 0 requests in flight" in text, text
        assert "Unexpected exit" not in text, text


def _stream(api: str, max_tokens: int, out: list[str]) -> threading.Thread:
    body = {"model": "tiny", "prompt": "ab", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}

    def run() -> None:
        try:
            with httpx.stream("POST", f"{api}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        out.append(line)
        except httpx.TransportError as e:
            out.append(f"transport error: {e}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("group", [False, True], ids=["main", "group"])
def test_a_second_signal_during_a_drain_stops_at_once(tiny_dir: Path, tmp_path: Path, group: bool) -> None:
    """Under load: one stream short enough to finish within the drain, one far too long. The
    first SIGTERM drains (readyz 503, the short stream completes); a second one, later than
    serve/signals.py's SAME_STOP_S, aborts the long stream (an error event, then [DONE]) and the
    process exits 0 long before drain_timeout_s."""
    with tl_serve(tiny_dir, tmp_path, "step=0.05") as srv:
        srv.wait_ready(120)
        short: list[str] = []
        long: list[str] = []
        t_long = _stream(srv.api, 480, long)
        while not long:
            time.sleep(0.01)
        t_short = _stream(srv.api, 8, short)
        while not short:
            time.sleep(0.01)
        first = srv.signal(signal.SIGTERM, group)
        srv.wait_line("draining: 2 requests in flight", 5)
        t_short.join(10)
        assert short[-1] == "data: [DONE]" and json.loads(short[-2][6:])["choices"][0]["finish_reason"] == "length"
        time.sleep(1.5)
        assert not long[-1].endswith("[DONE]"), "the long stream ended before the second signal"
        second = srv.signal(signal.SIGTERM, group)
        status, took = srv.exited_within(second, QUICK_S)
        t_long.join(10)
        assert status == 0, srv.log()
        assert time.monotonic() - first < DRAIN_S, "the second signal did not cut the drain short"
        assert long[-1] == "data: [DONE]", long[-3:]
        error = json.loads(long[-2][6:])
        assert error["error"]["code"] == "aborted", long[-3:]
        assert "stopping at once" in srv.log()


def test_a_drain_that_reaches_its_deadline_stops_within_the_bound(tiny_dir: Path, tmp_path: Path) -> None:
    """The drain-deadline path over real granian: a stream far too long to finish (480 tokens,
    every step slowed to 0.05 s: 24 s) is open at SIGTERM to the main process alone, with a 1 s
    drain_timeout_s. At the deadline it is aborted (an error event, then [DONE]) and the process
    exits 0 within drain_timeout_s + STOP_BOUND_S (the bound README's "Stopping" states), plus a
    little for this test's own polling."""
    drain_s = 1.0
    with tl_serve(tiny_dir, tmp_path, "step=0.05", drain_s=drain_s) as srv:
        srv.wait_ready(120)
        out: list[str] = []
        t = _stream(srv.api, 480, out)
        while not out:
            time.sleep(0.01)
        sent = srv.signal(signal.SIGTERM, False)
        status, took = srv.exited_within(sent, drain_s + STOP_BOUND_S + 1.0)
        t.join(10)
        assert status == 0, srv.log()
        assert took >= drain_s, f"exited after {took:.1f} s, before the drain deadline"
        text = srv.log()
        assert "draining: 1 requests in flight" in text and "drain deadline: aborting 1 requests" in text, text
        assert out[-1] == "data: [DONE]", out[-3:]
        assert json.loads(out[-2][6:])["error"]["code"] == "aborted", out[-3:]
        assert "Unexpected exit" not in text, text  # (no "Killing worker" check: see above)


def test_work_admitted_during_the_background_compiles_is_served(tiny_dir: Path, tmp_path: Path) -> None:
    """Embeddings (24 inputs, two at a time: their share of max_num_seqs) and a generation sent
    while the background compiles are pending (forced slow), every step so slow that the whole
    embeddings request outlasts the queue deadline: both answered, none refused (the 500
    "embeddings input N refused for lack of KV blocks" seen before). (A request that cannot
    start within the deadline for lack of sequences or blocks is a 503 no_capacity: not here.)"""
    with tl_serve(tiny_dir, tmp_path, "compile=3,step=0.03", "queue_deadline_ms = 200\n") as srv:
        srv.wait_ready(120)
        metrics = httpx.get(f"{srv.health}/metrics").text
        pending = next(
            float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("tl_engine_compile_pending ")
        )
        assert pending > 0
        streams: list[list[str]] = [[]]
        threads = [_stream(srv.api, 24, out) for out in streams]
        inputs = [[int(x) % 200 + 1 for x in range(i, i + 12)] for i in range(24)]
        r = httpx.post(f"{srv.api}/v1/embeddings", json={"model": "tiny", "input": inputs}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 24
        for t in threads:
            t.join(30)
        for out in streams:
            assert out[-1] == "data: [DONE]", out[-3:]
            assert json.loads(out[-2][6:])["choices"][0]["finish_reason"] == "length", out[-3:]
        assert " 500 " not in srv.log()


def test_debug_delays_refuse_what_they_cannot_read() -> None:
    from tl.core.debug_delays import parse

    assert parse("") == {} and parse("load=1, step=0.05") == {"load": 1.0, "step": 0.05}
    for bad in ("load=x", "loading=1", "compile", "step=-1"):
        with pytest.raises(ValueError, match="TL_DEBUG_DELAYS"):
            parse(bad)
