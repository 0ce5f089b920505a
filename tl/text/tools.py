"""Tool calling: a model's tool-call format, the constraint that forces or guards calls, and the
streaming parser that turns generated text into OpenAI tool calls.

Owns: ToolSpec (one function tool as the request gave it), ToolFormat and the two formats
(`hermes`: one `<tool_call>{"name", "arguments"}</tool_call>` block per call, as Hermes and
Qwen2.5 write them; `smollm2`: one `<tool_call>[{...}, ...]</tool_call>` block holding a JSON
array), `detect_format` (from the chat template's source, as llama.cpp detects formats),
`tool_template` (tl's tool-aware template for a model whose own renders no tools),
`tool_grammar` (the Lark + JSON Schema constraint for "auto", "required" and a named tool,
with or without parallel calls; compiled by tl/text/grammar.py), and ToolCallParser (text pieces
in, content text and call events out: it holds back any prefix of the start marker, as stop
strings are held back, and streams each call's arguments as raw JSON fragments, decided one
character at a time, so the events never depend on where the text was cut).
Pure Python: must not import jax. Tested by tests/text/test_tools.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tl.text.chat_template import ChatTemplate
from tl.text.pieces import add_text

FormatName = Literal["hermes", "smollm2"]
ChoiceMode = Literal["auto", "required", "named"]
JSON_WS = " \t\n\r"
TEMPLATES = Path(__file__).parent / "templates"
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""Calls' JSON: one space after "," and ":", as models are trained to write calls; no other
whitespace (no runaway newlines)."""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function tool: its name, description and parameters (JSON Schema text; "" = none)."""

    name: str
    description: str | None = None
    parameters: str = ""


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model writes calls: `start`/`end` around a block; `array`: one block holds a JSON
    array of calls (smollm2), else one block per call (hermes)."""

    name: FormatName
    array: bool
    start: str = "<tool_call>"
    end: str = "</tool_call>"


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", array=False),
    "smollm2": ToolFormat("smollm2", array=True),
}


def detect_format(template_source: str) -> tuple[ToolFormat, bool]:
    """(format, whether the model's own template renders tools). A template that uses `tools`
    and writes `<tool_call>` blocks is Hermes-style; one that renders no tools gets tl's own
    tool template (`tool_template`), whose form is SmolLM2's JSON array."""
    renders = "tools" in template_source
    if renders and "<tool_call>" in template_source:
        return FORMATS["hermes"], True
    return FORMATS["smollm2"], renders


@dataclass(frozen=True)
class ToolSetup:
    """The served model's tool calling: the format its calls are parsed in, the template that
    renders a request with tools, and why (logged at start-up)."""

    format: ToolFormat
    template: ChatTemplate
    reason: str


def setup(parser: str, template: ChatTemplate) -> ToolSetup:
    """`[engine] tool_parser` ("auto": detected from the template) applied to the model's template."""
    source = "\n".join(template.sources.values())
    detected, renders = detect_format(source)
    fmt = detected if parser == "auto" else FORMATS[parser]
    why = "detected from the chat template" if parser == "auto" else "tool_parser"
    how = f"tool calls in the {fmt.name} form ({why})"
    if renders:
        return ToolSetup(fmt, template, f"{how}; the model's template renders tools")
    own = ChatTemplate(tool_template(), template.bos_token, template.eos_token)
    return ToolSetup(fmt, own, f"{how}; the model's template renders no tools: tl's tool template renders them")


def tool_template() -> str:
    """tl's tool-aware ChatML template (SmolLM2's form: tools in the system turn inside
    <tools></tools>, calls as a JSON array in <tool_call>, results in <tool_response>)."""
    return (TEMPLATES / "tools_json_array.jinja").read_text(encoding="utf-8")


def _parameters(tool: ToolSpec) -> object:
    if not tool.parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}  # no parameters: {}
    return json.loads(tool.parameters)


def _call_schema(tool: ToolSpec) -> dict[str, object]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": _parameters(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_grammar(fmt: ToolFormat, tools: Sequence[ToolSpec], mode: ChoiceMode, parallel: bool, named: str = "") -> str:
    """A Lark grammar (llguidance's dialect) for the answer.

    required / named: nothing but calls (one for a named tool or parallel=False, else one or
    more), each `{"name": <a tool>, "arguments": <valid for that tool>}` with one space after
    "," and ":" (hermes: a newline allowed inside the block's markers). auto: any
    text, and once the start marker appears (a lazy lexeme: the text ends at the first marker)
    the same calls, then nothing more; plain text is never constrained.
    """
    chosen = [t for t in tools if t.name == named] if mode == "named" else list(tools)
    one = {"anyOf": [_call_schema(t) for t in chosen], "x-guidance": _CALL_JSON}
    single = mode == "named" or not parallel
    start, end = json.dumps(fmt.start), json.dumps(fmt.end)
    if fmt.array:
        array: dict[str, object] = {"type": "array", "items": one, "minItems": 1, "x-guidance": _CALL_JSON}
        if single:
            array["maxItems"] = 1
        calls = f"calls: %json {json.dumps(array)} {end}"
    else:
        repeat = "" if single else f' ("\\n" {start} call)*'
        calls = f'calls: call{repeat}\ncall: "\\n"? %json {json.dumps(one)} "\\n"? {end}'  # Qwen2.5 writes the newlines
    if mode == "auto":
        head = f"start: text_only | text_trig calls\ntext_only: TEXT\nTEXT: /(.|\\n)*/\ntext_trig[lazy]: TEXT {start}"
    else:
        head = f"start: {start} calls"
    return f"%llguidance {{}}\n{head}\n{calls}\n"


@dataclass(frozen=True, slots=True)
class CallStart:
    """A call opens: its index in the answer and its function name (arguments follow)."""

    index: int
    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    """A fragment of call `index`'s arguments, raw JSON text as generated."""

    index: int
    text: str


Event = str | CallStart | CallArgs
"""What the parser emits: content text, a call opening, or an arguments fragment."""


@dataclass
class _Call:
    name: str
    arguments: list[str] = field(default_factory=list)

    @property
    def arguments_text(self) -> str:
        return "".join(self.arguments)


class ToolCallParser:
    """Generated text -> content and tool calls, one character at a time. `push` the text as it
    becomes safe to show (after stop strings), `finish` at the end; `calls` holds each call's
    name and argument fragments. Text before the first block is content; whitespace between
    and after blocks is dropped; a block outside the expected form turns the rest into content
    (tl's constraint never lets that happen)."""

    _EXPECT = {  # state: (the one character it takes, the next state)
        "open_array": ("[", "item"),
        "obj": ("{", "key_name"),
        "colon_name": (":", "name_open"),
        "name_open": ('"', "name"),
        "after_name": (",", "key_args"),
        "colon_args": (":", "args_start"),
        "close_obj": ("}", ""),  # then "after_call" (array) or the end marker (hermes)
    }
    _LITERALS = {"key_name": ('"name"', "colon_name"), "key_args": ('"arguments"', "colon_args")}

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls: list[_Call] = []
        self._mode = "text"  # text | body | raw
        self._held = ""  # text mode: a possible start of the start marker
        self._state = ""  # body mode: where the scanner is
        self._tok = ""  # chars of the literal, name or end marker being matched
        self._depth = 0  # nesting inside the arguments value
        self._in_str = self._esc = self._prim = False
        self._after_block = False  # whitespace here is dropped
        self._block = ""  # the open block's text so far
        self._block_calls = 0  # calls begun before the open block

    def push(self, text: str) -> list[Event]:
        out: list[Event] = []
        for c in text:
            if self._mode == "text":
                self._text_char(c, out)
            elif self._mode == "body":
                self._block += c
                self._body_char(c, out)
            else:
                add_text(out, c)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._mode == "text":
            add_text(out, self._held)
            self._held = ""
        return out

    def _text_char(self, c: str, out: list[Event]) -> None:
        if self._after_block and not self._held and c in JSON_WS:
            return
        self._held += c
        start = self.fmt.start
        if self._held == start:
            self._held, self._mode, self._after_block = "", "body", False
            self._block, self._block_calls = "", len(self.calls)
            self._state = "open_array" if self.fmt.array else "obj"
            return
        while self._held and not start.startswith(self._held):
            self._after_block = False
            add_text(out, self._held[0])
            self._held = self._held[1:]

    def _body_char(self, c: str, out: list[Event]) -> None:
        s = self._state
        if s == "name":
            self._tok += c
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self.calls.append(_Call(json.loads(self._tok)))
                out.append(CallStart(len(self.calls) - 1, self.calls[-1].name))
                self._state = "after_name"
            return
        if s == "args":
            self._args_char(c, out)
            return
        if s in self._LITERALS or s == "end":
            want, nxt = self._LITERALS.get(s, (self.fmt.end, ""))
            if not self._tok and c in JSON_WS:
                return
            self._tok += c
            if not want.startswith(self._tok):
                self._raw(self._tok, out)
            elif self._tok == want:
                self._tok = ""
                if s == "end":
                    self._mode, self._state, self._after_block = "text", "", True
                else:
                    self._state = nxt
            return
        if c in JSON_WS:
            return
        if s == "args_start":
            self._state = "args"
            self._args_char(c, out)
        elif s == "item" and c in "{]" or s == "after_call" and c in ",]":
            self._state, self._tok = {"{": "key_name", ",": "obj", "]": "end"}[c], ""
        elif s in self._EXPECT and c == self._EXPECT[s][0]:
            nxt = self._EXPECT[s][1] or ("after_call" if self.fmt.array else "end")
            self._state, self._tok = nxt, '"' if nxt == "name" else ""
        else:
            self._raw(c, out)

    def _args_char(self, c: str, out: list[Event]) -> None:
        """The arguments value, streamed as generated, until it closes (strings, escapes and
        nesting tracked; a bare number or literal ends at the next delimiter)."""
        if self._prim and c in JSON_WS + ",}]":
            self._prim, self._state = False, "close_obj"
            self._body_char(c, out)
            return
        call = len(self.calls) - 1
        self.calls[call].arguments.append(c)
        _args(out, call, c)
        done = False
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str, done = False, self._depth == 0
        elif c == '"':
            self._in_str = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            done = self._depth == 0
        elif self._depth == 0:
            self._prim = True
        if done:
            self._state = "close_obj"

    def _raw(self, text: str, out: list[Event]) -> None:
        """The rest is content: the whole block so far when none of its calls began, else from here."""
        self._mode = "raw"
        add_text(out, self.fmt.start + self._block if len(self.calls) == self._block_calls else text)


def _args(out: list[Event], index: int, text: str) -> None:
    last = out[-1] if out else None
    if isinstance(last, CallArgs) and last.index == index:
        out[-1] = CallArgs(index, last.text + text)
    else:
        out.append(CallArgs(index, text))
