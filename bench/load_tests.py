"""The HTTP load tests: which requests to send, how (closed loop or Poisson), and their bounds.

Owns: the test catalogue (prefill, decode, sweep, shared, poisson) as lists of `Case`s; a
closed-loop driver (C workers pulling from a job list) and an open-loop Poisson driver
(seeded exponential gaps), both stopped at a request count and a deadline; and running a
case against one or two endpoints interleaved (A, B, A, B) so a noisy machine hurts both
sides alike. Formatting lives in bench/http_bench.py. Imports no tl and no jax.
Tested by tests/bench/test_bench_harness.py against a fake streaming server.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.load import Endpoint, RequestResult, request_body, stream_request
from bench.load_prompts import PromptFactory

CUT = "cut at deadline"


@dataclass(frozen=True, slots=True)
class Job:
    prompt: str
    max_tokens: int
    system: str | None = None


WARMUP = Job("The first request after a start pays for what the server prepares lazily:", 8)


@dataclass(frozen=True, slots=True)
class Limits:
    max_requests: int = 256  # per run (one case against one server, one repeat)
    max_seconds: float = 120.0  # per run; in-flight requests are cut at this deadline


@dataclass(frozen=True, slots=True)
class Case:
    """One measured configuration; `make_jobs` is called once per run so nonces never repeat."""

    test: str
    label: str
    make_jobs: Callable[[], list[Job]]
    concurrency: int = 1  # closed loop; ignored when rate is set
    rate: float | None = None  # requests/s, open-loop Poisson
    prompt_tokens: int = 0  # per request as sized (user part + system part)


@dataclass(slots=True)
class Run:
    """A case's results on one server, merged over repeats."""

    case: Case
    server: str
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    in_flight_s: float = 0.0  # sum over requests of their latency: mean in-flight = this / wall


@dataclass(frozen=True, slots=True)
class Sizes:
    prefill_tokens: int = 512
    decode_tokens: int = 256
    decode_prompt_tokens: int = 32
    sweep_prompt_tokens: int = 128
    sweep_output_tokens: int = 128
    sweep_levels: tuple[int, ...] = (1, 4, 16, 64)
    shared_prefix_tokens: int = 768
    shared_suffix_tokens: int = 32
    shared_output_tokens: int = 32
    shared_concurrency: int = 4
    prefill_requests: int = 5
    decode_requests: int = 2
    shared_requests: int = 16
    poisson_requests: int = 32


def build_cases(tests: Sequence[str], pf: PromptFactory, sz: Sizes, rate: float, limits: Limits) -> list[Case]:
    cases: list[Case] = []
    cap = limits.max_requests

    def unique(n: int, p: int, o: int) -> Callable[[], list[Job]]:
        return lambda: [Job(pf.unique(p), o) for _ in range(min(n, cap))]

    for t in tests:
        if t == "prefill":
            cases.append(
                Case(
                    "prefill",
                    f"prefill {sz.prefill_tokens}",
                    unique(sz.prefill_requests, sz.prefill_tokens, 1),
                    1,
                    None,
                    sz.prefill_tokens,
                )
            )
        elif t == "decode":
            cases.append(
                Case(
                    "decode",
                    f"decode {sz.decode_tokens}",
                    unique(sz.decode_requests, sz.decode_prompt_tokens, sz.decode_tokens),
                    1,
                    None,
                    sz.decode_prompt_tokens,
                )
            )
        elif t == "sweep":
            for c in sz.sweep_levels:
                cases.append(
                    Case(
                        "sweep",
                        f"sweep c={c}",
                        unique(max(4, 2 * c), sz.sweep_prompt_tokens, sz.sweep_output_tokens),
                        c,
                        None,
                        sz.sweep_prompt_tokens,
                    )
                )
        elif t == "shared":
            cases += _shared_cases(pf, sz, cap)
        elif t == "poisson":
            cases.append(
                Case(
                    "poisson",
                    f"poisson {rate:g} req/s",
                    unique(sz.poisson_requests, sz.sweep_prompt_tokens, sz.sweep_output_tokens),
                    0,
                    rate,
                    sz.sweep_prompt_tokens,
                )
            )
        else:
            raise ValueError(f"unknown test {t!r}; choose from prefill,decode,sweep,shared,poisson")
    return cases


def _shared_cases(pf: PromptFactory, sz: Sizes, cap: int) -> list[Case]:
    """Same sizes twice: one common system prompt (prefix-cache hits) vs every prefix unique."""
    n, total = min(sz.shared_requests, cap), sz.shared_prefix_tokens + sz.shared_suffix_tokens

    def shared_jobs() -> list[Job]:
        system = pf.shared(sz.shared_prefix_tokens)
        return [Job(pf.unique(sz.shared_suffix_tokens, "q"), sz.shared_output_tokens, system) for _ in range(n)]

    def unique_jobs() -> list[Job]:
        return [
            Job(pf.unique(sz.shared_suffix_tokens, "q"), sz.shared_output_tokens, pf.shared(sz.shared_prefix_tokens))
            for _ in range(n)
        ]

    c = sz.shared_concurrency
    return [
        Case(
            "shared", f"shared prefix {sz.shared_prefix_tokens}+{sz.shared_suffix_tokens}", shared_jobs, c, None, total
        ),
        Case(
            "shared", f"unique prefix {sz.shared_prefix_tokens}+{sz.shared_suffix_tokens}", unique_jobs, c, None, total
        ),
    ]


async def _one(client: aiohttp.ClientSession, ep: Endpoint, job: Job, out: list[RequestResult]) -> None:
    res = RequestResult(t_start=time.perf_counter())
    out.append(res)
    try:
        await stream_request(client, ep, request_body(ep, job.prompt, job.max_tokens, job.system), res)
    except asyncio.CancelledError:
        res.error, res.t_end = CUT, time.perf_counter()
        raise


async def run_closed(
    client: aiohttp.ClientSession, ep: Endpoint, jobs: list[Job], concurrency: int, max_seconds: float
) -> tuple[list[RequestResult], float]:
    """`concurrency` workers each send their next job as soon as the previous one ends."""
    out: list[RequestResult] = []
    pending = list(reversed(jobs))
    t0 = time.perf_counter()
    deadline = t0 + max_seconds

    async def worker() -> None:
        while pending and time.perf_counter() < deadline:
            await _one(client, ep, pending.pop(), out)

    await _bounded([asyncio.create_task(worker()) for _ in range(max(1, concurrency))], max_seconds)
    return out, _wall(out, t0)


async def run_poisson(
    client: aiohttp.ClientSession, ep: Endpoint, jobs: list[Job], rate: float, seed: int, max_seconds: float
) -> tuple[list[RequestResult], float]:
    """Open loop: send at seeded exponential gaps of mean 1/rate, whatever is in flight."""
    rng = random.Random(seed)
    out: list[RequestResult] = []
    t0 = time.perf_counter()
    deadline, at = t0 + max_seconds, t0
    tasks = []
    for job in jobs:
        at += rng.expovariate(rate)
        if at >= deadline:
            break
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        tasks.append(asyncio.create_task(_one(client, ep, job, out)))
    await _bounded(tasks, deadline - time.perf_counter())
    return out, _wall(out, t0)


async def _bounded(tasks: list[asyncio.Task[None]], timeout_s: float) -> None:
    if not tasks:
        return
    _, late = await asyncio.wait(tasks, timeout=max(0.0, timeout_s))
    for t in late:
        t.cancel()
    await asyncio.gather(*late, return_exceptions=True)


def _wall(out: list[RequestResult], t0: float) -> float:
    return max((r.t_end for r in out), default=t0) - t0


async def run_case(
    client: aiohttp.ClientSession, ep: Endpoint, case: Case, limits: Limits, seed: int
) -> tuple[list[RequestResult], float]:
    jobs = case.make_jobs()[: limits.max_requests]
    if case.rate is not None:
        return await run_poisson(client, ep, jobs, case.rate, seed, limits.max_seconds)
    return await run_closed(client, ep, jobs, case.concurrency, limits.max_seconds)


async def run_interleaved(
    cases: Sequence[Case],
    endpoints: dict[str, Endpoint],
    limits: Limits,
    repeats: int,
    seed: int,
    on_run: Callable[[Run, list[RequestResult], float], None] | None = None,
    prepare: Callable[[Case], dict[str, Endpoint]] | None = None,
    warmup: int = 0,
) -> list[Run]:
    """For each case: repeat × (A, B, ...) in turn; results merged per (case, server).
    `prepare(case)`: the endpoints that replace the given ones for that case (a peer started at
    the case's best setting: bench/peer.py); `warmup`: requests to each server before a case's
    runs (WARMUP, not counted: a server just started pays its first request's costs there)."""
    runs: list[Run] = []
    conns = max([c.concurrency for c in cases] + [64])
    # A connection a request: llama.cpp's server closes the connection after each streamed response
    # while its headers say keep-alive, and a pooled one then fails the next request before it is
    # sent (aiohttp: "Can not write request body"; 17 of 128 requests of a 64-stream sweep here).
    # The same for every server, so both sides pay the same loopback connect.
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=conns + 8, force_close=True),
        timeout=aiohttp.ClientTimeout(total=limits.max_seconds + 10),
    ) as client:
        for case in cases:
            eps = {**endpoints, **(prepare(case) if prepare is not None else {})}
            for ep in eps.values():
                await run_closed(client, ep, [WARMUP] * warmup, 1, limits.max_seconds)
            merged = {name: Run(case, name) for name in eps}
            for rep in range(repeats):
                for name, ep in eps.items():
                    res, wall = await run_case(client, ep, case, limits, seed + rep)
                    m = merged[name]
                    m.results += res
                    m.wall_s += wall
                    m.in_flight_s += sum(r.latency_s for r in res)
                    if on_run is not None:
                        on_run(m, res, wall)
            runs += merged.values()
    return runs
