"""`python -m bench multihost`: one model served by a group of N processes on this machine, against
the same model on one process over N devices (the same sharded arithmetic, one controller).

Owns `start_group` (N `tl serve` processes on localhost, one CPU device each, process 0 serving
the API: also what tests/entry/test_multihost.py starts) and the measurement: per server, greedy
streams of `--tokens` tokens (ignore_eos) at each concurrency of `--streams`, output tok/s and
the time between tokens; the group's leader logs what its step channel cost per step. The ratio
group/single is the whole price of the group on one machine: the step channel and JAX's
cross-process collectives (gloo over loopback) in place of in-process ones.

Example: `python -m bench multihost --model-dir artifacts/models/smol-135m --processes 3`
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.soak import free_port

ROOT = Path(__file__).resolve().parent.parent


def _serve(config: Path, env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`tl serve --config config` in its own session, its output to log."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "serve", "--config", str(config)],
            cwd=ROOT,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@dataclass
class Group:
    """A running group: its processes (0 the leader), the API URL, each health URL, each log."""

    procs: list[subprocess.Popen[bytes]]
    http: str
    health: list[str]
    logs: list[Path]

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")[-4000:]


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def start_group(
    engine_toml: str, tmp: Path, n: int, env: Mapping[str, str] | None = None, timeout_s: float = 300
) -> Iterator[Group]:
    """n processes on localhost (one CPU device each) serving one job from the `[engine]` lines
    engine_toml (tensor_parallel, num_processes, coordinator and step port added here): process 0
    through `tl serve`'s granian, the others as followers. Yields once every health port is
    ready; kills them all at the end."""
    http, coordinator, steps = free_port(), free_port(), free_port()
    health = [free_port() for _ in range(n)]
    config = tmp / "group.toml"
    config.write_text(
        f"[engine]\ntensor_parallel = {n}\nnum_processes = {n}\n"
        f'coordinator_address = "127.0.0.1:{coordinator}"\nstep_port = {steps}\n' + engine_toml
    )
    procs, logs = [], []
    for i in range(n):
        penv = {
            **os.environ,
            **(env or {}),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            "JAX_PLATFORMS": "cpu",
            "TL_ENGINE__PROCESS_ID": str(i),
            "TL_ENGINE__HTTP_LISTEN": f"127.0.0.1:{http}",
            "TL_ENGINE__HEALTH_LISTEN": f"127.0.0.1:{health[i]}",
        }
        logs.append(tmp / f"process-{i}.log")
        procs.append(_serve(config, penv, logs[-1]))
    g = Group(procs, f"http://127.0.0.1:{http}", [f"http://127.0.0.1:{p}" for p in health], logs)
    try:
        deadline = time.monotonic() + timeout_s
        for i, url in enumerate(g.health):
            while not _ready(url):
                if procs[i].poll() is not None:
                    raise RuntimeError(f"process {i} exited ({procs[i].returncode}):\n{g.log(i)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"process {i} not ready in {timeout_s:.0f} s:\n{g.log(i)}")
                time.sleep(0.1)
        yield g
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@contextmanager
def start_single(engine_toml: str, tmp: Path, n: int, timeout_s: float = 300) -> Iterator[tuple[str, str]]:
    """The same engine on one process over n CPU devices; yields its API and health URLs."""
    http, health = free_port(), free_port()
    config = tmp / "single.toml"
    config.write_text(f"[engine]\ntensor_parallel = {n}\n" + engine_toml)
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
        "JAX_PLATFORMS": "cpu",
        "TL_ENGINE__HTTP_LISTEN": f"127.0.0.1:{http}",
        "TL_ENGINE__HEALTH_LISTEN": f"127.0.0.1:{health}",
    }
    proc = _serve(config, env, tmp / "single.log")
    try:
        deadline = time.monotonic() + timeout_s
        while not _ready(f"http://127.0.0.1:{health}"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((tmp / "single.log").read_text(errors="replace")[-3000:])
            time.sleep(0.1)
        yield f"http://127.0.0.1:{http}", f"http://127.0.0.1:{health}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _stream(url: str, prompt: str, tokens: int) -> list[float]:
    """One greedy stream of exactly `tokens` tokens; the arrival time of each."""
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    with httpx.Client(timeout=300) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times


def wait_compiled(health: str, settle_s: float = 10.0) -> None:
    """Until the server's background compilation is over (tl_engine_compile_pending 0), then
    settle_s more (a group's followers compile the same variants at about the same pace)."""
    while True:
        text = httpx.get(health + "/metrics", timeout=5).text
        if any(ln.startswith("tl_engine_compile_pending ") and float(ln.split()[1]) == 0 for ln in text.splitlines()):
            break
        time.sleep(1)
    time.sleep(settle_s)


def measure(url: str, health: str, streams: Sequence[int], tokens: int) -> list[dict[str, float]]:
    wait_compiled(health)
    _stream(url, "warm up", 8)
    rows = []
    for n in streams:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            runs = list(pool.map(lambda i: _stream(url, f"Request {i}: once upon a time", tokens), range(n)))
        took = time.perf_counter() - t0
        gaps = [b - a for ts in runs for a, b in zip(ts, ts[1:], strict=False)]
        rows.append(
            {
                "streams": n,
                "tok_s": sum(len(ts) for ts in runs) / took,
                "itl_p50_ms": 1e3 * statistics.median(gaps),
            }
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench multihost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="artifacts/models/smol-135m")
    ap.add_argument("--processes", type=int, default=3, help="processes in the group = tensor_parallel")
    ap.add_argument("--streams", default="1,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="")
    return ap


def run(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out or f"bench/out/multihost-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    streams = [int(x) for x in args.streams.split(",")]
    engine = (
        f'model_dir = "{Path(args.model_dir).resolve()}"\nmodel_id = "m"\nmax_num_seqs = {max(streams)}\n'
        'matmul_precision = "highest"\nattention_kernel = "reference"\n'
        f"token_buckets = [{max(streams)}, 64]\nseq_buckets = [1, {max(streams)}]\n"
        "max_num_batched_tokens = 64\nprefill_chunk = 64\nnum_kv_blocks = 256\n"
        f'compile_cache_dir = "{(out / "jax-cache").resolve()}"\n'
    )
    config = {"bench": "multihost", "model_dir": args.model_dir, "processes": args.processes,
              "streams": streams, "tokens": args.tokens}  # fmt: skip
    print("config:", json.dumps(config), flush=True)
    results: dict[str, list[dict[str, float]]] = {}
    with start_single(engine, out, args.processes) as (url, health):
        results["single"] = measure(url, health, streams, args.tokens)
    with start_group(engine, out, args.processes) as g:
        results["group"] = measure(g.http, g.health[0], streams, args.tokens)
        g.procs[0].send_signal(signal.SIGTERM)  # the drain logs the channel's cost per step
        g.procs[0].wait(60)
        channel = next((ln for ln in g.log(0).splitlines() if "steps sent" in ln), "")
    lines = ["| streams | single tok/s | group tok/s | group/single | single ITL p50 ms | group ITL p50 ms |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for s, g_ in zip(results["single"], results["group"], strict=True):
        lines.append(
            f"| {s['streams']:.0f} | {s['tok_s']:.1f} | {g_['tok_s']:.1f} | {g_['tok_s'] / s['tok_s']:.3f} | "
            f"{s['itl_p50_ms']:.1f} | {g_['itl_p50_ms']:.1f} |"
        )
    lines.append("")
    lines.append(channel.split("tl.entry.multihost: ", 1)[-1])
    md = "\n".join(lines)
    (out / "report.md").write_text(md + "\n")
    (out / "results.json").write_text(json.dumps({"config": config, **results, "channel": channel}))
    print(md)
    return 0
