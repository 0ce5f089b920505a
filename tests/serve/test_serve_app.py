"""The ASGI app in memory, over the fake engine and the real tl.core.engine.Engine with the succ runner.

Covers the seed's table where no real socket is needed: the hand example, SSE framing,
stream == non-stream, seeds, stop strings, the error table, completions, templated usage,
429, disconnects, drain, embeddings, tokenize/models/request id, concurrency, n, logprobs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import Callable
from typing import Any

import pytest

from serve.app import App
from serve.config_load import parse_runtime_toml
from tests.helpers.asgi_client import call
from tests.helpers.fake_engine import (
    RoleTemplate,
    SuccRunner,
    byte_model,
    fake_embedding,
)
from tests.helpers.serve_app import CHAT, HAND, chat, content, factory, make_app, metric, run
from tl.core.async_engine import AsyncEngine
from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.core.request import ContextLengthError, EmbedRequest, GenRequest, SamplingParams
from tl.entry.build import build_async_engine
from tl.entry.served import ServedModel


@pytest.fixture(params=["fake", "real"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


async def wait_for(pred: Callable[[], bool], timeout: float) -> None:
    for _ in range(int(timeout / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


def test_hand_example_chat_completion(kind: str) -> None:
    async def body(app: App) -> None:
        r = await call(app, "POST", CHAT, HAND)
        assert r.status == 200 and r.headers["content-type"] == "application/json"
        doc = r.json()
        assert doc["id"].startswith("chatcmpl-") and isinstance(doc["created"], int)
        assert {k: v for k, v in doc.items() if k not in ("id", "created")} == {
            "object": "chat.completion",
            "model": "succ",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "bcd"},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": 1,
                "completion_tokens": 3,
                "total_tokens": 4,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }

    run(make_app(kind), body)


def test_stream_framing_role_first_then_done(kind: str) -> None:
    async def body(app: App) -> None:
        r = await call(app, "POST", CHAT, chat(stream=True, stream_options={"include_usage": True}))
        assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
        events = r.events()
        assert len(events) == 6 and len(r.chunks) == 6  # each event its own write
        assert events[-1] == "[DONE]"
        docs = [json.loads(e) for e in events[:-1]]
        assert len({d["id"] for d in docs}) == 1 and all(d["object"] == "chat.completion.chunk" for d in docs)
        assert docs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [d["choices"][0]["delta"] for d in docs[1:4]] == [{"content": c} for c in "bcd"]
        assert [d["choices"][0]["finish_reason"] for d in docs[:4]] == [None, None, None, "length"]
        assert docs[4]["choices"] == [] and docs[4]["usage"] == {
            "prompt_tokens": 1,
            "completion_tokens": 3,
            "total_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

    run(make_app(kind), body)


def test_stream_equals_nonstream_and_seeds_reproduce(kind: str) -> None:
    async def body(app: App) -> None:
        for req in (
            chat(max_tokens=40, messages=[{"role": "user", "content": "hello"}]),
            chat(max_tokens=40, temperature=1.0, seed=7),
            chat(max_tokens=300, stop=["xyz", "~"]),
        ):
            plain = (await call(app, "POST", CHAT, req)).json()["choices"][0]
            streamed = await call(app, "POST", CHAT, {**req, "stream": True})
            assert content(streamed) == plain["message"]["content"]
            last = json.loads(streamed.events()[-2])["choices"][0]
            assert last["finish_reason"] == plain["finish_reason"]
        seeded = chat(max_tokens=30, temperature=1.0, seed=1234)
        a, b = [(await call(app, "POST", CHAT, seeded)).json()["choices"][0]["message"]["content"] for _ in "ab"]
        c = (await call(app, "POST", CHAT, {**seeded, "seed": 99})).json()["choices"][0]["message"]["content"]
        assert a == b and a != c

    run(make_app(kind), body)


def test_stop_strings_end_generation_across_tokens(kind: str) -> None:
    async def body(app: App) -> None:
        req = chat(max_tokens=10, stop=["de"])
        doc = (await call(app, "POST", CHAT, req)).json()
        assert doc["choices"][0]["message"]["content"] == "bc" and doc["choices"][0]["finish_reason"] == "stop"
        assert doc["usage"]["completion_tokens"] == 4  # b c d e were generated
        r = await call(app, "POST", CHAT, {**req, "stream": True})
        assert content(r) == "bc" and json.loads(r.events()[-2])["choices"][0]["finish_reason"] == "stop"
        doc = (await call(app, "POST", CHAT, chat(max_tokens=10, stop="c"))).json()
        assert doc["choices"][0]["message"]["content"] == "b"
        doc = (await call(app, "POST", CHAT, chat(max_tokens=10, stop_token_ids=[101]))).json()
        assert doc["choices"][0]["message"]["content"] == "bcd" and doc["choices"][0]["finish_reason"] == "stop"
        await wait_for(lambda: app.engine is not None and app.engine.stats().running == 0, 2.0)

    run(make_app(kind), body)


BAD = [
    (CHAT, chat(temperature=-1), 400, "temperature", None),
    (CHAT, chat(temperature=2.5), 400, "temperature", None),
    (CHAT, chat(top_p=0), 400, "top_p", None),
    (CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    (CHAT, {"model": "succ"}, 400, "messages", None),
    (CHAT, chat(messages=[]), 400, "messages", None),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", None),
    (CHAT, chat(n=0), 400, "n", None),
    (CHAT, chat(presence_penalty=3), 400, "presence_penalty", None),
    (CHAT, chat(seed="abc"), 400, "seed", None),
    (CHAT, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs", None),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs", None),
    (CHAT, chat(logit_bias={"x": 1}), 400, "logit_bias", None),
    (CHAT, chat(max_tokens=600), 400, "max_tokens", "context_length_exceeded"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]), 400, "tools[0].function.name", None),
    (CHAT, chat(tool_choice="auto"), 400, "tool_choice", None),
    (CHAT, chat(functions=[{"name": "f"}]), 422, "functions", "unsupported_parameter"),
    (CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type", None),
    (CHAT, chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema", None),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        422,
        "messages[0].content[0].type",
        "unsupported_parameter",
    ),
    (CHAT, chat(model="gpt-4"), 404, "model", "model_not_found"),
    ("/v1/completions", {"model": "succ", "prompt": "a", "echo": True}, 422, "echo", "unsupported_parameter"),
    ("/v1/completions", {"model": "succ", "prompt": "a", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"model": "succ", "prompt": ["a", 1]}, 400, "prompt", None),
    ("/v1/embeddings", {"model": "succ", "input": ""}, 400, "input", None),
    ("/v1/embeddings", {"model": "nope", "input": "a"}, 404, "model", "model_not_found"),
]


def test_errors_use_the_openai_shape(kind: str) -> None:
    async def body(app: App) -> None:
        for path, req, status, param, code in BAD:
            r = await call(app, "POST", path, req)
            assert r.status == status, (req, r.status, r.body)
            err = r.error()
            assert (err["param"], err["code"]) == (param, code), (req, err)
            assert err["type"] == "invalid_request_error" and err["message"]
            assert r.headers["x-request-id"]
        r = await call(app, "POST", CHAT, body=b"{not json")
        assert r.status == 400 and r.error()["param"] is None
        r = await call(app, "POST", CHAT, body=b"[1, 2]")
        assert r.status == 400
        r = await call(app, "GET", "/v1/nothing")
        assert r.status == 404 and r.error()["code"] == "not_found"
        r = await call(app, "GET", CHAT)
        assert r.status == 405 and r.headers["allow"] == "POST" and r.error()["code"] == "method_not_allowed"
        r = await call(app, "POST", CHAT, body=b"x" * 5000)
        assert r.status == 413 and r.error()["code"] == "request_too_large"
        r = await call(app, "POST", CHAT, HAND, headers={"X-TL-Priority": "101"})
        assert r.status == 400 and r.error()["param"] == "X-TL-Priority"
        r = await call(app, "POST", CHAT, HAND, headers={"X-TL-KV-Handle": "h1"})
        assert r.status == 404 and r.error()["code"] == "kv_handle_not_found"
        r = await call(app, "POST", CHAT, chat(max_tokens=600))
        assert all(s in r.error()["message"] for s in ("512", "600", "1 in the prompt"))
        r = await call(app, "POST", CHAT, chat(messages=[{"role": "user", "content": "x"}], unknown_field=[1]))
        assert r.status == 200

    run(make_app(kind, max_body_bytes=4096), body)


def test_completions_endpoint_and_usage(kind: str) -> None:
    async def body(app: App) -> None:
        doc = (await call(app, "POST", "/v1/completions", {"model": "succ", "prompt": "a", "temperature": 0})).json()
        assert doc["object"] == "text_completion" and doc["id"].startswith("cmpl-")
        text = "".join(chr(c) for c in range(98, 98 + 16))
        assert doc["choices"] == [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}]
        assert doc["usage"] == {
            "prompt_tokens": 1,
            "completion_tokens": 16,
            "total_tokens": 17,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        doc = (
            await call(
                app,
                "POST",
                "/v1/completions",
                {"model": "succ", "prompt": [[97], [65, 66]], "max_tokens": 2, "temperature": 0},
            )
        ).json()
        assert [c["text"] for c in doc["choices"]] == ["bc", "CD"] and doc["usage"]["prompt_tokens"] == 3
        r = await call(
            app,
            "POST",
            "/v1/completions",
            {
                "model": "succ",
                "prompt": "a",
                "max_tokens": 3,
                "temperature": 0,
                "stream": True,
                "logprobs": 1,
                "stream_options": {"include_usage": True},
            },
        )
        docs = [json.loads(e) for e in r.events()[:-1]]
        assert "".join(d["choices"][0]["text"] for d in docs[:-1]) == "bcd"
        assert docs[-2]["choices"][0]["finish_reason"] == "length" and docs[-1]["usage"]["completion_tokens"] == 3
        assert docs[0]["choices"][0]["logprobs"]["tokens"] == ["b"]

    run(make_app(kind), body)


def test_usage_counts_the_templated_prompt(kind: str) -> None:
    async def body(app: App) -> None:
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi"}]
        doc = (await call(app, "POST", CHAT, chat(messages=msgs, max_tokens=2))).json()
        rendered = "<|system|>\nbe brief\n<|user|>\nHi\n<|assistant|>\n"
        assert doc["usage"]["prompt_tokens"] == len(rendered.encode())
        tok = (await call(app, "POST", "/v1/tokenize", {"model": "succ", "messages": msgs})).json()
        assert tok["count"] == len(rendered.encode()) and tok["tokens"] == list(rendered.encode())
        # the generation prompt's last token is "\n" (10): the succ continuation starts at 11
        assert doc["choices"][0]["message"]["content"] == "\x0b\x0c"

    run(make_app(kind, template=RoleTemplate()), body)


def test_full_queue_answers_429_with_retry_after(kind: str) -> None:
    async def body(app: App) -> None:
        first_token = asyncio.Event()
        long = chat(messages=[{"role": "user", "content": "A"}], max_tokens=40, stream=True)
        t1 = asyncio.create_task(call(app, "POST", CHAT, long, on_message=lambda b: first_token.set()))
        await first_token.wait()
        t2 = asyncio.create_task(call(app, "POST", CHAT, chat(max_tokens=3)))
        assert app.engine is not None
        await wait_for(lambda: app.engine.stats().queue_depth == 1, 2.0)  # type: ignore[union-attr]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        r3 = await call(app, "POST", CHAT, HAND)
        assert loop.time() - t0 < 0.2  # at once, not after a wait
        assert r3.status == 429 and r3.headers["retry-after"] == "1"
        assert r3.error()["code"] == "rate_limit_exceeded" and r3.error()["type"] == "rate_limit_exceeded"
        r4 = await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": ["a", "b"]})
        assert r4.status == 429 and r4.headers["retry-after"] == "1"  # embeddings share the admission queue
        r1, r2 = await t1, await t2
        assert content(r1) == "".join(chr(66 + i) for i in range(40))
        assert r2.status == 200 and r2.json()["choices"][0]["message"]["content"] == "bcd"
        r5 = await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": ["a", "b"]})
        assert r5.status == 200 and len(r5.json()["data"]) == 2  # served once the queue drained

    run(make_app(kind, 0.01, max_num_seqs=1, seq_buckets=(1,), queue_capacity=1), body)


def test_disconnect_frees_blocks_within_a_step(kind: str) -> None:
    async def body(app: App) -> None:
        for req in (chat(max_tokens=200, stream=True), chat(max_tokens=200)):
            task = asyncio.create_task(call(app, "POST", CHAT, req, disconnect_after=0.15))
            await wait_for(lambda: metric(app, "tl_engine_active_sequences") == 1, 2.0)
            await task
            await wait_for(
                lambda: (
                    metric(app, "tl_engine_active_sequences") == 0
                    and metric(app, 'tl_engine_kv_blocks{state="used"}') == 0
                ),
                2.0,
            )
            assert app.inflight == 0

    run(make_app(kind, 0.01), body)


def test_drain_finishes_in_flight_and_refuses_new(kind: str) -> None:
    async def body(app: App) -> None:
        started = asyncio.Event()
        stream = asyncio.create_task(
            call(app, "POST", CHAT, chat(max_tokens=30, stream=True), on_message=lambda b: started.set())
        )
        await started.wait()
        assert app.is_ready()
        app.begin_drain()
        await asyncio.sleep(0)
        assert not app.is_ready()
        r = await call(app, "POST", CHAT, HAND)
        assert r.status == 503 and r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        assert (await call(app, "GET", "/healthz")).status == 200
        done = await stream
        assert done.events()[-1] == "[DONE]" and len(content(done)) == 30
        assert app._drain_task is not None
        await asyncio.wait_for(app._drain_task, 2.0)

    run(make_app(kind, 0.01), body)


def test_drain_deadline_aborts_with_an_error_event(kind: str) -> None:
    async def body(app: App) -> None:
        started = asyncio.Event()
        stream = asyncio.create_task(
            call(app, "POST", CHAT, chat(max_tokens=400, stream=True), on_message=lambda b: started.set())
        )
        await started.wait()
        app.begin_drain()
        done = await stream
        events = done.events()
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        await wait_for(lambda: metric(app, 'tl_engine_kv_blocks{state="used"}') == 0, 2.0)

    run(make_app(kind, 0.01, drain_timeout_s=0.2), body)


def test_embeddings_are_mean_pooled_and_normalized(kind: str) -> None:
    async def body(app: App) -> None:
        doc = (await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": ["hello", "a", "xyz"]})).json()
        assert doc["object"] == "list" and doc["model"] == "succ"
        assert [d["index"] for d in doc["data"]] == [0, 1, 2]
        for d, text in zip(doc["data"], ["hello", "a", "xyz"], strict=True):
            assert d["object"] == "embedding"
            assert d["embedding"] == pytest.approx(fake_embedding(list(text.encode())))
            assert sum(x * x for x in d["embedding"]) == pytest.approx(1.0)
        assert doc["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
        doc = (
            await call(
                app, "POST", "/v1/embeddings", {"model": "succ", "input": [[1, 2, 3]], "encoding_format": "base64"}
            )
        ).json()
        raw = base64.b64decode(doc["data"][0]["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(fake_embedding([1, 2, 3]), abs=1e-6)

    run(make_app(kind), body)


def test_embeddings_limits_name_the_input() -> None:
    async def body(app: App) -> None:
        r = await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": ["a"] * 2049})
        assert r.status == 400 and r.error()["param"] == "input" and "2048" in r.error()["message"]
        r = await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": ["a", "b" * 600]})
        assert r.status == 400 and r.error()["param"] == "input" and r.error()["code"] == "context_length_exceeded"
        assert "input[1]" in r.error()["message"]
        r = await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": [[1, 2], [3, 999]]})
        assert r.status == 400 and r.error()["param"] == "input" and "999" in r.error()["message"]
        r = await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": list(range(2100))})
        assert r.status == 400 and r.error()["code"] == "context_length_exceeded"  # one input of 2100 ids
        assert (await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": ["a"] * 2048})).status == 200

    run(make_app("real", max_model_len=512), body, timeout=60)


def test_streams_keep_their_cadence_through_a_large_embeddings_request() -> None:
    """A 2,048-input embeddings request is prompt work in many steps, and a running stream gets a
    token in every one of them; the queue counts the request once; its blocks are free at the end."""

    async def body(app: App) -> None:
        seen = [0]
        started = asyncio.Event()

        def on_message(b: bytes) -> None:
            seen[0] += 1
            started.set()

        stream = asyncio.create_task(call(app, "POST", CHAT, chat(max_tokens=500, stream=True), on_message=on_message))
        await started.wait()
        inputs = [bytes([65 + i % 26]) * (1 + i % 40) for i in range(2048)]
        steps0, seen0 = metric(app, "tl_engine_steps_total"), seen[0]
        emb = asyncio.create_task(
            call(app, "POST", "/v1/embeddings", {"model": "succ", "input": [x.decode() for x in inputs]})
        )
        await wait_for(lambda: metric(app, "tl_engine_active_sequences") > 1, 5.0)
        assert metric(app, "tl_engine_queue_depth") <= 1
        r = await emb
        steps = metric(app, "tl_engine_steps_total") - steps0
        for _ in range(10):  # the tokens of steps already counted may still be on their way through the loop
            await asyncio.sleep(0)
        got = seen[0] - seen0
        assert r.status == 200
        data = r.json()["data"]
        assert [d["index"] for d in data] == list(range(2048))
        for i in (0, 7, 2047):
            assert data[i]["embedding"] == pytest.approx(fake_embedding(list(inputs[i])))
        assert stream.done() or got >= steps - 3, (steps, got)  # a token every step while it ran
        assert steps >= 40  # the inputs' 42k tokens ran as scheduled work, not one call
        done = await stream
        assert done.events()[-1] == "[DONE]" and len(content(done)) == 500
        await wait_for(lambda: metric(app, 'tl_engine_kv_blocks{state="used"}') == 0, 2.0)
        assert metric(app, "tl_engine_capped_steps_total") > 0

    run(make_app("real", 0.002, prompt_tokens_while_decoding=64), body, timeout=120)


def test_embeddings_disconnect_aborts_and_frees_blocks(kind: str) -> None:
    async def body(app: App) -> None:
        inputs = ["x" * 200] * 64
        task = asyncio.create_task(
            call(app, "POST", "/v1/embeddings", {"model": "succ", "input": inputs}, disconnect_after=0.1)
        )
        await task
        await wait_for(
            lambda: (
                metric(app, "tl_engine_active_sequences") == 0
                and metric(app, 'tl_engine_kv_blocks{state="used"}') == 0
                and metric(app, "tl_engine_queue_depth") == 0
            ),
            2.0,
        )
        assert app.inflight == 0
        r = await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": "ab"})
        assert r.status == 200

    run(make_app(kind, 0.02), body)


def test_drain_deadline_aborts_an_embeddings_request_with_503() -> None:
    async def body(app: App) -> None:
        task = asyncio.create_task(call(app, "POST", "/v1/embeddings", {"model": "succ", "input": ["x" * 300] * 200}))
        await wait_for(lambda: metric(app, "tl_engine_active_sequences") > 0, 2.0)
        app.begin_drain()
        r = await task
        assert r.status == 503 and r.error()["code"] == "aborted" and r.headers["retry-after"] == "1"
        await wait_for(lambda: metric(app, 'tl_engine_kv_blocks{state="used"}') == 0, 2.0)

    run(make_app("real", 0.02, drain_timeout_s=0.2), body)


def test_tokenize_models_health_and_request_id(kind: str) -> None:
    async def body(app: App) -> None:
        r = await call(app, "POST", "/v1/tokenize", {"model": "succ", "prompt": "hé"}, headers={"X-Request-Id": "abc"})
        assert r.json() == {"tokens": [104, 195, 169], "count": 3, "max_model_len": 512}
        assert r.headers["x-request-id"] == "abc"
        r = await call(app, "POST", "/v1/detokenize", {"model": "succ", "tokens": [104, 195, 169]})
        assert r.json() == {"prompt": "hé"}
        models = (await call(app, "GET", "/v1/models")).json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["succ"]
        assert (await call(app, "GET", "/v1/models/succ")).json()["object"] == "model"
        assert (await call(app, "GET", "/v1/models/other")).status == 404
        r = await call(app, "GET", "/healthz")
        assert r.status == 200 and r.headers["x-request-id"].startswith("req-")
        r1, r2 = await call(app, "POST", CHAT, HAND), await call(app, "POST", CHAT, HAND)
        assert r1.headers["x-request-id"] != r2.headers["x-request-id"]
        r = await call(app, "POST", CHAT, chat(stream=True), headers={"x-request-id": "s-1"})
        assert r.headers["x-request-id"] == "s-1"
        text = app.metrics.render("")[0].decode()
        assert 'tl_http_requests_total{endpoint="/v1/chat/completions",status="200"} 3.0' in text
        assert "tl_request_time_to_first_token_seconds_count 3.0" in text

    run(make_app(kind), body)


def test_concurrent_streams_equal_serial(kind: str) -> None:
    async def body(app: App) -> None:
        reqs = [
            chat(
                messages=[{"role": "user", "content": chr(65 + i) * (i + 1)}],
                max_tokens=12 + i,
                stream=True,
                **({"temperature": 0.8, "seed": i} if i % 2 else {}),
            )
            for i in range(8)
        ]
        serial = [content(await call(app, "POST", CHAT, r)) for r in reqs]
        parallel = await asyncio.gather(*(call(app, "POST", CHAT, r) for r in reqs))
        assert [content(r) for r in parallel] == serial

    run(make_app(kind, 0.002), body)


def test_n_choices_logprobs_priority_and_engine_failure(kind: str) -> None:
    async def body(app: App) -> None:
        doc = (
            await call(app, "POST", CHAT, chat(n=2, logprobs=True, top_logprobs=2), headers={"X-TL-Priority": "5"})
        ).json()
        assert [c["index"] for c in doc["choices"]] == [0, 1]
        assert all(c["message"]["content"] == "bcd" for c in doc["choices"])
        lp = doc["choices"][0]["logprobs"]["content"]
        assert [t["token"] for t in lp] == ["b", "c", "d"] and lp[0]["bytes"] == [98]
        assert [t["token"] for t in lp[0]["top_logprobs"]] == ["b", "c"]
        assert doc["usage"] == {
            "prompt_tokens": 1,
            "completion_tokens": 6,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        r = await call(app, "POST", CHAT, chat(n=2, stream=True))
        chunks = [json.loads(e)["choices"][0] for e in r.events()[:-1]]
        for i in (0, 1):
            assert "".join(c["delta"].get("content") or "" for c in chunks if c["index"] == i) == "bcd"
        # an engine failure mid-stream: one error event, then [DONE]; the server keeps serving
        assert app.engine is not None
        eng = app.engine.engine
        started = asyncio.Event()
        task = asyncio.create_task(
            call(app, "POST", CHAT, chat(max_tokens=300, stream=True), on_message=lambda b: started.set())
        )
        await started.wait()
        if isinstance(eng, Engine):
            original = eng.runner.execute

            def boom(plan: object) -> object:
                eng.runner.execute = original  # type: ignore[method-assign]
                raise RuntimeError("boom")

            eng.runner.execute = boom  # type: ignore[method-assign]
        else:
            eng.fail_next_step = True  # type: ignore[attr-defined]
        events = (await task).events()
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        assert (await call(app, "POST", CHAT, HAND)).json()["choices"][0]["message"]["content"] == "bcd"

    run(make_app(kind, 0.002), body)


def test_api_keys_and_ping(kind: str) -> None:
    async def body(app: App) -> None:
        r = await call(app, "GET", "/v1/models")
        assert r.status == 401 and r.error()["code"] == "invalid_api_key"
        assert (await call(app, "GET", "/v1/models", headers={"Authorization": "Bearer k2"})).status == 200
        assert (await call(app, "GET", "/healthz")).status == 200
        app.ping_interval_s = 0.05
        r = await call(app, "POST", CHAT, chat(max_tokens=2, stream=True), headers={"Authorization": "Bearer k1"})
        assert b": ping\n\n" in r.body and content(r) == "bc"

    run(make_app(kind, 0.12, api_keys=("k1", "k2")), body)


def test_api_keys_from_a_json_array_in_the_environment() -> None:
    """TL_ENGINE__API_KEYS='["k1","k2"]' (as k8s manifests write lists) is two keys, not one."""
    cfg = parse_runtime_toml(
        '[engine]\nmodel_dir = "models/succ"\nblock_size = 4\n', {"TL_ENGINE__API_KEYS": '["k1","k2"]'}
    )
    app = App(cfg, factory("fake"), handle_signals=False, start_health=False)

    async def body(app: App) -> None:
        for key, status in (("k2", 200), ("k1", 200), ('["k1","k2"]', 401), ("k3", 401)):
            r = await call(app, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status == status, key

    run(app, body)


def test_the_engine_factory_is_an_argument_never_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TL_ENGINE_FACTORY", "fake_engine:make_async_engine")
    assert App().engine_factory is build_async_engine
    assert App(engine_factory=factory("fake")).engine_factory is not build_async_engine


def test_context_refusals_are_the_engines_in_openai_shape(kind: str) -> None:
    """The engine decides whether a request fits (one rule, one message); serve names the field."""
    long_chat = {"model": "succ", "messages": [{"role": "user", "content": "a" * 600}]}

    async def body(app: App) -> None:
        assert app.engine is not None
        with pytest.raises(ContextLengthError) as gen:
            app.engine.check_context(GenRequest((97,), SamplingParams(max_tokens=600)))
        with pytest.raises(ContextLengthError) as emb:
            app.engine.check_context(EmbedRequest(((97,), (98,) * 600)))
        cases = [
            (CHAT, chat(max_tokens=600), "max_tokens", str(gen.value)),
            (CHAT, chat(max_completion_tokens=600), "max_completion_tokens", str(gen.value)),
            (CHAT, long_chat, "messages", None),  # no max_tokens: the prompt alone is too long
            ("/v1/completions", {"model": "succ", "prompt": ["a", "b" * 600]}, "max_tokens", None),
            ("/v1/embeddings", {"model": "succ", "input": ["a", "b" * 600]}, "input", str(emb.value)),
        ]
        for path, req, param, message in cases:
            for stream in (False, True) if path != "/v1/embeddings" else (False,):
                r = await call(app, "POST", path, {**req, "stream": True} if stream else req)
                err = r.error()
                assert (r.status, err["param"], err["code"]) == (400, param, "context_length_exceeded"), (req, err)
                assert message is None or err["message"] == message
        assert app.engine.max_model_len == 512
        await wait_for(
            lambda: app.engine is not None and app.engine.stats().running == app.engine.stats().kv_blocks_used == 0,
            2.0,
        )  # the completion's first prompt, admitted before the second was refused, is aborted

    run(make_app(kind), body)


def test_queue_deadline_answers_503_no_capacity(kind: str) -> None:
    async def body(app: App) -> None:
        started = asyncio.Event()
        first = asyncio.create_task(
            call(app, "POST", CHAT, chat(max_tokens=30, stream=True), on_message=lambda b: started.set())
        )
        await started.wait()
        r = await call(app, "POST", CHAT, HAND)
        assert r.status == 503 and r.error()["code"] == "no_capacity" and r.headers["retry-after"] == "1"
        r = await call(app, "POST", CHAT, chat(stream=True))
        events = r.events()
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "no_capacity"
        assert content(await first) == "".join(chr(98 + i) for i in range(30))

    run(make_app(kind, 0.01, max_num_seqs=1, seq_buckets=(1,), queue_deadline_ms=60), body)


def test_every_5xx_is_logged_once_with_its_request_id_and_cause(caplog: pytest.LogCaptureFixture) -> None:
    """A step that raises fails its request with 500 internal_error (non-streamed) and with an
    error event (streamed); each is logged once, naming the request id and the cause."""

    async def body(app: App) -> None:
        assert app.engine is not None
        sync = app.engine.engine

        def broken() -> Any:
            raise RuntimeError("the device fell over")

        sync.step = broken  # type: ignore[method-assign]
        r = await call(app, "POST", CHAT, HAND, headers={"x-request-id": "req-500"})
        assert r.status == 500 and r.json()["error"]["code"] == "internal_error"
        s = await call(app, "POST", CHAT, chat(stream=True), headers={"x-request-id": "req-stream"})
        assert s.status == 200 and s.events()[-1] == "[DONE]"
        assert json.loads(s.events()[-2])["error"]["code"] == "internal_error"

    with caplog.at_level("INFO", logger="serve"):
        run(make_app("real"), body)
    for rid in ("req-500", "req-stream"):
        lines = [r.getMessage() for r in caplog.records if r.name == "serve" and rid in r.getMessage()]
        assert len(lines) == 1, lines
        assert "500 internal_error" in lines[0] and "the device fell over" in lines[0], lines


def test_an_embeddings_input_out_of_capacity_is_a_retryable_503() -> None:
    """An embeddings input that finishes no_capacity (queue deadline, no KV blocks) makes the
    request a 503 no_capacity with Retry-After, as a generation's does, never a 500."""

    def build(cfg: EngineConfig) -> tuple[AsyncEngine, ServedModel]:  # 12 blocks of 4 tokens
        engine = Engine(SuccRunner(block_size=4, num_kv_blocks=12, step_delay_s=0.05), cfg)
        return AsyncEngine(engine), byte_model(cfg, engine.max_model_len, model_id="succ")

    async def body(app: App) -> None:
        ask = chat(messages=[{"role": "user", "content": "a" * 20}], max_tokens=20, stream=True)
        stream = asyncio.create_task(call(app, "POST", CHAT, ask))
        await wait_for(lambda: metric(app, "tl_engine_active_sequences") == 1, 5)
        # the stream holds blocks to the end; a 40-token input needs 10 of the 12 and never starts
        r = await call(app, "POST", "/v1/embeddings", {"model": "succ", "input": [[5] * 40]})
        assert r.status == 503, r.json()
        assert r.json()["error"]["code"] == "no_capacity" and r.headers["retry-after"] == "1"
        assert (await stream).status == 200

    config = EngineConfig(
        model_dir="models/succ",
        block_size=4,
        queue_deadline_ms=50,
        max_num_seqs=4,
        prefill_chunk=0,
        prompt_tokens_while_decoding=0,
    )
    run(App(config, build, handle_signals=False, start_health=False), body)
