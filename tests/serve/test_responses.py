"""OpenAI's Responses API with the official openai client over real HTTP (granian serving
tests/helpers/fake_app.py: the real Engine over the succ runner, and its scripted model for a known
function call): `responses.create` and `responses.stream` (the client's own assembly of the
typed events equals the non-streamed response), status `incomplete` on a length cut, usage,
function calls and their outputs, `text.format` through structured output, the store
(`previous_response_id`, GET, DELETE, its bound), and 422s naming unsupported items; plus the
store's LRU and age bounds in isolation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from serve.errors import ApiError
from serve.responses import ResponseStore
from serve.wire import ResponseDoc
from tests.helpers.granian_server import server


def client(api: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api}/v1", api_key="x", max_retries=0)


def test_create_stream_store_and_errors(tmp_path: Path) -> None:
    with server(tmp_path, "responses_store_size = 2\n") as srv, client(srv.api) as c:
        r = c.responses.create(model="succ", input="a", max_output_tokens=3, temperature=0)
        assert r.id.startswith("resp_") and r.object == "response" and r.status == "incomplete"
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
        assert r.output_text == "bcd" and r.output[0].type == "message"
        assert r.usage is not None and (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (1, 3, 4)
        with c.responses.stream(model="succ", input="a", max_output_tokens=3, temperature=0) as s:
            kinds = [e.type for e in s]
            final = s.get_final_response()
        assert final.output_text == "bcd" and final.status == "incomplete"
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.output_item.added" in kinds and "response.content_part.added" in kinds
        assert kinds.count("response.output_text.delta") == 3 and "response.output_text.done" in kinds
        raw = httpx.post(
            f"{srv.api}/v1/responses",
            json={"model": "succ", "input": "a", "max_output_tokens": 2, "temperature": 0, "stream": True},
        )
        numbers = [
            json.loads(line[6:])["sequence_number"] for line in raw.text.splitlines() if line.startswith("data: ")
        ]
        assert numbers == list(range(len(numbers)))
        # the store: continue, get, delete; past its bound of 2 the oldest is gone
        first = c.responses.create(model="succ", input="x", max_output_tokens=2, temperature=0)
        follow = c.responses.create(
            model="succ", input="y", previous_response_id=first.id, max_output_tokens=2, temperature=0
        )
        assert follow.output_text == "z{"  # the conversation "x" "yz" "y" rendered by the succ template ends in "y"
        assert c.responses.retrieve(follow.id).output_text == "z{"
        c.responses.delete(follow.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(follow.id)
        c.responses.create(model="succ", input="a", max_output_tokens=1, temperature=0)
        c.responses.create(model="succ", input="a", max_output_tokens=1, temperature=0)
        with pytest.raises(openai.NotFoundError) as nf:
            c.responses.retrieve(first.id)
        assert nf.value.code == "not_found"
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model="succ", input="a", previous_response_id="resp_nope")
        with pytest.raises(openai.UnprocessableEntityError) as bad:
            c.responses.create(
                model="succ", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
            )  # type: ignore[list-item]
        assert bad.value.param == "input[0].content[0].type"
        with pytest.raises(openai.UnprocessableEntityError) as bad:
            c.responses.create(model="succ", input="a", tools=[{"type": "web_search"}])  # type: ignore[list-item]
        assert bad.value.param == "tools[0].type"
        fmt: Any = {"format": {"type": "json_schema", "name": "pick", "schema": {"enum": ["yes", "no"]}}}
        r = c.responses.create(model="succ", input="a", text=fmt, temperature=0)
        assert r.output_text in ('"yes"', '"no"') and r.status == "completed"


def test_function_calls_and_their_outputs(tmp_path: Path) -> None:
    weather, now = '{"name": "get_weather", "arguments": {"city": "Rome"}}', '{"name": "now", "arguments": {}}'
    env = {"FAKE_SCRIPT": f"Checking. <tool_call>[{weather}, {now}]</tool_call>", "FAKE_SCRIPT_PER_STEP": "4"}
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools: Any = [
        {"type": "function", "name": "get_weather", "parameters": city},
        {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}}},
    ]
    with (
        server(tmp_path, "num_kv_blocks = 4096\n", env=env, app="tests.helpers.fake_app:script_app") as srv,
        client(srv.api) as c,
    ):
        r = c.responses.create(model="succ", input="weather?", tools=tools, max_output_tokens=300)
        assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
        calls = [o for o in r.output if o.type == "function_call"]
        assert [(o.name, o.arguments) for o in calls] == [("get_weather", '{"city": "Rome"}'), ("now", "{}")]  # type: ignore[union-attr]
        assert all(o.call_id.startswith("call_") for o in calls) and r.status == "completed"  # type: ignore[union-attr]
        with c.responses.stream(model="succ", input="weather?", tools=tools, max_output_tokens=300) as s:
            kinds = [e.type for e in s]
            final = s.get_final_response()
        streamed = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]  # type: ignore[union-attr]
        assert streamed == [("get_weather", '{"city": "Rome"}'), ("now", "{}")]
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
        history: Any = [
            {"role": "user", "content": "weather?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": '{"city": "Rome"}',
            },  # type: ignore[union-attr]
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21C"},  # type: ignore[union-attr]
        ]
        again = c.responses.create(model="succ", input=history, tools=tools, max_output_tokens=300)
        assert again.status == "completed"


def _doc(rid: str) -> ResponseDoc:
    return ResponseDoc(
        rid, "response", 0, "completed", None, "m", [], None, None, {}, True, None, None, None, [], {}, None, None, True
    )


def test_the_store_is_bounded_by_count_and_age() -> None:
    now = [0.0]
    store = ResponseStore(2, 10.0, clock=lambda: now[0])
    for rid in ("a", "b"):
        store.put(_doc(rid), [])
    store.get("a")  # a is now the most recent
    store.put(_doc("c"), [])
    assert len(store) == 2 and store.get("a") and store.get("c")
    with pytest.raises(ApiError):
        store.get("b")
    now[0] = 10.5
    store.put(_doc("d"), [])
    with pytest.raises(ApiError):
        store.get("a")  # older than 10 s
    assert len(store) == 1
