"""Engine tests over the FakeRunner: concurrent == alone across prefix caching, chunked
prefill, a KV cache small enough to preempt, and speculation; admission errors; abort;
the deadline; stats; and a hypothesis state machine checking the books after every
add / step / abort.

The differential tests take a runner factory: add the real ModelRunner on a tiny model to
RUNNER_FACTORIES (block_size 4 configs) to run the same checks on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.differential import (Arrival, RunnerFactory, assert_concurrent_equals_alone, drive, finish_reason,
                                token_ids)
from tests.fake_runner import FakeRunner, next_token
from tl.config import EngineConfig
from tl.engine import Engine
from tl.request import ContextLengthError, GenRequest, QueueFullError, SamplingParams, TokenOut
from tl.sequence import SeqStatus

BASE_CFG = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                        token_buckets=(8, 16, 32), seq_buckets=(1, 4), prefill_chunk=0, prefix_cache="none",
                        speculative="none", queue_capacity=16)
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "prefix_cache": {"prefix_cache": "radix"},
    "chunked": {"prefill_chunk": 4},
    "tiny_kv": {"num_kv_blocks": 14},
    "tiny_kv_prefix_cache": {"num_kv_blocks": 14, "prefix_cache": "radix"},
    "speculative": {"speculative": "prompt_lookup"},
    "everything": {"num_kv_blocks": 14, "prefix_cache": "radix", "prefill_chunk": 4, "speculative": "prompt_lookup"},
}
RUNNER_FACTORIES: list[Any] = [pytest.param(FakeRunner.from_config, id="fake")]


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


def reference(req: GenRequest, seed: int, vocab_size: int = 97, eos: Sequence[int] = (0,),
              max_model_len: int = 256) -> tuple[list[int], str]:
    """What the FakeRunner's rule produces for one request, computed directly."""
    ctx, out, p = list(req.prompt_ids), [], req.params
    while True:
        token = next_token(ctx, vocab_size, greedy=p.greedy, seed=seed, counter=len(out))
        ctx.append(token)
        out.append(token)
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos):
            return out, "stop"
        if len(out) >= p.max_tokens or len(ctx) >= max_model_len:
            return out, "length"


@pytest.mark.parametrize("factory", RUNNER_FACTORIES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_request_gets_exactly_what_it_gets_alone(factory: RunnerFactory, variant: str) -> None:
    cfg = BASE_CFG.replace(**VARIANTS[variant])
    engine = assert_concurrent_equals_alone(factory, cfg, BASE_CFG, workload(), check=check_engine)
    st_ = engine.stats()
    assert (st_.preemptions > 0) == (cfg.num_kv_blocks == 14), st_
    assert (st_.prefix_cache_hits > 0) == (cfg.prefix_cache == "radix"), st_
    assert (st_.spec_drafts_accepted > 0) == (cfg.speculative != "none"), st_
    assert st_.spec_drafts_accepted <= st_.spec_drafts_proposed
    if cfg.prefill_chunk:
        assert max(p.num_tokens for p in engine.runner.plans) <= cfg.max_num_batched_tokens  # type: ignore[attr-defined]
    assert (st_.kv_blocks_used, st_.running, st_.queue_depth) == (0, 0, 0)


def test_the_fake_engine_follows_the_rule() -> None:
    for arrival in workload():
        outs = drive(Engine(FakeRunner.from_config(BASE_CFG), BASE_CFG), [arrival])[0]
        seed = arrival.request.params.seed or 0
        assert (token_ids(outs), finish_reason(outs)) == reference(arrival.request, seed)
    assert finish_reason(drive(Engine(FakeRunner.from_config(BASE_CFG), BASE_CFG),
                               [workload()[3]])[0]) == "stop"


def test_greedy_speculation_is_token_identical_and_saves_steps() -> None:
    req = GenRequest(run(20) + run(8), greedy(24))
    plain = Engine(FakeRunner.from_config(BASE_CFG), BASE_CFG)
    spec_cfg = BASE_CFG.replace(speculative="prompt_lookup")
    spec = Engine(FakeRunner.from_config(spec_cfg), spec_cfg)
    assert token_ids(drive(plain, [Arrival(0, req)])[0]) == token_ids(drive(spec, [Arrival(0, req)])[0])
    assert spec.stats().steps < plain.stats().steps
    assert spec.stats().spec_drafts_accepted > 0


def test_context_too_long_is_refused_at_add_time() -> None:
    engine = Engine(FakeRunner.from_config(BASE_CFG.replace(max_model_len=40)), BASE_CFG.replace(max_model_len=40))
    assert engine.max_model_len == 40
    with pytest.raises(ContextLengthError) as err:
        engine.add_request(GenRequest(run(30), greedy(11)))
    assert all(str(n) in str(err.value) for n in (30, 11, 40)) and err.value.code == "context_length_exceeded"
    assert not engine.has_work()
    engine.add_request(GenRequest(run(30), greedy(10)))


def test_context_is_capped_by_the_kv_cache() -> None:
    cfg = BASE_CFG.replace(num_kv_blocks=5)
    assert Engine(FakeRunner.from_config(cfg), cfg).max_model_len == 20


def test_a_full_queue_raises_queue_full() -> None:
    cfg = BASE_CFG.replace(queue_capacity=2)
    engine = Engine(FakeRunner.from_config(cfg), cfg)
    engine.add_request(GenRequest(run(3)))
    engine.add_request(GenRequest(run(3)))
    with pytest.raises(QueueFullError):
        engine.add_request(GenRequest(run(3)))
    engine.step()  # both start running: the queue has room again
    assert engine.stats().queue_depth == 0
    engine.add_request(GenRequest(run(3)))


def test_abort_frees_blocks_before_the_next_schedule() -> None:
    engine = Engine(FakeRunner.from_config(BASE_CFG), BASE_CFG)
    a = engine.add_request(GenRequest(run(10), greedy(20)))
    b = engine.add_request(GenRequest(run(5), greedy(20)))
    engine.step()
    engine.step()
    used = engine.stats().kv_blocks_used
    engine.abort(a)
    assert engine.stats().kv_blocks_used == used - 3 and engine.stats().running == 1
    outs = engine.step()
    assert outs[0] == TokenOut(a, -1, finish_reason="abort")
    assert [o.request_id for o in outs[1:]] == [b]
    engine.abort_all()
    assert engine.stats().kv_blocks_used == 0 and engine.has_work()
    assert engine.step() == [TokenOut(b, -1, finish_reason="abort")]
    assert not engine.has_work() and engine.step() == []


def test_a_request_waiting_past_the_deadline_gets_no_capacity() -> None:
    now = [0.0]

    def clock() -> float:
        return now[0]

    cfg = BASE_CFG.replace(num_kv_blocks=6, queue_deadline_ms=1000)
    engine = Engine(FakeRunner.from_config(cfg), cfg, clock=clock)
    hog = engine.add_request(GenRequest(run(12), greedy(12)))  # 6 blocks by the end
    engine.step()
    late = engine.add_request(GenRequest(run(15), greedy(5)))  # needs 4 blocks: only 3 free
    now[0] = 0.5
    assert all(o.request_id == hog for o in engine.step())
    now[0] = 1.0
    outs = engine.step()
    assert TokenOut(late, -1, finish_reason="no_capacity") in outs
    assert engine.stats().queue_depth == 0


def test_seedless_requests_get_a_seed_drawn_once() -> None:
    cfg = BASE_CFG
    engine = Engine(FakeRunner.from_config(cfg), cfg, seed=1)
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    ids = [engine.add_request(GenRequest(run(5), params)) for _ in range(3)]
    seeds = [engine.scheduler.seqs[i].seed for i in ids]
    assert len(set(seeds)) == 3
    while engine.has_work():
        engine.step()
    plans = engine.runner.plans  # type: ignore[attr-defined]
    assert {w.seed for p in plans for w in p.work} == set(seeds)
    again = Engine(FakeRunner.from_config(cfg), cfg, seed=1)
    assert [again.scheduler.seqs[again.add_request(GenRequest(run(5), params))].seed for _ in range(3)] == seeds


def test_stats_report_the_engine() -> None:
    cfg = BASE_CFG.replace(prefix_cache="radix")
    engine = Engine(FakeRunner.from_config(cfg), cfg)
    engine.add_request(GenRequest(run(9), greedy(3)))
    engine.add_request(GenRequest(run(2), greedy(3)))
    engine.step()
    s = engine.stats()
    assert (s.running, s.queue_depth, s.batch_tokens, s.steps, s.compilations) == (2, 0, 11, 1, 0)
    assert (s.kv_blocks_used, s.kv_blocks_cached, s.kv_blocks_free) == (4, 0, 60)
    while engine.has_work():
        engine.step()
    engine.add_request(GenRequest(run(10), greedy(3)))
    engine.step()
    s = engine.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (21, 8)
    assert s.prefix_cache_hit_ratio == 8 / 21


class EngineMachine(RuleBasedStateMachine):
    """Random add / step / abort on a small KV cache; the books balance after every operation
    and every request that finishes by itself got exactly the rule's tokens."""

    @initialize(variant=st.sampled_from(sorted(VARIANTS)), kv=st.sampled_from([6, 9, 14, 64]))
    def setup(self, variant: str, kv: int) -> None:
        self.cfg = BASE_CFG.replace(**(VARIANTS[variant] | {"num_kv_blocks": kv}))
        self.engine = Engine(FakeRunner.from_config(self.cfg), self.cfg)
        self.requests: dict[int, GenRequest] = {}
        self.outs: dict[int, list[TokenOut]] = {}

    @rule(requests=st.lists(st.tuples(st.sampled_from([10, 10, 30, 90]), st.integers(1, 20), st.integers(1, 16),
                                       st.integers(-2, 2), st.none() | st.integers(0, 5), st.booleans()),
                             min_size=1, max_size=4))
    def add(self, requests: list[tuple[int, int, int, int, int | None, bool]]) -> None:
        """A burst of requests: (first token, length, max_tokens, priority, seed (None: greedy), repetitive)."""
        for start, n, max_tokens, priority, seed, repeat in requests:
            prompt = run(n, start) + (run(min(n, 4), start) if repeat else ())
            max_tokens = min(max_tokens, self.engine.max_model_len - len(prompt))
            if max_tokens >= 1:
                params = (SamplingParams(temperature=0.0, max_tokens=max_tokens) if seed is None
                          else SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=seed))
                self._add(GenRequest(prompt, params, priority))

    def _add(self, req: GenRequest) -> None:
        try:
            rid = self.engine.add_request(req)
        except QueueFullError:
            assert self.engine.stats().queue_depth >= self.cfg.queue_capacity  # preempted ones may add to it
            return
        self.requests[rid], self.outs[rid] = req, []

    @rule(n=st.integers(1, 8))
    def step(self, n: int) -> None:
        for _ in range(n):
            for out in self.engine.step():
                assert not self.outs[out.request_id] or self.outs[out.request_id][-1].finish_reason is None
                self.outs[out.request_id].append(out)

    @precondition(lambda self: bool(self.engine.scheduler.seqs))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.engine.abort(data.draw(st.sampled_from(sorted(self.engine.scheduler.seqs))))

    @invariant()
    def books_balance(self) -> None:
        if hasattr(self, "engine"):
            check_engine(self.engine)

    @invariant()
    def tokens_follow_the_rule(self) -> None:
        for rid, outs in getattr(self, "outs", {}).items():
            req = self.requests[rid]
            seed = req.params.seed if req.params.seed is not None else 0
            want, reason = reference(req, seed, max_model_len=self.engine.max_model_len)
            got = token_ids(outs)
            assert got == want[:len(got)], f"request {rid}: {got} is not a prefix of {want}"
            if outs and outs[-1].finish_reason in ("stop", "length"):
                assert (got, outs[-1].finish_reason) == (want, reason)

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            self.engine.abort_all()
            self.engine.step()
            check_engine(self.engine)
            assert self.engine.stats().kv_blocks_used == 0 and not self.engine.has_work()


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
