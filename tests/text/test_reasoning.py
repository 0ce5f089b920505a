"""Reasoning models: the thinking apart from the answer in every API.

Pure tests of tl/text/reasoning.py (the text split at every cut, the detection, the guide that
gates an answer's grammar and forces `</think>` on a spent budget, also under the real Engine's
scheduler), then the official `openai`
and `anthropic` clients over real HTTP against one granian server of tests/helpers/fake_app.py's
`think_app` (tests/helpers/fake_think.py: a scripted model, 3 tokens a step, `<think>`/`</think>` special
tokens): reasoning_content and reasoning, streamed before the content and equal to the document,
markers never in content (also when written byte by byte), reasoning_tokens, enable_thinking
false and other chat_template_kwargs reaching the template, a prompt that opened the thinking,
the budget, a json_schema answer and a forced tool call after the thinking, the Responses API's
reasoning items and events, the Messages API's thinking blocks and its `thinking` field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import numpy as np
import openai
import pytest

from serve.params import message_dicts
from serve.wire import CallFunction, ChatMessage, ToolCall
from tests.helpers.fake_engine import SuccRunner
from tests.helpers.fake_runner import pick_allowed
from tests.helpers.fake_think import END_ID, SCRIPTS, THINK_ID, TOKENIZER, VOCAB, allowed, think_grammars
from tests.helpers.granian_server import Server, server
from tests.helpers.models import IM_END_ID
from tl.core.config import ConfigError, EngineConfig
from tl.core.engine import Engine
from tl.core.plan import RunnerOutput, SchedulerOutput, SeqResult
from tl.core.request import ConstraintSpec, GenRequest, SamplingParams, TokenOut
from tl.text.reasoning import Markers, ReasoningParser, ReasoningText, ThinkSpec, setup

MARKERS = Markers(THINK_ID, END_ID)
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def split(pieces: list[str], opened: bool = False) -> tuple[str, str]:
    p = ReasoningParser(MARKERS, opened)
    out = [e for piece in pieces for e in p.push(piece)] + p.finish()
    thought = "".join(e.text for e in out if isinstance(e, ReasoningText))
    return thought, "".join(e for e in out if isinstance(e, str))


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>\nLet me think.\n</think>\n\nThe answer.", False, ("Let me think.", "The answer.")),
        ("opened thought </th>\n</think>\n\nA </think>", True, ("opened thought </th>", "A </think>")),
        ("No thinking, <think>here</think> is text.", False, ("", "No thinking, <think>here</think> is text.")),
        ("<thing> is not a marker", False, ("", "<thing> is not a marker")),
        ("<think>\ncut off mid thought <", False, ("cut off mid thought <", "")),
        ("<think></think>Only the answer.", False, ("", "Only the answer.")),
    ],
)
def test_parser_splits_the_same_at_every_cut(text: str, opened: bool, expected: tuple[str, str]) -> None:
    assert split([text], opened) == expected
    assert split(list(text), opened) == expected  # one character at a time
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            assert split([text[:i], text[i:j], text[j:]], opened) == expected


def test_setup_detects_from_template_or_vocabulary() -> None:
    assert setup("auto", "{{ '<think>' }}", TOKENIZER).markers == MARKERS
    assert "vocabulary" in setup("auto", "plain", TOKENIZER).reason
    assert setup("none", "<think>", TOKENIZER).markers is None
    from tests.helpers.fake_engine import ByteTokenizer

    assert setup("auto", "<think>", ByteTokenizer()).markers is None  # no such tokens
    with pytest.raises(ConfigError, match="single tokens"):
        setup("think", "", ByteTokenizer())
    with pytest.raises(ConfigError, match="reasoning_parser"):
        EngineConfig(model_dir="m", reasoning_parser="r1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="thinking_token_budget"):
        EngineConfig(model_dir="m", thinking_token_budget=-2)


def test_a_prompt_opens_the_thinking_when_its_last_marker_is_think() -> None:
    enc = TOKENIZER.encode
    assert ThinkSpec.of(MARKERS, enc("<|im_start|>assistant\n<think>\n"), None).opened
    assert not ThinkSpec.of(MARKERS, enc("<think>\nold\n</think>\n\nhi<|im_start|>assistant\n"), None).opened
    assert not ThinkSpec.of(MARKERS, enc("<think>\n\n</think>\n\n"), None).opened
    assert ThinkSpec.of(MARKERS, enc("x"), 4).constraint(None) is not None  # a budget needs the guide
    assert ThinkSpec.of(MARKERS, enc("x"), None).constraint(None) is None  # nothing to enforce


def test_guide_gates_the_answer_grammar_and_forces_the_end_on_budget() -> None:
    grammar = think_grammars(EngineConfig(model_dir="m")).compile(ConstraintSpec("json", json.dumps(CITY), "x")).grammar
    guide = ThinkSpec(MARKERS, opened=False, budget=3).constraint(grammar)
    assert guide is not None
    g = guide.matcher()
    first = allowed(g)
    assert THINK_ID in first and ord("{") in first and ord("a") not in first  # <think>, or the answer
    thought = [THINK_ID, *b"abc"]
    assert g.valid_prefix([*thought, ord("d")]) == 4  # the budget is spent after 3 thought tokens
    answer = TOKENIZER.encode('{"city":"Rome"}')
    assert g.valid_prefix([*thought, END_ID, *answer]) == 5 + len(answer)
    assert g.valid_prefix([*thought, END_ID, ord("x")]) == 5  # the answer's grammar holds after </think>
    rows = np.zeros((6, (VOCAB + 31) // 32), np.int32)
    g.fill(rows, 0, [*thought, END_ID])  # drafts across the phases: the same rows as step by step
    for k, t in enumerate([*thought, END_ID]):
        assert _ids(rows[k]) == allowed(g), k
        assert g.accept(t)
    assert _ids(rows[5]) == allowed(g)
    assert [t for t in range(VOCAB) if g.valid_prefix([t])] == allowed(g)
    for t in answer:
        assert not g.done and g.accept(t)
    assert g.done
    fresh = guide.matcher()  # drafts that answer at once: the answer's grammar from the first token
    assert fresh.valid_prefix(answer) == len(answer) and fresh.valid_prefix([ord("{"), ord("x")]) == 1
    rows = np.zeros((3, (VOCAB + 31) // 32), np.int32)
    fresh.fill(rows, 0, answer[:2])
    for k, t in enumerate(answer[:2]):
        assert _ids(rows[k]) == allowed(fresh), k
        assert fresh.accept(t)
    assert _ids(rows[2]) == allowed(fresh)
    spent = ThinkSpec(MARKERS, opened=True, budget=0).constraint(None).matcher()  # type: ignore[union-attr]
    assert allowed(spent) == [END_ID] and not spent.accept(ord("a")) and "budget" in spent.error


class ScriptRunner(SuccRunner):
    """A Runner for the real Engine: the script's next token, or what the guide's mask allows
    (the forced </think>: the script goes on after its own)."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(block_size=4, num_kv_blocks=256, max_model_len=512)
        self.script = script

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        results = []
        for w in plan.work:
            if not w.sample:
                continue
            n = w.num_generated
            tok = self.script[n] if n < len(self.script) else IM_END_ID
            if w.guide is not None:
                mask = np.zeros((1, (VOCAB + 31) // 32), np.int32)
                w.guide.fill(mask, 0, ())
                tok = pick_allowed(mask[0], tok, VOCAB)
                if tok == END_ID and END_ID in self.script[n:]:
                    del self.script[n : self.script.index(END_ID, n)]
            results.append(SeqResult(w.seq_id, (tok,), (0.0,), ()))
        return RunnerOutput(tuple(results))


def test_the_real_engine_forces_the_end_and_gates_the_answer() -> None:
    """tl.core.engine.Engine's scheduler feeds the guide: 5 thought tokens, the forced </think>,
    then the answer under its schema, finished by the grammar."""
    cfg = EngineConfig(model_dir="m", block_size=4, num_kv_blocks=256)
    script = TOKENIZER.encode("<think>\n" + "abc " * 10 + '</think>{"city":"Rome"}')
    engine = Engine(ScriptRunner(script), cfg)
    grammar = think_grammars(cfg).compile(ConstraintSpec("json", json.dumps(CITY), "x")).grammar
    constraint = ThinkSpec(MARKERS, opened=False, budget=5).constraint(grammar)
    engine.add_request(GenRequest((1, 2), SamplingParams(temperature=0, max_tokens=100), 0, constraint))
    outs: list[TokenOut] = []
    while not outs or outs[-1].finish_reason is None:
        outs += engine.step()
    assert outs[-1].finish_reason == "stop"
    assert TOKENIZER.decode(o.token_id for o in outs) == '<think>\nabc </think>{"city":"Rome"}'


def _ids(row: np.ndarray) -> list[int]:
    """The token ids a bitmask row allows (bits past the vocabulary ignored)."""
    return [int(i) for i in np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB])]


def test_messages_reach_the_template_as_it_expects() -> None:
    call = ToolCall(id="c1", function=CallFunction("get_weather", '{"city": "Rome"}'))
    dicts = message_dicts(
        [
            ChatMessage(role="developer", content="Be brief."),
            ChatMessage(role="assistant", content=None, tool_calls=[call], reasoning="I call."),
            ChatMessage(role="assistant", content="x", reasoning_content="Old thought."),
        ]
    )
    assert dicts[0] == {"role": "system", "content": "Be brief."}
    assert dicts[1]["content"] == "" and dicts[1]["reasoning_content"] == "I call."  # content null: "" (Qwen3)
    assert dicts[2]["reasoning_content"] == "Old thought."


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with server(
        tmp_path_factory.mktemp("think"), "num_kv_blocks = 4096\n", app="tests.helpers.fake_app:think_app"
    ) as s:
        yield s


def oai(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.api}/v1", api_key="x", max_retries=0)


def user(text: str) -> Any:
    return [{"role": "user", "content": text}]


def num_tokens(text: str) -> int:
    return len(TOKENIZER.encode(text))


def streamed(c: openai.OpenAI, **kw: Any) -> tuple[str, str, list[str], Any]:
    """(reasoning, content, the order of delta kinds, usage) of a streamed chat answer."""
    reasoning, content, kinds, usage = [], [], [], None
    for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                reasoning.append(extra["reasoning_content"])
                kinds.append("reasoning")
            if ch.delta.content:
                assert "<think>" not in ch.delta.content and "</think>" not in ch.delta.content
                content.append(ch.delta.content)
                kinds.append("content")
    return "".join(reasoning), "".join(content), kinds, usage


def test_chat_splits_thinking_streamed_and_not(srv: Server) -> None:
    with oai(srv) as c:
        for prompt in ("plain", "bytes"):  # "bytes": the markers written as plain bytes
            r = c.chat.completions.create(model="think", messages=user(prompt))
            m = r.choices[0].message
            extra = m.model_extra or {}
            assert extra["reasoning_content"] == extra["reasoning"] == 'Let me think about "a".'
            assert m.content == "The answer is b."
            thought, content, kinds, usage = streamed(c, model="think", messages=user(prompt))
            assert (thought, content) == (extra["reasoning"], m.content)
            assert kinds == sorted(kinds, reverse=True) and kinds.count("reasoning") > 1  # thinking first, in pieces
            assert usage.completion_tokens == r.usage.completion_tokens  # type: ignore[union-attr]
        assert r.usage is not None and r.usage.completion_tokens_details is not None
        assert r.usage.completion_tokens_details.reasoning_tokens == 0  # byte-level markers: no marker token
        plain = c.chat.completions.create(model="think", messages=user("plain"))
        details = plain.usage.completion_tokens_details  # type: ignore[union-attr]
        assert details is not None and details.reasoning_tokens == num_tokens(SCRIPTS["plain"].split("\n\n")[0])


def test_thinking_off_and_template_kwargs_reach_the_template(srv: Server) -> None:
    with oai(srv) as c:
        for extra in (
            {"chat_template_kwargs": {"enable_thinking": False}},
            {"reasoning_effort": "none"},
        ):
            r = c.chat.completions.create(model="think", messages=user("plain"), extra_body=extra)
            m = r.choices[0].message
            assert m.content == SCRIPTS["off"] and "reasoning_content" not in (m.model_extra or {})
            assert r.usage.completion_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]
        opened = {"chat_template_kwargs": {"open_think": True}}  # the template ends the prompt with <think>
        r = c.chat.completions.create(model="think", messages=user("plain"), extra_body=opened)
        m = r.choices[0].message
        assert (m.model_extra or {})["reasoning"] == "Thinking that the template opened."
        assert m.content == "Answer after an opened thought."
        assert streamed(c, model="think", messages=user("plain"), extra_body=opened)[:2] == (
            "Thinking that the template opened.",
            m.content,
        )
        bad: Any = {"chat_template_kwargs": {"messages": []}}
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
            c.chat.completions.create(model="think", messages=user("plain"), extra_body=bad)
    history = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "Earlier thought."},
        {"role": "user", "content": "plain"},
    ]
    body = {"model": "think", "messages": history, "chat_template_kwargs": {"enable_thinking": False}}
    ids = httpx.post(f"{srv.api}/v1/tokenize", json=body).json()["tokens"]
    text = httpx.post(f"{srv.api}/v1/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nBe brief.")
    assert "<think>\nEarlier thought.\n</think>\n\na<|im_end|>" in text and text.endswith("<think>\n\n</think>\n\n")


def test_budget_forces_the_end_of_thinking(srv: Server) -> None:
    with oai(srv) as c:
        kw: Any = {"model": "think", "messages": user("long"), "extra_body": {"thinking_token_budget": 5}}
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        assert (m.model_extra or {})["reasoning_content"] == "step" and m.content == "Done thinking."
        assert r.usage.completion_tokens_details.reasoning_tokens == 7  # <think> \n s t e p </think>
        assert streamed(c, **kw)[:2] == ("step", "Done thinking.")
        free = c.chat.completions.create(model="think", messages=user("long"))
        assert (free.choices[0].message.model_extra or {})["reasoning"] == ("step " * 40).strip()


def test_structured_answer_and_forced_call_after_thinking(srv: Server) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    with oai(srv) as c:
        r = c.chat.completions.create(model="think", messages=user("json"), response_format=fmt)
        m = r.choices[0].message
        jsonschema.validate(json.loads(m.content or ""), CITY)
        assert (m.model_extra or {})["reasoning"] == "The user wants JSON." and r.choices[0].finish_reason == "stop"
        assert streamed(c, model="think", messages=user("json"), response_format=fmt)[:2] == (
            "The user wants JSON.",
            m.content,
        )
        r = c.chat.completions.create(model="think", messages=user("tool"), tools=tools, tool_choice="required")
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and m.content is None
        assert m.tool_calls is not None and json.loads(m.tool_calls[0].function.arguments) == {"city": "Rome"}  # type: ignore[union-attr]
        assert (m.model_extra or {})["reasoning_content"] == "A call is needed."


def test_responses_api_reasoning_items(srv: Server) -> None:
    with oai(srv) as c:
        r = c.responses.create(model="think", input="plain")
        assert [o.type for o in r.output] == ["reasoning", "message"]
        item = r.output[0]
        assert item.type == "reasoning" and item.content is not None and item.summary == []
        assert item.content[0].text == 'Let me think about "a".' and r.output_text == "The answer is b."
        assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens == num_tokens(
            SCRIPTS["plain"].split("\n\n")[0]
        )
        with c.responses.stream(model="think", input="plain") as s:
            kinds = [e.type for e in s]
            final = s.get_final_response()
        assert final.output[0].model_dump() == {**item.model_dump(), "id": final.output[0].model_dump()["id"]}
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
        assert "response.reasoning_text.delta" in kinds
        items: Any = [{"role": "user", "content": "q"}, *[o.model_dump() for o in r.output], *user("plain")]
        follow = c.responses.create(model="think", input=items)
        assert follow.output_text == "The answer is b."
        off = c.responses.create(model="think", input="plain", reasoning={"effort": "none"})
        assert [o.type for o in off.output] == ["message"] and off.output_text == SCRIPTS["off"]


def test_messages_api_thinking_blocks(srv: Server) -> None:
    with anthropic.Anthropic(base_url=srv.api, api_key="x", max_retries=0) as c:
        kw: Any = {
            "model": "think",
            "max_tokens": 200,
            "messages": user("long"),
            "thinking": {"type": "enabled", "budget_tokens": 5},
        }
        msg = c.messages.create(**kw)
        assert [b.type for b in msg.content] == ["thinking", "text"]
        thinking, text = msg.content
        assert thinking.type == "thinking" and thinking.thinking == "step" and thinking.signature == ""
        assert text.type == "text" and text.text == "Done thinking."
        with c.messages.stream(**kw) as s:
            final = s.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
        off = c.messages.create(model="think", max_tokens=50, messages=user("plain"), thinking={"type": "disabled"})
        assert [b.type for b in off.content] == ["text"] and off.content[0].text == SCRIPTS["off"]  # type: ignore[union-attr]
        replay: Any = [*user("q"), {"role": "assistant", "content": [b.model_dump() for b in msg.content]}]
        again = c.messages.create(model="think", max_tokens=200, messages=[*replay, *user("plain")])
        assert again.content[0].type == "thinking"


def test_a_model_without_markers_is_never_split(tmp_path: Path) -> None:
    with server(
        tmp_path, 'num_kv_blocks = 4096\nreasoning_parser = "none"\n', app="tests.helpers.fake_app:think_app"
    ) as s:
        with oai(s) as c:
            r = c.chat.completions.create(model="think", messages=user("plain"))
        hidden = SCRIPTS["plain"].replace("<think>", "").replace("</think>", "")  # special tokens here: never shown
        assert r.choices[0].message.content == hidden and r.usage.completion_tokens_details is None  # type: ignore[union-attr]
