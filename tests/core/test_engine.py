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

from tests.helpers.differential import (
    Arrival,
    RunnerFactory,
    assert_concurrent_equals_alone,
    drive,
    finish_reason,
    token_ids,
)
from tests.helpers.engine_cases import BASE_CFG, check_engine, greedy, run, workload
from tests.helpers.fake_runner import FakeRunner, next_token, pooled_embedding
from tl.core.config import EngineConfig
from tl.core.engine import Engine
from tl.core.request import ContextLengthError, EmbedRequest, GenRequest, QueueFullError, SamplingParams, TokenOut

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "prefix_cache": {"prefix_cache": "radix"},
    "chunked": {"prefill_chunk": 4},
    "tiny_kv": {"num_kv_blocks": 14},
    "tiny_kv_prefix_cache": {"num_kv_blocks": 14, "prefix_cache": "radix"},
    "speculative": {"speculative": "prompt_lookup"},
    "everything": {"num_kv_blocks": 14, "prefix_cache": "radix", "prefill_chunk": 4, "speculative": "prompt_lookup"},
    "capped": {"prefill_chunk": 8, "prompt_tokens_while_decoding": 5},
    "capped_unchunked": {"prompt_tokens_while_decoding": 3, "num_kv_blocks": 14},
    "decode_steps": {"decode_steps": 4, "decode_steps_max_ms": 1e6},
    "decode_steps_everything": {
        "num_kv_blocks": 14,
        "prefix_cache": "radix",
        "prefill_chunk": 4,
        "speculative": "prompt_lookup",
        "decode_steps": 3,
        "decode_steps_max_ms": 1e6,
    },
    "overlap": {"overlap": "on"},
    "overlap_decode_steps": {"overlap": "on", "decode_steps": 4, "decode_steps_max_ms": 1e6},
}
VARIANTS["overlap_everything"] = {**VARIANTS["decode_steps_everything"], "overlap": "on"}
RUNNER_FACTORIES: list[Any] = [pytest.param(FakeRunner.from_config, id="fake")]


def reference(
    req: GenRequest, seed: int, vocab_size: int = 97, eos: Sequence[int] = (0,), max_model_len: int = 256
) -> tuple[list[int], str]:
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
    assert (st_.multi_step_calls > 0) == (cfg.decode_steps > 1), st_
    assert st_.multi_step_calls == sum(p.decode_steps > 1 for p in engine.runner.plans)  # type: ignore[attr-defined]
    assert (st_.overlapped_steps > 0) == (cfg.overlap == "on"), st_
    assert (st_.kv_blocks_used, st_.running, st_.queue_depth) == (0, 0, 0)


@pytest.mark.parametrize("refuse_after", [1, 2, 3])
def test_a_call_ahead_the_runner_refuses_is_scheduled_again(refuse_after: int) -> None:
    """The real runner refuses a call ahead while the program feeding its tokens compiles: the
    step chosen ahead (decodes, and prompts admitted beside them) is dropped, and the next
    schedule picks its sequences up where they are, blocks exact."""
    cfg = BASE_CFG.replace(**VARIANTS["overlap_everything"])
    runners: list[FakeRunner] = []

    def factory(c: EngineConfig) -> FakeRunner:
        runners.append(FakeRunner.from_config(c, refuse_after=refuse_after if c.overlap == "on" else 0))
        return runners[-1]

    engine = assert_concurrent_equals_alone(factory, cfg, BASE_CFG, workload(), check=check_engine)
    st_ = engine.stats()
    refused = runners[0].follow_ups // refuse_after
    assert refused == len(runners[0].refused) > 0 and st_.overlapped_steps == runners[0].follow_ups - refused, st_
    if refuse_after == 1:  # some dropped step had a prompt admitted beside its decodes
        assert any(p.num_prompt_tokens for p in runners[0].refused)
    assert (st_.kv_blocks_used, st_.running, st_.queue_depth) == (0, 0, 0)


def test_the_fake_engine_follows_the_rule() -> None:
    for arrival in workload():
        outs = drive(Engine(FakeRunner.from_config(BASE_CFG), BASE_CFG), [arrival])[0]
        seed = arrival.request.params.seed or 0
        assert (token_ids(outs), finish_reason(outs)) == reference(arrival.request, seed)
    assert finish_reason(drive(Engine(FakeRunner.from_config(BASE_CFG), BASE_CFG), [workload()[3]])[0]) == "stop"


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


def test_the_engine_names_its_eos_ids_and_backend_for_everyone_downstream() -> None:
    runner = FakeRunner.from_config(BASE_CFG, eos_token_ids=(0, 5))
    runner.num_compilations = 3
    engine = Engine(runner, BASE_CFG)
    assert engine.eos_token_ids == (0, 5) and engine.scheduler.eos_token_ids == frozenset((0, 5))
    assert engine.backend_info is None and engine.stats().compilations == 3


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
    assert engine.stats().aborts == 1
    outs = engine.step()
    assert outs[0] == TokenOut(a, -1, finish_reason="abort")
    assert [o.request_id for o in outs[1:]] == [b]
    engine.abort_all()
    engine.abort(a)  # gone already: not counted again
    assert engine.stats().kv_blocks_used == 0 and engine.has_work() and engine.stats().aborts == 2
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
    outs = engine.step()
    assert outs and all(o.request_id == hog for o in outs)
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

    @initialize(
        variant=st.sampled_from(sorted(VARIANTS)), kv=st.sampled_from([6, 9, 14, 64]), refuse=st.sampled_from([0, 2, 3])
    )
    def setup(self, variant: str, kv: int, refuse: int) -> None:
        """refuse: every refuse-th call ahead is refused (overlap variants), as while its feed compiles."""
        self.cfg = BASE_CFG.replace(**(VARIANTS[variant] | {"num_kv_blocks": kv}))
        self.engine = Engine(FakeRunner.from_config(self.cfg, refuse_after=refuse), self.cfg)
        self.requests: dict[int, GenRequest] = {}
        self.outs: dict[int, list[TokenOut]] = {}
        self.embeds: dict[int, tuple[int, ...]] = {}

    @rule(
        requests=st.lists(
            st.tuples(
                st.sampled_from([10, 10, 30, 90]),
                st.integers(1, 20),
                st.integers(1, 16),
                st.integers(-2, 2),
                st.none() | st.integers(0, 5),
                st.booleans(),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def add(self, requests: list[tuple[int, int, int, int, int | None, bool]]) -> None:
        """A burst of requests: (first token, length, max_tokens, priority, seed (None: greedy), repetitive)."""
        for start, n, max_tokens, priority, seed, repeat in requests:
            prompt = run(n, start) + (run(min(n, 4), start) if repeat else ())
            max_tokens = min(max_tokens, self.engine.max_model_len - len(prompt))
            if max_tokens >= 1:
                params = (
                    SamplingParams(temperature=0.0, max_tokens=max_tokens)
                    if seed is None
                    else SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=seed)
                )
                self._add(GenRequest(prompt, params, priority))

    def _add(self, req: GenRequest) -> None:
        try:
            rid = self.engine.add_request(req)
        except QueueFullError:
            assert self.engine.stats().queue_depth >= self.cfg.queue_capacity  # preempted ones may add to it
            return
        self.requests[rid], self.outs[rid] = req, []

    @rule(
        inputs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30)), min_size=1, max_size=5),
        priority=st.integers(-2, 2),
    )
    def embed(self, inputs: list[tuple[int, int]], priority: int) -> None:
        """An embeddings request: (first token, length) per input."""
        ids = tuple(run(n, start) for start, n in inputs)
        try:
            rids = self.engine.add_embedding(EmbedRequest(ids, priority))
        except ContextLengthError:
            assert max(map(len, ids)) > self.engine.max_model_len
            return
        except QueueFullError:
            assert self.engine.stats().queue_depth >= self.cfg.queue_capacity
            return
        for rid, x in zip(rids, ids, strict=True):
            self.embeds[rid], self.outs[rid] = x, []

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
    def embeddings_are_pooled_exactly(self) -> None:
        for rid, ids in getattr(self, "embeds", {}).items():
            outs = self.outs[rid]
            assert len(outs) <= 1 and all(o.token_id == -1 for o in outs)
            if outs and outs[0].finish_reason == "stop":
                assert list(outs[0].embedding) == pytest.approx(pooled_embedding(ids), rel=1e-9)

    @invariant()
    def tokens_follow_the_rule(self) -> None:
        for rid, outs in getattr(self, "outs", {}).items():
            if rid in self.embeds:
                continue
            req = self.requests[rid]
            seed = req.params.seed if req.params.seed is not None else 0
            want, reason = reference(req, seed, max_model_len=self.engine.max_model_len)
            got = token_ids(outs)
            assert got == want[: len(got)], f"request {rid}: {got} is not a prefix of {want}"
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


def _embed_cfg(**kw: Any) -> EngineConfig:
    return BASE_CFG.replace(prefill_chunk=4, prefix_cache="radix", **kw)


def test_embeddings_are_prompt_work_beside_decodes_and_free_their_blocks() -> None:
    cfg = _embed_cfg(prompt_tokens_while_decoding=6)
    engine = Engine(FakeRunner.from_config(cfg), cfg)
    gen = engine.add_request(GenRequest(run(3), greedy(12)))
    engine.step()  # the prompt: gen decodes from now on
    inputs = (run(13, 40), run(5, 20), run(9, 30))
    ids = engine.add_embedding(EmbedRequest(inputs))
    assert engine.stats().queue_depth == 1  # one request, three inputs
    outs: dict[int, TokenOut] = {}
    steps = 0
    while engine.has_work():
        for o in engine.step():
            if o.request_id != gen:
                outs[o.request_id] = o
        steps += 1
        plan = engine.runner.plans[-1]  # type: ignore[attr-defined]
        assert any(w.seq_id == gen for w in plan.work) or gen not in engine.scheduler.seqs  # never starved
        assert plan.num_tokens <= 8  # 1 decode + 6: the bucket of 8, filled
        check_engine(engine)
    pooled = [w for p in engine.runner.plans for w in p.work if w.pool]  # type: ignore[attr-defined]
    assert all(not w.sample for w in pooled) and max(len(w.token_ids) for w in pooled) <= 4  # chunked
    for rid, x in zip(ids, inputs, strict=True):
        assert outs[rid].finish_reason == "stop" and outs[rid].token_id == -1
        assert list(outs[rid].embedding) == pytest.approx(pooled_embedding(x), rel=1e-12)
    s = engine.stats()
    assert s.kv_blocks_used == 0 and s.kv_blocks_cached > 0  # only the generation's blocks were cached
    assert engine.block_manager.lookup(inputs[0]) == []  # embeddings inputs are never cached
    assert s.capped_steps > 0 and s.prompt_tokens_per_step.count == s.steps


def test_embedding_inputs_are_never_looked_up_in_the_prefix_cache() -> None:
    cfg = _embed_cfg()
    engine = Engine(FakeRunner.from_config(cfg), cfg)
    prompt = run(12, 50)
    drive(engine, [Arrival(0, GenRequest(prompt, greedy(2)))])
    assert engine.block_manager.lookup(prompt)  # cached by the generation
    (rid,) = engine.add_embedding(EmbedRequest((prompt,)))
    got = [o for o in drive_all(engine) if o.request_id == rid]
    assert list(got[0].embedding) == pytest.approx(pooled_embedding(prompt), rel=1e-12)
    assert [w.start_pos for p in engine.runner.plans for w in p.work if w.pool][0] == 0  # type: ignore[attr-defined]


def drive_all(engine: Engine) -> list[TokenOut]:
    outs: list[TokenOut] = []
    while engine.has_work():
        outs += engine.step()
    return outs


def test_a_generation_overtakes_queued_embedding_inputs_but_not_the_other_way() -> None:
    cfg = _embed_cfg(max_num_seqs=4)  # embeddings inputs hold at most 2 sequences
    engine = Engine(FakeRunner.from_config(cfg), cfg)
    engine.add_embedding(EmbedRequest(tuple(run(8, 10 + i) for i in range(6))))
    gen = engine.add_request(GenRequest(run(4), greedy(3)))
    engine.step()
    running = engine.scheduler.running
    assert sum(q.pool for q in running) == 2 and gen in {q.seq_id for q in running}
    outs = drive_all(engine)
    assert sum(o.embedding != () for o in outs) == 6 and engine.stats().kv_blocks_used == 0


def test_embedding_admission_is_all_or_nothing() -> None:
    cfg = _embed_cfg(max_model_len=20, queue_capacity=2)
    engine = Engine(FakeRunner.from_config(cfg), cfg)
    with pytest.raises(ContextLengthError, match=r"input\[1\] has 21 tokens") as e:
        engine.add_embedding(EmbedRequest((run(3), run(21))))
    assert e.value.param == "input" and not engine.scheduler.seqs
    engine.add_embedding(EmbedRequest(tuple(run(3) for _ in range(50))))
    engine.add_request(GenRequest(run(3), greedy(2)))
    with pytest.raises(QueueFullError):
        engine.add_embedding(EmbedRequest((run(3),)))
    assert engine.stats().queue_depth == 2


def test_aborting_an_embedding_input_mid_prompt_frees_its_blocks() -> None:
    cfg = _embed_cfg()
    engine = Engine(FakeRunner.from_config(cfg), cfg)
    (rid,) = engine.add_embedding(EmbedRequest((run(20),)))
    engine.step()
    assert engine.block_manager.holds(rid)
    engine.abort(rid)
    assert engine.step()[0].finish_reason == "abort"
    assert engine.stats().kv_blocks_used == 0 and not engine.has_work()


def test_the_prompt_cap_applies_only_beside_decodes() -> None:
    cfg = BASE_CFG.replace(prefill_chunk=32, prompt_tokens_while_decoding=8)
    engine = Engine(FakeRunner.from_config(cfg), cfg)
    engine.add_request(GenRequest(run(30), greedy(20)))
    engine.step()
    assert engine.runner.plans[-1].num_prompt_tokens == 30  # type: ignore[attr-defined]  # nothing decodes yet
    engine.add_request(GenRequest(run(30, 40), greedy(2)))
    engine.step()
    plan = engine.runner.plans[-1]  # type: ignore[attr-defined]
    assert (plan.num_tokens, plan.num_prompt_tokens, plan.capped) == (16, 15, True)  # 1 + 8 -> bucket 16, filled
    assert engine.stats().capped_steps == 1


def test_a_request_waiting_only_for_the_prompt_budget_is_not_expired() -> None:
    now = [0.0]
    cfg = BASE_CFG.replace(prefill_chunk=32, prompt_tokens_while_decoding=2, queue_deadline_ms=1000, max_num_seqs=4)
    engine = Engine(FakeRunner.from_config(cfg), cfg, clock=lambda: now[0])
    engine.add_request(GenRequest(run(3), greedy(40)))
    engine.step()  # decoding from here on: 2 prompt tokens a step beside it
    late = [engine.add_request(GenRequest(run(12, 40 + 12 * i), greedy(2))) for i in range(3)]
    outs: list[TokenOut] = []
    while engine.has_work():
        now[0] += 0.4  # each step 0.4 s: the last prompt starts long after the deadline
        outs += engine.step()
    finished = {o.request_id: o.finish_reason for o in outs if o.finish_reason}
    assert [finished[r] for r in late] == ["length"] * 3
