"""Running one GenSpec on the AsyncEngine: n choices per prompt, streamed as SSE or collected.

Owns: submitting one engine request per choice (all refused together on a full queue),
turning TokenOut lists into text through a TextStream per choice (stop strings abort the
engine request), the chat/completion documents and chunks, the 15 s ping, the error event
after the stream started, aborting everything when the client leaves, and the latency
histograms. Must not reach into the engine beyond the AsyncEngine API.
Tested through tests/test_serve_app.py and tests/test_serve_http.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

from serve import errors, sse
from serve.asgi import DisconnectWatcher, Sender
from serve.errors import ApiError
from serve.metrics import Metrics
from serve.params import GenSpec
from serve.textstream import TextStream
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
    Delta,
    FunctionCallOut,
    FunctionDelta,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
    encoder,
)
from tl.core.async_engine import AsyncEngine, EngineError, RequestHandle, settled
from tl.core.request import Constraint, GenRequest, RequestError, TokenOut
from tl.ops.served import ServedModel, TextTokenizer
from tl.text.tools import CallArgs, CallStart, Event, ToolCallParser

PING_INTERVAL_S = 15.0
_GONE = object()


@dataclass
class Choice:
    index: int
    prompt_len: int
    handle: RequestHandle
    stream: TextStream
    stop_ids: frozenset[int]
    hidden_ids: frozenset[int]  # special tokens: counted, never shown (vLLM's skip_special_tokens)
    parser: ToolCallParser | None = None  # tools: the shown text goes through it (content and calls)
    call_ids: list[str] = field(default_factory=list)  # the id of each call, in order
    text: list[str] = field(default_factory=list)  # content
    num_tokens: int = 0
    finish: str | None = None
    pending: list[TokenOut] = field(default_factory=list)  # tokens whose logprobs are not yet sent
    logprobs: list[TokenOut] = field(default_factory=list)  # every token, for the non-streamed answer
    first_token_at: float | None = None

    def feed(self, outs: list[TokenOut], tok: TextTokenizer) -> list[Event]:
        """Consume one delivery; return what may be sent now: content text and, with tools, call
        events. Raises ApiError on abort, no_capacity or a constraint's failure."""
        pieces = []
        for o in outs:
            if self.finish is not None:
                break
            if o.token_id >= 0:
                self.first_token_at = self.first_token_at or time.monotonic()
                self.num_tokens += 1
                self.pending.append(o)
                self.logprobs.append(o)
                hidden = o.token_id in self.hidden_ids or (o.finish_reason == "stop" and o.token_id in self.stop_ids)
                if not hidden:
                    pieces.append(self.stream.push(tok.token_bytes(o.token_id)))
                    if self.stream.stopped:
                        self.finish = "stop"
                        self.handle.abort()
                        break
            if o.finish_reason in ("stop", "length"):
                pieces.append(self.stream.finish())
                self.finish = o.finish_reason
            elif o.finish_reason == "no_capacity":
                raise errors.no_capacity()
            elif o.finish_reason == "abort":
                raise errors.aborted()
            elif o.finish_reason == "error":
                raise errors.constraint_failed(o.error or "the structured-output matcher failed")
        piece = "".join(pieces)
        if self.parser is None:
            self.text.append(piece)
            return [piece] if piece else []
        events = self.parser.push(piece) + (self.parser.finish() if self.finish is not None else [])
        for e in events:
            if isinstance(e, str):
                self.text.append(e)
            elif isinstance(e, CallStart):
                self.call_ids.append(f"call_{uuid.uuid4().hex[:24]}")
        if self.finish == "stop" and self.parser.calls:
            self.finish = "tool_calls"
        return events

    def message(self) -> AssistantMessage:
        """The non-streamed answer: content (null when only calls came) and the tool calls."""
        text = "".join(self.text)
        if self.parser is None or not self.parser.calls:
            return AssistantMessage("assistant", text)
        calls = [
            ToolCallOut(i, "function", FunctionCallOut(c.name, c.arguments_text))
            for i, c in zip(self.call_ids, self.parser.calls, strict=True)
        ]
        return AssistantMessage("assistant", text or None, calls)


async def _pump(choice: Choice, queue: asyncio.Queue[tuple[Choice | None, object]]) -> None:
    """One choice's deliveries into its Job's queue; an engine failure or refusal too, without
    its traceback (whose frame holds the queue it would sit in: a cycle if nobody reads it)."""
    try:
        async for outs in choice.handle:
            queue.put_nowait((choice, outs))
    except Exception as e:  # noqa: BLE001 - EngineError or an admission refusal, answered by the route
        queue.put_nowait((choice, e.with_traceback(None)))


class Job:
    """One HTTP generation request: its choices, merged deliveries and cleanup."""

    def __init__(
        self,
        spec: GenSpec,
        engine: AsyncEngine,
        model: ServedModel,
        priority: int,
        metrics: Metrics,
        arrived: float,
        constraint: Constraint | None = None,
    ) -> None:
        self.spec = spec
        self.constraint = constraint
        self.engine = engine
        self.model = model
        self.metrics = metrics
        self.arrived = arrived
        self.created = int(time.time())
        prefix = {"chat": "chatcmpl", "completion": "cmpl", "messages": "msg", "responses": "resp"}[spec.kind]
        self.id = (
            f"{prefix}{'-' if spec.kind in ('chat', 'completion') else '_'}{uuid.uuid4().hex}"  # msg_..., resp_...
        )
        self.queue: asyncio.Queue[tuple[Choice | None, object]] = asyncio.Queue()
        self.choices = self._submit(priority)
        # _pump is a function of the queue, not of the Job: a pump cancelled by close() keeps its
        # CancelledError and with it its frame, and a Job there would be a reference cycle
        # (Job -> task -> frame -> Job) holding every token until a full collection.
        self._pumps = [asyncio.create_task(_pump(c, self.queue)) for c in self.choices]

    def _submit(self, priority: int) -> list[Choice]:
        stop_ids = frozenset(self.engine.eos_token_ids)
        tok = self.model.tokenizer
        hidden_ids = tok.special_token_ids
        fmt = self.spec.tool_format
        if fmt is not None:  # a marker that is a special token (Qwen's <tool_call>) must reach the parser
            hidden_ids -= {tok.token_to_id(fmt.start), tok.token_to_id(fmt.end)}
        choices: list[Choice] = []
        try:
            for p_idx, prompt in enumerate(self.spec.prompts):
                for c_idx, params in enumerate(self.spec.params):
                    handle = self.engine.submit(GenRequest(prompt, params, priority, self.constraint))
                    stops = stop_ids | set(params.stop_token_ids)
                    choices.append(
                        Choice(
                            p_idx * self.spec.n + c_idx,
                            len(prompt),
                            handle,
                            TextStream(self.spec.stops),
                            stops,
                            hidden_ids,
                            None if fmt is None else ToolCallParser(fmt),
                        )
                    )
        except RequestError as e:  # the engine's refusal (context, queue): nothing of this request runs
            for c in choices:
                c.handle.abort()
            raise errors.from_request_error(e, self.spec.context_param) from None
        except EngineError as e:  # the engine is gone (a multi-host group lost a process)
            for c in choices:
                c.handle.abort()
            raise errors.from_engine_error(e) from None
        return choices

    async def admitted(self) -> None:
        """Wait until the engine thread took every choice; its refusal becomes an ApiError."""
        for c in self.choices:
            try:
                await settled(c.handle.admitted)
            except RequestError as e:
                raise errors.from_request_error(e, self.spec.context_param) from None
            except EngineError as e:
                raise errors.from_engine_error(e) from None

    def abort(self) -> None:
        for c in self.choices:
            c.handle.abort()

    def close(self) -> None:
        self.abort()
        for t in self._pumps:
            t.cancel()

    async def next(self, timeout: float | None) -> tuple[Choice | None, object]:
        """The next delivery (choice, TokenOut list or exception); (None, None) on timeout; (None, _GONE)."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None, None

    def gone(self) -> None:
        self.queue.put_nowait((None, _GONE))

    def feed(self, choice: Choice, item: object) -> list[Event]:
        if isinstance(item, RequestError):
            raise errors.from_request_error(item, self.spec.context_param)
        if isinstance(item, EngineError):
            raise errors.from_engine_error(item)
        if isinstance(item, BaseException):
            raise errors.internal(f"engine failure: {item}")
        events = choice.feed(cast(list[TokenOut], item), self.model.tokenizer)  # the engine's batch of outputs
        if choice.finish is not None:
            self._observe(choice)
        return events

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.spec.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        return Usage(prompt, completion, prompt + completion)

    def _observe(self, c: Choice) -> None:
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.arrived)
        if c.handle.admitted_at is not None:
            self.metrics.queue_time.observe(c.handle.admitted_at - c.handle.submitted_at)
        if c.first_token_at is not None:
            self.metrics.ttft.observe(c.first_token_at - self.arrived)
            if c.num_tokens > 1:
                self.metrics.tpot.observe((now - c.first_token_at) / (c.num_tokens - 1))

    def token_str(self, token_id: int) -> tuple[str, list[int]]:
        b = self.model.tokenizer.token_bytes(token_id)
        return b.decode("utf-8", errors="replace"), list(b)

    def chat_logprobs(self, outs: list[TokenOut]) -> ChatLogprobs | None:
        if not self.spec.logprobs:
            return None
        content = []
        for o in outs:
            s, b = self.token_str(o.token_id)
            tops = []
            for t, lp in o.top_logprobs:
                ts, tb = self.token_str(t)
                tops.append(TopLogprob(ts, lp, tb))
            content.append(TokenLogprob(s, o.logprob, b, tops))
        return ChatLogprobs(content)

    def completion_logprobs(self, outs: list[TokenOut], offset: int) -> CompletionLogprobs | None:
        if not self.spec.logprobs:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        for o in outs:
            s = self.token_str(o.token_id)[0]
            tokens.append(s)
            lps.append(o.logprob)
            tops.append({self.token_str(t)[0]: lp for t, lp in o.top_logprobs})
            offsets.append(offset)
            offset += len(s)
        return CompletionLogprobs(tokens, lps, tops, offsets)

    def final_document(self) -> bytes:
        if self.spec.kind == "chat":
            return encoder.encode(
                ChatCompletion(
                    self.id,
                    "chat.completion",
                    self.created,
                    self.model.model_id,
                    [
                        ChatChoice(c.index, c.message(), self.chat_logprobs(c.logprobs), c.finish or "stop")
                        for c in self.choices
                    ],
                    self.usage(),
                )
            )
        return encoder.encode(
            Completion(
                self.id,
                "text_completion",
                self.created,
                self.model.model_id,
                [
                    CompletionChoice(
                        c.index, "".join(c.text), self.completion_logprobs(c.logprobs, 0), c.finish or "stop"
                    )
                    for c in self.choices
                ],
                self.usage(),
            )
        )

    def chunks(self, c: Choice, events: list[Event]) -> list[bytes]:
        """The SSE chunks of one delivery: one per event (content text, a call opening with its id,
        type and name, an arguments fragment), the finish reason on the last; logprobs on the first."""
        if self.spec.kind != "chat" or c.parser is None:
            return [self.chunk(c, "".join(e for e in events if isinstance(e, str)))]
        if not events:
            return [self.chunk(c, "")] if c.finish is not None else []
        out = []
        for k, e in enumerate(events):
            last = k == len(events) - 1
            if isinstance(e, str):
                delta = Delta(content=e)
            elif isinstance(e, CallStart):
                fn = FunctionDelta(name=e.name, arguments="")
                delta = Delta(tool_calls=[ToolCallDelta(e.index, c.call_ids[e.index], "function", fn)])
            else:
                assert isinstance(e, CallArgs)
                delta = Delta(tool_calls=[ToolCallDelta(e.index, function=FunctionDelta(arguments=e.text))])
            out.append(self.chunk(c, "", delta=delta, finish=last))
        return out

    def chunk(
        self, c: Choice, piece: str, first: bool = False, delta: Delta | None = None, finish: bool = True
    ) -> bytes:
        outs, c.pending = c.pending, []
        if self.spec.kind == "chat":
            if delta is None:
                delta = Delta(role="assistant", content="") if first else Delta(content=piece or None)
            doc: object = ChatCompletionChunk(
                self.id,
                "chat.completion.chunk",
                self.created,
                self.model.model_id,
                [
                    ChunkChoice(
                        c.index, delta, None if first else self.chat_logprobs(outs), c.finish if finish else None
                    )
                ],
            )
        else:
            offset = sum(len(t) for t in c.text) - len(piece)
            doc = Completion(
                self.id,
                "text_completion",
                self.created,
                self.model.model_id,
                [CompletionChoice(c.index, piece, self.completion_logprobs(outs, offset), c.finish)],
            )
        return sse.event(encoder.encode(doc))

    def usage_chunk(self) -> bytes:
        if self.spec.kind == "chat":
            doc: object = ChatCompletionChunk(
                self.id, "chat.completion.chunk", self.created, self.model.model_id, [], self.usage()
            )
        else:
            doc = Completion(self.id, "text_completion", self.created, self.model.model_id, [], self.usage())
        return sse.event(encoder.encode(doc))


class Presenter(Protocol):
    """Another API's shapes for a Job (serve/anthropic.py, serve/responses.py): its document and
    its stream."""

    def document(self, job: Job) -> bytes: ...
    async def stream(self, job: Job, out: Sender, ping_s: float) -> None: ...


async def respond(
    job: Job,
    out: Sender,
    watcher: DisconnectWatcher,
    ping_interval_s: Callable[[], float],
    present: Presenter | None = None,
) -> None:
    """Answer one generation request (errors before the first byte are raised as ApiError);
    `present`: another API's document and stream instead of chat's or completions'."""
    watcher.on_gone(job.gone)
    try:
        if present is not None and job.spec.stream:
            await job.admitted()
            await present.stream(job, out, ping_interval_s())
        elif present is not None:
            if await _finish(job):
                await out.whole(200, present.document(job))
        elif job.spec.stream:
            await job.admitted()
            await _stream(job, out, ping_interval_s())
        else:
            await _collect(job, out)
    finally:
        job.close()


async def _finish(job: Job) -> bool:
    """Every delivery fed in; False if the client left first."""
    while not job.done:
        choice, item = await job.next(None)  # every choice's handle ends with an item (tl/core/async_engine.py)
        if item is _GONE:
            return False
        assert choice is not None
        job.feed(choice, item)
    return True


async def _collect(job: Job, out: Sender) -> None:
    if await _finish(job):
        await out.whole(200, job.final_document())


async def pump(
    job: Job, out: Sender, ping_s: float, deliver: Callable[[Choice, list[Event]], list[bytes]], ping: bytes = sse.PING
) -> bool:
    """Every delivery of a streamed Job fed in and its chunks (as `deliver` frames them) sent,
    `ping` after ping_s without one; False if the client left. Raises ApiError from a delivery."""
    while not job.done:
        choice, item = await job.next(ping_s)
        if item is _GONE:
            return False
        if choice is None:
            await out.chunk(ping)
            continue
        for data in deliver(choice, job.feed(choice, item)):
            await out.chunk(data)
    return True


async def _stream(job: Job, out: Sender, ping_s: float) -> None:
    await out.start(200, b"text/event-stream", ((b"cache-control", b"no-cache"),))
    if job.spec.kind == "chat":
        for c in job.choices:
            await out.chunk(job.chunk(c, "", first=True))
    try:
        if not await pump(job, out, ping_s, lambda c, ev: job.chunks(c, ev) if ev or c.finish is not None else []):
            return
        if job.spec.include_usage:
            await out.chunk(job.usage_chunk())
    except ApiError as e:
        job.abort()
        errors.log_server_error(out, e)
        await out.chunk(sse.event(encoder.encode(e.doc())))
    await out.chunk(sse.DONE)
    await out.end()
