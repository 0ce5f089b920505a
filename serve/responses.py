"""OpenAI's Responses API on the one generation path: POST /v1/responses, GET and DELETE
/v1/responses/{id}.

Owns translation and the store: a ResponsesRequest becomes the ChatRequest it means
(`instructions` as the system turn, `input` items as turns: messages with input_text /
output_text parts, function_call items as an assistant's tool_calls, function_call_output
items as tool turns, reasoning items as the next assistant turn's reasoning_content; function
tools, tool_choice, parallel_tool_calls, max_output_tokens, temperature, top_p, `text.format` as
response_format, `reasoning.effort` "none" as reasoning_effort) and runs through serve/params.py's
chat_spec and serve/generate.py's Job like any chat request; the finished Job becomes a
response object (output items `reasoning` with `reasoning_text` content before the others,
`message` with `output_text` and `function_call` with its `call_id`; status `completed`,
or `incomplete` with `incomplete_details.reason` on a length cut; usage, its reasoning tokens
counted), or, streamed, the typed event sequence with a `sequence_number` on every event.
ResponseStore keeps stored responses (`store`, default true) per replica, bounded by count
(LRU) and age, so `previous_response_id` continues a conversation and GET / DELETE work; an id
past the bound is a 404. Tested with the openai client by tests/serve/test_responses.py and
tests/text/test_reasoning.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from serve import errors, sse
from serve.errors import ApiError, log_server_error
from serve.params import GenSpec, chat_spec
from serve.wire import (
    CallFunction,
    ChatMessage,
    ChatRequest,
    FunctionDef,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseDoc,
    ResponseFormat,
    ResponsesEvent,
    ResponsesFunctionCall,
    ResponsesIncomplete,
    ResponsesInputDetails,
    ResponsesItem,
    ResponsesMessageItem,
    ResponsesOutputDetails,
    ResponsesOutputItem,
    ResponsesOutputText,
    ResponsesReasoningItem,
    ResponsesReasoningText,
    ResponsesRequest,
    ResponsesText,
    ResponsesTextFormat,
    ResponsesTool,
    ResponsesToolChoice,
    ResponsesUsage,
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


@dataclasses.dataclass
class Stored:
    at: float
    doc: ResponseDoc
    conversation: list[ChatMessage]  # every turn through this response's output


class ResponseStore:
    """Stored responses of this replica: at most `size` (least recently used dropped first),
    none older than `ttl_s`. Loop-only (no lock)."""

    def __init__(self, size: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.size, self.ttl_s, self._clock = size, ttl_s, clock
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, doc: ResponseDoc, conversation: list[ChatMessage]) -> None:
        self._items[doc.id] = Stored(self._clock(), doc, conversation)
        self._items.move_to_end(doc.id)
        self._expire()
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        self._expire()
        item = self._items.get(response_id)
        if item is None:
            raise ApiError(
                404, f"Response with id '{response_id}' not found.", "invalid_request_error", param, "not_found"
            )
        self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._items and next(iter(self._items.values())).at < cutoff:
            self._items.popitem(last=False)


def _turns(req: ResponsesRequest) -> list[ChatMessage]:
    items = [ResponsesItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    out: list[ChatMessage] = []
    thought: str | None = None  # a reasoning item's text, for the assistant turn that follows
    for i, it in enumerate(items):
        if it.type == "message":
            if it.role is None:
                raise errors.bad_request(f"input[{i}].role is required for a message", f"input[{i}].role")
            reasoning, thought = (thought, None) if it.role == "assistant" else (None, thought)
            out.append(ChatMessage(role=it.role, content=_text(it.content, i), reasoning_content=reasoning))
        elif it.type == "function_call":
            call = ToolCall(id=it.call_id or f"call_{i}", function=CallFunction(it.name or "", it.arguments or "{}"))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls and thought is None:
                last.tool_calls.append(call)
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call], reasoning_content=thought))
                thought = None
        elif it.type == "reasoning":
            parts = it.content if isinstance(it.content, list) else []
            thought = "".join(p.text or "" for p in parts if p.type == "reasoning_text") or None
        elif it.type == "function_call_output":
            out.append(ChatMessage(role="tool", content=it.output or "", tool_call_id=it.call_id))
        else:
            raise errors.unsupported(f"input[{i}].type", f"input item {it.type!r}")
    return out


def _text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text"):
            raise errors.unsupported(f"input[{i}].content[{j}].type", f"content part {part.type!r}")
    return "".join(p.text or "" for p in content)


def _tools(req: ResponsesRequest) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if req.tools:
        for i, t in enumerate(req.tools):
            if t.type != "function":
                raise errors.unsupported(f"tools[{i}].type", f"tool {t.type!r}")
            if not t.name:
                raise errors.bad_request(f"tools[{i}].name is required", f"tools[{i}].name")
        kw["tools"] = [
            Tool(
                type="function",
                function=FunctionDef(name=t.name or "", description=t.description, parameters=t.parameters),
            )
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        kw["tool_choice"] = (
            choice if isinstance(choice, str) else NamedToolChoice(type="function", function=NamedFunction(choice.name))
        )
    if req.parallel_tool_calls is not None:
        kw["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        schema = JsonSchemaFormat(name=fmt.name or "response", schema=fmt.schema, strict=fmt.strict)
        kw["response_format"] = ResponseFormat(type="json_schema", json_schema=schema)
    elif fmt is not None and fmt.type == "json_object":
        kw["response_format"] = ResponseFormat(type="json_object")
    return kw


def conversation(req: ResponsesRequest, store: ResponseStore) -> list[ChatMessage]:
    """The turns this request continues (its previous response's) plus its own."""
    prior = store.get(req.previous_response_id, "previous_response_id").conversation if req.previous_response_id else []
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    return system + [m for m in prior if m.role != "system"] + _turns(req)


def responses_spec(req: ResponsesRequest, info: ServedModel, turns: list[ChatMessage]) -> GenSpec:
    chat = ChatRequest(
        model=req.model,
        messages=turns,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=bool(req.stream),
        **_tools(req),
        **_effort(req),
    )
    return dataclasses.replace(chat_spec(chat, info), kind="responses")


def _effort(req: ResponsesRequest) -> dict[str, Any]:
    effort = req.reasoning.effort if req.reasoning is not None else None
    return {} if effort is None else {"reasoning_effort": effort}


def _message_id(job: Job) -> str:
    return job.id.replace("resp_", "msg_")


def _reasoning_id(job: Job) -> str:
    return job.id.replace("resp_", "rs_")


def _reasoning_item(item_id: str, text: str, status: str) -> ResponsesReasoningItem:
    parts = [ResponsesReasoningText(text)] if status == "completed" else []
    return ResponsesReasoningItem(item_id, [], parts, status)


def _call_item_id(job: Job, index: int) -> str:
    return f"fc_{job.id[5:]}_{index}"


@dataclasses.dataclass(frozen=True, slots=True)
class _TextKind:
    """What a streamed text item is: the thinking (a reasoning item) or the answer (a message)."""

    event: str  # response.<event>.delta / .done
    part: Callable[[str], ResponsesOutputText | ResponsesReasoningText]
    item: Callable[[str, str, str], ResponsesOutputItem]  # (id, text, status)
    item_type: type
    new_id: Callable[[Job], str]


def _message_item(item_id: str, text: str, status: str) -> ResponsesMessageItem:
    parts = [ResponsesOutputText(text)] if text or status == "completed" else []
    return ResponsesMessageItem(item_id, status, "assistant", parts)


_REASONING = _TextKind("reasoning_text", ResponsesReasoningText, _reasoning_item, ResponsesReasoningItem, _reasoning_id)
_MESSAGE = _TextKind("output_text", ResponsesOutputText, _message_item, ResponsesMessageItem, _message_id)


def output_items(job: Job, c: Choice) -> list[ResponsesOutputItem]:
    text, thought = "".join(c.text), "".join(c.reasoning)
    items: list[ResponsesOutputItem] = [_reasoning_item(_reasoning_id(job), thought, "completed")] if thought else []
    if text:
        items.append(_message_item(_message_id(job), text, "completed"))
    for i, (call_id, call) in enumerate(zip(c.call_ids, c.parser.calls if c.parser else [], strict=True)):
        items.append(ResponsesFunctionCall(_call_item_id(job, i), call_id, call.name, call.arguments_text, "completed"))
    return items


def response_doc(
    job: Job, req: ResponsesRequest, status: str, output: list[ResponsesOutputItem], usage: ResponsesUsage | None
) -> ResponseDoc:
    incomplete = ResponsesIncomplete("max_output_tokens") if status == "incomplete" else None
    tools = [
        ResponsesTool(type="function", name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)
        for t in req.tools or []
    ]
    fmt = req.text.format if req.text is not None else None
    choice = req.tool_choice
    return ResponseDoc(
        id=job.id,
        object="response",
        created_at=job.created,
        status=status,
        incomplete_details=incomplete,
        model=job.model.model_id,
        output=output,
        usage=usage,
        instructions=req.instructions,
        metadata=req.metadata or {},
        parallel_tool_calls=req.parallel_tool_calls is not False,
        temperature=req.temperature,
        top_p=req.top_p,
        tool_choice=choice
        if isinstance(choice, str) or choice is None
        else ResponsesToolChoice(type="function", name=choice.name),
        tools=tools,
        text=ResponsesText(format=fmt or ResponsesTextFormat(type="text")),
        max_output_tokens=req.max_output_tokens,
        previous_response_id=req.previous_response_id,
        store=req.store is not False,
    )


def usage(job: Job) -> ResponsesUsage:
    c = job.choices[0]
    prompt, output = job.num_prompt_tokens, c.num_tokens
    return ResponsesUsage(
        prompt,
        ResponsesInputDetails(job.num_cached_tokens),
        output,
        ResponsesOutputDetails(c.num_reasoning_tokens),
        prompt + output,
    )


def finished(job: Job, req: ResponsesRequest, store: ResponseStore, turns: list[ChatMessage]) -> ResponseDoc:
    """The finished response (stored when `store` is not false, with its conversation)."""
    c = job.choices[0]
    status = "incomplete" if c.finish == "length" else "completed"
    doc = response_doc(job, req, status, output_items(job, c), usage(job))
    if req.store is not False:
        reply = ChatMessage(role="assistant", content="".join(c.text), reasoning_content="".join(c.reasoning) or None)
        if c.parser is not None and c.parser.calls:
            reply.tool_calls = [
                ToolCall(id=i, function=CallFunction(call.name, call.arguments_text))
                for i, call in zip(c.call_ids, c.parser.calls, strict=True)
            ]
        store.put(doc, [*turns, reply])
    return doc


class Stream:
    """The typed event sequence of one streamed response, numbered from 0."""

    def __init__(self, job: Job, req: ResponsesRequest) -> None:
        self.job, self.req = job, req
        self.seq = 0
        self.index = -1  # output index of the open item
        self.open: ResponsesOutputItem | None = None  # the open item, as it was added
        self.text = ""  # the open message's (or reasoning item's) text so far
        self.arguments = ""  # the open call's arguments so far

    def event(self, **fields: Any) -> bytes:
        """One event (`type` and its fields), numbered."""
        doc = ResponsesEvent(sequence_number=self.seq, **fields)
        self.seq += 1
        return sse.event(encoder.encode(doc), doc.type)

    def start(self) -> list[bytes]:
        doc = response_doc(self.job, self.req, "in_progress", [], None)
        return [
            self.event(type="response.created", response=doc),
            self.event(type="response.in_progress", response=doc),
        ]

    def deliver(self, c: Choice, events: list[Item]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if isinstance(e, ReasoningText):
                out += self._text(_REASONING, e.text)
            elif isinstance(e, str):
                if e:
                    out += self._text(_MESSAGE, e)
            elif isinstance(e, CallStart):
                out += self._close()
                call_id = c.call_ids[e.index]
                out += self._add(
                    ResponsesFunctionCall(_call_item_id(self.job, e.index), call_id, e.name, "", "in_progress")
                )
            elif isinstance(e, CallArgs):
                assert self.open is not None
                self.arguments += e.text
                out.append(
                    self.event(
                        type="response.function_call_arguments.delta",
                        item_id=self.open_id,
                        output_index=self.index,
                        delta=e.text,
                    )
                )
        if c.finish is not None:
            out += self._close()
        return out

    @property
    def open_id(self) -> str:
        assert self.open is not None
        return self.open.id

    def _text(self, kind: _TextKind, text: str) -> list[bytes]:
        """A delta of reasoning or answer text, opening its item (closing the open one) first."""
        out: list[bytes] = []
        if not isinstance(self.open, kind.item_type):
            out += self._close()
            out += self._add(kind.item(kind.new_id(self.job), "", "in_progress"))
            out.append(self._part("response.content_part.added", kind.part("")))
        self.text += text
        event = f"response.{kind.event}.delta"
        out.append(self.event(type=event, item_id=self.open_id, output_index=self.index, content_index=0, delta=text))
        return out

    def _part(self, kind: str, part: ResponsesOutputText | ResponsesReasoningText) -> bytes:
        return self.event(type=kind, item_id=self.open_id, output_index=self.index, content_index=0, part=part)

    def _add(self, item: ResponsesOutputItem) -> list[bytes]:
        self.index += 1
        self.open = item
        return [self.event(type="response.output_item.added", output_index=self.index, item=item)]

    def _close(self) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        out = []
        done: ResponsesOutputItem
        if isinstance(item, ResponsesReasoningItem | ResponsesMessageItem):
            kind = _REASONING if isinstance(item, ResponsesReasoningItem) else _MESSAGE
            event = f"response.{kind.event}.done"
            out.append(
                self.event(type=event, item_id=item.id, output_index=self.index, content_index=0, text=self.text)
            )
            out.append(self._part("response.content_part.done", kind.part(self.text)))
            done = kind.item(item.id, self.text, "completed")
            self.text = ""
        else:
            out.append(
                self.event(
                    type="response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=self.index,
                    arguments=self.arguments,
                )
            )
            done = msgspec.structs.replace(item, arguments=self.arguments, status="completed")
            self.arguments = ""
        out.append(self.event(type="response.output_item.done", output_index=self.index, item=done))
        self.open = None
        return out

    def end(self, doc: ResponseDoc) -> bytes:
        """`response.completed` carrying the response, whose `status` says "incomplete" on a length
        cut: the official client's stream helper takes only that event as the end."""
        return self.event(type="response.completed", response=doc)


@dataclasses.dataclass(frozen=True, slots=True)
class ResponsesPresenter:
    """The Responses API's shapes for a Job (serve/generate.py's Presenter): the finished response
    (stored unless `store` is false), or its event stream ending with it."""

    id_prefix = "resp_"
    req: ResponsesRequest
    store: ResponseStore
    turns: list[ChatMessage]

    def document(self, job: Job) -> bytes:
        return encoder.encode(finished(job, self.req, self.store, self.turns))

    async def stream(self, job: Job, out: Sender, ping_s: float) -> None:
        await stream(job, self.req, out, ping_s, lambda: finished(job, self.req, self.store, self.turns))


async def stream(job: Job, req: ResponsesRequest, out: Sender, ping_s: float, done: Callable[[], ResponseDoc]) -> None:
    """The streamed response (after admission); a failure after the first byte is an `error` event."""
    from serve.generate import pump

    s = Stream(job, req)
    await out.start(200, b"text/event-stream", ((b"cache-control", b"no-cache"),))
    for data in s.start():
        await out.chunk(data)
    try:
        if await pump(job, out, ping_s, s.deliver):
            await out.chunk(s.end(done()))
    except ApiError as e:
        job.abort()
        log_server_error(out, e)
        await out.chunk(s.event(type="error", code=e.code, message=e.message, param=e.param))
    await out.end()
