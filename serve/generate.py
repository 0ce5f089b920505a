"""Running one GenSpec on the AsyncEngine: n choices per prompt, their outputs merged into one queue.

Owns: the Job (submitting one engine request per choice, all refused together on a full
queue; every choice's outputs into the request's one asyncio queue, an Outbox of
tl/core/async_engine.py; aborting them all), each choice's text through a TextStream (stop
strings abort the engine request), a reasoning model's thinking split from the answer (then,
with tools, the answer through the call parser) and its reasoning-token count; the latency histograms
and the times they are taken from (each choice's first token and finish, which its trace's spans
reuse: serve/otel.py), and each choice's failure;
`respond`, which answers through the dialect's Presenter (serve/chat.py for chat and
completions, serve/anthropic.py, serve/responses.py), and `pump`, the streamed loop every
Presenter runs (the 15 s ping, the client leaving). Documents and chunks are the Presenters'.
Must not reach into the engine beyond the AsyncEngine API.
Tested through tests/serve/test_serve_app.py and tests/serve/test_serve_http.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from serve import errors, sse
from serve.asgi import DisconnectWatcher, Sender
from serve.metrics import Metrics
from serve.params import GenSpec
from serve.textstream import TextStream
from tl.core.async_engine import AsyncEngine, EngineError, Outbox, Output, RequestHandle, settled
from tl.core.request import Constraint, GenRequest, RequestError, TokenOut
from tl.entry.served import ServedModel, TextTokenizer
from tl.text.reasoning import Markers, ReasoningParser, ReasoningText, Thinking
from tl.text.tools import CallStart, Event, ToolCallParser

Item = Event | ReasoningText
"""What a delivery yields to its Presenter: answer text, a call's events, or a piece of the thinking."""

PING_INTERVAL_S = 15.0
_GONE_KEY = -1


class ClientLeft(Exception):
    """The client disconnected mid-request: GONE, the one instance, goes through the request's
    queue (as an output would) to wake whoever waits on it; never raised."""


GONE = ClientLeft("the client left")


@dataclass
class Choice:
    index: int
    prompt_len: int
    handle: RequestHandle
    stream: TextStream
    stop_ids: frozenset[int]
    hidden_ids: frozenset[int]  # special tokens: counted, never shown (vLLM's skip_special_tokens)
    parser: ToolCallParser | None = None  # tools: the shown text goes through it (content and calls)
    thinker: ReasoningParser | None = None  # a reasoning model: thinking and answer split (first)
    thinking: Thinking | None = None  # its token-level state, for num_reasoning_tokens
    markers: Markers | None = None
    call_ids: list[str] = field(default_factory=list)  # the id of each call, in order
    text: list[str] = field(default_factory=list)  # content
    reasoning: list[str] = field(default_factory=list)  # the thinking
    num_tokens: int = 0
    num_reasoning_tokens: int = 0  # of num_tokens, the thinking's (markers included)
    num_cached_tokens: int = 0  # of prompt_len, read from the prefix cache (the engine's TokenOut says)
    finish: str | None = None
    pending: list[TokenOut] = field(default_factory=list)  # tokens whose logprobs are not yet sent
    logprobs: list[TokenOut] = field(default_factory=list)  # every token, for the non-streamed answer
    first_token_at: float | None = None  # time.monotonic() its first token reached serve (TTFT's)
    scheduled_s: float = 0.0  # the engine's clock when it was first scheduled (TokenOut.scheduled_s)
    finished_at: float | None = None  # time.monotonic() its finish was fed (Job._observe)
    failure: errors.ApiError | None = None  # what ended it otherwise (Job.feed raised it)

    def feed(self, outs: list[TokenOut], tok: TextTokenizer) -> list[Item]:
        """Consume one delivery; return what may be sent now: thinking (a reasoning model),
        content text and, with tools, call events. Raises ApiError on abort, no_capacity or a
        constraint's failure."""
        pieces = []
        for o in outs:
            if self.finish is not None:
                break
            if o.token_id >= 0:
                self.first_token_at = self.first_token_at or time.monotonic()
                self.num_tokens += 1
                self._count_thinking(o.token_id)
                self.num_cached_tokens = o.num_cached_tokens
                self.scheduled_s = o.scheduled_s
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
        end = self.finish is not None
        split = [piece] if self.thinker is None else self.thinker.push(piece) + (self.thinker.finish() if end else [])
        thought = [p for p in split if isinstance(p, ReasoningText)]  # the thinking comes first
        self.reasoning += [p.text for p in thought]
        items: list[Item] = [*thought, *self._answer("".join(p for p in split if isinstance(p, str)))]
        return items

    def _count_thinking(self, token_id: int) -> None:
        if self.thinking is not None and self.markers is not None:
            self.num_reasoning_tokens += self.thinking.is_reasoning(token_id, self.markers)
            self.thinking = self.thinking.after(token_id, self.markers)

    def _answer(self, piece: str) -> list[Event]:
        """The answer's text: content, or with tools content and call events."""
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


class Job:
    """One HTTP generation request: its choices, their outputs merged into one queue, and aborting them."""

    def __init__(
        self,
        spec: GenSpec,
        engine: AsyncEngine,
        model: ServedModel,
        priority: int,
        metrics: Metrics,
        arrived: float,
        constraint: Constraint | None = None,
        id_prefix: str = "",
    ) -> None:
        """id_prefix: the dialect's (its Presenter's); the id is it plus 32 hex digits."""
        self.spec = spec
        self.constraint = constraint
        self.engine = engine
        self.model = model
        self.metrics = metrics
        self.arrived = arrived
        self.created = int(time.time())
        self.id = f"{id_prefix}{uuid.uuid4().hex}"
        # The queue holds (choice index, output) only: nothing in it refers back to the Job, so
        # one left unread (the client gone) makes no reference cycle.
        self.queue: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
        self.choices = self._submit(priority)

    def _submit(self, priority: int) -> list[Choice]:
        stop_ids = frozenset(self.engine.eos_token_ids)
        tok = self.model.tokenizer
        hidden_ids = tok.special_token_ids
        fmt = self.spec.tool_format
        if fmt is not None:  # a marker that is a special token (Qwen's <tool_call>) must reach the parser
            hidden_ids -= {tok.token_to_id(fmt.start), tok.token_to_id(fmt.end)}
        thinking = self.spec.thinking
        constraint = self.constraint
        if thinking is not None:  # the markers reach the reasoning parser; an answer's constraint waits for </think>
            hidden_ids -= {thinking.markers.start_id, thinking.markers.end_id}
            constraint = thinking.constraint(constraint)
        choices: list[Choice] = []
        try:
            for prompt in self.spec.prompts:
                for params in self.spec.params:
                    outbox = Outbox(self.queue, len(choices))
                    handle = self.engine.submit(GenRequest(prompt, params, priority, constraint), outbox)
                    stops = stop_ids | set(params.stop_token_ids)
                    choices.append(
                        Choice(
                            len(choices),
                            len(prompt),
                            handle,
                            TextStream(self.spec.stops),
                            stops,
                            hidden_ids,
                            None if fmt is None else ToolCallParser(fmt),
                            None if thinking is None else thinking.parser(),
                            None if thinking is None else thinking.initial(),
                            None if thinking is None else thinking.markers,
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
                # no bound: the engine thread settles each Add in order (admitted or refused), before
                # any later command (an abort too); a failed engine settles every open one
                # (AsyncEngine.fail); a wedged thread is left to the stop's bound (serve/app.py)
                await settled(c.handle.admitted)
            except RequestError as e:
                raise errors.from_request_error(e, self.spec.context_param) from None
            except EngineError as e:
                raise errors.from_engine_error(e) from None

    def abort(self) -> None:
        """Abort every choice still generating (idempotent)."""
        for c in self.choices:
            c.handle.abort()

    async def next(self, timeout: float | None) -> tuple[Choice | None, Output | None]:
        """The next output (its choice, and a TokenOut list or an exception); (None, None) on
        timeout; (None, GONE) once the client left."""
        try:
            key, item = await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None, None
        return (None, item) if key == _GONE_KEY else (self.choices[key], item)

    def gone(self) -> None:
        self.queue.put_nowait((_GONE_KEY, GONE))

    def feed(self, choice: Choice, item: Output) -> list[Item]:
        """One output of `choice` in; raises the ApiError that ends it (kept as choice.failure)."""
        try:
            if isinstance(item, RequestError):
                raise errors.from_request_error(item, self.spec.context_param)
            if isinstance(item, EngineError):
                raise errors.from_engine_error(item)
            if isinstance(item, BaseException):
                raise errors.internal(f"engine failure: {item}")
            events = choice.feed(item, self.model.tokenizer)  # the engine's batch of outputs
        except errors.ApiError as e:
            # a copy never raised: e's traceback holds this frame, which holds the choice (a cycle
            # that would keep every finished request alive until the collector runs)
            choice.failure = errors.ApiError(e.status, e.message, e.type, e.param, e.code, e.headers)
            raise
        if choice.finish is not None:
            self._observe(choice)
        return events

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt tokens usage reports: each prompt once, however many choices it has (as OpenAI)."""
        return sum(len(p) for p in self.spec.prompts)

    @property
    def num_cached_tokens(self) -> int:
        """The part of num_prompt_tokens read from the prefix cache, the one count every dialect's
        usage reports: for each prompt, the count of its first choice (its first engine request).
        Not a sum over the n choices: usage counts a prompt once, so its cached part is that
        prompt's, as the request found the cache; the n choices are admitted together and rarely
        hit each other's blocks. The engine decides what a request's count is (first admission,
        whole blocks: tl/core/request.py TokenOut.num_cached_tokens)."""
        return sum(c.num_cached_tokens for c in self.choices[:: self.spec.n])

    def _observe(self, c: Choice) -> None:
        now = c.finished_at = time.monotonic()
        self.metrics.e2e.observe(now - self.arrived)
        if c.handle.admitted_at is not None:
            self.metrics.queue_time.observe(c.handle.admitted_at - c.handle.submitted_at)
        if c.first_token_at is not None:
            self.metrics.ttft.observe(c.first_token_at - self.arrived)
            if c.num_tokens > 1:
                self.metrics.tpot.observe((now - c.first_token_at) / (c.num_tokens - 1))


class Presenter(Protocol):
    """One dialect's shapes for a Job (serve/chat.py, serve/anthropic.py, serve/responses.py): its
    ids' prefix, its document and its stream (which starts the response and ends it)."""

    @property
    def id_prefix(self) -> str: ...
    def document(self, job: Job) -> bytes: ...
    async def stream(self, job: Job, out: Sender, ping_s: float) -> None: ...


async def respond(
    job: Job, out: Sender, watcher: DisconnectWatcher, ping_interval_s: Callable[[], float], present: Presenter
) -> None:
    """Answer one generation request in `present`'s dialect (errors before the first byte are
    raised as ApiError); every choice is aborted when it returns."""
    watcher.on_gone(job.gone)
    try:
        if job.spec.stream:
            await job.admitted()
            await present.stream(job, out, ping_interval_s())
        elif await _finish(job):
            await out.whole(200, present.document(job))
    finally:
        job.abort()


async def _finish(job: Job) -> bool:
    """Every output fed in; False if the client left first."""
    while not job.done:
        choice, item = await job.next(None)  # every choice's handle ends with an item (tl/core/async_engine.py)
        if item is GONE:
            return False
        assert choice is not None and item is not None
        job.feed(choice, item)
    return True


async def pump(
    job: Job, out: Sender, ping_s: float, deliver: Callable[[Choice, list[Item]], list[bytes]], ping: bytes = sse.PING
) -> bool:
    """Every output of a streamed Job fed in and its chunks (as `deliver` frames them) sent,
    `ping` after ping_s without one; False if the client left. Raises ApiError from an output."""
    while not job.done:
        choice, item = await job.next(ping_s)
        if item is GONE:
            return False
        if choice is None or item is None:
            await out.chunk(ping)
            continue
        for data in deliver(choice, job.feed(choice, item)):
            await out.chunk(data)
    return True
