"""`python -m bench soak`: the soak and fault suite, against servers it starts on loopback.

Owns: starting a tl server (granian over serve.app:app, TL_CONFIG plus TL_ENGINE__* overrides,
free 127.0.0.1 ports) and stopping it, and four scenarios, each a list of named checks:
- mixed: minutes of mixed load (streams and non-streams of mixed lengths, n > 1, embeddings,
  cancellations at random points, a few bad requests), sampling the server's RSS, queue depth,
  KV blocks, compile count and every stream's inter-token gaps: zero 5xx, no block used once
  idle, RSS flat within 5% after warm-up, no compile after warm-up, and a plot of them; a run
  with whole minutes after minute 5 (over 7 minutes) also checks the memory criterion: from
  minute 5's median on, RSS grows less than 1% per 10 minutes (`rss_growth_pct_per_10min`);
- storm: 100 streams cut at random points: every block free within a second, the next request
  served;
- sigterm: SIGTERM under 64 streams: every admitted stream reaches [DONE], new requests get
  503, the process exits 0;
- kv: a KV cache a tenth of the demand: every request completes, and greedy outputs equal the
  same requests' outputs run one at a time.
Imports no tl (it drives a server over HTTP only). tests/bench/test_soak.py runs a short version of
each on the tiny model; the closing figures come from `python -m bench soak --minutes 30`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.load import SSEParser, percentile

ROOT = Path(__file__).resolve().parent.parent
USED = 'tl_engine_kv_blocks{state="used"}'


def free_port() -> int:
    """A loopback port free now, drawn below the kernel's ephemeral range: a port that bind(0)
    hands out is an ephemeral one, which any client socket may take as its source port before
    the server that was given it binds (a test group's JAX coordinator once failed to start so)."""
    lo = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range full: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a guess as good as any


@dataclass
class Server:
    """One tl server process on loopback ports."""

    proc: subprocess.Popen[bytes]
    api: str
    health: str
    model: str = ""
    log_path: Path | None = None

    async def metrics(self, client: aiohttp.ClientSession) -> dict[str, float]:
        async with client.get(f"{self.health}/metrics") as r:
            text = await r.text()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def rss_bytes(self) -> int:
        """The server's resident set: granian's worker is the process's child, so both are summed."""
        total = 0
        for pid in _tree(self.proc.pid):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total


def _tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*") if Path(f"/proc/{p}/task").exists() else []:
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


@asynccontextmanager
async def serve(
    config: str,
    overrides: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 900.0,
    log_dir: Path | None = None,
    prefix: Sequence[str] = (),
) -> AsyncIterator[Server]:
    """Start `tl serve --config config` (granian over serve.app:app) with `TL_ENGINE__<KEY>` overrides
    (keys lower-case as in runtime.toml); wait until /readyz answers 200 and every step variant
    is compiled (tl_engine_compile_pending 0); kill it at the end. prefix: a command the server runs
    under (`taskset -c 0`)."""
    port, hport = free_port(), free_port()
    full = {
        **os.environ,
        **(env or {}),
        "TL_CONFIG": config,
        "TL_ENGINE__HTTP_LISTEN": f"127.0.0.1:{port}",
        "TL_ENGINE__HEALTH_LISTEN": f"127.0.0.1:{hport}",
    }
    for k, v in (overrides or {}).items():
        full[f"TL_ENGINE__{k.upper()}"] = v
    argv = [*prefix, sys.executable, "-m", "serve", "--config", config]  # `tl serve`: granian, as users get it
    log_path = (log_dir or Path("/tmp")) / f"tl-soak-{port}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, cwd=ROOT, env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    srv = Server(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{hport}", log_path=log_path)
    try:
        async with aiohttp.ClientSession() as client:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited {proc.returncode} before ready; log: {log_path}")
                try:
                    async with client.get(f"{srv.health}/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready in {ready_timeout_s} s; log: {log_path}")
                await asyncio.sleep(0.1)
            # Ready serves in the start-up variants; measure once the background compilation is done.
            while time.monotonic() < deadline:
                async with client.get(f"{srv.health}/metrics") as r:
                    text = await r.text()
                if any(line.startswith("tl_engine_compile_pending 0") for line in text.splitlines()):
                    break
                await asyncio.sleep(0.5)
            async with client.get(f"{srv.api}/v1/models") as r:
                srv.model = (await r.json())["data"][0]["id"]
        yield srv
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        log.close()


@dataclass
class Outcome:
    kind: str
    status: int  # HTTP status; 0: the client cut it (a cancellation) or the connection failed
    t_start: float
    chunk_times: list[float] = field(default_factory=list)
    done: bool = False  # a stream that reached [DONE]
    error_event: bool = False  # a stream that carried an error event
    text: str = ""
    error: str = ""

    @property
    def gaps(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


async def stream(
    client: aiohttp.ClientSession,
    srv: Server,
    prompt: str,
    max_tokens: int,
    cut_after: int | None = None,
    kind: str = "stream",
) -> Outcome:
    """A streamed greedy chat completion; cut_after: close the connection after that many chunks."""
    out = Outcome(kind, 0, time.monotonic())
    body = {
        "model": srv.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        async with client.post(f"{srv.api}/v1/chat/completions", json=body) as r:
            out.status = r.status
            if r.status != 200:
                out.error = (await r.read())[:300].decode("utf-8", "replace")
                return out
            parser, buf = SSEParser(), b""
            async for chunk in r.content.iter_any():
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    data = parser.feed(line.decode("utf-8", "replace"))
                    if data is None:
                        continue
                    if data.strip() == "[DONE]":
                        out.done = True
                        return out
                    doc = json.loads(data)
                    if "error" in doc:
                        out.error_event = True
                        continue
                    for ch in doc.get("choices") or []:
                        piece = (ch.get("delta") or {}).get("content") or ""
                        if piece:
                            out.chunk_times.append(time.monotonic())
                            out.text += piece
                if cut_after is not None and len(out.chunk_times) >= cut_after:
                    out.status = 0  # we left
                    return out
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def post(client: aiohttp.ClientSession, srv: Server, path: str, body: dict[str, Any], kind: str) -> Outcome:
    out = Outcome(kind, 0, time.monotonic())
    try:
        async with client.post(f"{srv.api}{path}", json=body) as r:
            out.status = r.status
            raw = await r.read()
            if r.status == 200 and path.endswith("completions"):
                doc = json.loads(raw)
                out.text = "\x00".join(
                    c.get("text") or (c.get("message") or {}).get("content") or "" for c in doc["choices"]
                )
            elif r.status != 200:
                out.error = raw[:300].decode("utf-8", "replace")
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        rng.choice(("tea", "river", "stone", "cloud", "seven", "blue", "lamp", "north", "paper")) for _ in range(n)
    )


PROMPT_WORDS = (3, 20, 80, 200)


async def one_mixed(
    client: aiohttp.ClientSession,
    srv: Server,
    rng: random.Random,
    max_out: int,
    prompt_words: Sequence[int] = PROMPT_WORDS,
) -> Outcome:
    """One request of a random kind, as a mixed production load would send."""
    roll = rng.random()
    prompt = _words(rng, rng.choice(prompt_words))
    if roll < 0.40:
        return await stream(client, srv, prompt, rng.randint(1, max_out))
    if roll < 0.55:
        return await stream(client, srv, prompt, max_out, cut_after=rng.randint(1, max(1, max_out // 2)), kind="cancel")
    if roll < 0.75:
        return await post(
            client,
            srv,
            "/v1/completions",
            {
                "model": srv.model,
                "prompt": prompt,
                "max_tokens": rng.randint(1, max_out),
                "n": rng.choice((1, 2, 3)),
                "temperature": 0.7,
                "seed": rng.randint(0, 99),
            },
            "n",
        )
    if roll < 0.95:
        inputs = [_words(rng, rng.randint(1, max(prompt_words))) for _ in range(rng.choice((1, 4, 16, 64)))]
        return await post(client, srv, "/v1/embeddings", {"model": srv.model, "input": inputs}, "embed")
    bad = rng.choice(
        (
            {"model": srv.model, "messages": [{"role": "user", "content": "x"}], "temperature": 9},
            {"model": srv.model, "messages": "not a list"},
            {"model": srv.model, "input": []},
        )
    )
    path = "/v1/embeddings" if "input" in bad else "/v1/chat/completions"
    return await post(client, srv, path, bad, "bad")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    scenario: str
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, bool(ok), detail))

    @property
    def ok(self) -> bool:
        """Every check passed, and there was at least one: a scenario that checked nothing fails."""
        return bool(self.checks) and all(c.ok for c in self.checks)


async def _idle(client: aiohttp.ClientSession, srv: Server, timeout_s: float) -> tuple[float, dict[str, float]]:
    """Seconds until no KV block is used, no sequence runs and nothing waits (or the timeout)."""
    t0 = time.monotonic()
    while True:
        m = await srv.metrics(client)
        if (
            m.get(USED, 1) == 0
            and m.get("tl_engine_active_sequences", 1) == 0
            and m.get("tl_engine_queue_depth", 1) == 0
        ):
            return time.monotonic() - t0, m
        if time.monotonic() - t0 > timeout_s:
            return time.monotonic() - t0, m
        await asyncio.sleep(0.02)


async def mixed(
    srv: Server,
    seconds: float,
    concurrency: int = 16,
    max_out: int = 64,
    seed: int = 0,
    warmup_frac: float = 0.2,
    out_dir: Path | None = None,
    prompt_words: Sequence[int] = PROMPT_WORDS,
) -> Report:
    rep = Report("mixed")
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    samples: list[dict[str, float]] = []
    t0 = time.monotonic()
    stop = t0 + seconds
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as client:

        async def worker(i: int) -> None:
            wrng = random.Random(rng.random())
            while time.monotonic() < stop:
                outcomes.append(await one_mixed(client, srv, wrng, max_out, prompt_words))

        async def sampler() -> None:
            while time.monotonic() < stop:
                m = await srv.metrics(client)
                samples.append(
                    {
                        "t": time.monotonic() - t0,
                        "rss": srv.rss_bytes(),
                        "queue": m.get("tl_engine_queue_depth", 0),
                        "blocks": m.get(USED, 0),
                        "compilations": m.get("tl_engine_compilations", 0),
                        "running": m.get("tl_engine_active_sequences", 0),
                    }
                )
                await asyncio.sleep(max(0.2, seconds / 600))

        await asyncio.gather(sampler(), *(worker(i) for i in range(concurrency)))
        idle_s, m = await _idle(client, srv, 10.0)
    by_kind: dict[str, int] = {}
    for o in outcomes:
        by_kind[o.kind] = by_kind.get(o.kind, 0) + 1
    five = [o for o in outcomes if o.status >= 500]
    rep.check("zero 5xx", not five, f"{len(five)} of {len(outcomes)} ({[o.error[:120] for o in five[:3]]})")
    unexpected = [o for o in outcomes if o.kind != "bad" and o.kind != "cancel" and o.status not in (200,)]
    rep.check(
        "every good request 200",
        not unexpected,
        f"{len(unexpected)} others: {[(o.kind, o.status, o.error[:80]) for o in unexpected[:3]]}",
    )
    bad_ok = all(o.status == 400 or o.status == 422 for o in outcomes if o.kind == "bad")
    rep.check("bad requests 400/422", bad_ok, str(sorted({o.status for o in outcomes if o.kind == "bad"})))
    streams = [o for o in outcomes if o.kind == "stream"]
    rep.check("streams reach [DONE]", all(o.done and not o.error_event for o in streams), f"{len(streams)} streams")
    rep.check("no KV block used once idle", m.get(USED, 1) == 0, f"used {m.get(USED)} after {idle_s:.2f} s idle wait")
    warm = [s for s in samples if s["t"] >= seconds * warmup_frac]
    if warm:
        base = warm[0]["rss"]
        peak = max(s["rss"] for s in warm)
        end = warm[-1]["rss"]
        rep.check(
            "RSS flat within 5% after warm-up",
            peak <= base * 1.05,
            f"after warm-up {base / 2**20:.0f} MiB, peak {peak / 2**20:.0f}, end {end / 2**20:.0f}",
        )
        comp = {s["compilations"] for s in warm}
        rep.check("no compile after warm-up", len(comp) == 1, f"compile counts seen {sorted(comp)}")
    per_minute = _per_minute(samples)
    growth = rss_growth_per_10min(per_minute)
    if growth is not None:
        rep.check(
            f"RSS grows < {MAX_RSS_GROWTH_PCT_PER_10MIN}% per 10 min after minute {RSS_SETTLED_MINUTE}",
            growth < MAX_RSS_GROWTH_PCT_PER_10MIN,
            f"{growth:+.2f}% per 10 min: {per_minute[RSS_SETTLED_MINUTE]} MiB at minute {RSS_SETTLED_MINUTE},"
            f" {per_minute[-1]} MiB at minute {len(per_minute) - 1} (per-minute medians)",
        )
    gaps = [g for o in streams for g in o.gaps]
    rep.figures = {
        "seconds": seconds,
        "requests": len(outcomes),
        "by_kind": by_kind,
        "itl_p50_ms": percentile(gaps, 50) * 1e3,
        "itl_p99_ms": percentile(gaps, 99) * 1e3,
        "itl_max_ms": max(gaps, default=0.0) * 1e3,
        "samples": len(samples),
        "rss_mib_first_last": [samples[0]["rss"] / 2**20, samples[-1]["rss"] / 2**20] if samples else [],
        "rss_mib_per_minute": per_minute,
        "rss_growth_pct_per_10min": None if growth is None else round(growth, 3),
    }
    if out_dir is not None and samples:
        rep.figures["plot"] = str(_plot(samples, streams, t0, out_dir / "soak-mixed.png"))
    return rep


RSS_SETTLED_MINUTE = 5
"""The memory criterion counts RSS growth from this minute's median on (warm-up before it)."""
MAX_RSS_GROWTH_PCT_PER_10MIN = 1.0
"""The memory criterion: RSS grows less than this, in % per 10 minutes, after RSS_SETTLED_MINUTE."""


def rss_growth_per_10min(per_minute: Sequence[float], since: int = RSS_SETTLED_MINUTE) -> float | None:
    """RSS growth in % per 10 minutes from minute `since`'s median to the last whole minute's
    (per_minute: `_per_minute`'s medians, index = minute); None without a minute after `since`."""
    if len(per_minute) < since + 2 or per_minute[since] <= 0:
        return None
    minutes = len(per_minute) - 1 - since
    return (per_minute[-1] / per_minute[since] - 1.0) * 100.0 * 10.0 / minutes


def _per_minute(samples: Sequence[dict[str, float]]) -> list[float]:
    """The median RSS (MiB) of each whole minute's samples: the curve without the spikes of a
    large step's transient buffers."""
    out = []
    for m in range(int(max((s["t"] for s in samples), default=0) // 60)):
        rss = sorted(s["rss"] for s in samples if m * 60 <= s["t"] < (m + 1) * 60)
        if rss:
            out.append(round(rss[len(rss) // 2] / 2**20, 1))
    return out


def _plot(samples: Sequence[dict[str, float]], streams: Sequence[Outcome], t0: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    t = [s["t"] for s in samples]
    axes[0].plot(t, [s["rss"] / 2**20 for s in samples])
    axes[0].set_ylabel("RSS MiB")
    axes[1].plot(t, [s["queue"] for s in samples], label="queue")
    axes[1].plot(t, [s["running"] for s in samples], label="running")
    axes[1].legend()
    axes[1].set_ylabel("requests")
    axes[2].plot(t, [s["blocks"] for s in samples])
    axes[2].set_ylabel("KV blocks used")
    pts = [(b - t0, (b - a) * 1e3) for o in streams for a, b in zip(o.chunk_times, o.chunk_times[1:], strict=False)]
    axes[3].scatter([p[0] for p in pts], [p[1] for p in pts], s=2)
    axes[3].set_ylabel("ITL ms")
    axes[3].set_xlabel("seconds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


async def storm(srv: Server, streams: int = 100, max_out: int = 200, seed: int = 1) -> Report:
    rep = Report("storm")
    rng = random.Random(seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        cuts = await asyncio.gather(
            *(
                stream(client, srv, _words(rng, rng.randint(2, 60)), max_out, cut_after=rng.randint(1, 30), kind="cut")
                for _ in range(streams)
            )
        )
        idle_s, m = await _idle(client, srv, 5.0)
        after = await stream(client, srv, "hello", 8)
    served = sum(1 for o in cuts if o.chunk_times)
    rep.check(
        "all blocks free within 1 s",
        idle_s <= 1.0 and m.get(USED, 1) == 0,
        f"{idle_s:.3f} s after the last cut; used {m.get(USED)}",
    )
    rep.check(
        "next request served",
        after.status == 200 and after.done and len(after.chunk_times) > 0,
        f"status {after.status}, {len(after.chunk_times)} chunks",
    )
    rep.figures = {"streams": streams, "got_tokens_before_cut": served, "idle_after_s": idle_s}
    return rep


async def sigterm(srv: Server, streams: int = 64, max_out: int = 64, seed: int = 2) -> Report:
    rep = Report("sigterm")
    rng = random.Random(seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        tasks = [
            asyncio.create_task(stream(client, srv, _words(rng, rng.randint(2, 40)), max_out)) for _ in range(streams)
        ]
        for _ in range(600):  # every stream admitted and producing
            m = await srv.metrics(client)
            if m.get("tl_engine_active_sequences", 0) + m.get("tl_engine_queue_depth", 0) >= streams:
                break
            await asyncio.sleep(0.05)
        os.killpg(srv.proc.pid, signal.SIGTERM)
        await asyncio.sleep(0.2)
        late = await post(
            client,
            srv,
            "/v1/chat/completions",
            {"model": srv.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            "late",
        )
        outs = await asyncio.gather(*tasks)
    code = await asyncio.get_running_loop().run_in_executor(None, srv.proc.wait, 60)
    admitted = [o for o in outs if o.status == 200]
    rep.check(
        "every admitted stream reaches [DONE]",
        all(o.done and not o.error_event for o in admitted),
        f"{sum(o.done for o in admitted)} of {len(admitted)} admitted ({len(outs)} sent)",
    )
    rep.check("every stream was admitted", len(admitted) == len(outs), f"statuses {sorted({o.status for o in outs})}")
    rep.check(
        "new requests get 503",
        late.status == 503 or late.status == 0 and "Connect" in late.error,
        f"status {late.status} {late.error[:80]}",
    )
    rep.check("exit 0", code == 0, f"exit code {code}")
    rep.figures = {"streams": streams, "tokens": sum(len(o.chunk_times) for o in admitted)}
    return rep


async def kv_exhaustion(srv: Server, requests: int = 24, max_out: int = 48, seed: int = 3) -> Report:
    """Run on a server whose KV cache is about a tenth of the requests' total demand."""
    rep = Report("kv")
    rng = random.Random(seed)
    prompts = [_words(rng, rng.randint(10, 40)) for _ in range(requests)]
    body = [
        {"model": srv.model, "prompt": p, "max_tokens": max_out, "temperature": 0, "ignore_eos": True} for p in prompts
    ]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        alone = [await post(client, srv, "/v1/completions", b, "alone") for b in body]
        before = await srv.metrics(client)
        crowd = await asyncio.gather(*(post(client, srv, "/v1/completions", b, "crowd") for b in body))
        idle_s, m = await _idle(client, srv, 5.0)
    rep.check(
        "every request completes",
        all(o.status == 200 for o in alone + crowd),
        f"statuses {sorted({o.status for o in alone + crowd})}",
    )
    same = sum(a.text == c.text for a, c in zip(alone, crowd, strict=False))
    rep.check("greedy outputs equal the uncontended ones", same == requests, f"{same} of {requests} equal")
    pre = m.get("tl_engine_preemptions_total", 0) - before.get("tl_engine_preemptions_total", 0)
    rep.check("the cache was contended (preemptions happened)", pre > 0, f"{pre:.0f} preemptions")
    rep.check("no KV block used once idle", m.get(USED, 1) == 0, f"{idle_s:.2f} s")
    rep.figures = {"requests": requests, "preemptions": pre}
    return rep


def _print(rep: Report) -> None:
    print(f"## {rep.scenario}: {'PASS' if rep.ok else 'FAIL'}")
    for c in rep.checks:
        print(f"- [{'x' if c.ok else ' '}] {c.name}: {c.detail}")
    print("figures:", json.dumps(rep.figures))


async def _main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.scenarios.split(",")
    reports: list[Report] = []
    base = {"num_kv_blocks": str(args.num_kv_blocks)} if args.num_kv_blocks else {}
    if "mixed" in names or "storm" in names:
        async with serve(args.config, base, log_dir=out) as srv:
            if "mixed" in names:
                reports.append(await mixed(srv, args.minutes * 60, args.concurrency, seed=args.seed, out_dir=out))
                _print(reports[-1])
            if "storm" in names:
                reports.append(await storm(srv))
                _print(reports[-1])
    if "sigterm" in names:
        async with serve(args.config, base, log_dir=out) as srv:
            reports.append(await sigterm(srv, max_out=32))
            _print(reports[-1])
    if "kv" in names:
        # 24 requests x (~15-60 prompt + 48 output tokens) ~ 135 blocks of 16 with SmolLM2: 14 a tenth.
        async with serve(args.config, {**base, "num_kv_blocks": str(args.kv_blocks)}, log_dir=out) as srv:
            reports.append(await kv_exhaustion(srv))
            _print(reports[-1])
    (out / "soak.json").write_text(
        json.dumps(
            [
                {"scenario": r.scenario, "ok": r.ok, "figures": r.figures, "checks": [c.__dict__ for c in r.checks]}
                for r in reports
            ],
            indent=1,
        )
    )
    print(f"wrote {out / 'soak.json'}")
    return 0 if all(r.ok for r in reports) else 1


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench soak")
    ap.add_argument("--config", default="configs/runtime.toml", help="runtime.toml the servers start from")
    ap.add_argument("--scenarios", default="mixed,storm,sigterm,kv")
    ap.add_argument("--minutes", type=float, default=30.0, help="length of the mixed load")
    ap.add_argument("--concurrency", type=int, default=16, help="clients of the mixed load")
    ap.add_argument("--num-kv-blocks", type=int, default=0, help="override the config's cache size (0: keep)")
    ap.add_argument("--kv-blocks", type=int, default=14, help="the kv scenario's cache (about a tenth of demand)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=f"bench/out/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    return asyncio.run(_main(args))
