"""Anthropic's Messages API on the one generation path: /v1/messages and /v1/messages/count_tokens.

Owns translation only: a MessagesRequest becomes the ChatRequest it means (system, text blocks,
tool_use blocks as an assistant's tool_calls, tool_result blocks as tool turns, thinking blocks
as an assistant's reasoning_content, tools and tool_choice, stop_sequences, temperature/top_p/
top_k, `thinking` as enable_thinking and the thinking budget) and goes through serve/params.py's
chat_spec and serve/generate.py's Job like any chat request (the same admission, disconnects,
drain, metrics, API keys, request id); the finished Job becomes Anthropic's message document,
or, streamed, Anthropic's event sequence (message_start, content_block_start / delta / stop per
thinking, text or tool_use block, the thinking first; message_delta with stop_reason and usage,
message_stop; an `error` event if it fails after the first byte). Errors on these routes take Anthropic's shape
(serve/errors.py anthropic_doc). Tested with the anthropic client by tests/serve/test_anthropic.py
and tests/text/test_reasoning.py.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from serve import errors, sse
from serve.errors import ApiError, log_server_error
from serve.params import GenSpec, chat_spec, render_chat, tool_request
from serve.wire import (
    AnthropicBlock,
    AnthropicBlockOut,
    AnthropicDelta,
    AnthropicEvent,
    AnthropicMessage,
    AnthropicMessageDoc,
    AnthropicOutputUsage,
    AnthropicTextOut,
    AnthropicThinking,
    AnthropicThinkingOut,
    AnthropicTool,
    AnthropicToolChoice,
    AnthropicToolUseOut,
    AnthropicUsage,
    CallFunction,
    ChatMessage,
    ChatRequest,
    CountTokensRequest,
    FunctionDef,
    MessagesRequest,
    NamedFunction,
    NamedToolChoice,
    StopReason,
    Tool,
    ToolCall,
    encoder,
)
from tl.entry.served import ServedModel
from tl.text.reasoning import ReasoningText
from tl.text.tools import CallArgs, CallStart

if TYPE_CHECKING:
    from serve.asgi import Sender
    from serve.generate import Choice, Item, Job

STOP_REASONS: dict[str, StopReason] = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _text(blocks: str | list[AnthropicBlock] | None, param: str) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for i, b in enumerate(blocks):
        if b.type != "text":
            raise errors.unsupported(f"{param}[{i}].type", f"content block {b.type!r} here")
    return "".join(b.text or "" for b in blocks)


def _messages(system: str | list[AnthropicBlock] | None, messages: list[AnthropicMessage]) -> list[ChatMessage]:
    out = [ChatMessage(role="system", content=_text(system, "system"))] if system else []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
            continue
        text, calls, thought = [], [], []
        for j, b in enumerate(m.content):
            param = f"messages[{i}].content[{j}]"
            if b.type == "text":
                text.append(b.text or "")
            elif b.type == "thinking" and m.role == "assistant":
                thought.append(b.thinking or "")
            elif b.type == "redacted_thinking" and m.role == "assistant":
                continue  # encrypted elsewhere: nothing a template can show
            elif b.type == "tool_use" and m.role == "assistant":
                arguments = json.dumps(b.input or {})
                calls.append(ToolCall(id=b.id or f"toolu_{i}_{j}", function=CallFunction(b.name or "", arguments)))
            elif b.type == "tool_result" and m.role == "user":
                result = _text(b.content, f"{param}.content")
                out.append(ChatMessage(role="tool", content=result, tool_call_id=b.tool_use_id))
            else:
                raise errors.unsupported(f"{param}.type", f"content block {b.type!r} in a {m.role} turn")
        if text or calls or m.role == "assistant":
            reasoning = "".join(thought) if thought else None
            out.append(
                ChatMessage(role=m.role, content="".join(text), tool_calls=calls or None, reasoning_content=reasoning)
            )
    return out


def _tools(tools: list[AnthropicTool] | None, choice: AnthropicToolChoice | None) -> dict[str, Any]:
    if not tools:
        return {"tool_choice": "none"} if choice is not None and choice.type == "none" else {}
    wire = [
        Tool(type="function", function=FunctionDef(name=t.name, description=t.description, parameters=t.input_schema))
        for t in tools
    ]
    kw: dict[str, Any] = {"tools": wire}
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise errors.bad_request(
                    "tool_choice.name is required when tool_choice.type is 'tool'", "tool_choice.name"
                )
            kw["tool_choice"] = NamedToolChoice(type="function", function=NamedFunction(choice.name))
        else:
            kw["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            kw["parallel_tool_calls"] = False
    return kw


def _thinking(thinking: AnthropicThinking | None) -> dict[str, Any]:
    """`thinking` as chat fields: enable_thinking for the template, budget_tokens as the
    thinking budget (absent: the model's and the server's defaults)."""
    if thinking is None:
        return {}
    kw: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": thinking.type != "disabled"}}
    if thinking.type == "enabled" and thinking.budget_tokens is not None:
        kw["thinking_token_budget"] = thinking.budget_tokens
    return kw


def messages_spec(req: MessagesRequest, info: ServedModel) -> GenSpec:
    """The chat request a Messages request means, as a GenSpec of kind "messages"."""
    if req.top_k == 0:
        raise errors.bad_request("top_k must be >= 1", "top_k")
    chat = ChatRequest(
        model=req.model,
        messages=_messages(req.system, req.messages),
        max_tokens=req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_sequences or None,
        stream=bool(req.stream),
        **_tools(req.tools, req.tool_choice),
        **_thinking(req.thinking),
    )
    spec = chat_spec(chat, info)
    return dataclasses.replace(spec, kind="messages", stream=bool(req.stream))


def count_tokens(req: CountTokensRequest, info: ServedModel) -> int:
    """Input tokens of the request as it would be rendered (tools included)."""
    chat = ChatRequest(model=req.model, messages=_messages(req.system, req.messages), **_tools(req.tools, None))
    tools = tool_request(chat, info)
    return len(render_chat(chat.messages, info, tools=tools.dicts))


def _stop(c: Choice) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if c.stream.matched is not None:
        return "stop_sequence", c.stream.matched
    return STOP_REASONS.get(c.finish or "stop", "end_turn"), None


def document(job: Job) -> bytes:
    c = job.choices[0]
    content: list[AnthropicBlockOut] = []
    if c.reasoning:
        content.append(AnthropicThinkingOut("".join(c.reasoning)))
    text = "".join(c.text)
    if text:
        content.append(AnthropicTextOut(text))
    for call_id, call in zip(c.call_ids, c.parser.calls if c.parser else [], strict=True):
        content.append(AnthropicToolUseOut(_tool_use_id(call_id), call.name, _input(call.arguments_text)))
    reason, sequence = _stop(c)
    doc = AnthropicMessageDoc(job.id, "message", "assistant", job.model.model_id, content, reason, sequence, usage(job))
    return encoder.encode(doc)


def usage(job: Job, num_output_tokens: int | None = None) -> AnthropicUsage:
    """Anthropic's usage: the prompt split into tokens read from the prefix cache
    (cache_read_input_tokens) and the rest (input_tokens); nothing is billed as a cache write.
    num_output_tokens: the choice's own when None."""
    cached = job.num_cached_tokens
    output = job.choices[0].num_tokens if num_output_tokens is None else num_output_tokens
    return AnthropicUsage(job.num_prompt_tokens - cached, output, 0, cached)


def _tool_use_id(call_id: str) -> str:
    """Anthropic's id of a call (toolu_...) from the one the chat path gave it (call_...)."""
    return call_id.replace("call_", "toolu_", 1)


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


class Stream:
    """Anthropic's event sequence for one streamed choice: blocks open as their text or call
    begins and close when the next begins or the message ends.

    message_start goes with the engine's first delivery, not at admission: its usage carries the
    prompt's cache hit, which the engine knows once it schedules the request (pings may precede
    it while the request waits; the client skips them)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.block = -1  # index of the open block
        self.kind = ""  # "thinking", "text" or "tool_use"
        self.started = False

    def start(self) -> bytes:
        self.started = True
        message = AnthropicMessageDoc(
            self.job.id, "message", "assistant", self.job.model.model_id, [], None, None, usage(self.job, 0)
        )
        return _event(AnthropicEvent(type="message_start", message=message))

    def deliver(self, c: Choice, events: list[Item]) -> list[bytes]:
        out: list[bytes] = [] if self.started else [self.start()]
        for e in events:
            if isinstance(e, ReasoningText):
                if self.kind != "thinking":
                    out += self._open(AnthropicThinkingOut(""), "thinking")
                out.append(self._delta(AnthropicDelta(type="thinking_delta", thinking=e.text)))
            elif isinstance(e, str):
                if not e:
                    continue
                if self.kind != "text":
                    out += self._open(AnthropicTextOut(""), "text")
                out.append(self._delta(AnthropicDelta(type="text_delta", text=e)))
            elif isinstance(e, CallStart):
                out += self._open(AnthropicToolUseOut(_tool_use_id(c.call_ids[e.index]), e.name, {}), "tool_use")
            elif isinstance(e, CallArgs):
                out.append(self._delta(AnthropicDelta(type="input_json_delta", partial_json=e.text)))
        if c.finish is not None:
            out += self._close()
            reason, sequence = _stop(c)
            delta = AnthropicDelta(stop_reason=reason, stop_sequence=sequence)
            u = usage(self.job)
            totals = AnthropicOutputUsage(
                u.output_tokens, u.input_tokens, u.cache_creation_input_tokens, u.cache_read_input_tokens
            )
            out.append(_event(AnthropicEvent(type="message_delta", delta=delta, usage=totals)))
            out.append(_event(AnthropicEvent(type="message_stop")))
        return out

    def _open(self, block: AnthropicBlockOut, kind: str) -> list[bytes]:
        out = self._close()
        self.block, self.kind = self.block + 1, kind
        out.append(_event(AnthropicEvent(type="content_block_start", index=self.block, content_block=block)))
        return out

    def _close(self) -> list[bytes]:
        if not self.kind:
            return []
        self.kind = ""
        return [_event(AnthropicEvent(type="content_block_stop", index=self.block))]

    def _delta(self, delta: AnthropicDelta) -> bytes:
        return _event(AnthropicEvent(type="content_block_delta", index=self.block, delta=delta))


def _event(event: AnthropicEvent) -> bytes:
    return sse.event(encoder.encode(event), event.type)


def error_event(e: ApiError) -> bytes:
    return sse.event(e.anthropic_body(), "error")


class MessagesPresenter:
    """The Messages API's shapes for a Job (serve/generate.py's Presenter)."""

    id_prefix = "msg_"

    def document(self, job: Job) -> bytes:
        return document(job)

    async def stream(self, job: Job, out: Sender, ping_s: float) -> None:
        await stream(job, out, ping_s)


async def stream(job: Job, out: Sender, ping_s: float) -> None:
    """The streamed answer (after admission); errors after the first byte become an error event."""
    from serve.generate import pump

    s = Stream(job)
    await out.start(200, b"text/event-stream", ((b"cache-control", b"no-cache"),))
    try:
        await pump(job, out, ping_s, s.deliver, _event(AnthropicEvent(type="ping")))
    except ApiError as e:
        job.abort()
        log_server_error(out, e)
        await out.chunk(error_event(e))
    await out.end()
