"""The routers' probes (serve/fleet.py) in memory over the succ engine: /health follows the drain,
/get_load counts what waits and runs in the shape load_shape names, /server_info and /model_info
name the model, none of them needs the API key, and the router fields the real routers add to a
body are taken (tests/serve/test_routers.py drives the real routers)."""

from __future__ import annotations

import asyncio

import pytest

from serve.app import App
from tests.helpers.asgi_client import call
from tests.helpers.serve_app import CHAT, HAND, chat, content, make_app, metric, run

# What vllm-router 0.1.17 and sglang-router 0.3.2 add to a chat body they pass on (seen on a
# logging worker): fields tl has no use for are ignored, max_completion_tokens is honoured.
ROUTER_CHAT = {
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
ROUTER_COMPLETION = {
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


def test_health_is_200_while_serving_and_503_from_the_drain_on() -> None:
    async def body(app: App) -> None:
        r = await call(app, "GET", "/health")
        assert r.status == 200 and r.body == b""
        assert (await call(app, "POST", "/health")).status == 405
        started = asyncio.Event()
        stream = asyncio.create_task(
            call(app, "POST", CHAT, chat(max_tokens=20, stream=True), on_message=lambda b: started.set())
        )
        await started.wait()
        app.begin_drain()
        await asyncio.sleep(0)
        r = await call(app, "GET", "/health")
        assert r.status == 503 and r.error()["code"] == "server_shutting_down"
        assert r.headers["connection"] == "close"
        assert (await call(app, "GET", "/healthz")).status == 200  # liveness is not readiness
        assert len(content(await stream)) == 20  # the drain still finishes what it holds

    run(make_app("real", 0.01), body)


@pytest.mark.parametrize("shape", ["vllm", "sglang"])
def test_get_load_counts_waiting_and_running_in_the_callers_shape(shape: str) -> None:
    async def body(app: App) -> None:
        idle = (await call(app, "GET", "/get_load")).json()
        zero = {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        assert idle == ({"load": 0} if shape == "vllm" else [zero])
        started = asyncio.Event()
        streams = [
            asyncio.create_task(
                call(app, "POST", CHAT, chat(max_tokens=40, stream=True), on_message=lambda b: started.set())
            )
            for _ in range(3)
        ]
        await started.wait()
        deadline = asyncio.get_running_loop().time() + 5
        while True:  # the third request reaches the queue a moment after the first token
            busy = (await call(app, "GET", "/get_load")).json()
            if (busy["load"] == 3) if shape == "vllm" else (busy[0]["num_reqs"], busy[0]["num_waiting_reqs"]) == (3, 1):
                break  # max_num_seqs 2: two run, one waits
            assert asyncio.get_running_loop().time() < deadline, busy
            await asyncio.sleep(0.005)
        assert 0 < metric(app, "tl_engine_kv_cache_usage_ratio") < 1  # two sequences' blocks of 256
        if shape == "sglang":
            (rank,) = busy
            assert rank["num_tokens"] % 4 == 0 and rank["num_tokens"] >= 2 * 4  # whole 4-token blocks
        for s in streams:
            await s
        deadline = asyncio.get_running_loop().time() + 5
        while (await call(app, "GET", "/get_load")).json() != idle:  # the stats snapshot of the last step
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.005)
        assert metric(app, "tl_engine_kv_cache_usage_ratio") == 0.0

    run(make_app("real", 0.02, max_num_seqs=2, load_shape=shape), body)


def test_server_and_model_info_name_the_model_under_both_spellings() -> None:
    async def body(app: App) -> None:
        for path in ("/server_info", "/get_server_info"):
            doc = (await call(app, "GET", path)).json()
            assert doc["served_model_name"] == "succ" and doc["dp_size"] == 1 and doc["tp_size"] == 1
            assert doc["model_path"].endswith("models/succ") and doc["page_size"] == 4
            # the blocks the engine has (the succ runner keeps 256 of the 2048 configured)
            assert doc["max_total_num_tokens"] == 256 * 4
        for path in ("/model_info", "/get_model_info"):
            doc = (await call(app, "GET", path)).json()
            assert doc["served_model_name"] == "succ" and doc["is_generation"] is True

    run(make_app("real"), body)


def test_probes_need_no_key_while_the_api_does() -> None:
    async def body(app: App) -> None:
        for path in ("/health", "/get_load", "/server_info", "/model_info", "/metrics"):
            assert (await call(app, "GET", path)).status == 200, path
        scraped = (await call(app, "GET", "/metrics")).body.decode()
        for name in ("tl_engine_queue_depth", "tl_engine_active_sequences", "tl_engine_kv_cache_usage_ratio"):
            assert f"\n{name} " in scraped, name  # what the endpoint picker's flags name (README)
        assert (await call(app, "POST", "/tokenize", {"prompt": "ab"})).status == 401
        ok = await call(app, "POST", "/tokenize", {"prompt": "ab"}, headers={"authorization": "Bearer k"})
        assert ok.status == 200 and ok.json()["tokens"] == [97, 98]
        back = await call(app, "POST", "/detokenize", {"tokens": [97, 98]}, headers={"authorization": "Bearer k"})
        assert back.json()["prompt"] == "ab"

    run(make_app("real", api_keys=("k",)), body)


def test_a_routers_chat_body_is_served_and_its_limit_honoured() -> None:
    async def body(app: App) -> None:
        plain = await call(app, "POST", CHAT, HAND)
        routed = {**HAND, **ROUTER_CHAT, "stream": False}
        del routed["max_tokens"]
        r = await call(app, "POST", CHAT, {**routed, "max_completion_tokens": 3})
        assert r.status == 200, r.body()
        assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
        assert r.json()["usage"]["completion_tokens"] == 3
        completion = {"model": "succ", "prompt": "a", "max_tokens": 3, "temperature": 0}
        r = await call(app, "POST", "/v1/completions", {**completion, **ROUTER_COMPLETION})
        assert r.status == 200 and r.json()["choices"][0]["text"] == "bcd"

    run(make_app("real"), body)


def test_drain_min_s_is_a_lame_duck_window_health_503_requests_served_then_refused() -> None:
    async def body(app: App) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        app.begin_drain()
        await asyncio.sleep(0.1)
        assert (await call(app, "GET", "/health")).status == 503  # a router polling it stops sending
        assert not app.is_ready()  # the health port's /readyz: 503
        served = await call(app, "POST", CHAT, HAND)  # what it still sends meanwhile is served
        assert served.status == 200, served.body()
        assert app._drain_task is not None and not app._drain_task.done()
        await asyncio.wait_for(app._drain_task, 2.0)  # nothing in flight: over at drain_min_s
        assert loop.time() - t0 >= 0.4
        refused = await call(app, "POST", CHAT, HAND)
        assert refused.status == 503 and refused.json()["error"]["code"] == "server_shutting_down"

    run(make_app("real", drain_min_s=0.4), body)


def test_drain_min_s_is_bounded_by_the_drain_timeout() -> None:
    with pytest.raises(ValueError, match=r"drain_min_s must be in 0\.\.drain_timeout_s \(1\.0\), got 2\.0"):
        make_app("real", drain_timeout_s=1.0, drain_min_s=2.0)
