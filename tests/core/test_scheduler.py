"""Scheduler unit tests: 4-token blocks, hand-made RunnerOutputs, exact block ids, and
block-manager invariants after every stage. Also the prompt-lookup proposer."""

from __future__ import annotations

from typing import Any

from tl.core.block_manager import BlockManager
from tl.core.config import EngineConfig
from tl.core.plan import POOL_BITS, RunnerOutput, SchedulerOutput, SeqResult, SeqWork
from tl.core.request import SamplingParams, TokenOut
from tl.core.scheduler import Scheduler
from tl.core.sequence import SeqStatus, Sequence
from tl.core.spec_decode import PromptLookupProposer

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
EOS_ENDS = SamplingParams(temperature=0.0, max_tokens=8)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make(num_blocks: int = 16, **kw: Any) -> tuple[Scheduler, Clock]:
    base: dict[str, Any] = {
        "block_size": 4,
        "num_kv_blocks": num_blocks,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "token_buckets": (16,),
        "seq_buckets": (4,),
        "prefill_chunk": 0,
        "prefix_cache": "none",
    }
    cfg = EngineConfig(**(base | kw))
    clock = Clock()
    bm = BlockManager(num_blocks, 4, cfg.prefix_cache == "radix")
    return Scheduler(cfg, bm, eos_token_ids=(0,), max_model_len=64, clock=clock), clock


def add(
    s: Scheduler,
    seq_id: int,
    prompt: list[int],
    params: SamplingParams = GREEDY,
    priority: int = 0,
    arrival_s: float = 0.0,
) -> Sequence:
    seq = Sequence(seq_id, tuple(prompt), params, seed=seq_id, priority=priority, arrival_s=arrival_s)
    s.add(seq)
    return seq


def schedule(s: Scheduler) -> SchedulerOutput:
    plan = s.schedule()
    s.block_manager.check_invariants()
    return plan


def update(s: Scheduler, plan: SchedulerOutput, *results: SeqResult) -> list[TokenOut]:
    outs = s.update(plan, RunnerOutput(results))
    s.block_manager.check_invariants()
    for seq in s.running:
        assert len(s.block_manager.block_table(seq.seq_id)) * 4 >= seq.num_computed_tokens
    assert not any(s.block_manager.holds(seq.seq_id) for seq in s.waiting)
    return outs


def res(seq_id: int, *tokens: int, accepted: int = 0) -> SeqResult:
    return SeqResult(seq_id, tokens, tuple(-0.5 for _ in tokens), num_accepted=accepted)


def decode_all(s: Scheduler, plan: SchedulerOutput, token: int = 7) -> list[TokenOut]:
    return update(s, plan, *(res(w.seq_id, token) for w in plan.work if w.sample))


def shape(plan: SchedulerOutput) -> list[tuple[int, int, int, tuple[int, ...], bool]]:
    return [(w.seq_id, w.start_pos, len(w.token_ids), w.block_table, w.sample) for w in plan.work]


def test_prompt_then_decodes_grow_the_table() -> None:
    s, _ = make()
    add(s, 0, [1, 2, 3, 4, 5, 6])
    plan = schedule(s)
    assert plan.work[0] == SeqWork(0, (1, 2, 3, 4, 5, 6), 0, (0, 1), True, GREEDY, 0, 0)
    assert update(s, plan, res(0, 50)) == [TokenOut(0, 50, -0.5)]
    plan = schedule(s)
    assert shape(plan) == [(0, 6, 1, (0, 1), True)]
    assert plan.work[0].token_ids == (50,) and plan.work[0].num_generated == 1
    update(s, plan, res(0, 51))
    plan = schedule(s)
    assert shape(plan) == [(0, 7, 1, (0, 1), True)]
    update(s, plan, res(0, 52))
    assert shape(schedule(s)) == [(0, 8, 1, (0, 1, 2), True)]


def test_finish_on_max_tokens_eos_and_stop_ids_frees_blocks() -> None:
    s, _ = make()
    add(s, 0, [1, 2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    add(s, 1, [1, 2], SamplingParams(temperature=0.0, max_tokens=5))
    add(s, 2, [1, 2], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=(9,)))
    plan = schedule(s)
    assert [o.finish_reason for o in update(s, plan, res(0, 0), res(1, 0), res(2, 9))] == [None, "stop", "stop"]
    outs = update(s, schedule(s), res(0, 5))
    assert outs == [TokenOut(0, 5, -0.5, (), "length")]
    assert not s.has_work() and s.block_manager.num_used == 0


def test_chunked_prefill_interleaves_with_decodes() -> None:
    s, _ = make(prefill_chunk=4, max_num_batched_tokens=8, token_buckets=(8,))
    add(s, 0, [1, 2])
    decode_all(s, schedule(s))
    add(s, 1, list(range(10, 20)))  # 10 tokens: chunks of 4, 4, 2
    plans = []
    for _ in range(3):
        plans.append(schedule(s))
        decode_all(s, plans[-1])
    assert [shape(p) for p in plans] == [
        [(0, 2, 1, (0,), True), (1, 0, 4, (1,), False)],
        [(0, 3, 1, (0,), True), (1, 4, 4, (1, 2), False)],
        [(0, 4, 1, (0, 3), True), (1, 8, 2, (1, 2, 4), True)],
    ]


def test_without_chunking_a_prompt_waits_for_a_step_with_room() -> None:
    s, _ = make(max_num_batched_tokens=8, token_buckets=(8,))
    add(s, 0, [1, 2])
    decode_all(s, schedule(s))
    add(s, 1, list(range(10, 18)))  # 8 tokens: only fits an empty step
    plan = schedule(s)
    assert shape(plan) == [(0, 2, 1, (0,), True)]
    s.abort(0)
    update(s, plan)
    assert shape(schedule(s)) == [(1, 0, 8, (1, 2), True)]


def test_without_chunking_a_prompt_over_the_budget_is_split_by_the_budget() -> None:
    s, _ = make(max_num_batched_tokens=8, token_buckets=(8,))
    add(s, 0, list(range(10, 22)))
    plan = schedule(s)
    assert shape(plan) == [(0, 0, 8, (0, 1), False)]
    update(s, plan)
    assert shape(schedule(s)) == [(0, 8, 4, (0, 1, 2), True)]


def test_sequence_limit_and_token_budget() -> None:
    s, _ = make(max_num_seqs=2, max_num_batched_tokens=8, token_buckets=(8,), seq_buckets=(2,))
    for i in range(3):
        add(s, i, [1, 2])
    plan = schedule(s)
    assert [w.seq_id for w in plan.work] == [0, 1]
    decode_all(s, plan)
    assert [w.seq_id for w in schedule(s).work] == [0, 1]  # 2 running: the third waits
    assert len(s.waiting) == 1


def test_priority_orders_admission_fifo_within_a_priority() -> None:
    s, _ = make(max_num_batched_tokens=4, token_buckets=(4,))
    for seq_id, priority in enumerate((0, 5, -3, 5)):
        add(s, seq_id, [1, 2, 3, 4], EOS_ENDS, priority=priority)
    order = []
    for _ in range(4):
        plan = schedule(s)
        order += [w.seq_id for w in plan.work if w.start_pos == 0]
        update(s, plan, *(res(w.seq_id, 0) for w in plan.work))  # EOS: each finishes at once
    assert order == [1, 3, 0, 2]


def test_preemption_takes_the_lowest_priority_then_latest_and_keeps_its_tokens() -> None:
    s, _ = make(num_blocks=4)
    add(s, 0, [1, 2, 3, 4, 5, 6, 7, 8], priority=0)
    add(s, 1, [1, 2, 3, 4, 5, 6, 7, 8], priority=1)
    plan = schedule(s)
    assert shape(plan) == [(1, 0, 8, (0, 1), True), (0, 0, 8, (2, 3), True)]
    update(s, plan, res(0, 40), res(1, 41))
    plan = schedule(s)  # both need a third block; seq 1 (higher priority) goes first and preempts seq 0
    assert shape(plan) == [(1, 8, 1, (0, 1, 3), True)]
    seq0 = s.seqs[0]
    assert seq0.status is SeqStatus.WAITING and seq0.num_computed_tokens == 0
    assert seq0.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 40] and s.counters.preemptions == 1
    update(s, plan, res(1, 42))
    s.abort(1)  # frees 3, 1, 0 (tail first) after seq 0's 2
    plan = schedule(s)  # seq 0 recomputes prompt + output and samples its next token
    assert shape(plan) == [(0, 0, 9, (2, 3, 1), True)]
    assert plan.work[0].num_generated == 1
    assert update(s, plan, res(0, 43)) == [TokenOut(1, -1, finish_reason="abort"), TokenOut(0, 43, -0.5)]


def test_num_cached_tokens_is_what_the_first_admission_found_in_the_prefix_cache() -> None:
    s, _ = make(num_blocks=5, prefix_cache="radix", max_num_batched_tokens=32, token_buckets=(32,))
    add(s, 1, list(range(1, 10)), priority=0)  # 9 tokens: blocks 2, 3, 4
    add(s, 2, list(range(60, 68)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), priority=5)
    plan = schedule(s)
    assert shape(plan) == [(2, 0, 8, (0, 1), True), (1, 0, 9, (2, 3, 4), True)]
    assert [o.num_cached_tokens for o in update(s, plan, res(1, 50), res(2, 70))] == [0, 0]  # nothing cached yet
    plan = schedule(s)  # seq 2 needs a third block: seq 1 (lower priority) is preempted
    assert shape(plan) == [(2, 8, 1, (0, 1, 4), True)] and s.seqs[1].num_preemptions == 1
    update(s, plan, res(2, 71))  # seq 2 finishes (max_tokens 2), its blocks freed
    plan = schedule(s)  # seq 1 recomputes from its own two indexed blocks, 8 tokens
    assert shape(plan) == [(1, 8, 2, (2, 3, 4), True)] and s.counters.prefix_cache_hits == 8
    assert update(s, plan, res(1, 51))[0].num_cached_tokens == 0  # the request's own count: first admission
    add(s, 3, [*range(1, 9), 77, 78])  # shares two whole blocks (8 tokens) with seq 1's prompt
    plan = schedule(s)
    assert shape(plan)[-1] == (3, 8, 2, (2, 3, 1), True)
    outs = update(s, plan, res(1, 52), res(3, 90))
    assert [(o.request_id, o.num_cached_tokens) for o in outs] == [(1, 0), (3, 8)]
    s.abort(3)
    assert update(s, schedule(s), res(1, 53))[0] == TokenOut(3, -1, finish_reason="abort", num_cached_tokens=8)


def test_preemption_of_an_already_scheduled_victim_drops_its_work() -> None:
    s, _ = make(num_blocks=3, prefill_chunk=4)
    add(s, 0, list(range(10, 22)), priority=5)  # 12 tokens in chunks of 4
    add(s, 1, [1, 2], priority=0)
    plan = schedule(s)
    assert shape(plan) == [(0, 0, 4, (0,), False), (1, 0, 2, (1,), True)]
    decode_all(s, plan)
    plan = schedule(s)
    assert shape(plan) == [(1, 2, 1, (1,), True), (0, 4, 4, (0, 2), False)]
    decode_all(s, plan)
    plan = schedule(s)  # seq 1's decode goes first, then seq 0's last chunk needs its block
    assert shape(plan) == [(0, 8, 4, (0, 2, 1), True)]
    assert s.seqs[1].status is SeqStatus.WAITING and s.counters.preemptions == 1


def test_a_sequence_that_cannot_fit_preempts_itself_when_it_is_the_lowest() -> None:
    s, _ = make(num_blocks=3)
    add(s, 0, [1, 2, 3, 4, 5, 6, 7], priority=5)
    add(s, 1, [1, 2, 3, 4], priority=0)
    plan = schedule(s)
    assert shape(plan) == [(0, 0, 7, (0, 1), True), (1, 0, 4, (2,), True)]
    update(s, plan, res(0, 40), res(1, 41))
    plan = schedule(s)  # seq 0's decode fits; seq 1 needs a block and is itself the victim
    assert shape(plan) == [(0, 7, 1, (0, 1), True)]
    assert s.seqs[1].status is SeqStatus.WAITING and s.counters.preemptions == 1


def test_deadline_finishes_a_request_that_never_got_blocks() -> None:
    s, clock = make(num_blocks=3, queue_deadline_ms=500)
    add(s, 0, [1, 2, 3, 4, 5, 6, 7])
    decode_all(s, schedule(s))
    add(s, 1, [1, 2, 3, 4, 5], arrival_s=0.0)
    clock.now_s = 0.4
    plan = schedule(s)
    assert [w.seq_id for w in plan.work] == [0] and 1 in s.seqs
    decode_all(s, plan)
    clock.now_s = 0.5
    plan = schedule(s)
    assert 1 not in s.seqs
    assert update(s, plan, res(0, 9))[0] == TokenOut(1, -1, finish_reason="no_capacity")


def test_abort_frees_blocks_at_once_and_reports_on_the_next_update() -> None:
    s, _ = make()
    add(s, 0, [1, 2, 3, 4, 5])
    add(s, 1, [1, 2])
    plan = schedule(s)
    s.abort(0)  # between schedule and update: its result is ignored
    assert s.block_manager.num_used == 1 and s.block_manager.block_table(1) == (2,)
    outs = update(s, plan, res(0, 40), res(1, 41))
    assert outs == [TokenOut(0, -1, finish_reason="abort"), TokenOut(1, 41, -0.5)]
    s.abort(0)  # already gone: nothing
    s.abort(1)
    assert s.block_manager.num_used == 0
    assert update(s, schedule(s)) == [TokenOut(1, -1, finish_reason="abort")]
    assert not s.has_work()


def test_prefix_hit_starts_at_the_cached_blocks() -> None:
    s, _ = make(prefix_cache="radix")
    add(s, 0, list(range(10, 20)), EOS_ENDS)
    update(s, schedule(s), res(0, 0))  # EOS: finished, blocks 0, 1 cached, block 2 blank again
    assert (s.block_manager.num_cached, s.block_manager.num_used) == (2, 0)
    add(s, 1, list(range(10, 22)))
    plan = schedule(s)
    assert shape(plan) == [(1, 8, 4, (0, 1, 3), True)]
    assert (s.counters.prefix_cache_queries, s.counters.prefix_cache_hits) == (22, 8)


def test_drafts_advance_computed_tokens_only_over_accepted() -> None:
    s, _ = make(speculative="prompt_lookup", num_speculative_tokens=4, max_num_batched_tokens=20, token_buckets=(20,))
    add(s, 0, [1, 2, 3, 1, 2])
    update(s, schedule(s), res(0, 3))  # tokens 1 2 3 1 2 3
    plan = schedule(s)
    w = plan.work[0]
    assert (w.token_ids, w.draft_ids, w.start_pos, w.block_table) == ((3, 1, 2, 3), (1, 2, 3), 5, (0, 1, 2))
    outs = update(s, plan, res(0, 1, 9, accepted=1))
    assert [o.token_id for o in outs] == [1, 9]
    seq = s.seqs[0]
    assert seq.token_ids == [1, 2, 3, 1, 2, 3, 1, 9] and seq.num_computed_tokens == 7
    assert s.block_manager.block_table(0) == (0, 1, 2)  # the block of rejected slots is kept for reuse
    assert (s.counters.spec_drafts_proposed, s.counters.spec_drafts_accepted) == (3, 1)
    assert shape(schedule(s)) == [(0, 7, 1, (0, 1, 2), True)]  # no n-gram match for ... 1 9


def test_stop_inside_the_accepted_run_truncates() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(2,))
    s, _ = make(speculative="prompt_lookup", max_num_batched_tokens=20, token_buckets=(20,))
    add(s, 0, [1, 2, 3, 1, 2], params)
    update(s, schedule(s), res(0, 3))
    plan = schedule(s)
    assert plan.work[0].draft_ids == (1, 2, 3)
    outs = update(s, plan, res(0, 1, 2, 3, 4, accepted=3))
    assert [(o.token_id, o.finish_reason) for o in outs] == [(1, None), (2, "stop")]
    assert s.seqs == {} and s.block_manager.num_used == 0


def test_drafts_never_pass_max_tokens_or_the_context() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    s, _ = make(speculative="prompt_lookup", max_num_batched_tokens=20, token_buckets=(20,))
    add(s, 0, [1, 2, 3, 1, 2], params)
    update(s, schedule(s), res(0, 3))
    assert schedule(s).work[0].draft_ids == (1,)  # 1 generated, so at most 2 more: 1 draft + 1


def test_prompt_lookup_prefers_the_longest_then_latest_match() -> None:
    p = PromptLookupProposer(min_n=1, max_n=3)
    assert p.propose([5, 6, 7, 8, 6, 7], 3) == (8, 6, 7)
    assert p.propose([1, 2, 3, 9, 2, 3, 5, 2, 3], 2) == (5, 2)  # n=2 [2, 3]: latest earlier match
    assert p.propose([1, 2, 3, 4], 2) == ()
    assert p.propose([4, 1, 2, 3, 7, 2, 3], 4) == (7, 2, 3)
    assert p.propose([1, 1], 4) == (1,)
    assert p.propose([1, 2, 1], 0) == ()
    assert PromptLookupProposer(min_n=2, max_n=4).propose([3, 4, 5, 9, 5], 2) == ()


def test_an_embeddings_request_under_way_outlives_the_queue_deadline() -> None:
    """A large embeddings request's inputs run at most max_num_seqs // 2 at a time; the ones
    waiting for their turn behind their own request's running inputs are not refused at the
    queue deadline (the cause of a 500 seen while the background compiles slowed every step).
    A request that never started still is: test_deadline_finishes_a_request_that_never_got_blocks."""
    s, clock = make(num_blocks=64, max_num_seqs=4, queue_deadline_ms=500)
    inputs = [Sequence(i, (1, 2, 3), GREEDY, seed=0, priority=0, arrival_s=0.0, pool=True, group=0) for i in range(10)]
    for seq in inputs:
        s.add(seq)
    done: list[TokenOut] = []
    for _ in range(10):
        plan = schedule(s)
        assert 0 < len(plan.work) <= 2  # the embeddings' share of the sequences
        clock.now_s += 0.4  # every step slower than the deadline
        done += update(s, plan, *(SeqResult(w.seq_id, (), (), pooled=(1 << POOL_BITS, 0)) for w in plan.work))
        if not s.has_work():
            break
    assert sorted(o.request_id for o in done) == list(range(10))
    assert {o.finish_reason for o in done} == {"stop"}
    assert s._group_left == {} and s._started_groups == set()


def test_schedule_ahead_continues_each_decode_one_call_late_with_exact_blocks() -> None:
    """Two sequences decode; the step after theirs is chosen before their tokens are known: each
    continues with a fed-back decode at the next position (a block reserved where it crosses
    one), a waiting prompt is admitted beside them, one whose max_tokens ends with the call in
    flight is left out; a stop seen when that call is folded in drops the sequence's next work
    (its blocks freed with it), and the next call's results fold in after."""
    s, _ = make()
    add(s, 0, [1, 2, 3])  # decodes at position 3: the next at 4 needs a second block
    add(s, 1, [1, 2], EOS_ENDS)  # stops at EOS (0) in the call in flight
    add(s, 2, [5], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    decode_all(s, schedule(s))  # the prompts' first tokens
    prev = schedule(s)
    assert [(w.seq_id, w.start_pos, w.plain_decode) for w in prev.work] == [(0, 3, True), (1, 2, True), (2, 1, True)]
    add(s, 3, [9, 9, 9, 9, 9])
    ahead = s.schedule_ahead(prev)
    s.block_manager.check_invariants()
    assert ahead is not None
    by = {w.seq_id: w for w in ahead.work}
    assert sorted(by) == [0, 1, 3]  # seq 2's max_tokens (2) ends with prev
    assert (by[0].start_pos, by[0].fed_back, by[0].token_ids, by[0].num_generated) == (4, True, (0,), 2)
    assert len(by[0].block_table) == 2 and len(s.block_manager.block_table(0)) == 2
    assert (by[1].start_pos, by[1].fed_back) == (3, True)
    assert (by[3].start_pos, by[3].fed_back, by[3].token_ids) == (0, False, (9, 9, 9, 9, 9))
    assert s.waiting == [] and ahead.num_prompt_tokens == 5
    used = s.block_manager.num_used
    outs = update(s, prev, res(0, 7), res(1, 0), res(2, 8))
    assert [(o.request_id, o.token_id, o.finish_reason) for o in outs] == [
        (0, 7, None),
        (1, 0, "stop"),
        (2, 8, "length"),
    ]
    assert s.block_manager.num_used == used - 1 - 1  # seq 1's block (its ahead position 3 fits it), seq 2's
    outs = update(s, ahead, res(0, 6), res(1, 5), res(3, 4))  # seq 1's token is nobody's
    assert [(o.request_id, o.token_id) for o in outs] == [(0, 6), (3, 4)]
    assert [q.seq_id for q in s.running] == [0, 3] and s.seqs[0].output_ids == (7, 7, 6)


def test_schedule_ahead_waits_for_the_results_when_it_cannot_choose_without_them() -> None:
    s, _ = make(num_blocks=3)
    add(s, 0, [1, 2, 3, 4, 5, 6, 7])  # two blocks; its next decode at 8 needs a third
    add(s, 1, [1, 2, 3])  # one block: none left for either's next block
    decode_all(s, schedule(s))
    prev = schedule(s)
    assert s.schedule_ahead(prev) is None  # seq 0's block is not free (no preemption ahead)
    prompt = SchedulerOutput((*prev.work, SeqWork(9, (1, 2), 0, (), True, GREEDY, 9, 0)))
    assert s.schedule_ahead(prompt) is None  # prev is not all plain decodes
    s2, _ = make()
    add(s2, 0, [1, 2])
    add(s2, 1, [3, 4])
    decode_all(s2, schedule(s2))
    prev = schedule(s2)
    assert s2.schedule_ahead(SchedulerOutput(prev.work[:1])) is None  # seq 1 runs but prev did not carry it
