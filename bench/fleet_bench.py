"""`python -m bench fleet`: tl replicas behind the routers people run, routed by load and by prefix.

Owns: starting a router (vLLM's `vllm-router` or SGLang's gateway, `smg launch`) in front of
workers on loopback (`router`: tests/serve/test_routers.py starts them through it too), and the
multi-turn benchmark: --conversations conversations that share one system prompt grow turn by
turn (each turn sends the history plus a new user message, greedy, streamed; the answer joins
the history), all at once through the router, once per policy, the policies alternated over
--rounds rounds. Each round has its own system prompt and conversations, so no round reads what
another left in the replicas' prefix caches. Per policy: the share of prompt tokens the replicas
found cached (usage.prompt_tokens_details.cached_tokens), TTFT p50 and p90, the requests each
replica served, and the router's own Prometheus lines about its workers. The replicas are `tl
serve` processes of one config, each pinned to a core of its own where taskset exists (two
replicas on a 2-core machine: one core each; not pinned when there are fewer cores than
replicas). kv_aware (vllm-router's) has each replica publish its prefix cache's events
(kv_events_endpoint) and the router subscribe to them. Writes fleet.json under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.load import Endpoint, RequestResult, percentile, stream_request
from bench.soak import Server, free_port, serve

BIN = Path(sys.executable).parent
ROUTERS = {"vllm-router": ("vllm-router",), "smg": ("smg", "launch")}
POLICIES = ("round_robin", "cache_aware", "power_of_two", "kv_aware")  # kv_aware: vllm-router's only


@dataclass(frozen=True, slots=True)
class Router:
    url: str
    metrics_url: str


@contextmanager
def router(
    name: str, policy: str, workers: Sequence[str], log: Path, model: str, extra: Sequence[str] = ()
) -> Iterator[Router]:
    """The router in front of workers (their API URLs) on free loopback ports, health-checked every
    second, with extra flags of its own; yields once a completion of `model` through it answers 200;
    stopped at the end."""
    exe, *sub = ROUTERS[name]
    port, mport = free_port(), free_port()
    argv = [
        str(BIN / exe) if (BIN / exe).exists() else exe,
        *sub,
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport)),
        *("--worker-urls", *workers),
        *("--policy", policy, "--health-check-interval-secs", "1"),
        *extra,
    ]
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"model": model, "prompt": "a", "max_tokens": 1, "temperature": 0}).encode()
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}: {log.read_text()[-2000:]}")
                try:
                    req = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
                    with urllib.request.urlopen(req, timeout=10) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} routed no request in 60 s: {log.read_text()[-2000:]}")
                time.sleep(0.2)
            yield Router(url, f"http://127.0.0.1:{mport}/metrics")
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


WORDS = (
    "river stone garden lamp window market letter engine winter forest number yellow quiet answer "
    "travel bridge kitchen planet silver mountain ocean paper music orange signal doctor"
).split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Turn:
    result: RequestResult
    conversation: int
    turn: int


async def _conversation(
    client: aiohttp.ClientSession, ep: Endpoint, system: str, rng: random.Random, idx: int, turns: int, max_tokens: int
) -> list[Turn]:
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    out = []
    for t in range(turns):
        history.append({"role": "user", "content": f"Question {t + 1} of talk {idx}: {_text(rng, 40)}?"})
        body = {
            "model": ep.model,
            "messages": history,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        res = await stream_request(client, ep, body)
        out.append(Turn(res, idx, t))
        history.append({"role": "assistant", "content": res.text})
    return out


async def _round(url: str, model: str, seed: int, conversations: int, turns: int, max_tokens: int) -> list[Turn]:
    rng = random.Random(seed)
    system = f"You are assistant {seed}. " + _text(rng, 200)
    ep = Endpoint(url, model, api="chat")
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as client:
        talks = [
            _conversation(client, ep, system, random.Random(seed * 1000 + i), i, turns, max_tokens)
            for i in range(conversations)
        ]
        return [t for talk in await asyncio.gather(*talks) for t in talk]


def _served(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("tl_http_requests_total{") and 'endpoint="/v1/chat' in k)


def _router_lines(url: str) -> list[str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError) as e:
        return [f"# no metrics: {e}"]
    keep = ("worker", "policy", "cache", "load")
    return [ln for ln in text.splitlines() if ln and not ln.startswith("#") and any(k in ln for k in keep)]


def _summary(turns: Sequence[Turn]) -> dict[str, Any]:
    ok = [t.result for t in turns if t.result.ok]
    prompt = sum(r.usage_prompt_tokens or 0 for r in ok)
    cached = sum(r.usage_cached_tokens or 0 for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    later = [t.result.ttft_s for t in turns if t.turn > 0 and t.result.ok and t.result.ttft_s is not None]
    return {
        "requests": len(turns),
        "errors": [t.result.error for t in turns if not t.result.ok][:5],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3 if ttfts else None,
        "ttft_p90_ms": percentile(ttfts, 90) * 1e3 if ttfts else None,
        "ttft_p50_ms_after_turn_1": percentile(later, 50) * 1e3 if later else None,
    }


async def _main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = {"model_dir": args.model} if args.model else {}
    kv = "kv_aware" in args.policies.split(",")
    events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(args.replicas)] if kv else []
    cores = sorted(os.sched_getaffinity(0))
    pin = shutil.which("taskset") is not None and args.pin and len(cores) >= args.replicas
    async with AsyncExitStack() as stack:
        starts = [
            stack.enter_async_context(
                serve(
                    args.config,
                    overrides | ({"kv_events_endpoint": events[i]} if kv else {}),
                    log_dir=out,
                    prefix=("taskset", "-c", str(cores[i])) if pin else (),
                )
            )
            for i in range(args.replicas)
        ]
        replicas: list[Server] = list(await asyncio.gather(*starts))  # side by side: each on its own core
        model = replicas[0].model
        print(f"{args.replicas} replicas of {model} ready{' (one core each)' if pin else ''}", flush=True)
        results: dict[str, dict[str, Any]] = {}
        async with aiohttp.ClientSession() as client:
            for rnd in range(args.rounds):
                for name in args.routers.split(","):
                    for policy in args.policies.split(","):
                        if policy == "kv_aware" and name != "vllm-router":
                            continue  # SGLang's gateway has no kv_aware
                        key = f"{name}/{policy}"
                        before = [_served(await s.metrics(client)) for s in replicas]
                        log = out / f"{name}-{policy}-{rnd}.log"
                        extra = shlex.split(args.router_args) if policy == "cache_aware" else []
                        if policy == "kv_aware":
                            extra = [
                                a
                                for s, e in zip(replicas, events, strict=True)
                                for a in ("--kv-event-source", f"{s.api}={e}")
                            ]
                            extra += ["--kv-event-block-size", str(args.block_size), "--kv-event-model", model]
                        with router(name, policy, [s.api for s in replicas], log, model, extra) as r:
                            seed = 1 + len(results) + rnd * 100 + sum(map(ord, key))
                            t0 = time.perf_counter()
                            turns = await _round(r.url, model, seed, args.conversations, args.turns, args.max_tokens)
                            wall = time.perf_counter() - t0
                            lines = _router_lines(r.metrics_url)
                        after = [_served(await s.metrics(client)) for s in replicas]
                        summary = _summary(turns) | {
                            "wall_s": wall,
                            "per_replica": [a - b for a, b in zip(after, before, strict=True)],
                            "router_metrics": lines[:40],
                        }
                        results.setdefault(key, {"rounds": []})["rounds"].append(summary)
                        print(
                            f"round {rnd} {key}: cached {summary['cached_share']:.1%} of "
                            f"{summary['prompt_tokens']} prompt tokens, TTFT p50 "
                            f"{summary['ttft_p50_ms']:.0f} ms (after turn 1: "
                            f"{summary['ttft_p50_ms_after_turn_1']:.0f} ms), per replica {summary['per_replica']}, "
                            f"{wall:.1f} s, errors {len(summary['errors'])}",
                            flush=True,
                        )
    (out / "fleet.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"wrote {out / 'fleet.json'}")
    return 0


def run(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/runtime.toml", help="the replicas' runtime.toml")
    ap.add_argument("--model", default="", help="model_dir for the replicas (default: the config's)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--routers", default="vllm-router,smg", help=f"comma-separated: {', '.join(ROUTERS)}")
    ap.add_argument("--policies", default="round_robin,cache_aware", help=f"comma-separated: {', '.join(POLICIES)}")
    ap.add_argument("--block-size", type=int, default=16, help="the replicas' block_size (kv_aware's router needs it)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="each policy this many times, alternated")
    ap.add_argument(
        "--router-args",
        default="",
        help="flags for cache_aware's routers, e.g. '--balance-abs-threshold 2' (their defaults suit GPU batches)",
    )
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="leave the replicas on every core")
    ap.add_argument("--out", default="artifacts/bench/fleet")
    args = ap.parse_args(argv)
    for name in args.routers.split(","):
        if name not in ROUTERS:
            ap.error(f"--routers: unknown router {name!r}; choose from {', '.join(ROUTERS)}")
    for policy in args.policies.split(","):
        if policy not in POLICIES:
            ap.error(f"--policies: unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    return asyncio.run(_main(args))
