"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) with the official
`anthropic` client over real HTTP: granian serving tests/helpers/fake_app.py (the real Engine over the
succ runner: "a" continues "bcd...") and its scripted model (a known tool call). Text, system,
stop_sequences, max_tokens, the streamed event sequence assembled by the client's own stream
helper equal to the non-streamed message, tool_use and tool_result blocks, count_tokens, and
errors in Anthropic's shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.helpers.granian_server import server

TOOLS: Any = [
    {
        "name": "get_weather",
        "description": "The weather",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]


GREEDY = {"temperature": 0}  # the client (2.x) no longer sends sampling fields itself; the API still takes them


def client(api: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api, api_key="x", max_retries=0)


def test_text_messages_streamed_and_not(tmp_path: Path) -> None:
    with server(tmp_path) as srv, client(srv.api) as c:
        msg = c.messages.create(
            model="succ", max_tokens=3, extra_body=GREEDY, messages=[{"role": "user", "content": "a"}]
        )
        assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
        assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "bcd"  # type: ignore[union-attr]
        assert msg.stop_reason == "max_tokens" and msg.usage.input_tokens == 1 and msg.usage.output_tokens == 3
        stopped = c.messages.create(
            model="succ",
            max_tokens=10,
            extra_body=GREEDY,
            stop_sequences=["de"],
            messages=[{"role": "user", "content": "a"}],
        )
        assert stopped.content[0].text == "bc"  # type: ignore[union-attr]
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "de")
        with c.messages.stream(
            model="succ", max_tokens=3, extra_body=GREEDY, messages=[{"role": "user", "content": "a"}]
        ) as s:
            final = s.get_final_message()
            assert "".join(s.text_stream) == ""  # consumed by get_final_message
        assert final.content[0].text == "bcd" and final.stop_reason == "max_tokens"  # type: ignore[union-attr]
        raw = httpx.post(
            f"{srv.api}/v1/messages",
            json={
                "model": "succ",
                "max_tokens": 2,
                "temperature": 0,
                "stream": True,
                "messages": [{"role": "user", "content": "a"}],
            },
        )
        names = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
        assert names == [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        system = c.messages.count_tokens(model="succ", system="xy", messages=[{"role": "user", "content": "a"}])
        assert system.input_tokens == 3  # the succ template: the contents concatenated


def test_errors_have_anthropics_shape(tmp_path: Path) -> None:
    with server(tmp_path) as srv, client(srv.api) as c:
        with pytest.raises(anthropic.BadRequestError) as bad:
            c.messages.create(
                model="succ", max_tokens=3, extra_body={"temperature": 1.5}, messages=[{"role": "user", "content": "a"}]
            )
        assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "temperature" in bad.value.body["error"]["message"]  # type: ignore[index]
        with pytest.raises(anthropic.NotFoundError) as nf:
            c.messages.create(model="claude-x", max_tokens=3, messages=[{"role": "user", "content": "a"}])
        assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        r = httpx.post(f"{srv.api}/v1/messages", json={"model": "succ", "messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"  # max_tokens is required
        assert "max_tokens" in r.json()["error"]["message"]
        image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]
        r = httpx.post(
            f"{srv.api}/v1/messages",
            json={"model": "succ", "max_tokens": 3, "messages": [{"role": "user", "content": image}]},
        )
        assert r.status_code == 422 and "messages[0].content[0].type" in r.json()["error"]["message"]


def test_tool_use_and_tool_result(tmp_path: Path) -> None:
    call = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_call>'
    env = {"FAKE_SCRIPT": "Checking. " + call, "FAKE_SCRIPT_PER_STEP": "4"}
    with (
        server(tmp_path, "num_kv_blocks = 4096\n", env=env, app="tests.helpers.fake_app:script_app") as srv,
        client(srv.api) as c,
    ):
        messages: Any = [{"role": "user", "content": "Weather in Rome?"}]
        msg = c.messages.create(model="succ", max_tokens=300, tools=TOOLS, messages=messages)
        assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["text", "tool_use"]
        use = msg.content[1]
        assert use.name == "get_weather" and use.input == {"city": "Rome"} and use.id.startswith("toolu_")  # type: ignore[union-attr]
        with c.messages.stream(model="succ", max_tokens=300, tools=TOOLS, messages=messages) as s:
            final = s.get_final_message()
        assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
        assert final.content[1].input == {"city": "Rome"} and final.content[0].text == "Checking. "  # type: ignore[union-attr]
        follow = [
            *messages,
            {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21C"}]},  # type: ignore[union-attr]
        ]
        counted = c.messages.count_tokens(model="succ", tools=TOOLS, messages=follow)
        assert counted.input_tokens > len(json.dumps(TOOLS[0]["input_schema"]))  # the tools and the history rendered
        again = c.messages.create(model="succ", max_tokens=300, tools=TOOLS, messages=follow)  # the history runs
        assert again.stop_reason == "tool_use"
