"""AsyncEngine: the engine thread, bounded admission, abort, embeddings, surviving a failing step
and slow grammars that starve no other."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Awaitable, Callable

import pytest

from tests.helpers.fake_engine import (
    FakeEngine,
    FakeRunner,
    SuccRunner,
    byte_grammars,
    fake_embedding,
)
from tl.core import async_engine
from tl.core.async_engine import Abort, Add, AddEmbedding, AsyncEngine, EngineError, Outbox
from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.core.request import (
    ConstraintSpec,
    ContextLengthError,
    EmbedRequest,
    GenRequest,
    QueueFullError,
    SamplingParams,
    TokenOut,
)
from tl.core.stats import BackendInfo
from tl.text.grammar import GrammarError

pytestmark = pytest.mark.serial  # timing bounds: `make test` runs it alone, after the parallel part

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


def fake(cfg: EngineConfig, delay: float = 0.0) -> AsyncEngine:
    return AsyncEngine(FakeEngine(FakeRunner(), cfg, delay))


def real(cfg: EngineConfig, delay: float = 0.0) -> AsyncEngine:
    runner = SuccRunner(block_size=cfg.block_size, num_kv_blocks=64, step_delay_s=delay)
    return AsyncEngine(Engine(runner, cfg))


BUILDERS = [fake, real]


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 20))


async def tokens(handle: object) -> list[TokenOut]:
    return [o async for outs in handle for o in outs]  # type: ignore[attr-defined]


async def until(pred: Callable[[], bool], timeout: float = 2.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("build", BUILDERS)
def test_generates_on_its_thread(build: Callable[..., AsyncEngine]) -> None:
    async def body() -> None:
        eng = build(EngineConfig(block_size=4))
        eng.start()
        await eng.warmup()
        assert eng.ready
        outs = await tokens(eng.submit(GenRequest((97,), GREEDY)))
        assert [o.token_id for o in outs] == [98, 99, 100] and outs[-1].finish_reason == "length"
        assert await eng.embed([[1, 2], [3]]) == [fake_embedding([1, 2]), fake_embedding([3])]
        assert not eng.engine.runner.closed  # type: ignore[attr-defined]
        eng.shutdown()
        assert eng.engine.runner.closed  # type: ignore[attr-defined]  # background compilation stopped

    run(body)


@pytest.mark.parametrize("build", BUILDERS)
def test_handles_sharing_an_outbox_deliver_there_tagged_with_their_keys(build: Callable[..., AsyncEngine]) -> None:
    """Two generations submitted with one Outbox: every output lands in its queue as (key, list),
    each handle is done once its finishing list is there, and an abort after sends nothing."""

    async def body() -> None:
        eng = build(EngineConfig(block_size=4))
        eng.start()
        merged: asyncio.Queue[tuple[int, list[TokenOut] | BaseException]] = asyncio.Queue()
        handles = [eng.submit(GenRequest((p,), GREEDY), Outbox(merged, k)) for k, p in enumerate((97, 65))]
        got: dict[int, list[int]] = {0: [], 1: []}
        ended: set[int] = set()
        while len(ended) < 2:
            key, item = await merged.get()
            assert isinstance(item, list) and key not in ended
            got[key] += [o.token_id for o in item]
            ended |= {key} if item[-1].finish_reason is not None else set()
        assert got == {0: [98, 99, 100], 1: [66, 67, 68]} and merged.empty()
        assert all(h.done for h in handles)
        handles[0].abort()  # done: nothing is sent
        await eng.call(lambda: None)
        assert merged.empty()
        eng.shutdown()

    run(body)


@pytest.mark.parametrize("build", BUILDERS)
def test_full_admission_refuses_at_once_and_abort_frees_blocks(build: Callable[..., AsyncEngine]) -> None:
    async def body() -> None:
        cfg = EngineConfig(block_size=4, max_num_seqs=1, seq_buckets=(1,), queue_capacity=1)
        eng = build(cfg, 0.01)
        eng.start()
        long = SamplingParams(temperature=0.0, max_tokens=200)
        first = eng.submit(GenRequest((97,), long))
        await first.__anext__()  # running
        second = eng.submit(GenRequest((97,), long))
        await until(lambda: eng.stats().queue_depth == 1)
        with pytest.raises(QueueFullError):
            eng.submit(GenRequest((97,), long))
        first.abort()
        first.abort()  # idempotent
        await until(lambda: eng.stats().running == 1 and eng.stats().queue_depth == 0)
        second.abort()
        await until(lambda: eng.stats().running == 0 and eng.stats().kv_blocks_used == 0)
        eng.shutdown()

    run(body)


@pytest.mark.parametrize("build", BUILDERS)
def test_thread_survives_a_failing_step(build: Callable[..., AsyncEngine]) -> None:
    async def body() -> None:
        eng = build(EngineConfig(block_size=4), 0.005)
        eng.start()
        h = eng.submit(GenRequest((97,), SamplingParams(temperature=0.0, max_tokens=100)))
        await h.__anext__()
        target = eng.engine.runner if isinstance(eng.engine, Engine) else eng.engine
        original = target.execute if isinstance(eng.engine, Engine) else None

        def boom(plan: object) -> object:
            raise RuntimeError("device fell over")

        if original is not None:
            target.execute = boom  # type: ignore[method-assign]
        else:
            target.fail_next_step = True
        with pytest.raises(EngineError, match="device fell over|injected"):
            await tokens(h)
        if original is not None:
            target.execute = original  # type: ignore[method-assign]
        await until(lambda: eng.stats().kv_blocks_used == 0 and eng.stats().running == 0)
        outs = await tokens(eng.submit(GenRequest((97,), GREEDY)))
        assert [o.token_id for o in outs] == [98, 99, 100]
        eng.shutdown()

    run(body)


def test_the_engine_thread_takes_typed_frozen_commands() -> None:
    async def body() -> None:
        eng = fake(EngineConfig(block_size=4))
        eng._loop = asyncio.get_running_loop()  # no thread started: the commands stay in the queue
        gen = eng.submit(GenRequest((97,), GREEDY))
        emb = eng.submit_embedding(EmbedRequest(((1, 2),)))
        gen.abort()
        emb.abort()
        cmds = [eng._cmds.get_nowait() for _ in range(4)]
        assert cmds == [Add(gen), AddEmbedding(emb), Abort(gen), Abort(emb)]
        with pytest.raises(dataclasses.FrozenInstanceError):
            cmds[0].handle = gen  # type: ignore[misc]

    run(body)


def test_what_serve_reads_comes_from_the_engines_own_members() -> None:
    """Context length, EOS ids and the backend card: the engine's, not probed off its runner."""
    engine = FakeEngine(FakeRunner(max_model_len=64), EngineConfig(block_size=4))
    engine.eos_token_ids = (9,)
    engine.backend_info = BackendInfo(platform="tpu")
    eng = AsyncEngine(engine)
    assert (eng.max_model_len, eng.eos_token_ids, eng.backend_info) == (64, (9,), BackendInfo(platform="tpu"))
    real = Engine(SuccRunner(block_size=4), EngineConfig(block_size=4, max_model_len=40))
    assert AsyncEngine(real).max_model_len == real.max_model_len == 40


@pytest.mark.parametrize("build", BUILDERS)
def test_submit_refuses_by_the_engines_rules_and_words(build: Callable[..., AsyncEngine]) -> None:
    """submit() applies the engine's own context and queue rules at once: the same refusal, word
    for word, as the engine's add_request gives."""

    async def body() -> None:
        cfg = EngineConfig(block_size=4, max_num_seqs=1, seq_buckets=(1,), queue_capacity=1)
        eng = build(cfg, 0.01)
        alone = build(cfg).engine  # never started: called directly, on this thread
        eng.start()
        too_long = GenRequest((97,) * eng.max_model_len, SamplingParams(max_tokens=1))
        with pytest.raises(ContextLengthError) as at_once:
            eng.submit(too_long)
        with pytest.raises(ContextLengthError) as direct:
            alone.add_request(too_long)
        assert str(at_once.value) == str(direct.value) and at_once.value.param == "max_tokens"
        with pytest.raises(ContextLengthError, match=r"input\[1\]"):
            eng.submit_embedding(EmbedRequest(((1,), (2,) * (eng.max_model_len + 1))))
        long = SamplingParams(temperature=0.0, max_tokens=200)
        first = eng.submit(GenRequest((97,), long))
        await first.__anext__()  # running
        eng.submit(GenRequest((97,), long))
        await until(lambda: eng.stats().queue_depth == 1)
        with pytest.raises(QueueFullError) as full:
            eng.submit(GenRequest((97,), long))
        alone.add_request(GenRequest((97,), long))
        with pytest.raises(QueueFullError) as direct_full:
            alone.add_request(GenRequest((97,), long))
        assert str(full.value) == str(direct_full.value)
        eng.shutdown()

    run(body)


def many_properties(num: int, value: dict[str, object]) -> dict[str, object]:
    """An object of num optional properties: llguidance's build time grows with num squared."""
    return {"type": "object", "properties": {f"p{i}": value for i in range(num)}}


SLOW_SCHEMAS = [  # llguidance alone, idle 2-core Zen 5 (the fastest CPU here): 0.96 s, 0.77 s, 1.17 s
    many_properties(4000, {"type": "integer"}),  # 2,000 took 0.21 s there: inside the bound, CI went red
    many_properties(3500, {"type": "number"}),
    many_properties(4500, {"type": "string", "pattern": "[a-z]{1,20}"}),
]


def test_slow_schemas_do_not_starve_a_plain_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three schemas far slower than a 0.25 s bound, more than the pool's places (two here): at the
    bound each is refused as too slow (and remembered as refused while it still compiles) and its
    place given back, so a plain one sent then compiles at once. Without the give-back it would
    queue behind compiles that run for seconds and be refused. Shutdown waits for none of them."""
    monkeypatch.setattr(async_engine, "NUM_GRAMMAR_WORKERS", 2)
    cfg = EngineConfig(block_size=4, grammar_timeout_s=0.25)
    field = "response_format.json_schema.schema"

    async def body() -> None:
        eng = AsyncEngine(FakeEngine(FakeRunner(), cfg), byte_grammars(cfg))
        assert eng._grammar_pool.num_workers == 2 < len(SLOW_SCHEMAS) <= eng._grammar_pool.max_overdue
        eng.start()
        await eng.compile_constraint(ConstraintSpec("regex", "warm", "p"))  # llguidance's tokenizer, built
        slow = [
            asyncio.create_task(eng.compile_constraint(ConstraintSpec("json", json.dumps(s), field)))
            for s in SLOW_SCHEMAS
        ]
        for task in slow:
            with pytest.raises(GrammarError) as e:
                await task
            assert e.value.param == field and "grammar_timeout_s" in str(e.value)
        t0 = time.perf_counter()
        plain = await eng.compile_constraint(
            ConstraintSpec("json", json.dumps(many_properties(2, {"type": "integer"})), field)
        )
        assert time.perf_counter() - t0 < cfg.grammar_timeout_s and not plain.cached
        assert eng._grammar_pool.num_overdue > 0  # still compiling, written off
        t0 = time.perf_counter()
        with pytest.raises(GrammarError, match="grammar_timeout_s"):  # from the cache: no fourth compile
            await eng.compile_constraint(ConstraintSpec("json", json.dumps(SLOW_SCHEMAS[0]), "other.field"))
        assert time.perf_counter() - t0 < cfg.grammar_timeout_s
        t0 = time.perf_counter()
        eng.shutdown()
        assert time.perf_counter() - t0 < 1.0
        grammar_threads = [t for t in threading.enumerate() if t.name == "tl-grammar"]
        assert grammar_threads and all(t.daemon for t in grammar_threads)  # the overdue ones: exit does not wait

    run(body)
