"""AsyncEngine: the engine thread, and asyncio handles that serve/ awaits.

Owns: the one OS thread that calls the synchronous `tl.core.engine.Engine` (add_request,
add_embedding, abort, step, stats), a FIFO command queue into it, and per-request asyncio
queues out of it (filled with loop.call_soon_threadsafe, one call per step; several handles may
share one, an Outbox, each output tagged with its handle's key); embeddings
requests are engine work like prompts (EmbedHandle gathers their inputs' vectors). Nothing that
computes runs on the event loop: the loop only enqueues commands and reads snapshots.
Commands into the thread are typed records (Add, AddEmbedding, Abort, Call, Stop).
Structured output's grammars compile on worker threads of their own (`compile_constraint`,
through tl.core.request's ConstraintCompiler, time-bounded; tl/core/grammar_pool.py writes off a
compile that overran, so slow schemas cannot starve later ones), so neither the loop nor the
engine thread ever waits for one. Admission is the engine's (its check_context and
check_capacity, which read only fixed limits), applied here too so that submit() refuses at
once: ContextLengthError, or QueueFullError when requests not yet taken by the thread plus the
engine's waiting queue reach queue_capacity.
The thread survives a failing step: every live request fails with EngineError and is
aborted in the engine (its blocks freed), and the loop keeps serving.
Must not import jax or serve/. Tested with tests/helpers/fake_engine.py by tests/core/test_async_engine.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from tl.core.grammar_pool import GrammarPool
from tl.core.request import (
    Compiled,
    ConstraintCompiler,
    ConstraintSpec,
    EmbedRequest,
    GenRequest,
    RequestError,
    TokenOut,
)
from tl.core.stats import BackendInfo, EngineStats

log = logging.getLogger("tl.core.async_engine")
T = TypeVar("T")

NUM_GRAMMAR_WORKERS = 4
"""Compiles that run at once: enough that a plain schema is not queued behind a few slow ones
before the bound writes them off (the cores are shared: a plain compile takes milliseconds)."""
MAX_OVERDUE_GRAMMARS = 4
"""Compiles past grammar_timeout_s that may run on, written off (tl/core/grammar_pool.py): the most
threads slow schemas can hold beyond NUM_GRAMMAR_WORKERS."""


@dataclass(frozen=True, slots=True)
class InFlight:
    """One spec's compile in flight: the pool's future (to give up on) and the loop's view of it."""

    source: concurrent.futures.Future[Compiled]
    job: asyncio.Future[Compiled]


class EngineError(RuntimeError):
    """The engine failed (or stopped) while this request was live."""


class NoCapacity(EngineError):
    """An embeddings request whose input waited past the queue deadline without starting (the
    generations' finish reason no_capacity): served as a retryable 503."""


class EngineUnavailable(EngineError):
    """The engine can run no more steps (a multi-host group lost a process): served as 503."""


class SyncEngine(Protocol):
    """The part of tl.core.engine.Engine the AsyncEngine uses (tests/helpers/fake_engine.py's FakeEngine has
    the same). The properties and the two checks read only what is fixed at construction, so
    the event loop calls them; everything else runs on the engine thread."""

    @property
    def max_model_len(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def backend_info(self) -> BackendInfo | None: ...
    def check_context(self, req: GenRequest | EmbedRequest) -> None: ...
    def check_capacity(self, num_waiting: int) -> None: ...
    def add_request(self, req: GenRequest) -> int: ...
    def add_embedding(self, req: EmbedRequest) -> list[int]: ...
    def abort(self, request_id: int) -> None: ...
    def abort_all(self) -> None: ...
    def step(self) -> list[TokenOut]: ...
    def has_work(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def close(self) -> None: ...


Output = list[TokenOut] | BaseException
"""What a generation's handle is handed on the loop: a step's tokens, or its failure or refusal."""


@dataclass(frozen=True, slots=True)
class Outbox:
    """Where a handle's outputs go instead of its own queue: an asyncio queue several handles
    share (serve's Job merges its choices there), each output tagged with the handle's `key`.
    The items hold neither handle nor queue, so a queue left unread makes no reference cycle."""

    queue: asyncio.Queue[tuple[int, Output]]
    key: int


class RequestHandle:
    """One submitted request, seen from the event loop: async-iterable over lists of TokenOut,
    or, submitted with an Outbox, delivering into that instead (then it is not iterated).

    Iteration ends after the list holding the finish_reason; an engine failure is raised
    from the iteration (EngineError), an admission refusal from `admitted` and iteration.
    """

    def __init__(
        self, owner: AsyncEngine, request: GenRequest, loop: asyncio.AbstractEventLoop, outbox: Outbox | None = None
    ) -> None:
        self.request = request
        self.engine_id: int | None = None  # written by the engine thread only
        self.submitted_at = time.monotonic()
        self.admitted_at: float | None = None
        self.admitted: asyncio.Future[None] = loop.create_future()
        self._owner = owner
        self._outbox = outbox
        self._queue: asyncio.Queue[Output] | None = asyncio.Queue() if outbox is None else None
        self._done = False
        self._abort_sent = False

    def abort(self) -> None:
        """Stop generating and free the request's blocks (idempotent, any time)."""
        if not self._abort_sent and not self._done:
            self._abort_sent = True
            self._owner._command(Abort(self))

    @property
    def done(self) -> bool:
        return self._done

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> list[TokenOut]:
        assert self._queue is not None, "a handle with an outbox delivers there"
        if self._done:
            raise StopAsyncIteration
        # Unbounded by design: the engine thread delivers to every live handle each step, and a
        # stop, an abort, a failed step or a lost group (fail) ends every open one with an item.
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise detached(item) from None
        if _ends(item):
            self._done = True
        return item

    def _put(self, item: Output) -> None:
        if self._outbox is None:
            assert self._queue is not None
            self._queue.put_nowait(item)
            return
        if not self._done:  # what follows the end (a late failure) is nobody's
            self._done = isinstance(item, BaseException) or _ends(item)
            self._outbox.queue.put_nowait((self._outbox.key, item))


class EmbedHandle:
    """One submitted embeddings request, seen from the event loop: `await handle.vectors()`.

    Its inputs run as separate engine sequences, in any order and steps; the vectors come back
    in input order. An admission refusal, an engine failure or an abort is raised from
    vectors() (RequestError, EngineError).
    """

    def __init__(self, owner: AsyncEngine, request: EmbedRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.engine_ids: list[int] = []  # written by the engine thread only
        self.admitted: asyncio.Future[None] = loop.create_future()
        self._owner = owner
        self._result: asyncio.Future[list[list[float]]] = loop.create_future()
        self._vectors: list[list[float] | None] = [None] * len(request.inputs)
        self._index: dict[int, int] = {}
        self._left = len(request.inputs)
        self._abort_sent = False

    def abort(self) -> None:
        """Stop every input still running and free its blocks (idempotent, any time)."""
        if not self._abort_sent and not self._result.done():
            self._abort_sent = True
            self._owner._command(Abort(self))

    @property
    def done(self) -> bool:
        return self._result.done()

    @property
    def aborted(self) -> bool:
        """abort() was called before the vectors were all in."""
        return self._abort_sent

    async def vectors(self) -> list[list[float]]:
        return await settled(self._result)  # settled as RequestHandle's items are (see __anext__)

    def _put(self, item: list[TokenOut] | BaseException) -> None:
        if self._result.done():
            return
        if isinstance(item, BaseException):
            self._result.set_exception(item)
            return
        for o in item:
            if o.finish_reason == "stop" and o.embedding:
                i = self._index[o.request_id]
                if self._vectors[i] is None:
                    self._left -= 1
                self._vectors[i] = list(o.embedding)
            elif o.finish_reason is not None:
                i = self._index[o.request_id]
                if o.finish_reason == "no_capacity":
                    self._result.set_exception(NoCapacity(f"embeddings input {i} found no KV-cache capacity in time"))
                else:
                    self._result.set_exception(EngineError(f"embeddings input {i} ended: {o.finish_reason}"))
                return
        if self._left == 0:
            self._result.set_result([v for v in self._vectors if v is not None])


Handle = RequestHandle | EmbedHandle
Delivery = list[TokenOut] | BaseException | None
"""What the thread hands a handle: a step's tokens, a failure or refusal, or None (admitted)."""
Event = tuple[Handle, Delivery]


@dataclass(frozen=True, slots=True)
class Add:
    """Admit a generation (engine.add_request) and stream its tokens to the handle."""

    handle: RequestHandle


@dataclass(frozen=True, slots=True)
class AddEmbedding:
    """Admit an embeddings request (engine.add_embedding), its inputs' vectors to the handle."""

    handle: EmbedHandle


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort whatever of the handle's request is still live in the engine."""

    handle: Handle


@dataclass(frozen=True, slots=True)
class Call:
    """Run fn on the engine thread between steps (it settles its own future)."""

    fn: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Stop:
    """Fail everything live and end the thread."""


Command = Add | AddEmbedding | Abort | Call | Stop


class AsyncEngine:
    def __init__(self, engine: SyncEngine, grammars: ConstraintCompiler | None = None) -> None:
        """grammars: compiles the constraints of structured output (tl/text/grammar.py's; None:
        such requests are refused)."""
        self.engine = engine
        self.grammars = grammars
        self._grammar_pool = GrammarPool(NUM_GRAMMAR_WORKERS, MAX_OVERDUE_GRAMMARS)
        self._compiling: dict[tuple[str, str, str], InFlight] = {}  # the loop's only
        self.ready = False
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._inbox = 0  # submitted, not yet taken by the thread (under _lock)
        self._waiting = 0  # engine waiting queue at the last snapshot (under _lock)
        self._stats = engine.stats()  # before the thread runs: the blocks it starts with, not zeros
        self._live: dict[int, Handle] = {}  # engine id -> handle; engine thread only
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: weakref.WeakSet[Handle] = weakref.WeakSet()  # submitted handles (the loop's only)
        self.failure: EngineUnavailable | None = None

    @property
    def max_model_len(self) -> int:
        """The engine's context length (prompt + output)."""
        return self.engine.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The engine's ids that end a generation."""
        return self.engine.eos_token_ids

    @property
    def backend_info(self) -> BackendInfo | None:
        """Where the engine runs (None for a fake runner)."""
        return self.engine.backend_info

    def check_context(self, req: GenRequest | EmbedRequest) -> None:
        """The engine's context-length rule, now: raises ContextLengthError (submit applies it too)."""
        self.engine.check_context(req)

    async def compile_constraint(self, spec: ConstraintSpec) -> Compiled:
        """The compiled grammar of spec, from the cache or built on a worker thread (never on the
        loop), within grammars.timeout_s. Concurrent requests for one spec share one compile
        (they count as cached). Raises RequestError naming spec.param: no grammar support, a
        constraint that does not compile, or one slower than the bound (remembered as refused at
        once; its compile is written off, see tl/core/grammar_pool.py, and ends on its own thread)."""
        grammars = self.grammars
        if grammars is None:
            raise RequestError("structured output is not available for this model", param=spec.param)
        key = (spec.kind, spec.text, spec.param)
        shared = key in self._compiling
        if not shared:
            self._compiling[key] = self._start_compile(grammars, spec, key)
        source, job = self._compiling[key].source, self._compiling[key].job
        # asyncio.wait neither cancels the job when this request is cancelled nor raises when
        # the job is (a sharer gave up on it while it was queued)
        await asyncio.wait((job,), timeout=grammars.timeout_s)
        if not job.done() or job.cancelled():
            if source.running():  # a compile this slow is refused from now on, not built again
                grammars.refuse(spec)
            self._grammar_pool.give_up(source)
            raise grammars.too_slow(spec)
        compiled = job.result()
        return dataclasses.replace(compiled, cached=True, seconds=0.0) if shared else compiled

    def _start_compile(self, grammars: ConstraintCompiler, spec: ConstraintSpec, key: tuple[str, str, str]) -> InFlight:
        """Submit spec's compile; it leaves _compiling when it ends."""
        source = self._grammar_pool.submit(functools.partial(grammars.compile, spec))
        job = asyncio.wrap_future(source)

        def done(f: asyncio.Future[Compiled]) -> None:
            self._compiling.pop(key, None)
            if not f.cancelled():
                f.exception()  # retrieved: a refusal nobody awaits any more (timed out) is not logged

        job.add_done_callback(done)
        return InFlight(source, job)

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will submit."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tl-engine", daemon=True)
        self._thread.start()
        if self.grammars is not None:  # llguidance's tokenizer (~0.4 s), built before the first constraint needs it
            self._grammar_pool.submit(self.grammars.tokenizer)

    async def warmup(self) -> None:
        """Mark ready once the engine thread answers (one round trip through its commands).

        tl.entry.build compiles the step variants start-up needs before it returns the engine, so
        nothing is left to warm here; a thread that never took commands never turns ready.
        """
        await self.call(_nothing)
        self.ready = True

    def submit(self, req: GenRequest, outbox: Outbox | None = None) -> RequestHandle:
        """Queue a request for the engine; raises ContextLengthError, or QueueFullError when
        admission is full, at once (the engine's own rules). `outbox`: its outputs go there
        (tagged with outbox.key) rather than to the handle's own queue."""
        assert self._loop is not None, "start() first"
        self._reserve(req)
        handle = RequestHandle(self, req, self._loop, outbox)
        self._open.add(handle)
        self._command(Add(handle))
        return handle

    def submit_embedding(self, req: EmbedRequest) -> EmbedHandle:
        """Queue an embeddings request (one admission, however many inputs); raises
        ContextLengthError or QueueFullError at once, as submit(). Its inputs are scheduled as
        prompt work with the rest."""
        assert self._loop is not None, "start() first"
        self._reserve(req)
        handle = EmbedHandle(self, req, self._loop)
        self._open.add(handle)
        self._command(AddEmbedding(handle))
        return handle

    def _reserve(self, req: GenRequest | EmbedRequest) -> None:
        """Apply the engine's admission rules to `req` and count it in the inbox if they pass."""
        if self.failure is not None:
            raise self.failure
        self.engine.check_context(req)
        with self._lock:
            self.engine.check_capacity(self._inbox + self._waiting)
            self._inbox += 1

    async def embed(self, inputs: Sequence[Sequence[int]], priority: int = 0) -> list[list[float]]:
        """Mean-pooled, L2-normalised embeddings of the inputs, in their order (submit_embedding
        and wait; aborted if the caller is cancelled)."""
        handle = self.submit_embedding(EmbedRequest(tuple(tuple(x) for x in inputs), priority))
        try:
            return await handle.vectors()
        finally:
            handle.abort()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between steps and await its result (or its exception)."""
        loop = self._loop
        assert loop is not None, "start() first"
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - handed to the awaiting caller
                loop.call_soon_threadsafe(_fail, fut, e)
            else:
                loop.call_soon_threadsafe(_resolve, fut, result)

        self._command(Call(run))
        return await fut  # the thread runs commands between steps, and every 0.25 s when idle

    def stats(self) -> EngineStats:
        """The snapshot the engine thread took after its last iteration."""
        return self._stats

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything live, stop the thread, wait for it (blocking: call off the loop or at exit)."""
        self.ready = False
        if self._thread is not None and self._thread.is_alive():
            self._command(Stop())
            self._thread.join(timeout)
        # waits for no compile: the pool's threads are daemons, so a stuck one cannot hold the exit
        self._grammar_pool.shutdown()
        self.engine.close()  # the runner's background compilation

    def fail(self, reason: str) -> None:
        """From any thread: the engine can run no more steps (tl/entry/multihost.py's on_failure, while
        the engine thread may be stuck in a step). Not ready from now on; every open request
        fails with EngineUnavailable(reason) on the loop, and submit refuses new ones with it."""
        self.failure = EngineUnavailable(reason)
        self.ready = False
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._fail_open)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _fail_open(self) -> None:
        err = self.failure
        assert err is not None
        _dispatch([(h, err) for h in list(self._open) if not h.done])

    def _command(self, cmd: Command) -> None:
        self._cmds.put(cmd)

    def _run(self) -> None:
        while True:
            events: list[Event] = []
            try:
                stop = self._handle_commands(block=not self.engine.has_work(), events=events)
                if stop:
                    self._fail_all(EngineError("engine stopped"), events)
                    self._deliver(events)
                    return
                if self.engine.has_work():
                    self._step(events)
                self._snapshot()
            except Exception:  # a bug outside step(): keep the thread alive, fail what is live
                log.exception("engine thread iteration failed")
                self._fail_all(EngineError("engine failure"), events)
            self._deliver(events)

    def _handle_commands(self, block: bool, events: list[Event]) -> bool:
        """Run every queued command (waiting up to 0.25 s for one when `block`); True on Stop."""
        try:
            cmd = self._cmds.get(timeout=0.25) if block else self._cmds.get_nowait()
        except queue.Empty:
            return False
        added = False
        while True:
            match cmd:
                case Stop():
                    return True
                case Add(handle):
                    added = True
                    self._add(handle, events)
                case AddEmbedding(handle):
                    added = True
                    self._add_embedding(handle, events)
                case Abort(handle):
                    self._abort(handle, events)
                case Call(fn):
                    fn()
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
        if added:
            self._snapshot()
        return False

    def _add(self, handle: RequestHandle, events: list[Event]) -> None:
        def admit() -> None:
            rid = self.engine.add_request(handle.request)
            handle.engine_id = rid
            handle.admitted_at = time.monotonic()
            self._live[rid] = handle

        self._admit(handle, events, "add_request", admit)

    def _add_embedding(self, handle: EmbedHandle, events: list[Event]) -> None:
        def admit() -> None:
            ids = self.engine.add_embedding(handle.request)
            handle.engine_ids = ids
            handle._index = {rid: i for i, rid in enumerate(ids)}
            for rid in ids:
                self._live[rid] = handle

        self._admit(handle, events, "add_embedding", admit)

    def _admit(self, handle: Handle, events: list[Event], what: str, admit: Callable[[], None]) -> None:
        """Run one admission: its refusal (RequestError) or failure goes to the handle, as does
        its success (None); the inbox count drops either way."""
        try:
            admit()
        except RequestError as e:
            events.append((handle, e))
        except Exception as e:
            log.exception("%s failed", what)
            events.append((handle, EngineError(f"{what} failed: {e}")))
        else:
            events.append((handle, None))
        finally:
            with self._lock:
                self._inbox -= 1

    def _abort(self, handle: Handle, events: list[Event]) -> None:
        if isinstance(handle, EmbedHandle):
            live = [rid for rid in handle.engine_ids if self._live.pop(rid, None) is not None]
            for rid in live:
                self.engine.abort(rid)
            if live:
                events.append((handle, EngineError("embeddings request aborted")))
            return
        engine_id = handle.engine_id
        if engine_id is None or self._live.pop(engine_id, None) is None:
            return
        self.engine.abort(engine_id)
        events.append((handle, [TokenOut(engine_id, -1, finish_reason="abort")]))

    def _step(self, events: list[Event]) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing %d live requests", len(self._live))
            self._fail_all(self.failure or EngineError(f"engine step failed: {e}"), events)
            return
        by_id: dict[int, list[TokenOut]] = {}
        for o in outs:
            by_id.setdefault(o.request_id, []).append(o)
        for rid, lst in by_id.items():
            handle = self._live.get(rid)
            if handle is None:
                continue  # aborted here already
            if any(o.finish_reason is not None for o in lst):
                del self._live[rid]
            events.append((handle, lst))

    def _fail_all(self, err: Exception, events: list[Event]) -> None:
        failed = list(dict.fromkeys(self._live.values()))  # an embeddings handle once
        self._live.clear()
        try:
            self.engine.abort_all()
        except Exception:
            log.exception("abort_all failed")
        events.extend((h, err) for h in failed)

    def _snapshot(self) -> None:
        stats = self.engine.stats()
        with self._lock:
            self._waiting = stats.queue_depth
        self._stats = stats

    def _deliver(self, events: list[Event]) -> None:
        if events and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(_dispatch, events)
            except RuntimeError:  # loop closed between the check and the call
                pass


def _nothing() -> None:
    return None


def _ends(outs: list[TokenOut]) -> bool:
    return any(o.finish_reason is not None for o in outs)


def _resolve(fut: asyncio.Future[T], result: T) -> None:
    if not fut.done():
        fut.set_result(result)


def detached(err: BaseException) -> BaseException:
    """A copy of err to raise, err itself left without a traceback. An exception kept where the
    frames it is raised through can reach it (a handle's future or queue: handle -> future ->
    exception -> traceback -> frame -> handle) makes a reference cycle that holds the whole
    request until a full collection; the copy holds only its own frames."""
    err.__traceback__ = None
    return copy.copy(err)


async def settled(fut: asyncio.Future[T]) -> T:
    """fut's result; its exception raised `detached` (the future keeps the original)."""
    try:
        return await fut
    except Exception as e:
        raise detached(e) from None


def _fail(fut: asyncio.Future[T], err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)


def _dispatch(events: list[Event]) -> None:
    """On the loop: admission results settle `admitted`; lists and errors go to the handle's queue.
    An error raised on the engine thread comes without its traceback (its frames hold the handle
    it is kept in: a reference cycle)."""
    for handle, item in events:
        if item is None:
            _resolve(handle.admitted, None)
            continue
        if isinstance(item, BaseException):
            item.__traceback__ = None
        if isinstance(item, BaseException) and not handle.admitted.done():
            handle.admitted.set_exception(item)
            handle.admitted.exception()  # mark retrieved: iteration raises it again
        handle._put(item)
