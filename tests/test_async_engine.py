"""AsyncEngine: the engine thread, bounded admission, abort, embeddings and surviving a failing step."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import pytest
from fake_engine import (
    ByteTokenizer,
    ConcatTemplate,
    FakeEngine,
    FakeRunner,
    SuccRunner,
    fake_embedding,
)

from tl.async_engine import Abort, Add, AddEmbedding, AsyncEngine, EngineError
from tl.config import EngineConfig
from tl.engine import Engine
from tl.request import ContextLengthError, EmbedRequest, GenRequest, QueueFullError, SamplingParams, TokenOut
from tl.stats import BackendInfo

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


def fake(cfg: EngineConfig, delay: float = 0.0) -> AsyncEngine:
    return AsyncEngine(FakeEngine(FakeRunner(), cfg, delay), ByteTokenizer(), ConcatTemplate(), "succ")


def real(cfg: EngineConfig, delay: float = 0.0) -> AsyncEngine:
    runner = SuccRunner(block_size=cfg.block_size, num_kv_blocks=64, step_delay_s=delay)
    return AsyncEngine(Engine(runner, cfg), ByteTokenizer(), ConcatTemplate(), "succ")


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
    eng = AsyncEngine(engine, ByteTokenizer(), ConcatTemplate(), "succ")
    assert (eng.max_model_len, eng.eos_token_ids, eng.backend_info) == (64, (9,), BackendInfo(platform="tpu"))
    real = Engine(SuccRunner(block_size=4), EngineConfig(block_size=4, max_model_len=40))
    assert AsyncEngine(real, ByteTokenizer(), ConcatTemplate(), "succ").max_model_len == real.max_model_len == 40


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
