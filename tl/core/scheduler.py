"""Scheduler: picks each step's work (schedule) and folds the runner's results back (update).

Owns: the waiting queue (priority, then FIFO), the running set, every Sequence's mutable
state, preemption, the queue deadline, stop checks, draft proposal and the counters behind
EngineStats. Uses the BlockManager for every block it holds; never touches the runner or
device data: its only output is a SchedulerOutput, its only input a RunnerOutput. Pure
Python, no jax/numpy. Tested by tests/core/test_scheduler.py (hand-made RunnerOutputs, exact
block ids) and through tests/core/test_engine.py.

Scheduling is the vLLM v1 rule with no phases: each sequence has known tokens and computed
tokens, and a step lets computed catch up with known within a token budget
(max_num_batched_tokens) and a sequence limit (max_num_seqs). Order: running sequences
that are decoding, then running sequences mid-prompt (chunks of at most prefill_chunk
tokens), then waiting ones by priority and arrival. A waiting sequence starts at its
longest cached prefix; the tokens its first start found cached are the request's
num_cached_tokens on every TokenOut (usage's cached tokens; a recompute leaves it), and the
clock then its scheduled_s (where its queue wait ends and its prefill starts: serve's traces).
Drafts are just extra known-but-unverified tokens after the last one; update() advances
num_computed_tokens only over those the runner accepted, so the rejected drafts' KV slots
are simply rewritten later (their blocks stay in the table).

Steady cadence: while a step carries decodes, the prompt work beside them (chunks of
prompts, recomputes, embeddings inputs) is capped at prompt_tokens_while_decoding tokens,
rounded up to fill the token bucket the step lands in (its padding rows cost as much as
real ones), and, by time, at the largest bucket whose estimated step time (step_costs, from
measured steps) is within the decodes' own plus prompt_ms_while_decoding, never below the next
bucket above the decodes; so a burst of prompts never stretches every stream's next token to
a long prefill step, whatever the model's size: a stream's gap is at most the larger of its
decode step plus prompt_ms_while_decoding and the step of the next bucket up (as estimated);
with no decode in the step the whole max_num_batched_tokens budget is prompt work (and
with prefill_chunk = 0, where a prompt cannot be cut, the step's first prompt goes whole).
The cadence protects streams from prompts that arrive while they stream: a prompt that
arrived before every decode of the step had its first token (the rest of a burst admitted a
budget at a time) takes the full budget beside them, so a burst's last prompt does not wait
behind its first ones' streams (16 prompts at once on a 1B model: the last one's first token
otherwise came after some 40 s of 100-ms slices).

Embeddings inputs (Sequence.pool) are prompt work like any other: chunked, under the same
budget and cap, never looked up in nor added to the prefix cache (their hidden states must
be computed to be pooled), their blocks freed the step their last chunk is computed, when
they finish with the pooled vector. They hold at most half of max_num_seqs at once; a
generation request queued behind them may start before their waiting inputs (never the
other way round), so one large embeddings request cannot hold every new chat back.

Structured output: a constrained sequence's matcher (Sequence.guide) has consumed exactly its
output tokens. Its drafts are cut to the prefix the grammar allows before they are scheduled
(a refused draft is never verified), its sampled work carries the matcher so the runner fills
its rows' bitmask, and update() feeds it each token: a grammar complete is "stop" (before any
length check), a refused token ends the request with "error". Preemption keeps the matcher:
recomputing re-feeds no token to it, so it resumes exactly where it was.

Overlap: `schedule_ahead` chooses the step after a decode-only call still in flight, before its
tokens are known: each live row continues with one fed-back decode (SeqWork.fed_back), as if the
call made all its steps without a finish, and waiting requests are admitted beside them; blocks
are reserved as usual (never by preempting).
update() folds that call in first; a row it finishes is gone when the step after's results come,
which update() skips, so its surplus token is never seen and its blocks were freed with it.

Preemption: when a running sequence cannot get blocks, the running sequence with the
lowest priority and latest arrival (possibly itself) releases all its blocks and goes back
to waiting with its tokens kept (prompt + output, recomputed later, often from the prefix
cache). A waiting sequence never preempts: it waits, and if it has never started after
queue_deadline_ms it finishes with "no_capacity".
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from tl.core.block_manager import BlockManager
from tl.core.config import EngineConfig
from tl.core.plan import POOL_BITS, RunnerOutput, SchedulerOutput, SeqResult, SeqWork
from tl.core.request import FinishReason, TokenOut
from tl.core.sequence import SeqStatus, Sequence
from tl.core.spec_decode import PromptLookupProposer


@dataclass(slots=True)
class SchedulerCounters:
    preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up when a sequence starts
    prefix_cache_hits: int = 0  # of those, tokens found cached
    spec_drafts_proposed: int = 0
    spec_drafts_accepted: int = 0
    capped_steps: int = 0  # steps whose prompt work the cadence bound cut (tokens or time beside decodes)
    aborts: int = 0  # live sequences finished by abort() (a client gone or stopped)


class StepCostEstimates(Protocol):
    """Estimated seconds of one step of n tokens: high where guessed (None: nothing measured), or
    low (0: nothing measured at or below)."""

    def predict(self, num_tokens: int) -> float | None: ...

    def predict_low(self, num_tokens: int) -> float: ...


def _is_decode(seq: Sequence) -> bool:
    """One token left to compute of a generating sequence: everything else is prompt work."""
    return not seq.pool and seq.num_tokens - seq.num_computed_tokens == 1


def _running_order(seq: Sequence) -> tuple[bool, int, int]:
    """Decodes before prompt work, then priority, then arrival."""
    return (not _is_decode(seq), -seq.priority, seq.seq_id)


def _victim_order(seq: Sequence) -> tuple[int, int]:
    """min() of this is the preemption victim: lowest priority, then latest arrival."""
    return (seq.priority, -seq.seq_id)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        *,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        clock: Callable[[], float],
        attention_window: int = 0,
        step_costs: StepCostEstimates | None = None,
    ) -> None:
        """attention_window: W when every layer of the model attends to its last W positions
        only (Mistral v0.1): blocks behind a sequence's window are released after each step.
        step_costs: the estimated seconds of a step of n tokens (the engine's
        tl/core/step_costs.py): what prompt_ms_while_decoding is measured with."""
        self.config = config
        self.step_costs = step_costs
        self.block_manager = block_manager
        self.attention_window = attention_window
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.clock = clock
        self.proposer = (
            PromptLookupProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.speculative == "prompt_lookup"
            else None
        )
        self.waiting: list[Sequence] = []  # sorted by Sequence.order_key
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}  # every live (waiting or running) sequence
        self.counters = SchedulerCounters()
        self._finished_outs: list[TokenOut] = []  # aborts and deadline misses, returned by update()
        self._scheduled: dict[int, SeqWork] = {}
        self._num_scheduled_tokens = 0
        self._num_prompt_tokens = 0  # of those, prompt work's
        self._num_decodes = 0  # decodes scheduled this step
        self._capped = False  # the cadence bound cut some prompt work this step
        self._preempted_this_step = False
        self._waiting_on_compute = False  # the last admission stopped for the token budget
        self._max_pool_seqs = max(1, config.max_num_seqs // 2)
        self._group_left: dict[int, int] = {}  # embeddings request -> its inputs still live
        self._started_groups: set[int] = set()  # embeddings requests one of whose inputs started

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        if seq.pool:
            self._group_left[seq.group] = self._group_left.get(seq.group, 0) + 1
        bisect.insort(self.waiting, seq, key=Sequence.order_key)

    def abort(self, seq_id: int) -> None:
        """Free the sequence's blocks now; its TokenOut(-1, "abort") comes with the next update()."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            self.counters.aborts += 1
            self._finish(seq, "abort")
            self._finished_outs.append(
                TokenOut(seq_id, -1, finish_reason="abort", num_cached_tokens=seq.num_cached_tokens)
            )

    def has_work(self) -> bool:
        return bool(self.seqs) or bool(self._finished_outs)

    def num_waiting_requests(self) -> int:
        """Requests with a sequence waiting: an embeddings request's inputs count once."""
        return len({seq.request_key for seq in self.waiting})

    def schedule(self, decode_steps: Callable[[int], int] | None = None) -> SchedulerOutput:
        """This step's work. decode_steps(n): the most decode steps one call may run for a step of
        n plain decodes (the runner's programs and the engine's time bound); None: one."""
        self._expire_waiting()
        self._scheduled, self._num_scheduled_tokens, self._preempted_this_step = {}, 0, False
        self._num_prompt_tokens, self._num_decodes, self._capped = 0, 0, False
        self._first_decoding_s = math.inf  # the earliest decoding_s of this step's decodes
        for seq in sorted(self.running, key=_running_order):
            if seq.status is SeqStatus.RUNNING and self._has_room():
                self._schedule_running(seq)
        if not self._preempted_this_step:
            self._admit_waiting()
        self.counters.capped_steps += self._capped
        if decode_steps is not None and not self.waiting and self._scheduled:
            self._several_steps(decode_steps)
        return SchedulerOutput(
            tuple(self._scheduled.values()), num_prompt_tokens=self._num_prompt_tokens, capped=self._capped
        )

    def _several_steps(self, decode_steps: Callable[[int], int]) -> None:
        """When every work of the step is a plain decode and nothing waits, let each run up to k
        decode steps in the one call (within its max_tokens and the context), with blocks for
        them; a sequence whose extra blocks are not free keeps one step (no preemption for it)."""
        works = list(self._scheduled.values())
        if not all(w.plain_decode for w in works):
            return
        k = decode_steps(len(works))
        if k <= 1:
            return
        for w in works:  # a decode feeds its last known token: num_tokens is start_pos + 1 (fed back too)
            seq = self.seqs[w.seq_id]
            steps = min(k, seq.params.max_tokens - w.num_generated, self.max_model_len - (w.start_pos + 1))
            if steps > 1 and self.block_manager.allocate(seq.seq_id, w.start_pos + steps):
                table = self.block_manager.block_table(seq.seq_id)
                self._scheduled[w.seq_id] = dataclasses.replace(w, steps=steps, block_table=table)

    def schedule_ahead(
        self, prev: SchedulerOutput, decode_steps: Callable[[int], int] | None = None
    ) -> SchedulerOutput | None:
        """The step after `prev`, which is in flight (its tokens not folded in yet), when it can be
        chosen without them: every work of prev is a plain decode, and prev carries every running
        sequence. Each live sequence of prev continues with one decode fed back on the device
        (SeqWork.fed_back; penalised ones keep the host's output_ids: the runner adds prev's tokens
        to their counts there), as if prev made all its steps without a finish: a sequence that
        does finish in prev is gone when this step's results come, so its work here computes a
        token nobody sees, in blocks it held; one whose max_tokens or the context ends with prev
        is left out. Waiting requests are admitted beside them as schedule() admits them (never
        preempting), so a new prompt starts at once; with none, the decodes may run several steps.
        None (the engine then waits for prev and schedules as usual) when any of that fails or a
        continuing sequence's blocks are not free. Changes no running sequence; blocks are
        reserved as schedule() reserves them, and update() must fold prev in before this step."""
        if not prev.work or any(not w.plain_decode for w in prev.work):
            return None
        live = [(self.seqs[w.seq_id], w) for w in prev.work if w.seq_id in self.seqs]  # else aborted since
        if len(live) != len(self.running) or any(seq.status is not SeqStatus.RUNNING for seq, _ in live):
            return None  # a running sequence prev did not carry: its work needs the usual schedule
        self._expire_waiting()
        self._scheduled, self._num_scheduled_tokens, self._preempted_this_step = {}, 0, False
        self._num_prompt_tokens, self._num_decodes, self._capped = 0, 0, False
        self._first_decoding_s = math.inf  # the earliest decoding_s of this step's decodes
        for seq, w in live:
            num_tokens, num_generated = w.start_pos + 1 + w.steps, w.num_generated + w.steps
            if num_generated >= seq.params.max_tokens or num_tokens >= self.max_model_len:
                continue  # prev ends it
            if not self.block_manager.allocate(seq.seq_id, num_tokens):
                self._scheduled = {}
                return None  # blocks already added to earlier rows are theirs: their next tokens use them
            self._scheduled[seq.seq_id] = dataclasses.replace(
                w,
                token_ids=(0,),
                start_pos=num_tokens - 1,
                block_table=self.block_manager.block_table(seq.seq_id),
                num_generated=num_generated,
                output_ids=seq.output_ids if seq.params.has_penalties else (),  # without prev's: added on the device
                steps=1,
                fed_back=True,
            )
            self._num_scheduled_tokens += 1
            self._num_decodes += 1
            self._first_decoding_s = min(self._first_decoding_s, seq.decoding_s)
        if self.waiting:
            self._admit_waiting()
            self.counters.capped_steps += self._capped
        if not self._scheduled:
            return None
        if decode_steps is not None and not self.waiting:
            self._several_steps(decode_steps)
        return SchedulerOutput(
            tuple(self._scheduled.values()), num_prompt_tokens=self._num_prompt_tokens, capped=self._capped
        )

    def _has_room(self) -> bool:
        return (
            len(self._scheduled) < self.config.max_num_seqs
            and self._num_scheduled_tokens < self.config.max_num_batched_tokens
        )

    def _schedule_running(self, seq: Sequence) -> None:
        num_new = self._num_new_tokens(seq, seq.num_computed_tokens)
        if num_new == 0:
            return
        drafts = self._propose_drafts(seq, num_new)
        if self._reserve_blocks(seq, seq.num_computed_tokens + num_new + len(drafts)):
            self._add_work(seq, num_new, drafts)

    def _admit_waiting(self) -> None:
        """Start waiting sequences in order until one does not fit (no overtaking), passing over
        embeddings inputs while they hold their share of the sequences."""
        num_pool = sum(seq.pool for seq in self.running)
        i = 0
        self._waiting_on_compute = False
        while i < len(self.waiting) and len(self.running) < self.config.max_num_seqs:
            if not self._has_room():
                self._waiting_on_compute = len(self._scheduled) < self.config.max_num_seqs
                return
            seq = self.waiting[i]
            if seq.pool and num_pool >= self._max_pool_seqs:
                i += 1
                continue
            if not self._admit(seq, i):
                return
            num_pool += seq.pool

    def _admit(self, seq: Sequence, index: int) -> bool:
        prefix = [] if seq.pool else self.block_manager.lookup(seq.token_ids)
        num_cached = len(prefix) * self.block_manager.block_size
        num_new = self._num_new_tokens(seq, num_cached)
        if num_new == 0:
            self._waiting_on_compute = True
            return False
        if not self.block_manager.allocate(seq.seq_id, num_cached + num_new, prefix):
            return False
        if self.block_manager.enable_prefix_cache and not seq.pool:
            self.counters.prefix_cache_queries += seq.num_tokens
            self.counters.prefix_cache_hits += num_cached
        if not seq.started:  # the request's own count and time: its first admission, not a recompute's
            seq.num_cached_tokens = num_cached
            seq.scheduled_s = self.clock()
        self.waiting.pop(index)
        self.running.append(seq)
        seq.status, seq.started, seq.num_computed_tokens = SeqStatus.RUNNING, True, num_cached
        if seq.pool:
            self._started_groups.add(seq.group)
        self._add_work(seq, num_new, ())
        return True

    def _num_new_tokens(self, seq: Sequence, num_computed: int) -> int:
        """Tokens to compute this step: the rest, a chunk of it, or 0 to wait for a roomier step."""
        remaining = seq.num_tokens - num_computed
        budget = self.config.max_num_batched_tokens - self._num_scheduled_tokens
        top = self._cadence_top() if self._protects_decodes(seq) and (seq.pool or remaining > 1) else None
        if top is not None:  # prompt work beside decodes
            # The step's tokens up to the cadence's token bucket: the padding the compiled step
            # would compute anyway is filled with prompt work. Without chunking a prompt cannot
            # be cut: the step's first prompt goes whole.
            room = max(0, top - self._num_scheduled_tokens)
            if not self.config.prefill_chunk and self._num_prompt_tokens == 0:
                room = budget
            if room < min(remaining, budget, self.config.prefill_chunk or remaining):
                self._capped = True
            budget = min(budget, room)
            if budget == 0:
                return 0
        if self.config.prefill_chunk:
            return min(remaining, self.config.prefill_chunk, budget)
        if remaining <= budget:
            return remaining
        # No chunking: wait for a step with room, unless even a whole step's budget is too small.
        return budget if remaining > self.config.max_num_batched_tokens else 0

    def _protects_decodes(self, seq: Sequence) -> bool:
        """Whether seq's prompt work is bounded by the cadence: some decode of this step was
        streaming when seq arrived (its first token sampled no later). Prompts that arrived
        before every decode's first token (a burst, admitted a budget at a time) go at the full
        budget: the streams of their own burst are not protected from them."""
        return self._num_decodes > 0 and self._first_decoding_s <= seq.arrival_s

    def _cadence_top(self) -> int | None:
        """The most tokens a step carrying decodes may reach with prompt work (None: unbounded):
        the token bucket prompt_tokens_while_decoding lands in, and the largest bucket whose
        estimated time stays within the decodes' own plus prompt_ms_while_decoding (at least the
        next bucket above the decodes); the lower of the two where both apply."""
        decode_tokens = self._num_scheduled_tokens - self._num_prompt_tokens
        tops = []
        if cap := self.config.prompt_tokens_while_decoding:
            tops.append(self._cap_top(decode_tokens + cap))
        if (timed := self._timed_top(decode_tokens)) is not None:
            tops.append(timed)
        return min(tops, default=None)

    def _timed_top(self, decode_tokens: int) -> int | None:
        """The largest token bucket whose estimated step time is within the decodes' bucket's
        plus prompt_ms_while_decoding, at least the next bucket above the decodes (None: no time
        bound configured). A bucket with no estimate yet is taken as too costly: steps start
        small and are measured."""
        ms, costs = self.config.prompt_ms_while_decoding, self.step_costs
        if not ms or costs is None:
            return None
        base = costs.predict_low(decode_tokens)
        top = self._cap_top(decode_tokens + 1)  # the least: prompts always progress
        for bucket in self.config.token_buckets:
            if bucket <= top or bucket > self.config.max_num_batched_tokens:
                continue
            cost = costs.predict(bucket)
            if cost is None or cost > base + ms / 1000:
                break
            top = bucket
        return top

    def _cap_top(self, tokens: int) -> int:
        """The smallest token bucket holding `tokens` (at most the step's budget)."""
        buckets = self.config.token_buckets
        i = bisect.bisect_left(buckets, tokens)
        return min(buckets[i] if i < len(buckets) else tokens, self.config.max_num_batched_tokens)

    def _propose_drafts(self, seq: Sequence, num_new: int) -> tuple[int, ...]:
        """Drafts for work that reaches the last known token, within budget, max_tokens and context."""
        if self.proposer is None or seq.num_computed_tokens + num_new != seq.num_tokens:
            return ()
        num_drafts = min(
            self.config.num_speculative_tokens,
            self.config.max_num_batched_tokens - self._num_scheduled_tokens - num_new,
            seq.params.max_tokens - seq.num_generated - 1,
            self.max_model_len - seq.num_tokens,
        )
        drafts = self.proposer.propose(seq.token_ids, num_drafts)
        if seq.guide is not None and drafts:  # a draft the grammar refuses is never verified
            drafts = drafts[: seq.guide.valid_prefix(drafts)]
        return drafts

    def _reserve_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for num_tokens positions, preempting victims until they fit; False if seq itself went."""
        while not self.block_manager.allocate(seq.seq_id, num_tokens):
            victim = min(self.running, key=_victim_order)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        work = self._scheduled.pop(seq.seq_id, None)
        if work is not None:
            self._num_scheduled_tokens -= len(work.token_ids)
            decode = _is_decode(seq)
            self._num_decodes -= decode
            self._num_prompt_tokens -= 0 if decode else len(work.token_ids)
        seq.status, seq.num_computed_tokens, seq.pooled = SeqStatus.WAITING, 0, []
        seq.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=Sequence.order_key)
        self.counters.preemptions += 1
        self._preempted_this_step = True

    def _add_work(self, seq: Sequence, num_new: int, drafts: tuple[int, ...]) -> None:
        start = seq.num_computed_tokens
        decode = _is_decode(seq)
        sample = not seq.pool and start + num_new == seq.num_tokens
        self._scheduled[seq.seq_id] = SeqWork(
            seq_id=seq.seq_id,
            token_ids=tuple(seq.token_ids[start : start + num_new]) + drafts,
            start_pos=start,
            block_table=self.block_manager.block_table(seq.seq_id),
            sample=sample,
            params=seq.params,
            seed=seq.seed,
            num_generated=seq.num_generated,
            draft_ids=drafts,
            output_ids=seq.output_ids if seq.params.has_penalties else (),
            pool=seq.pool,
            guide=seq.guide if sample else None,
        )
        self._num_scheduled_tokens += num_new + len(drafts)
        self._num_decodes += decode
        if decode:
            self._first_decoding_s = min(self._first_decoding_s, seq.decoding_s)
        self._num_prompt_tokens += 0 if decode else num_new

    def _expire_waiting(self) -> None:
        """Requests never started within queue_deadline_ms finish with no_capacity, unless the
        last step's admission stopped for its token budget (the queue is moving, at the rate of
        compute), not for KV blocks or sequences. The deadline is a request's: an embeddings
        input whose request has started (one of its inputs was scheduled) waits for its turn
        under the request's share of the sequences, however long that takes."""
        if self._waiting_on_compute:
            return
        deadline_s = self.clock() - self.config.queue_deadline_ms / 1000
        expired = [
            s
            for s in self.waiting
            if not s.started and s.arrival_s <= deadline_s and not (s.pool and s.group in self._started_groups)
        ]
        for seq in expired:
            self._finish(seq, "no_capacity")
            self._finished_outs.append(TokenOut(seq.seq_id, -1, finish_reason="no_capacity"))

    def update(self, plan: SchedulerOutput, output: RunnerOutput) -> list[TokenOut]:
        """Fold one step's results in: advance computed tokens, append sampled ones, stop, free."""
        outs, self._finished_outs = self._finished_outs, []
        results = {r.seq_id: r for r in output.results}
        for work in plan.work:
            seq = self.seqs.get(work.seq_id)
            if seq is not None and seq.status is SeqStatus.RUNNING:  # else aborted since schedule()
                outs.extend(self._apply(seq, work, results.get(work.seq_id)))
        return outs

    def _apply(self, seq: Sequence, work: SeqWork, result: SeqResult | None) -> list[TokenOut]:
        if work.start_pos != seq.num_computed_tokens:
            raise RuntimeError(f"seq {seq.seq_id}: work starts at {work.start_pos}, computed {seq.num_computed_tokens}")
        num_fed = len(work.token_ids) - len(work.draft_ids)
        if work.pool:
            return self._pool(seq, work, result)
        if not work.sample:
            seq.num_computed_tokens += num_fed
            self._computed(seq)
            return []
        result = _checked(work, result)
        self.counters.spec_drafts_proposed += len(work.draft_ids)
        self.counters.spec_drafts_accepted += min(result.num_accepted, len(work.draft_ids))
        seq.num_computed_tokens += num_fed + result.num_accepted  # rejected drafts' KV is stale: recomputed later
        outs = self._append_tokens(seq, result)
        if not seq.decoding_s:
            seq.decoding_s = self.clock()
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)  # a stop may cut the accepted run
        if outs[-1].finish_reason is not None:
            self.block_manager.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            self._finish(seq, outs[-1].finish_reason)
        else:
            self._computed(seq)
        return outs

    def _computed(self, seq: Sequence) -> None:
        """seq's KV now covers num_computed_tokens: index its full blocks; behind an every-layer
        sliding window, release the blocks its next tokens can no longer see (their keys lie
        before position num_computed_tokens - window + 1)."""
        self.block_manager.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if self.attention_window:
            self.block_manager.release_behind(seq.seq_id, seq.num_computed_tokens - self.attention_window + 1)

    def _pool(self, seq: Sequence, work: SeqWork, result: SeqResult | None) -> list[TokenOut]:
        """Add a pooled chunk's sum in; the input's last chunk finishes it with its vector."""
        if result is None or not result.pooled or (seq.pooled and len(result.pooled) != len(seq.pooled)):
            raise RuntimeError(f"runner returned no pooled sum of the right size for seq {work.seq_id}")
        prior = seq.pooled or [0] * len(result.pooled)
        seq.pooled = [a + b for a, b in zip(prior, result.pooled, strict=True)]  # integers: exact, in any order
        seq.num_computed_tokens += len(work.token_ids)
        if seq.num_computed_tokens < seq.num_tokens:
            return []
        mean = [math.ldexp(x, -POOL_BITS) / seq.num_tokens for x in seq.pooled]
        norm = max(math.sqrt(sum(x * x for x in mean)), 1e-12)
        self._finish(seq, "stop")
        return [TokenOut(seq.seq_id, -1, finish_reason="stop", embedding=tuple(x / norm for x in mean))]

    def _append_tokens(self, seq: Sequence, result: SeqResult) -> list[TokenOut]:
        outs = []
        for i, token in enumerate(result.token_ids):
            if seq.guide is not None and not seq.guide.accept(token):
                error = f"the structured-output matcher refused token {token}: {seq.guide.error}"
                outs.append(
                    TokenOut(
                        seq.seq_id,
                        -1,
                        finish_reason="error",
                        error=error,
                        num_cached_tokens=seq.num_cached_tokens,
                        scheduled_s=seq.scheduled_s,
                    )
                )
                break
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            top = result.top_logprobs[i] if i < len(result.top_logprobs) else ()
            outs.append(
                TokenOut(
                    seq.seq_id,
                    token,
                    result.logprobs[i],
                    top,
                    reason,
                    num_cached_tokens=seq.num_cached_tokens,
                    scheduled_s=seq.scheduled_s,
                )
            )
            if reason is not None:
                break
        return outs

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if seq.guide is not None and seq.guide.done:  # a complete answer, before any length cut
            return "stop"
        if token in seq.params.stop_token_ids or (not seq.params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_generated >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        del self.seqs[seq.seq_id]
        if seq.pool:
            left = self._group_left.pop(seq.group) - 1
            if left:
                self._group_left[seq.group] = left
            else:
                self._started_groups.discard(seq.group)


def _checked(work: SeqWork, result: SeqResult | None) -> SeqResult:
    """The runner's result for a sampled work, if it keeps the plan's contract."""
    if result is None:
        raise RuntimeError(f"runner returned no result for sampled seq {work.seq_id}")
    most = len(work.draft_ids) + work.steps - 1  # accepted drafts, or the tokens fed back on the device
    if not 0 <= result.num_accepted <= most or len(result.token_ids) != result.num_accepted + 1:
        raise RuntimeError(
            f"seq {work.seq_id}: {len(result.token_ids)} tokens with {result.num_accepted} of "
            f"{len(work.draft_ids)} drafts accepted in {work.steps} steps"
        )
    if len(result.logprobs) != len(result.token_ids):
        raise RuntimeError(f"seq {work.seq_id}: {len(result.logprobs)} logprobs for {len(result.token_ids)} tokens")
    return result
