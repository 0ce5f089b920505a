"""tl.text.chat_template: SmolLM2's real template byte for byte, the jinja features chat
templates use, errors at construction and at render, template discovery in a model
dir, and a differential check against transformers' own renderer
(transformers.utils.chat_template_utils.render_jinja_template) over several templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from models import make_tiny_llama

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
