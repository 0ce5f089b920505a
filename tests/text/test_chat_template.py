"""tl.text.chat_template: SmolLM2's real template byte for byte, the jinja features chat
templates use, errors at construction and at render, template discovery in a model
dir, and a differential check against transformers' own renderer
(transformers.utils.chat_template_utils.render_jinja_template) over several templates, and over
the official templates of every family tl serves (tests/templates/, sources in its README.md):
Llama 3.1/3.2 (tools, builtin tools, date via strftime_now pinned on both sides), Qwen3 (tools,
multi-step tool loop, reasoning_content and its aliases, enable_thinking), Gemma 3 and Mistral v0.3
(their raise_exception cases raise TemplateError with transformers' message)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.models import make_tiny_llama
from tl.text.chat_template import DEFAULT_TEMPLATE, ChatTemplate, TemplateError

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_HI = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
)

# A tools-aware ChatML template in the style of Qwen2.5's, and a Llama-3 style one.
TOOLS_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}You are helpful.{%- endif %}
{{- "\\n\\n# Tools\\n<tools>" }}
{%- for tool in tools %}
{{- "\\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "system" %}{% continue %}{% endif %}
    {%- if message.tool_calls is defined %}
        {{- '<|im_start|>assistant' }}
        {%- for tc in message.tool_calls %}
{{- '\\n<tool_call>\\n' }}{{ tc.function | tojson(sort_keys=True) }}{{ '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(n=0) %}
{%- for message in messages %}
    {%- set ns.n = ns.n + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{% endgeneration %}
    {%- else %}{{- message['content'] | trim }}{% endif %}
    {{- '<|eot_id|>' }}
    {%- if loop.last %}{{ '' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
{{- eos_token if not add_generation_prompt else '' }}
"""
BLOCKS_TEMPLATE = """{% for m in messages %}
  {% if m.role == 'user' %}
U: {{ m.content | upper }}
  {% elif m.role == 'assistant' %}
A: {{ m.content | replace('a', '4') }}{{ '' if loop.last else ' |' }}
  {% else %}
{{ raise_exception('bad role ' + m.role) }}
  {% endif %}
{% endfor %}
{{ messages | length }} {{ messages | map(attribute='role') | join(',') }} {{ (missing | default('dflt')) }}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": "  2+2? "},
        {"role": "assistant", "content": "a 4, naïve <b>"},
        {"role": "user", "content": "Sûr? 🙂"},
    ],
    [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "°C"}}}
            ],
        },
        {"role": "tool", "content": '{"t": 21}'},
        {"role": "user", "content": "thanks"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & ☀",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_smollm2_template_exact() -> None:
    assert ChatTemplate(SMOLLM2_TEMPLATE).render([{"role": "user", "content": "Hi"}]) == SMOLLM2_HI
    with_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate(SMOLLM2_TEMPLATE).render(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


@pytest.mark.slow
def test_smollm2_model_dir_template(smol_dir: Path) -> None:
    t = ChatTemplate.from_model_dir(smol_dir)
    assert t.render([{"role": "user", "content": "Hi"}]) == SMOLLM2_HI
    assert (t.bos_token, t.eos_token) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.parametrize(
    "source",
    [SMOLLM2_TEMPLATE, TOOLS_TEMPLATE, LLAMA3_TEMPLATE, DEFAULT_TEMPLATE],
    ids=["smollm2", "tools", "llama3", "default"],
)
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_matches_transformers(source: str, conv: int, add_generation_prompt: bool, with_tools: bool) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = CONVERSATIONS[conv]
    if source in (SMOLLM2_TEMPLATE, DEFAULT_TEMPLATE, LLAMA3_TEMPLATE) and conv == 2:
        messages = [m for m in messages if m.get("content") is not None]
    tools = TOOLS if with_tools else None
    want, _ = render_jinja_template(
        [messages],
        tools=tools,
        chat_template=source,
        add_generation_prompt=add_generation_prompt,
        bos_token="<s>",
        eos_token="</s>",
    )
    got = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(
        messages, add_generation_prompt=add_generation_prompt, tools=tools
    )
    assert got == want[0]


def test_default_template() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate(DEFAULT_TEMPLATE).render(msgs) == "<|system|>\nS\n<|user|>\nHi\n<|assistant|>\n"
    assert ChatTemplate(DEFAULT_TEMPLATE).render(msgs, add_generation_prompt=False) == "<|system|>\nS\n<|user|>\nHi\n"


def test_blocks_filters_whitespace_and_loop() -> None:
    msgs = [
        {"role": "user", "content": "hey"},
        {"role": "assistant", "content": "banana"},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "aa"},
    ]
    assert (
        ChatTemplate(BLOCKS_TEMPLATE).render(msgs)
        == "U: HEY\nA: b4n4n4 |\nU: X\nA: 44\n4 user,assistant,user,assistant dflt"
    )  # final newline dropped (keep_trailing_newline off)


def test_whitespace_control_and_loopcontrols() -> None:
    src = (
        "{% for m in messages %}\n  {%- if loop.index > 2 %}{% break %}{% endif -%}\n  [{{ m.content }}]\n{%- endfor %}"
    )
    msgs = [{"role": "user", "content": str(i)} for i in range(5)]
    assert ChatTemplate(src).render(msgs) == "[0][1]"


def test_tojson_is_not_html_escaped_and_keeps_unicode() -> None:
    src = (
        "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}"
        "|{{ 'é' | tojson(ensure_ascii=True) }}"
    )
    got = ChatTemplate(src).render([{"role": "user", "content": "<a href='x'>é & 🙂</a>"}])
    assert got.startswith('{"role": "user", "content": "<a href=\'x\'>é & 🙂</a>"}|{\n  "content"')
    assert got.endswith('|"\\u00e9"')


def test_none_keys_are_dropped_and_special_tokens_are_variables() -> None:
    src = (
        "{{ bos_token }}{% for m in messages %}{{ 'T' if m.tool_calls is defined else 'N' }}{% endfor %}{{ eos_token }}"
    )
    msgs = [{"role": "assistant", "content": "x", "tool_calls": None}, {"role": "assistant", "tool_calls": []}]
    assert ChatTemplate(src, bos_token="<s>", eos_token="</s>").render(msgs) == "<s>NT</s>"
    assert ChatTemplate(src).render(msgs) == "NT"  # unset tokens are undefined, not "None"


def test_raise_exception_and_runtime_errors_become_template_errors() -> None:
    with pytest.raises(TemplateError, match="bad role tool"):
        ChatTemplate(BLOCKS_TEMPLATE).render([{"role": "tool", "content": "x"}])
    with pytest.raises(TemplateError, match="chat template failed: TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="chat messages must be objects"):
        ChatTemplate(DEFAULT_TEMPLATE).render(["hello"])  # type: ignore[list-item]


def test_sandbox_refuses_mutation_and_internals() -> None:
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages.append(1) }}").render([])
    with pytest.raises(TemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
    assert ChatTemplate("{{ ''.__class__ }}").render([]) == ""


@pytest.mark.parametrize(
    "source,why",
    [
        ("{% for m in messages %}{{ m.content }}", r"line 1: Unexpected end of template.*'endfor'"),
        ("{% if x %}a{% else %}b", r"Unexpected end of template.*'endif'"),
        ("hello\n{% frobnicate %}", r"line 2: Encountered unknown tag 'frobnicate'"),
        ("{{ messages | frobnicate }}", r"No filter named 'frobnicate'"),
        ("{% if add_generation_prompt %}{{ x | nope }}{% endif %}", r"No filter named 'nope'"),
        ("{{ x is nope }}", r"No test named 'nope'"),
        ("{{ 'a' + }}", r"line 1: unexpected"),
    ],
)
def test_parse_errors_refused_at_construction(source: str, why: str) -> None:
    with pytest.raises(TemplateError, match=why):
        ChatTemplate(source)


def test_named_templates() -> None:
    t = ChatTemplate({"default": "D{{ messages | length }}", "tool_use": "T{{ tools | length }}"})
    assert t.render([{"role": "user", "content": "x"}]) == "D1"
    assert t.render([{"role": "user", "content": "x"}], tools=TOOLS) == "T1"
    with pytest.raises(TemplateError, match="have no 'default'"):
        ChatTemplate({"tool_use": "x"})
    with pytest.raises(TemplateError, match="'tool_use' line 1"):
        ChatTemplate({"default": "x", "tool_use": "{% if %}"})


def test_strftime_now_and_generation_block() -> None:
    import datetime

    got = ChatTemplate("{{ strftime_now('%Y') }}{% generation %}g{% endgeneration %}").render([])
    assert got in {f"{datetime.date.today().year}g", f"{datetime.date.today().year + 1}g"}


def test_from_model_dir_precedence(tmp_path: Path) -> None:
    d = make_tiny_llama(tmp_path / "m")
    msgs = [{"role": "user", "content": "Hi"}]
    assert ChatTemplate.from_model_dir(d).render(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    (d / "chat_template.jinja").write_text("J{{ bos_token }}")
    assert ChatTemplate.from_model_dir(d).render(msgs) == "J<|im_start|>"
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "chat_template": "G"}))
    assert ChatTemplate.from_model_dir(d).render(msgs) == "G"
    for name in ("generation_config.json", "chat_template.jinja", "tokenizer_config.json"):
        (d / name).unlink()
    assert ChatTemplate.from_model_dir(d).render(msgs) == "<|user|>\nHi\n<|assistant|>\n"


# --- The real templates of the families tl serves, against transformers' apply_chat_template ---

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"
FAMILY_TOKENS = {  # bos/eos of each family's tokenizer_config.json
    "llama3_1": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama3_2": ("<|begin_of_text|>", "<|eot_id|>"),
    "qwen3": (None, "<|im_end|>"),
    "gemma3": ("<bos>", "<eos>"),
    "mistral_v0_3": ("<s>", "</s>"),
}
WEATHER_TOOLS = [
    *TOOLS,
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}},
        },
    },
]


def _call(call_id: str, name: str, arguments: object) -> dict[str, object]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


PLAIN = [
    {"role": "system", "content": "  Be brief.\n"},
    {"role": "user", "content": "  2+2? "},
    {"role": "assistant", "content": "4, naïve <b> "},
    {"role": "user", "content": "Sûr? 🙂"},
]
NO_SYSTEM = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "x"},
]
ONE_TOOL_CALL = [
    {"role": "system", "content": "You can look things up."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call00001", "get_weather", {"city": "Zürich"})]},
    {"role": "tool", "tool_call_id": "call00001", "content": '{"t": 21, "unit": "°C"}'},
]
ONE_TOOL_CALL_ANSWERED = [*ONE_TOOL_CALL, {"role": "assistant", "content": "21 °C."}, {"role": "user", "content": "ok"}]
# Qwen3's first template reads an assistant's content unguarded: a tool call without content fails
# there as in transformers (the "qwen3-tools" cases), so clients send "" (the "qwen3-tools_empty" ones).
QWEN3_TOOL_CALL = [{**m, "content": m["content"] or ""} for m in ONE_TOOL_CALL]
QWEN3_MULTI_STEP = [  # two tool rounds after the last real user query, reasoning on each step
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nfirst answer"},
    {"role": "user", "content": "weather and time?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "\nneed two tools\n",
        "tool_calls": [_call("a", "get_weather", {"city": "Bern"}), _call("b", "get_time", '{"tz": "CET"}')],
    },
    {"role": "tool", "content": '{"t": 3}'},
    {"role": "tool", "content": "12:00"},
    {
        "role": "assistant",
        "content": "",
        "reasoning": "one more",
        "tool_calls": [_call("c", "get_time", {"tz": "UTC"})],
    },
    {"role": "user", "content": "<tool_response>\n11:00\n</tool_response>"},
]
QWEN3_THINKING = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "<think>r2</think>a2"},
]
GEMMA_PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "Sys "}]},
    {
        "role": "user",
        "content": [{"type": "text", "text": " look "}, {"type": "image"}, {"type": "text", "text": "here"}],
    },
]
MISTRAL_TOOLS = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "tool_calls": [_call("abc123XYZ", "get_weather", {"city": "Paris"})]},
    {"role": "tool", "tool_call_id": "abc123XYZ", "content": "sunny"},
    {"role": "assistant", "content": " Sunny. "},
    {"role": "user", "content": "thanks"},
]

FAMILY_CASES: list[tuple[str, str, list[dict[str, object]], dict[str, object]]] = [
    # (id, template, messages, extra kwargs; "tools" among them goes to the tools argument)
    *[
        (f"{t}-{name}", t, msgs, {})
        for t in FAMILY_TOKENS
        for name, msgs in [("plain", PLAIN), ("no_system", NO_SYSTEM)]
    ],
    *[(f"{t}-tools", t, ONE_TOOL_CALL, {"tools": WEATHER_TOOLS}) for t in ("llama3_1", "llama3_2", "qwen3")],
    *[(f"{t}-tools_answered", t, ONE_TOOL_CALL_ANSWERED, {"tools": TOOLS}) for t in ("llama3_1", "llama3_2", "qwen3")],
    ("qwen3-tools_empty", "qwen3", QWEN3_TOOL_CALL, {"tools": WEATHER_TOOLS}),
    ("qwen3-tools_empty_no_tools", "qwen3", QWEN3_TOOL_CALL, {}),
    ("llama3_1-tools_in_system", "llama3_1", ONE_TOOL_CALL, {"tools": TOOLS, "tools_in_user_message": False}),
    ("llama3_1-builtin", "llama3_1", ONE_TOOL_CALL, {"builtin_tools": ["brave_search", "code_interpreter"]}),
    (
        "llama3_1-builtin_call",
        "llama3_1",
        [
            {"role": "user", "content": "news?"},
            {"role": "assistant", "tool_calls": [_call("x", "brave_search", {"query": "q"})]},
        ],
        {"builtin_tools": ["brave_search"], "date_string": "01 Jan 2025"},
    ),
    ("llama3_2-date_string", "llama3_2", PLAIN, {"date_string": "01 Jan 2025"}),
    ("llama3_2-custom_tools", "llama3_2", ONE_TOOL_CALL, {"custom_tools": TOOLS, "tools_in_user_message": False}),
    ("llama3_2-tool_dict_content", "llama3_2", [*ONE_TOOL_CALL[:3], {"role": "tool", "content": {"t": 21}}], {}),
    ("qwen3-multi_step", "qwen3", QWEN3_MULTI_STEP, {"tools": WEATHER_TOOLS}),
    ("qwen3-thinking", "qwen3", QWEN3_THINKING, {}),
    ("qwen3-no_thinking", "qwen3", QWEN3_THINKING[:3], {"enable_thinking": False}),
    ("qwen3-thinking_on", "qwen3", QWEN3_THINKING[:3], {"enable_thinking": True}),
    ("qwen3-system_mid", "qwen3", [*NO_SYSTEM, {"role": "system", "content": "late"}], {}),
    ("gemma3-parts", "gemma3", GEMMA_PARTS, {}),
    ("mistral_v0_3-tools", "mistral_v0_3", MISTRAL_TOOLS, {"tools": WEATHER_TOOLS}),
    # Each template's raise_exception (tl must raise TemplateError with transformers' message)
    ("gemma3-bad_order", "gemma3", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {}),
    (
        "gemma3-assistant_first",
        "gemma3",
        [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
        {},
    ),
    ("gemma3-bad_content", "gemma3", [{"role": "user", "content": 7}], {}),
    ("mistral_v0_3-bad_order", "mistral_v0_3", [{"role": "assistant", "content": "a"}], {}),
    (
        "mistral_v0_3-two_users",
        "mistral_v0_3",
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        {},
    ),
    (
        "mistral_v0_3-bad_call_id",
        "mistral_v0_3",
        [MISTRAL_TOOLS[1], {"role": "assistant", "tool_calls": [_call("short", "get_weather", {})]}],
        {},
    ),
    (
        "mistral_v0_3-bad_role",
        "mistral_v0_3",
        [{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}],
        {},
    ),
    ("llama3_1-no_user_for_tools", "llama3_1", [{"role": "system", "content": "s"}], {"tools": TOOLS}),
    (
        "llama3_2-two_calls",
        "llama3_2",
        [
            {"role": "user", "content": "u"},
            {"role": "assistant", "tool_calls": [_call("a", "f", {}), _call("b", "g", {})]},
        ],
        {},
    ),
    ("qwen3-content_none", "qwen3", [{"role": "user", "content": "u"}, {"role": "assistant", "content": None}], {}),
]


@pytest.fixture
def pinned_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """strftime_now reads datetime.now() on both sides; pin it so the dated templates compare."""
    import datetime as dt

    import transformers.utils.chat_template_utils as hf

    import tl.text.chat_template as ours

    class Pinned(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> Pinned:
            return cls(2025, 3, 5, 13, 7, tzinfo=tz)

    monkeypatch.setattr(hf, "datetime", Pinned)
    monkeypatch.setattr(ours, "datetime", Pinned)


def _transformers_render(source: str, messages: list[dict[str, object]], **kwargs: object) -> str:
    """What tokenizer.apply_chat_template(..., tokenize=False) does: None-valued keys dropped, special
    tokens as variables (overridden by kwargs), then render_jinja_template."""
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    rendered, _ = render_jinja_template([_normalize_chat_messages(messages)], chat_template=source, **kwargs)
    return rendered[0]


@pytest.mark.usefixtures("pinned_now")
@pytest.mark.parametrize("case", FAMILY_CASES, ids=[c[0] for c in FAMILY_CASES])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_family_templates_match_transformers(
    case: tuple[str, str, list[dict[str, object]], dict[str, object]], add_generation_prompt: bool
) -> None:
    import jinja2

    _, family, messages, extra = case
    source = (TEMPLATES_DIR / f"{family}.jinja").read_text(encoding="utf-8")
    bos, eos = FAMILY_TOKENS[family]
    tokens = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    kwargs = {"add_generation_prompt": add_generation_prompt, **extra}
    ours = ChatTemplate(source, bos_token=bos, eos_token=eos)
    try:
        want = _transformers_render(source, messages, **tokens, **kwargs)
    except jinja2.TemplateError as e:
        with pytest.raises(TemplateError, match=re.escape(str(e.message))):
            ours.render(messages, **kwargs)  # type: ignore[arg-type]
        return
    except (TypeError, AttributeError, KeyError, IndexError, ValueError):
        with pytest.raises(TemplateError):
            ours.render(messages, **kwargs)  # type: ignore[arg-type]
        return
    assert ours.render(messages, **kwargs) == want  # type: ignore[arg-type]


@pytest.mark.usefixtures("pinned_now")
def test_pinned_date_reaches_llama32_and_raises_are_exercised() -> None:
    """The differential test above is only as good as its cases: the pinned date shows, and
    every family's raise_exception fires."""
    source = (TEMPLATES_DIR / "llama3_2.jinja").read_text(encoding="utf-8")
    got = ChatTemplate(source, "<|begin_of_text|>").render([{"role": "user", "content": "x"}])
    assert "Today Date: 05 Mar 2025\n\n" in got
    gemma = ChatTemplate((TEMPLATES_DIR / "gemma3.jinja").read_text(encoding="utf-8"), "<bos>")
    with pytest.raises(TemplateError, match="Conversation roles must alternate user/assistant"):
        gemma.render([{"role": "assistant", "content": "a"}])
    mistral = ChatTemplate((TEMPLATES_DIR / "mistral_v0_3.jinja").read_text(encoding="utf-8"), "<s>", "</s>")
    with pytest.raises(TemplateError, match="After the optional system message, conversation roles must alternate"):
        mistral.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_reasoning_aliases_as_transformers() -> None:
    from transformers.utils.chat_template_utils import _alias_reasoning_fields

    from tl.text.chat_template import normalize_messages

    for key in ("reasoning_content", "thinking", "reasoning"):
        msgs = [{"role": "assistant", "content": "a", key: "r", "tool_calls": None}, {"role": "user", "content": "u"}]
        got = normalize_messages(msgs)
        want = _alias_reasoning_fields([{k: v for k, v in m.items() if v is not None} for m in msgs])
        assert got == want and [list(m) for m in got] == [list(m) for m in want]
        assert got[0]["reasoning_content"] == got[0]["thinking"] == "r"
