"""AsyncEngine: the engine thread, bounded admission, abort, embeddings and surviving a failing step."""

from __future__ import annotations

import asyncio
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

from tl.async_engine import AsyncEngine, EngineError
from tl.config import EngineConfig
from tl.engine import Engine
from tl.request import GenRequest, QueueFullError, SamplingParams, TokenOut

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


def fake(cfg: EngineConfig, delay: float = 0.0) -> AsyncEngine:
    return AsyncEngine(FakeEngine(FakeRunner(), cfg, delay), ByteTokenizer(), ConcatTemplate(), "succ", config=cfg)


def real(cfg: EngineConfig, delay: float = 0.0) -> AsyncEngine:
    runner = SuccRunner(block_size=cfg.block_size, num_kv_blocks=64, step_delay_s=delay)
    return AsyncEngine(Engine(runner, cfg), ByteTokenizer(), ConcatTemplate(), "succ", config=cfg)


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
