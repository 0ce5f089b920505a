"""OpenAI's chat completions and completions shapes for a Job: two Presenters (serve/generate.py).

Owns: the chat.completion and text_completion documents, their streamed chunks (chat's first
chunk per choice carries the role; a reasoning model's thinking as reasoning_content and
reasoning, in its own chunks before the content's; with tools, one chunk per content piece, call
opening and arguments fragment; the finish reason on the last; logprobs on the first chunk of a
delivery), the usage chunk (`stream_options.include_usage`; a reasoning model's reasoning-token
count in it), the error event after the stream started, and `[DONE]`. Every document is a
msgspec Struct of serve/wire.py.
Tested through tests/serve/test_serve_app.py, tests/serve/test_serve_tools.py and tests/serve/test_serve_http.py.
"""

from __future__ import annotations

from collections.abc import Callable

from serve import errors, sse
from serve.asgi import Sender
from serve.errors import ApiError
from serve.generate import Choice, Item, Job, pump
from serve.wire import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
    Delta,
    FunctionCallOut,
    FunctionDelta,
    PromptTokensDetails,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
    encoder,
)
from tl.core.request import TokenOut
from tl.text.reasoning import ReasoningText
from tl.text.tools import CallArgs, CallStart


class ChatPresenter:
    """/v1/chat/completions: a chat.completion, or chat.completion.chunk events."""

    id_prefix = "chatcmpl-"

    def document(self, job: Job) -> bytes:
        choices = [
            ChatChoice(c.index, _message(c), _chat_logprobs(job, c.logprobs), c.finish or "stop") for c in job.choices
        ]
        return encoder.encode(
            ChatCompletion(job.id, "chat.completion", job.created, job.model.model_id, choices, _usage(job))
        )

    async def stream(self, job: Job, out: Sender, ping_s: float) -> None:
        role = Delta(role="assistant", content="")
        first = [_chat_chunk(job, ChunkChoice(c.index, role, None, c.finish)) for c in job.choices]

        def usage() -> ChatCompletionChunk:
            return ChatCompletionChunk(
                job.id, "chat.completion.chunk", job.created, job.model.model_id, [], _usage(job)
            )

        await _stream(job, out, ping_s, first, lambda c, events: _chat_chunks(job, c, events), usage)


class CompletionPresenter:
    """/v1/completions: a text_completion, or text_completion events."""

    id_prefix = "cmpl-"

    def document(self, job: Job) -> bytes:
        choices = [
            CompletionChoice(c.index, "".join(c.text), _completion_logprobs(job, c.logprobs, 0), c.finish or "stop")
            for c in job.choices
        ]
        return encoder.encode(
            Completion(job.id, "text_completion", job.created, job.model.model_id, choices, _usage(job))
        )

    async def stream(self, job: Job, out: Sender, ping_s: float) -> None:
        def usage() -> Completion:
            return Completion(job.id, "text_completion", job.created, job.model.model_id, [], _usage(job))

        await _stream(job, out, ping_s, [], lambda c, events: _completion_chunks(job, c, events), usage)


async def _stream(
    job: Job,
    out: Sender,
    ping_s: float,
    first: list[bytes],
    deliver: Callable[[Choice, list[Item]], list[bytes]],
    usage: Callable[[], ChatCompletionChunk | Completion],
) -> None:
    """The event stream (after admission): `first`, each delivery's chunks (a delivery with no
    event and no finish sends none), the usage chunk when asked for (made at the end), [DONE];
    an error after the first byte is an error event before [DONE]; nothing more once the
    client left."""
    await out.start(200, b"text/event-stream", ((b"cache-control", b"no-cache"),))
    for data in first:
        await out.chunk(data)
    try:
        if not await pump(
            job, out, ping_s, lambda c, events: deliver(c, events) if events or c.finish is not None else []
        ):
            return
        if job.spec.include_usage:
            await out.chunk(sse.event(encoder.encode(usage())))
    except ApiError as e:
        job.abort()
        errors.log_server_error(out, e)
        await out.chunk(sse.event(encoder.encode(e.doc())))
    await out.chunk(sse.DONE)
    await out.end()


def _usage(job: Job) -> Usage:
    prompt = job.num_prompt_tokens
    completion = sum(c.num_tokens for c in job.choices)
    details = None
    if job.spec.thinking is not None:
        details = CompletionTokensDetails(sum(c.num_reasoning_tokens for c in job.choices))
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(job.num_cached_tokens), details)


def _message(c: Choice) -> AssistantMessage:
    """The non-streamed answer: content (null when only calls came), the tool calls, and the
    thinking under both names (absent when there was none)."""
    text = "".join(c.text)
    thought = "".join(c.reasoning) or None
    if c.parser is None or not c.parser.calls:
        return AssistantMessage("assistant", text, None, thought, thought)
    calls = [
        ToolCallOut(i, "function", FunctionCallOut(call.name, call.arguments_text))
        for i, call in zip(c.call_ids, c.parser.calls, strict=True)
    ]
    return AssistantMessage("assistant", text or None, calls, thought, thought)


def _chat_chunk(job: Job, choice: ChunkChoice) -> bytes:
    doc = ChatCompletionChunk(job.id, "chat.completion.chunk", job.created, job.model.model_id, [choice])
    return sse.event(encoder.encode(doc))


def _chat_chunks(job: Job, c: Choice, events: list[Item]) -> list[bytes]:
    """The chunks of one delivery: one per event (a piece of the thinking, content text, with
    tools a call opening with its id, type and name, an arguments fragment), the finish reason
    on the last (on a chunk of its own when the delivery has no event). The delivery's
    logprobs go on its first chunk."""
    if not events:
        return [_chat_chunk(job, ChunkChoice(c.index, Delta(), _pending(job, c), c.finish))]
    out = []
    for k, e in enumerate(events):
        if isinstance(e, ReasoningText):
            delta = Delta(reasoning_content=e.text, reasoning=e.text)
        elif isinstance(e, str):
            delta = Delta(content=e)
        elif isinstance(e, CallStart):
            fn = FunctionDelta(name=e.name, arguments="")
            delta = Delta(tool_calls=[ToolCallDelta(e.index, c.call_ids[e.index], "function", fn)])
        else:
            assert isinstance(e, CallArgs)
            delta = Delta(tool_calls=[ToolCallDelta(e.index, function=FunctionDelta(arguments=e.text))])
        finish = c.finish if k == len(events) - 1 else None
        out.append(_chat_chunk(job, ChunkChoice(c.index, delta, _pending(job, c), finish)))
    return out


def _pending(job: Job, c: Choice) -> ChatLogprobs | None:
    """The chat logprobs of the tokens not sent yet (taken: the next chunk sends none)."""
    outs, c.pending = c.pending, []
    return _chat_logprobs(job, outs)


def _completion_chunks(job: Job, c: Choice, events: list[Item]) -> list[bytes]:
    piece = "".join(e for e in events if isinstance(e, str))
    outs, c.pending = c.pending, []
    offset = sum(len(t) for t in c.text) - len(piece)
    choice = CompletionChoice(c.index, piece, _completion_logprobs(job, outs, offset), c.finish)
    doc = Completion(job.id, "text_completion", job.created, job.model.model_id, [choice])
    return [sse.event(encoder.encode(doc))]


def _token_str(job: Job, token_id: int) -> tuple[str, list[int]]:
    b = job.model.tokenizer.token_bytes(token_id)
    return b.decode("utf-8", errors="replace"), list(b)


def _chat_logprobs(job: Job, outs: list[TokenOut]) -> ChatLogprobs | None:
    if not job.spec.logprobs:
        return None
    content = []
    for o in outs:
        s, b = _token_str(job, o.token_id)
        tops = []
        for t, lp in o.top_logprobs:
            ts, tb = _token_str(job, t)
            tops.append(TopLogprob(ts, lp, tb))
        content.append(TokenLogprob(s, o.logprob, b, tops))
    return ChatLogprobs(content)


def _completion_logprobs(job: Job, outs: list[TokenOut], offset: int) -> CompletionLogprobs | None:
    if not job.spec.logprobs:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for o in outs:
        s = _token_str(job, o.token_id)[0]
        tokens.append(s)
        lps.append(o.logprob)
        tops.append({_token_str(job, t)[0]: lp for t, lp in o.top_logprobs})
        offsets.append(offset)
        offset += len(s)
    return CompletionLogprobs(tokens, lps, tops, offsets)
