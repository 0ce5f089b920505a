"""The server over the real runner (tl.entry.build) on the tiny test models, in memory.

One app per model (compiling is the cost): one step bucket (32 tokens x 4 sequences), so
each model compiles once. succ: the hand example, stop strings and framing on real
weights. tiny Llama (ChatML template, random weights): stream == non-stream at
temperature 0, eight concurrent streams == serial, usage counts the rendered template,
embeddings normalised and in input order; overlap and several decode steps per call on give
the answers (n > 1, seeded, penalised, logprobs, stop strings) of both off.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

from serve.app import App
from tests.helpers.asgi_client import Reply, call, served
from tl.core.config import EngineConfig
from tl.entry.build import build_async_engine

CHAT = "/v1/chat/completions"


def app_for(model_dir: Path, model_id: str, **engine: object) -> App:
    cfg = EngineConfig(
        model_dir=str(model_dir),
        model_id=model_id,
        block_size=4,
        num_kv_blocks=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        prefill_chunk=32,
        token_buckets=(32,),
        seq_buckets=(4,),
        max_logprobs=0,
        compile_cache_dir="",
    ).replace(**engine)
    return App(cfg, build_async_engine, handle_signals=False, start_health=False)


def run(app: App, body: Callable[[App], Awaitable[None]]) -> None:
    async def main() -> None:
        async with served(app):
            await asyncio.wait_for(body(app), 300)

    asyncio.run(main())


def content(r: Reply) -> str:
    return "".join(
        json.loads(e)["choices"][0]["delta"].get("content") or "" for e in r.events()[:-1] if json.loads(e)["choices"]
    )


def test_succ_model_hand_example_stop_and_framing(succ_dir: Path) -> None:
    async def body(app: App) -> None:
        req = {"model": "succ", "messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "temperature": 0}
        doc = (await call(app, "POST", CHAT, req)).json()
        assert doc["choices"][0]["message"] == {"role": "assistant", "content": "bcd"}
        assert doc["choices"][0]["finish_reason"] == "length" and doc["usage"]["total_tokens"] == 4
        r = await call(app, "POST", CHAT, {**req, "stream": True, "stream_options": {"include_usage": True}})
        assert len(r.events()) == 6 and content(r) == "bcd"
        stop = {**req, "max_tokens": 10, "stop": ["de"]}
        doc = (await call(app, "POST", CHAT, stop)).json()
        assert (doc["choices"][0]["message"]["content"], doc["choices"][0]["finish_reason"]) == ("bc", "stop")
        assert content(await call(app, "POST", CHAT, {**stop, "stream": True})) == "bc"
        for _ in range(200):  # the stop string's abort reaches the engine thread within a step
            if app.engine is not None and app.engine.stats().kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        assert app.engine is not None and app.engine.stats().kv_blocks_used == 0
        # the KV cache's capacity and memory: on the model card and in /metrics alike
        card = (await call(app, "GET", "/v1/models")).json()["data"][0]["backend"]
        assert card["kv_capacity_tokens"] == 128 * 4 and card["kv_cache_dtype"] == "float32"
        assert card["kv_cache_bytes"] > 0  # its formula: tests/runtime/test_runner.py's bf16 cache test
        text = app.metrics.render("")[0].decode()
        assert f"tl_engine_kv_cache_capacity_tokens {128 * 4}.0" in text
        assert f"tl_engine_kv_cache_bytes {float(card['kv_cache_bytes'])}" in text

    # One decode step a call: the framing counted above is a chunk a token. With several steps a
    # call (compiled before ready since the one-sequence program is), the tokens of one call come
    # in one chunk, and how many a call runs depends on the measured step time.
    run(app_for(succ_dir, "succ", decode_steps=1), body)


def test_tiny_llama_stream_equals_nonstream_concurrency_usage_embeddings(tiny_dir: Path) -> None:
    async def body(app: App) -> None:
        reqs = [
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"prompt {i} " * (i + 1)}],
                "max_tokens": 8,
                "temperature": 0,
            }
            for i in range(8)
        ]
        plain = [(await call(app, "POST", CHAT, r)).json() for r in reqs]
        rendered = f"<|im_start|>user\n{reqs[0]['messages'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
        tok = (await call(app, "POST", "/v1/tokenize", {"model": "tiny", "messages": reqs[0]["messages"]})).json()
        specials = ("<|im_start|>", "<|im_end|>")
        expected = len(rendered.replace(specials[0], "").replace(specials[1], "").encode()) + 3  # specials: 1 each
        assert plain[0]["usage"]["prompt_tokens"] == tok["count"] == expected
        for r, doc in zip(reqs, plain, strict=True):
            streamed = await call(app, "POST", CHAT, {**r, "stream": True})
            assert content(streamed) == doc["choices"][0]["message"]["content"]
        parallel = await asyncio.gather(*(call(app, "POST", CHAT, {**r, "stream": True}) for r in reqs))
        assert [content(p) for p in parallel] == [d["choices"][0]["message"]["content"] for d in plain]
        inputs = ["hello there", "a", "the same input again"]
        both = (await call(app, "POST", "/v1/embeddings", {"model": "tiny", "input": inputs})).json()["data"]
        for i, text in enumerate(inputs):
            alone = (await call(app, "POST", "/v1/embeddings", {"model": "tiny", "input": text})).json()["data"][0]
            assert both[i]["index"] == i
            assert alone["embedding"] == both[i]["embedding"]  # bit for bit (issue 48)
            assert abs(sum(x * x for x in both[i]["embedding"]) - 1.0) < 1e-4
        assert both[0]["embedding"] != both[1]["embedding"]

    run(app_for(tiny_dir, "tiny"), body)


def test_overlap_and_decode_steps_change_no_answer(tiny_dir: Path) -> None:
    """The same requests on an engine with overlap on and 4 decode steps per call and
    on one with neither: n = 2 seeded samples with a penalty and logprobs, and greedy answers cut
    by a stop string (which serve/ applies by aborting the request: one call late with overlap),
    streamed and not. The overlap engine is first run until it has launched calls ahead (their
    token feeds compile in the background the first time)."""
    base = {"model": "tiny", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 24}
    sampled = {**base, "n": 2, "temperature": 0.9, "seed": 5, "frequency_penalty": 0.6, "logprobs": True}

    def answers(docs: list[dict]) -> list[tuple[str, str, list[float]]]:
        return [
            (
                c["message"]["content"],
                c["finish_reason"],
                [t["logprob"] for t in (c.get("logprobs") or {}).get("content") or []],
            )
            for d in docs
            for c in d["choices"]
        ]

    def outcome(overlap: bool) -> tuple[list[tuple[str, str, list[float]]], list[str], int]:
        got: dict[str, object] = {}

        async def body(app: App) -> None:
            assert app.engine is not None
            greedy = {**base, "temperature": 0}
            for _ in range(20):
                if not overlap or app.engine.stats().overlapped_steps > 0:
                    break
                await call(app, "POST", CHAT, greedy)
                await asyncio.sleep(0.2)
            first = (await call(app, "POST", CHAT, greedy)).json()["choices"][0]["message"]["content"]
            stops = [{**greedy, "stop": [first[i : i + 2]]} for i in (5, 11, 17) if len(first) > i + 2]
            docs = [(await call(app, "POST", CHAT, r)).json() for r in [sampled, *stops]]
            docs += list(await asyncio.gather(*(call(app, "POST", CHAT, r) for r in [sampled, *stops])))
            got["docs"] = [d if isinstance(d, dict) else d.json() for d in docs]
            got["streamed"] = [content(await call(app, "POST", CHAT, {**r, "stream": True})) for r in stops]
            got["overlapped"] = app.engine.stats().overlapped_steps

        engine: dict[str, object] = {"overlap": "on" if overlap else "off", "decode_steps": 4 if overlap else 1}
        run(app_for(tiny_dir, "tiny", **engine, decode_steps_max_ms=1e6), body)
        return answers(got["docs"]), got["streamed"], int(got["overlapped"])  # type: ignore[arg-type,call-overload]

    on, off = outcome(True), outcome(False)
    assert on[0] == off[0] and on[1] == off[1]
    assert on[2] > 0 and off[2] == 0
    assert any(reason == "stop" for _, reason, _ in on[0]) and len({text for text, _, _ in on[0]}) > 2
