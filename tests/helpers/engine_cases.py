"""The engine's differential workload and its book checks, shared by the engine tests over the
FakeRunner (tests/core/test_engine.py) and over the real runner (tests/runtime/): BASE_CFG, the
workload of requests arriving at different steps, check_engine (the books after each step), CFG
(BASE_CFG with the real runner's few buckets) and NarrowKV (a runner seen with fewer KV blocks).
Must hold no tests."""

from __future__ import annotations

from typing import Any

from tests.helpers.differential import Arrival
from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.core.request import GenRequest, SamplingParams
from tl.core.sequence import SeqStatus

BASE_CFG = EngineConfig(
    block_size=4,
    num_kv_blocks=64,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=(8, 16, 32),
    seq_buckets=(1, 4),
    prefill_chunk=0,
    prefix_cache="none",
    speculative="none",
    queue_capacity=16,
    decode_steps=1,  # one step per call, but in the decode_steps variants below
    overlap="off",  # every step synchronous, but in the overlap variants below
)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def sampled(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=seed, ignore_eos=True)


def run(n: int, start: int = 10) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def workload() -> list[Arrival]:
    """Different lengths and arrival steps; shared prefixes; repetitive prompts for lookup."""
    return [
        Arrival(0, GenRequest(run(12) + run(5), greedy(16))),
        Arrival(0, GenRequest(run(9), sampled(12, seed=7))),
        Arrival(1, GenRequest(run(12) + (3, 4, 5), greedy(10))),
        Arrival(3, GenRequest(run(8, start=80), SamplingParams(temperature=0.0, max_tokens=20))),  # reaches EOS
        Arrival(5, GenRequest(run(25), greedy(20), priority=2)),
        Arrival(8, GenRequest((50, 51, 52), sampled(18, seed=3), priority=-1)),
        Arrival(8, GenRequest(run(12) + run(5), sampled(15, seed=11))),
        Arrival(9, GenRequest(run(6, start=30) + run(6, start=30), greedy(9, stop_token_ids=(40,)))),
    ]


def check_engine(engine: Engine) -> None:
    """The books after a step: blocks exact, waiting holds nothing, running covers its KV."""
    s, bm = engine.scheduler, engine.block_manager
    bm.check_invariants()
    assert set(s.seqs) == {q.seq_id for q in s.waiting} | {q.seq_id for q in s.running}
    assert len(s.running) <= engine.config.max_num_seqs
    for seq in s.waiting:
        assert seq.status is SeqStatus.WAITING and not bm.holds(seq.seq_id) and seq.num_computed_tokens == 0
    for seq in s.running:
        assert seq.status is SeqStatus.RUNNING and seq.num_computed_tokens < seq.num_tokens
        assert len(bm.block_table(seq.seq_id)) * bm.block_size >= seq.num_computed_tokens
    if not s.running:
        assert bm.num_used == 0 and bm.num_free + bm.num_cached == bm.num_blocks
    if bm.num_cached and not bm.enable_prefix_cache:
        raise AssertionError("cached blocks without a prefix cache")


CFG = BASE_CFG.replace(token_buckets=(8, 32), seq_buckets=(1, 4), max_logprobs=5, compile_cache_dir="")


class NarrowKV:
    """A runner seen with fewer KV blocks than it has (the engine only hands out ids below)."""

    def __init__(self, runner: Any, num_kv_blocks: int) -> None:
        self._runner = runner
        self.num_kv_blocks = num_kv_blocks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)
