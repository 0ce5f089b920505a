"""tl behind the routers people run, unchanged: vllm-router and SGLang's gateway (smg) in front of
two tl replicas of the successor-byte model on loopback, in round_robin, cache_aware and
power_of_two. Through each router and policy, chat and completions, streamed and not, answer as a
replica alone does (the official openai client), every stream ends with [DONE], and round_robin
uses both replicas. Then one replica gets SIGTERM in the middle of a burst: /health answers 503
at once while requests are still served for drain_min_s (the router stops sending meanwhile),
then new ones 503, it exits, and no request of the burst is lost. The routers are
test dependencies (pyproject's test extra), started by bench/fleet_bench.py's `router` with
--host 127.0.0.1 and stopped whatever happened.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from bench.fleet_bench import POLICIES, ROUTERS, Router, router
from tests.helpers.granian_server import Server, free_port, replica

ENGINE = (
    "num_kv_blocks = 256\nmax_num_seqs = 8\nmax_num_batched_tokens = 64\nprefill_chunk = 64\n"
    "token_buckets = [8, 64]\nseq_buckets = [1, 8]\ndrain_timeout_s = 10.0\ndrain_min_s = 4.0\n"
)
PROMPTS = ("abc", "hello", "xyz", "The quick brown fox")


@contextmanager
def replicas(succ_dir: Path, tmp_path: Path) -> Iterator[tuple[Server, Server, list[str]]]:
    """Two replicas, each publishing its prefix cache's events; and the router flags that name them."""
    with ExitStack() as stack:
        servers, sources = [], []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            events = f"tcp://127.0.0.1:{free_port()}"
            engine = f'{ENGINE}kv_events_endpoint = "{events}"\n'
            servers.append(stack.enter_context(replica(succ_dir, tmp_path / name, engine, "succ")))
            sources += ["--kv-event-source", f"{servers[-1].api}={events}"]
        yield servers[0], servers[1], [*sources, "--kv-event-block-size", "16", "--kv-event-model", "succ"]


def _completion(prompt: str, **kw: object) -> dict[str, object]:
    return {"model": "succ", "prompt": prompt, "max_tokens": 6, "temperature": 0, **kw}


def _answers(client: openai.OpenAI) -> list[str]:
    """Chat and completions of every prompt, streamed and not, greedy: their texts."""
    out = []
    for p in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        c = client.chat.completions.create(model="succ", messages=msgs, max_tokens=6, temperature=0)  # type: ignore[arg-type]
        out.append(c.choices[0].message.content or "")
        s = client.chat.completions.create(model="succ", messages=msgs, max_tokens=6, temperature=0, stream=True)  # type: ignore[arg-type]
        out.append("".join(ch.choices[0].delta.content or "" for ch in s if ch.choices))
        t = client.completions.create(model="succ", prompt=p, max_tokens=6, temperature=0)
        out.append(t.choices[0].text)
        s2 = client.completions.create(model="succ", prompt=p, max_tokens=6, temperature=0, stream=True)
        out.append("".join(ch.choices[0].text for ch in s2 if ch.choices))
    return out


def _served(s: Server, endpoint: str) -> float:
    """Requests the replica answered 200 on endpoint."""
    for line in httpx.get(f"{s.health}/metrics").text.splitlines():
        if line.startswith("tl_http_requests_total{") and f'endpoint="{endpoint}"' in line and 'status="200"' in line:
            return float(line.split()[-1])
    return 0.0


def _done(url: str, path: str, body: dict[str, object]) -> list[str]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


@pytest.mark.parametrize("name", list(ROUTERS))
def test_a_router_drives_two_replicas_unchanged_and_loses_nothing_to_a_drain(
    name: str, succ_dir: Path, tmp_path: Path
) -> None:
    with replicas(succ_dir, tmp_path) as (a, b, kv_sources):
        with openai.OpenAI(base_url=f"{a.api}/v1", api_key="none", max_retries=0) as alone:
            expected = _answers(alone)
        assert expected[0] == "defghi"[: len(expected[0])] and len(expected[0]) == 6  # 'c' -> 'd', ...
        for policy in POLICIES:
            before = [_served(s, "/v1/completions") + _served(s, "/v1/chat/completions") for s in (a, b)]
            extra = kv_sources if policy == "kv_aware" else []
            if policy == "kv_aware" and name != "vllm-router":
                continue  # SGLang's gateway has no such policy
            with router(name, policy, (a.api, b.api), tmp_path / f"{name}-{policy}.log", "succ", extra) as r:
                url = r.url
                with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
                    assert _answers(client) == expected, policy
                chat = {"model": "succ", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 6}
                assert _done(url, "/v1/chat/completions", chat)[-1] == "data: [DONE]"
                assert _done(url, "/v1/completions", _completion("abc"))[-1] == "data: [DONE]"
                if policy == "kv_aware":
                    _turns_follow_their_prefix(r)
            after = [_served(s, "/v1/completions") + _served(s, "/v1/chat/completions") for s in (a, b)]
            if policy == "round_robin":
                assert all(x > y for x, y in zip(after, before, strict=True)), (policy, before, after)
        with router(name, "round_robin", (a.api, b.api), tmp_path / f"{name}-drain.log", "succ") as r:
            _burst_while_b_drains(r.url, a, b)


def _turns_follow_their_prefix(r: Router) -> None:
    """Three conversations of four turns through kv_aware: every later turn lands where the KV of
    its history is (the replica reports it cached), which the router knows only from the events.
    The router's subscribers connect after it reports ready, and what a PUB socket sends before a
    subscriber has joined is gone (ZMQ's slow joiner): a moment first, or a first turn's blocks
    may never reach the index."""
    time.sleep(1.0)
    with openai.OpenAI(base_url=f"{r.url}/v1", api_key="none", max_retries=0) as client:
        for c in range(3):
            talk: list[dict[str, str]] = [{"role": "user", "content": f"conversation {c}: " + "lorem ipsum " * 12}]
            before = 0  # the last turn's prompt: its whole 16-token blocks are cached where it ran
            for turn in range(4):
                res = client.chat.completions.create(model="succ", messages=talk, max_tokens=20, temperature=0)  # type: ignore[arg-type]
                usage = res.usage
                assert usage is not None and usage.prompt_tokens_details is not None
                cached = usage.prompt_tokens_details.cached_tokens or 0
                assert cached >= before // 16 * 16, (c, turn, usage)
                before = usage.prompt_tokens
                talk += [{"role": "assistant", "content": res.choices[0].message.content or ""}]
                talk += [{"role": "user", "content": f"and turn {turn} " * 3}]
                time.sleep(0.5)  # the turn's events reach the router's index (a next turn sent at once raced them)
    lines = httpx.get(r.metrics_url).text.splitlines()

    def count(prefix: str) -> float:
        return sum(float(ln.split()[-1]) for ln in lines if ln.startswith(prefix))

    assert count('vllm_router_kv_routing_inputs_total{transport="http",result="render"}') >= 12, lines  # tl's ids
    assert count('vllm_router_kv_placement_lookups_total{result="hit"}') >= 9, lines  # its index: tl's events


def _burst_while_b_drains(url: str, a: Server, b: Server) -> None:
    """48 completions through the router, 4 at a time; SIGTERM to b's granian once 8 are done:
    /health answers 503 at once and requests are still served for drain_min_s (4 s: the routers
    poll every second and give a worker up after 3 failures), then refused, then b exits; every
    answer is still right. Without the window (b refusing at once) vllm-router sent one request
    of 96 to b five times running and passed its 503 on (retries exhausted), in 1 of 2 runs."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as client:

        def one(i: int) -> str:
            r = client.completions.create(model="succ", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24, temperature=0)
            return r.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            first = list(pool.map(one, range(len(PROMPTS))))
            burst = [pool.submit(one, i) for i in range(48)]
            while sum(f.done() for f in burst) < 8:
                time.sleep(0.01)
            b.proc.send_signal(signal.SIGTERM)  # granian's main process: the drain
            answers = [f.result() for f in burst]
    assert b.proc.wait(30) == 0
    assert answers == [first[i % len(PROMPTS)] for i in range(48)]
    assert _served(a, "/v1/completions") > 0
