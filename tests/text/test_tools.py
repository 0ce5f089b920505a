"""tl/text/tools.py: the streaming tool-call parser over scripted texts cut at every boundary (as
tests/serve/test_textstream.py tests stop strings), the grammars each tool_choice compiles to (checked
by feeding texts through llguidance's matcher over the byte tokenizer), format detection, and
tl's tool template rendered byte for byte as transformers renders it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.fake_engine import byte_grammars
from tests.helpers.models import HERMES_TEMPLATE, IM_END_ID
from tl.core.config import EngineConfig
from tl.core.request import ConstraintSpec
from tl.text.chat_template import ChatTemplate
from tl.text.tools import (
    FORMATS,
    CallArgs,
    CallStart,
    Event,
    ToolCallParser,
    ToolSpec,
    detect_format,
    setup,
    tool_grammar,
    tool_template,
)


def parse(fmt: str, text: str, cuts: tuple[int, ...] = ()) -> tuple[list[Event], list[tuple[str, str]]]:
    p = ToolCallParser(FORMATS[fmt])
    events: list[Event] = []
    points = [0, *cuts, len(text)]
    for a, b in zip(points, points[1:], strict=False):
        events += p.push(text[a:b])
    events += p.finish()
    return events, [(c.name, c.arguments_text) for c in p.calls]


def content(events: list[Event]) -> str:
    return "".join(e for e in events if isinstance(e, str))


def merged(events: list[Event]) -> list[Event]:
    """Events with adjacent text and same-call argument fragments joined (what a cut may split)."""
    out: list[Event] = []
    for e in events:
        if out and isinstance(e, str) and isinstance(out[-1], str):
            out[-1] += e
        elif out and isinstance(e, CallArgs) and isinstance(out[-1], CallArgs) and out[-1].index == e.index:
            out[-1] = CallArgs(e.index, out[-1].text + e.text)
        else:
            out.append(e)
    return out


CASES = [
    (
        "smollm2",
        'Let me look. <tool_call>[{"name":"get_weather","arguments":{"city":"Pa\\"ris","days":[1,{"x":"]}"}]}},'
        '{"name":"now","arguments":{}}]</tool_call>',
        "Let me look. ",
        [("get_weather", '{"city":"Pa\\"ris","days":[1,{"x":"]}"}]}'), ("now", "{}")],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name":"g","arguments":{}}'
        "</tool_call>\n",
        "",
        [("f", '{"a": 1}'), ("g", "{}")],
    ),
    ("hermes", 'x <tool_call>{"name":"n","arguments":42}</tool_call>', "x ", [("n", "42")]),
    ("smollm2", "no call at all, not even <tool_ or <tool_call", "no call at all, not even <tool_ or <tool_call", []),
    ("hermes", "<tool_call>oops</tool_call> rest", "<tool_call>oops</tool_call> rest", []),  # not the form: content
    ("smollm2", '<tool_call>[{"name":"a","arguments":{"k":"v"}}]</tool_call>', "", [("a", '{"k":"v"}')]),
]


@pytest.mark.parametrize(("fmt", "text", "want_content", "want_calls"), CASES)
def test_parser_gives_the_same_calls_however_the_text_is_cut(
    fmt: str, text: str, want_content: str, want_calls: list[tuple[str, str]]
) -> None:
    whole, calls = parse(fmt, text)
    assert content(whole) == want_content and calls == want_calls
    starts = [e for e in whole if isinstance(e, CallStart)]
    assert [(s.index, s.name) for s in starts] == [(i, n) for i, (n, _) in enumerate(want_calls)]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 5):
            events, got = parse(fmt, text, (i, j))
            assert got == want_calls and merged(events) == merged(whole), (i, j)
    one_by_one, got = parse(fmt, text, tuple(range(1, len(text))))
    assert got == want_calls and merged(one_by_one) == merged(whole)


def test_a_marker_prefix_is_held_back_until_it_cannot_be_one() -> None:
    p = ToolCallParser(FORMATS["hermes"])
    assert p.push("Hello <tool") == ["Hello "]
    assert p.push("bar") == ["<toolbar"]
    assert p.push(" <tool_c") == [" "]
    assert p.finish() == ["<tool_c"]


def test_the_call_starts_before_its_arguments_and_streams_them() -> None:
    p = ToolCallParser(FORMATS["smollm2"])
    assert p.push('<tool_call>[{"name":"get') == []
    assert p.push('_weather","argu') == [CallStart(0, "get_weather")]
    assert p.push('ments":{"ci') == [CallArgs(0, '{"ci')]
    assert p.push('ty":"Rome"}}]</tool_call>') == [CallArgs(0, 'ty":"Rome"}')]


def test_detection_and_setup() -> None:
    hermes = '{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>\n{"name": ...}</tool_call>'
    assert detect_format(hermes) == (FORMATS["hermes"], True)
    assert detect_format("{{ messages[0]['content'] }}") == (FORMATS["smollm2"], False)
    own = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    s = setup("auto", own)
    assert s.format.name == "smollm2" and s.template is not own and "tl's tool template" in s.reason
    s = setup("hermes", ChatTemplate(hermes))
    assert s.format.name == "hermes" and "renders tools" in s.reason


WEATHER = ToolSpec(
    "get_weather",
    "The weather",
    json.dumps({"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}),
)
NOW = ToolSpec("now")


def matches(grammar: str, text: str) -> bool:
    """Whether the grammar accepts exactly `text` (then EOS), over the byte tokenizer."""
    g = byte_grammars(EngineConfig(model_dir="x")).compile(ConstraintSpec("grammar", grammar, "tools")).grammar
    m = g.matcher()
    if not all(m.accept(b) for b in text.encode()):
        return False
    return m.done or m.accept(IM_END_ID)


ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
NOW_CALL = '{"name": "now", "arguments": {}}'


def array(*calls: str) -> str:
    return "<tool_call>[" + ", ".join(calls) + "]</tool_call>"


def blocks(*calls: str) -> str:
    return "\n".join(f"<tool_call>{c}</tool_call>" for c in calls)


@pytest.mark.parametrize(
    ("fmt", "mode", "parallel", "text", "ok"),
    [
        ("smollm2", "required", True, array(ROME), True),
        ("smollm2", "required", True, array(NOW_CALL, NOW_CALL), True),
        ("smollm2", "required", False, array(NOW_CALL, NOW_CALL), False),
        ("smollm2", "required", True, array(OSLO), False),
        ("smollm2", "required", True, array(), False),
        ("smollm2", "required", True, "I won't call anything.", False),
        ("smollm2", "auto", True, "I won't call anything.", True),
        ("smollm2", "auto", True, "Sure. " + array(NOW_CALL), True),
        ("smollm2", "auto", True, "Sure. <tool_call>hello", False),  # once a call opens, it is constrained
        ("smollm2", "auto", True, "Sure. " + array('{"name": "now", "arguments": {"x": 1}}'), False),
        ("smollm2", "required", True, '<tool_call>[{"name":"now","arguments":{}}]</tool_call>', False),  # one space
        ("hermes", "required", False, "<tool_call>\n" + NOW_CALL + "\n</tool_call>", True),  # Qwen's newlines
        ("smollm2", "named", True, array(NOW_CALL), True),
        ("smollm2", "named", True, array(ROME), False),
        ("hermes", "required", True, blocks(NOW_CALL, NOW_CALL), True),
        ("hermes", "required", False, blocks(NOW_CALL, NOW_CALL), False),
        ("hermes", "auto", True, "ok " + blocks(ROME), True),
    ],
)
def test_each_tool_choice_compiles_to_the_language_it_promises(
    fmt: str, mode: Any, parallel: bool, text: str, ok: bool
) -> None:
    grammar = tool_grammar(FORMATS[fmt], [WEATHER, NOW], mode, parallel, "now" if mode == "named" else "")
    assert matches(grammar, text) is ok


def hf_byte_tokenizer(tmp_path: Path) -> Any:
    """transformers' tokenizer over tests/helpers/models.py's byte tokenizer (the reference renderer)."""
    from transformers import PreTrainedTokenizerFast

    from tests.helpers.models import byte_tokenizer_json

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(byte_tokenizer_json()))
    return PreTrainedTokenizerFast(tokenizer_file=str(path))


def test_tl_tool_template_renders_as_transformers_does(tmp_path: Path) -> None:
    tk = hf_byte_tokenizer(tmp_path)
    weather = {"name": "get_weather", "description": "The weather", "parameters": {"type": "object"}}
    tools = [{"type": "function", "function": weather}, {"type": "function", "function": {"name": "now"}}]
    conversations = [
        [{"role": "user", "content": "Weather in Paris?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": c}},
                    }
                    for i, c in enumerate(("Paris", "Rome"), 1)
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "21C"},
            {"role": "assistant", "content": "Paris 18C, Rome 21C."},
            {"role": "user", "content": "Thanks"},
        ],
    ]
    ours = ChatTemplate(tool_template())
    for messages in conversations:
        for tl_tools in (tools, None):
            ref = tk.apply_chat_template(
                messages, tools=tl_tools, tokenize=False, add_generation_prompt=True, chat_template=tool_template()
            )
            got = ours.render(messages, add_generation_prompt=True, tools=tl_tools)
            assert got == ref
    text = ours.render(conversations[1], tools=tools)
    assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ' in text
    assert "<tool_response>18C</tool_response>" in text and "<tools>[" in text


def test_a_hermes_template_is_detected_and_gets_the_tools_as_transformers_passes_them(tmp_path: Path) -> None:
    s = setup("auto", ChatTemplate(HERMES_TEMPLATE))
    assert s.format.name == "hermes" and "renders tools" in s.reason
    tk = hf_byte_tokenizer(tmp_path)
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": {}}}
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    ref = tk.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, chat_template=HERMES_TEMPLATE
    )
    assert s.template.render(messages, tools=tools) == ref
    assert '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' in ref
