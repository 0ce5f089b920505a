"""Tool calling through the ASGI app: the real Engine with the succ runner (it follows the
grammar, so forced calls are hand-checkable) and ScriptEngine, a tiny scripted model whose
answer is a known text (a known call under "auto"). Non-streamed and streamed shapes exactly as
the OpenAI API has them, streamed arguments equal to the non-streamed ones byte for byte, two
calls in one delivery, no marker in content, "none" never parsing, the 400s naming the field,
and a multi-turn conversation with a tool result."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from serve.app import App
from tests.helpers.asgi_client import Reply, call
from tests.helpers.fake_engine import ScriptEngine, SuccRunner, byte_grammars, byte_model, byte_tools
from tests.helpers.serve_app import CHAT, run
from tl.core.async_engine import AsyncEngine
from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.entry.served import ServedModel
from tl.text.tools import ToolSetup, setup

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]
CONFIG = EngineConfig(model_dir="models/succ", block_size=4, num_kv_blocks=2048)


def succ_app() -> App:
    def build(cfg: EngineConfig) -> tuple[AsyncEngine, ServedModel]:
        engine = Engine(SuccRunner(block_size=4, num_kv_blocks=2048, max_model_len=4096), cfg)
        return AsyncEngine(engine, byte_grammars(cfg)), byte_model(
            cfg, engine.max_model_len, tools=byte_tools(), model_id="succ"
        )

    return App(CONFIG, build, handle_signals=False, start_health=False)


def script_app(script: str, per_step: int = 1, tools: ToolSetup | None = None) -> App:
    def build(cfg: EngineConfig) -> tuple[AsyncEngine, ServedModel]:
        engine = ScriptEngine(cfg, script.encode(), per_step)
        setup = tools or byte_tools()
        return AsyncEngine(engine, byte_grammars(cfg)), byte_model(
            cfg, engine.max_model_len, tools=setup, model_id="succ"
        )

    return App(CONFIG, build, handle_signals=False, start_health=False)


def ask(**kw: Any) -> dict[str, Any]:
    return {"model": "succ", "messages": [{"role": "user", "content": "a"}], "temperature": 0, "max_tokens": 200, **kw}


def streamed(r: Reply) -> tuple[str, list[dict[str, Any]], str | None, list[dict[str, Any]]]:
    """(content, calls assembled from the deltas, the last finish_reason, every delta)."""
    text, calls, finish, deltas = "", [], None, []
    for e in r.events()[:-1]:
        for ch in json.loads(e)["choices"]:
            d = ch["delta"]
            deltas.append(d)
            text += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                if "id" in tc:
                    assert tc["index"] == len(calls) and tc["type"] == "function" and tc["function"]["arguments"] == ""
                    calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                    calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
            finish = ch["finish_reason"] or finish
    return text, calls, finish, deltas


def plain_calls(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in doc["choices"][0]["message"].get("tool_calls") or []
    ]


async def both(app: App, req: dict[str, Any]) -> tuple[dict[str, Any], tuple[Any, ...]]:
    doc = (await call(app, "POST", CHAT, req)).json()
    return doc, streamed(await call(app, "POST", CHAT, {**req, "stream": True}))


def same_calls(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return [(c["name"], c["arguments"]) for c in a] == [(c["name"], c["arguments"]) for c in b]


def test_required_and_named_calls_are_forced_and_shaped_as_openai_does() -> None:
    async def body(app: App) -> None:
        for choice, want in (
            ("required", [("get_weather", '{"city": "Paris"}')]),
            ({"type": "function", "function": {"name": "now"}}, [("now", "{}")]),  # no parameters: "{}", never dropped
        ):
            doc, (text, calls, finish, _) = await both(
                app, ask(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
            )
            msg = doc["choices"][0]["message"]
            assert msg["content"] is None and doc["choices"][0]["finish_reason"] == "tool_calls"
            got = plain_calls(doc)
            assert [(c["name"], c["arguments"]) for c in got] == want
            assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in got)
            assert msg["tool_calls"][0]["type"] == "function"
            assert text == "" and finish == "tool_calls" and same_calls(calls, got)
            if want[0][0] == "get_weather":
                jsonschema.validate(json.loads(got[0]["arguments"]), CITY)
        # parallel calls: the succ model keeps calling until max_tokens; every call is complete but the last
        doc, (_, calls, finish, _) = await both(app, ask(tools=TOOLS, tool_choice="required", max_tokens=120))
        got = plain_calls(doc)
        assert len(got) >= 2 and len({c["id"] for c in got}) == len(got) and same_calls(calls, got)
        assert doc["choices"][0]["finish_reason"] == finish == "length"

    run(succ_app(), body)


CALLS = (
    '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "now", "arguments": {}}]</tool_call>'
)


@pytest.mark.parametrize("per_step", [1, 7, 1000], ids=["token_by_token", "chunks", "all_at_once"])
def test_auto_with_a_scripted_call_streams_the_same_calls(per_step: int) -> None:
    """Text then two calls, arriving a token at a time, in chunks, or in one delivery."""

    async def body(app: App) -> None:
        doc, (text, calls, finish, deltas) = await both(app, ask(tools=TOOLS))
        assert doc["choices"][0]["message"]["content"] == text == "Let me check. "
        got = plain_calls(doc)
        assert [(c["name"], c["arguments"]) for c in got] == [("get_weather", '{"city": "Rome"}'), ("now", "{}")]
        assert same_calls(calls, got) and doc["choices"][0]["finish_reason"] == finish == "tool_calls"
        assert not any("<" in (d.get("content") or "") for d in deltas)  # no marker leaks into content

    run(script_app("Let me check. " + CALLS, per_step), body)


def test_the_hermes_form_end_to_end() -> None:
    """A model whose template writes Hermes blocks: one block per call, parsed and forced alike."""
    from tests.helpers.models import HERMES_TEMPLATE
    from tl.text.chat_template import ChatTemplate

    hermes = setup("auto", ChatTemplate(HERMES_TEMPLATE))
    script = 'On it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    script += '<tool_call>{"name": "now", "arguments": {}}</tool_call>'

    async def body(app: App) -> None:
        doc, (text, calls, finish, _) = await both(app, ask(tools=TOOLS))
        got = plain_calls(doc)
        assert [(c["name"], c["arguments"]) for c in got] == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
        assert doc["choices"][0]["message"]["content"] == text == "On it.\n" and same_calls(calls, got)
        assert finish == "tool_calls"
        tok = await call(app, "POST", "/v1/tokenize", {"model": "succ", "messages": [{"role": "user", "content": "a"}]})
        assert "<tools>" not in bytes(tok.json()["tokens"]).decode()  # no tools in the request: none rendered

    run(script_app(script, 5, hermes), body)


def test_auto_answers_text_and_none_never_parses() -> None:
    async def body(app: App) -> None:
        doc, (text, calls, finish, _) = await both(app, ask(tools=TOOLS, max_tokens=12))  # succ: plain text
        assert doc["choices"][0]["message"]["content"] == text and len(text) == 12 and calls == []
        assert "tool_calls" not in doc["choices"][0]["message"] and finish == "length"

    run(succ_app(), body)

    async def none(app: App) -> None:
        doc, (text, calls, finish, _) = await both(app, ask(tools=TOOLS, tool_choice="none"))
        assert doc["choices"][0]["message"]["content"] == text == "Calling: " + CALLS  # verbatim, never parsed
        assert calls == [] and finish == "stop" == doc["choices"][0]["finish_reason"]

    run(script_app("Calling: " + CALLS), none)


def test_a_script_that_leaves_the_grammar_is_an_error_never_a_call() -> None:
    async def body(app: App) -> None:
        r = await call(app, "POST", CHAT, ask(tools=TOOLS))
        assert r.status == 500 and r.error()["code"] == "structured_output_failed"

    run(script_app('<tool_call>[{"name": "delete_everything", "arguments": {}}]</tool_call>'), body)


def tool_call(name: str, arguments: str, id: str = "c") -> dict[str, Any]:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


USER = {"role": "user", "content": "a"}
BAD: list[tuple[Callable[[], dict[str, Any]], str, str]] = [
    (lambda: ask(tool_choice="auto"), "tool_choice", "only allowed when tools"),
    (lambda: ask(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}), "tool_choice", "'x'"),
    (lambda: ask(tools=[TOOLS[0], TOOLS[0]]), "tools", "'get_weather' appears more than once"),
    (
        lambda: ask(tools=[TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]),
        "tools[1].function.parameters",
        "Invalid type",
    ),
    (lambda: ask(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name", ""),
    (lambda: ask(tools=TOOLS, response_format={"type": "json_object"}), "response_format", "both constrain"),
    (
        lambda: ask(messages=[USER, {"role": "assistant", "tool_calls": [tool_call("now", "{x")]}]),
        "messages[1].tool_calls[0].function.arguments",
        "not valid JSON",
    ),
]  # fmt: skip


def test_bad_tool_requests_are_400s_naming_the_field() -> None:
    async def body(app: App) -> None:
        for make, param, reason in BAD:
            r = await call(app, "POST", CHAT, make())
            assert r.status == 400, (make(), r.body)
            assert r.error()["param"] == param and reason in r.error()["message"], r.error()
        r = await call(app, "POST", "/v1/completions", {"model": "succ", "prompt": "a", "tools": TOOLS})
        assert r.status == 422 and r.error()["param"] == "tools"

    run(succ_app(), body)


def test_a_multi_turn_conversation_with_tool_results_renders_and_runs() -> None:
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [tool_call("get_weather", '{"city": "Rome"}', "call_1")],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
        {"role": "assistant", "content": "21C in Rome.", "tool_calls": []},  # empty tool_calls: absent
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip

    async def body(app: App) -> None:
        tok = (await call(app, "POST", "/v1/tokenize", {"model": "succ", "messages": history})).json()
        rendered = bytes(tok["tokens"]).decode()
        assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_call>' in rendered
        assert "<tool_response>21C</tool_response>" in rendered and "21C in Rome.<|im_end|>" in rendered
        doc = (
            await call(
                app, "POST", CHAT, ask(messages=history, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
            )
        ).json()
        assert doc["choices"][0]["finish_reason"] == "tool_calls"

    run(succ_app(), body)
