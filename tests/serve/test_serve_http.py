"""The server over real HTTP: the granian CLI as a subprocess on pre-picked free ports.

The engine is the real tl.core.engine.Engine over the succ runner (granian serves the tests'
target tests/helpers/fake_app.py, an App built with that engine's factory), so no JAX compile is
needed. Covers the health port,
the official openai client, disconnects freeing blocks, SIGTERM drain and start-up refusal.
Every test stops the server it starts.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.granian_server import server

pytestmark = pytest.mark.serial  # timing bounds: `make test` runs it alone, after the parallel part

CHAT = {"model": "succ", "messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "temperature": 0}


def test_health_port_tokenize_models_and_openai_client(tmp_path: Path) -> None:
    with (
        server(tmp_path, 'api_keys = ["sk-test"]\n') as srv,
        openai.OpenAI(base_url=f"{srv.api}/v1", api_key="sk-test", max_retries=0) as client,
    ):
        assert httpx.get(f"{srv.health}/healthz").status_code == 200
        assert httpx.get(f"{srv.health}/readyz").status_code == 200
        m = httpx.get(f"{srv.health}/metrics")
        assert m.status_code == 200 and "text/plain" in m.headers["content-type"]
        assert 'tl_engine_kv_blocks{state="free"}' in m.text and "tl_engine_queue_depth" in m.text
        assert httpx.get(f"{srv.health}/nope").status_code == 404
        assert httpx.get(f"{srv.api}/v1/models").status_code == 401
        assert [m.id for m in client.models.list().data] == ["succ"]
        r = client.chat.completions.create(
            model="succ", messages=[{"role": "user", "content": "a"}], max_tokens=3, temperature=0
        )
        assert r.choices[0].message.content == "bcd" and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (1, 3)  # type: ignore[union-attr]
        r = client.chat.completions.create(
            model="succ",
            messages=[{"role": "user", "content": "a"}],
            max_completion_tokens=10,
            temperature=0,
            stop=["de"],
        )
        assert r.choices[0].message.content == "bc" and r.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(
            model="succ",
            messages=[{"role": "user", "content": "a"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "bcdef"
        assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 6
        with client.chat.completions.stream(
            model="succ", messages=[{"role": "user", "content": "a"}], max_tokens=10, temperature=0, stop="f"
        ) as s:
            assert s.get_final_completion().choices[0].message.content == "bcde"
        c = client.completions.create(model="succ", prompt="a", temperature=0)
        assert len(c.choices[0].text) == 16 and c.usage.completion_tokens == 16  # type: ignore[union-attr]
        e = client.embeddings.create(model="succ", input=["ab", "c"])
        assert [d.index for d in e.data] == [0, 1] and abs(sum(x * x for x in e.data[0].embedding) - 1) < 1e-6
        e = client.embeddings.create(model="succ", input="ab")  # the client asks for base64 by default
        assert abs(sum(x * x for x in e.data[0].embedding) - 1) < 1e-6
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="succ", messages=[{"role": "user", "content": "a"}], temperature=3)
        assert bad.value.param == "temperature" and bad.value.type == "invalid_request_error"
        with pytest.raises(openai.NotFoundError) as nf:
            client.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "a"}])
        assert nf.value.code == "model_not_found"
        with pytest.raises(openai.UnprocessableEntityError):
            client.chat.completions.create(
                model="succ", messages=[{"role": "user", "content": "a"}], extra_body={"functions": [{"name": "f"}]}
            )
        r2 = httpx.post(
            f"{srv.api}/v1/tokenize",
            json={"prompt": "ab"},
            headers={"Authorization": "Bearer sk-test", "X-Request-Id": "t-9"},
        )
        assert r2.json()["tokens"] == [97, 98] and r2.headers["x-request-id"] == "t-9"


def test_429_disconnect_and_drain(tmp_path: Path) -> None:
    extra = "max_num_seqs = 1\nseq_buckets = [1]\nqueue_capacity = 1\ndrain_timeout_s = 10\n"
    with (
        server(tmp_path, extra, env={"FAKE_STEP_DELAY_S": "0.01"}) as srv,
        openai.OpenAI(base_url=f"{srv.api}/v1", api_key="x", max_retries=0) as client,
    ):
        long = {**CHAT, "messages": [{"role": "user", "content": "A"}], "max_tokens": 60, "stream": True}
        with httpx.Client(timeout=10) as h1, httpx.Client(timeout=10) as h2:
            # disconnect mid-stream frees the blocks (seen in /metrics) within 2 s
            with h1.stream("POST", f"{srv.api}/v1/chat/completions", json=long) as resp:
                lines = resp.iter_lines()
                assert next(lines).startswith("data: ")
            t0 = time.monotonic()
            while srv.metric("tl_engine_active_sequences") or srv.metric('tl_engine_kv_blocks{state="used"}'):
                assert time.monotonic() - t0 < 2.0, "blocks not freed after a disconnect"
                time.sleep(0.02)
            # queue of one: running + one waiting, the third is refused at once with Retry-After
            with h1.stream("POST", f"{srv.api}/v1/chat/completions", json=long) as running:
                run_lines = running.iter_lines()
                assert next(run_lines).startswith("data: ")
                with h2.stream("POST", f"{srv.api}/v1/chat/completions", json={**long, "max_tokens": 3}) as queued:
                    t0 = time.monotonic()
                    while srv.metric("tl_engine_queue_depth") != 1:
                        assert time.monotonic() - t0 < 2.0
                        time.sleep(0.01)
                    t0 = time.monotonic()
                    r3 = httpx.post(f"{srv.api}/v1/chat/completions", json=CHAT)
                    assert r3.status_code == 429 and r3.headers["retry-after"] == "1"
                    assert time.monotonic() - t0 < 0.5
                    with pytest.raises(openai.RateLimitError):
                        client.chat.completions.create(model="succ", messages=[{"role": "user", "content": "a"}])
                    # SIGTERM: readyz 503, new requests refused, in-flight streams reach [DONE], exit 0
                    os.kill(srv.proc.pid, signal.SIGTERM)
                    t0 = time.monotonic()
                    while httpx.get(f"{srv.health}/readyz").status_code != 503:
                        assert time.monotonic() - t0 < 2.0
                        time.sleep(0.01)
                    assert httpx.get(f"{srv.health}/healthz").status_code == 200
                    try:
                        refused = httpx.post(f"{srv.api}/v1/chat/completions", json=CHAT, timeout=2).status_code
                    except httpx.TransportError:
                        refused = -1
                    assert refused in (503, -1)
                    rest = list(run_lines)
                    assert [ln for ln in rest if ln][-1] == "data: [DONE]"
                    q = [ln for ln in queued.iter_lines() if ln]
                    assert q[-1] == "data: [DONE]"
                    text = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content") or "" for ln in q[:-1])
                    assert text == "BCD"
        assert srv.proc.wait(10) == 0


def test_bad_config_stops_startup_with_the_name(tmp_path: Path) -> None:
    with server(tmp_path, "prefill_chunkz = 3\n", expect_ready=False) as srv:
        assert srv.proc.wait(20) != 0
        assert srv.proc.stdout is not None
        assert "prefill_chunkz" in srv.proc.stdout.read().decode()


def test_tl_serve_config_starts_granian_and_drains_on_sigterm(tmp_path: Path) -> None:
    with server(tmp_path, via_cli=True) as srv:
        r = httpx.post(f"{srv.api}/v1/chat/completions", json=CHAT)
        assert r.json()["choices"][0]["message"]["content"] == "bcd"
        os.kill(srv.proc.pid, signal.SIGTERM)
        assert srv.proc.wait(10) == 0


def test_openai_client_tool_calls_under_auto_from_a_scripted_model(tmp_path: Path) -> None:
    """`tool_choice` auto end to end with the official client: a scripted model answers text and
    two calls; create() and the client's own stream accumulation give the same calls."""
    weather, now = '{"name": "get_weather", "arguments": {"city": "Rome"}}', '{"name": "now", "arguments": {}}'
    calls = f"<tool_call>[{weather}, {now}]</tool_call>"
    env = {"FAKE_SCRIPT": "Checking. " + calls, "FAKE_SCRIPT_PER_STEP": "3"}
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
    messages: Any = [{"role": "user", "content": "weather?"}]
    with (
        server(tmp_path, "num_kv_blocks = 4096\n", env=env, app="tests.helpers.fake_app:script_app") as srv,
        openai.OpenAI(base_url=f"{srv.api}/v1", api_key="x", max_retries=0) as client,
    ):
        done = client.chat.completions.create(model="succ", messages=messages, tools=tools, max_tokens=300)
        msg = done.choices[0].message
        assert done.choices[0].finish_reason == "tool_calls" and msg.content == "Checking. "
        got = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]  # type: ignore[union-attr]
        assert got == [("get_weather", '{"city": "Rome"}'), ("now", "{}")]
        with client.chat.completions.stream(model="succ", messages=messages, tools=tools, max_tokens=300) as s:
            final = s.get_final_completion()
        streamed = final.choices[0].message
        assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls or []] == got
        assert streamed.content == "Checking. " and final.choices[0].finish_reason == "tool_calls"
        assert len({c.id for c in streamed.tool_calls or []}) == 2
