"""Engine: the synchronous core behind every front end (CLI, AsyncEngine, bench).

Owns: request ids and seeds, admission (the one authority on it: tl/core/request.py's context and
queue rules applied with this engine's limits, `check_context` and `check_capacity`, which
AsyncEngine also calls to refuse at once), the context length (`max_model_len`), the ids that
end generation (`eos_token_ids`), embeddings requests turned into pooled sequences, the step
loop (schedule -> runner.execute -> update; with `overlap`, schedule -> launch, then
schedule_ahead -> launch the next call -> collect -> update, one call late), the measured step
costs the scheduler budgets prompt work with (tl/core/step_costs.py), the step-time and
prompt-tokens histograms, the host time around each step (tl/core/stats.py HostTimes), and
EngineStats. The scheduler owns request state, the block manager owns KV blocks, the runner owns
the device; the engine only wires them. Not thread-safe: one thread calls it
(tl/core/async_engine.py). Pure Python, no jax/numpy. Tested by tests/core/test_engine.py with
tests/helpers/fake_runner.py, whose differential helpers also accept the real ModelRunner.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from tl.core.block_manager import BlockManager
from tl.core.config import EngineConfig
from tl.core.debug_delays import debug_delay
from tl.core.kv_events import KVEventSink
from tl.core.plan import Launched, Overlapping, Runner, RunnerOutput, SchedulerOutput
from tl.core.request import MAX_SEED, EmbedRequest, GenRequest, SamplingParams, TokenOut, check_capacity, check_context
from tl.core.scheduler import Scheduler
from tl.core.sequence import Sequence
from tl.core.stats import (
    MASK_SECONDS_BUCKETS,
    PROMPT_TOKENS_BUCKETS,
    STEP_SECONDS_BUCKETS,
    BackendInfo,
    EngineStats,
    Histogram,
    HostTimes,
)
from tl.core.step_costs import StepCosts

_POOL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)  # an embeddings input samples nothing


class Engine:
    def __init__(
        self,
        runner: Runner,
        config: EngineConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
        timer: Callable[[], float] = time.perf_counter,
        kv_events: KVEventSink | None = None,
    ) -> None:
        """clock (seconds) drives the queue deadline; seed fixes the seeds drawn for seedless
        requests; timer (seconds) times the steps (the runner's StepTimes are on the same one);
        kv_events gets each step's prefix-cache events (tl/core/kv_events.py)."""
        self._timer = timer
        self._costs = StepCosts(config.token_buckets)
        self._compilations = runner.num_compilations  # at the last step's end: a change means a compile
        self.runner = runner
        self.config = config
        self.max_model_len = _context_limit(runner, config)
        """Context length (prompt + output): what admission, the scheduler and serve/ go by."""
        self.eos_token_ids: tuple[int, ...] = tuple(runner.eos_token_ids)
        """Ids that end a generation (unless ignore_eos): what the scheduler stops on and serve/ hides."""
        self.block_manager = BlockManager(runner.num_kv_blocks, runner.block_size, config.prefix_cache == "radix")
        self._kv_events = kv_events
        if kv_events is not None:
            self.block_manager.publish_events()
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            clock=clock,
            attention_window=runner.attention_window,
            step_costs=self._costs,
        )
        self._clock = clock
        self._rng = random.Random(seed)
        self._next_id = 0
        self._num_steps = 0
        self._multi_step_calls = 0
        self._batch_tokens = 0
        self._step_seconds = Histogram(STEP_SECONDS_BUCKETS)
        self._prompt_tokens = Histogram(PROMPT_TOKENS_BUCKETS)
        self._mask_seconds = Histogram(MASK_SECONDS_BUCKETS)
        self._host = HostTimes()
        self._decode_step_s: dict[int, float] = {}  # by sequences: the last decode step's seconds
        self._overlap = _overlap(runner, config)
        self._overlap_seqs = None  # the most sequences a step launching the next call ahead may carry (None: any)
        if self._overlap is not None and config.overlap == "auto":
            self._overlap_seqs = self._overlap.overlap_auto_seqs
        self._inflight: Launched | None = None  # a call launched ahead, its results not folded in yet
        self._inflight_at = 0.0  # when it was handed to the runner
        self._results_at = 0.0  # when the last call's results were on the host
        self._overlapped_steps = 0

    @property
    def backend_info(self) -> BackendInfo | None:
        """Where the runner runs (None for a fake runner)."""
        return self.runner.backend_info

    def check_context(self, req: GenRequest | EmbedRequest) -> None:
        """Raise ContextLengthError if `req` does not fit max_model_len. Reads only what is fixed
        at construction, so any thread may call it."""
        check_context(req, self.max_model_len)

    def check_capacity(self, num_waiting: int) -> None:
        """Raise QueueFullError if one more request may not join `num_waiting` waiting ones (the
        engine's own count, or AsyncEngine's, which adds those its thread has not taken yet).
        Reads only the config, so any thread may call it."""
        check_capacity(num_waiting, self.config.queue_capacity)

    def add_request(self, req: GenRequest) -> int:
        """Queue a request; its id. Raises ContextLengthError or QueueFullError, changing nothing."""
        self.check_context(req)
        self.check_capacity(self.scheduler.num_waiting_requests())
        seed = req.params.seed if req.params.seed is not None else self._rng.randint(0, MAX_SEED)
        seq_id, self._next_id = self._next_id, self._next_id + 1
        guide = req.constraint.matcher() if req.constraint is not None else None
        seq = Sequence(seq_id, req.prompt_ids, req.params, seed, req.priority, self._clock(), guide=guide)
        self.scheduler.add(seq)
        return seq_id

    def add_embedding(self, req: EmbedRequest) -> list[int]:
        """Queue an embeddings request's inputs, one sequence each; their ids in input order. Each
        finishes with a TokenOut carrying its vector. Raises ContextLengthError or QueueFullError,
        changing nothing."""
        self.check_context(req)
        self.check_capacity(self.scheduler.num_waiting_requests())
        first, self._next_id = self._next_id, self._next_id + len(req.inputs)
        now = self._clock()
        for i, ids in enumerate(req.inputs):
            self.scheduler.add(Sequence(first + i, ids, _POOL_PARAMS, 0, req.priority, now, pool=True, group=first))
        return list(range(first, first + len(req.inputs)))

    def abort(self, request_id: int) -> None:
        """Finish a live request; its blocks are free at once, its "abort" TokenOut comes from the next step."""
        self.scheduler.abort(request_id)

    def close(self) -> None:
        """Stop the runner's background work and the event sink (the engine is not stepped after this)."""
        self.runner.close()
        if self._kv_events is not None:
            self._kv_events.close()

    def abort_all(self) -> None:
        for request_id in list(self.scheduler.seqs):
            self.scheduler.abort(request_id)

    def step(self) -> list[TokenOut]:
        """One step's tokens: synchronously (schedule, run, fold the results in), or overlapped."""
        begun = self._timer()
        if self._overlap is None:
            outs = self._step_synchronous(begun)
        else:
            outs = self._step_overlapped(self._overlap, begun)
        if self._kv_events is not None and self.block_manager.events:
            self._kv_events.publish(self.block_manager.take_events())
        return outs

    def _step_synchronous(self, begun: float) -> list[TokenOut]:
        plan, schedule_s = self._schedule(begun)
        if not plan.work:
            return self._fold(plan, RunnerOutput(()), begun, schedule_s, 0.0, True, None)
        debug_delay("step")
        launched_at = self._timer()
        output = self.runner.execute(plan)
        return self._fold(plan, output, begun, schedule_s, launched_at, True, None)

    def _step_overlapped(self, overlap: Overlapping, begun: float) -> list[TokenOut]:
        """A step of plain decodes has the next call launched before its results are waited for
        (Scheduler.schedule_ahead, its tokens fed back on the device), so the host's update,
        token delivery, scheduling and packing run while the device computes; that call's results
        are the next step()'s, and a finish or abort seen in them drops the call after it."""
        current, self._inflight = self._inflight, None
        own = current is None  # this step launches the call whose results it folds in
        launched_at, schedule_s = self._inflight_at, 0.0
        if current is None:
            plan, schedule_s = self._schedule(begun)
            if not plan.work:
                return self._fold(plan, RunnerOutput(()), begun, schedule_s, 0.0, own, None)
            debug_delay("step")
            launched_at = self._timer()
            current = overlap.launch(plan)
            assert current is not None, "a call that follows none is always launched"
        t0 = self._timer()
        ahead = None
        if self._launches_ahead(current.plan):
            ahead = self.scheduler.schedule_ahead(current.plan, self._steps_of())
        schedule_s += self._timer() - t0
        if ahead is not None:
            debug_delay("step")
            self._inflight_at = self._timer()
            self._inflight = overlap.launch(ahead, after=current)
            self._overlapped_steps += self._inflight is not None  # None: not yet (its blocks stay reserved)
        try:
            output = overlap.collect(current)
        except BaseException:
            self._inflight = None  # it followed the failed call on the device: nothing to wait for
            raise
        return self._fold(current.plan, output, begun, schedule_s, launched_at, own, self._inflight)

    def _schedule(self, begun: float) -> tuple[SchedulerOutput, float]:
        """This step's plan and the seconds since `begun` it took."""
        plan = self.scheduler.schedule(self._steps_of())
        return plan, self._timer() - begun

    def _steps_of(self) -> Callable[[int], int] | None:
        """How the scheduler asks how many decode steps one call may run (None: [engine] decode_steps 1)."""
        return self._decode_steps if self.config.decode_steps > 1 else None

    def _launches_ahead(self, plan: SchedulerOutput) -> bool:
        """Whether the call after plan's (in flight) may be launched before its results are in:
        overlap on, and plan carries no more sequences than overlap "auto" launches ahead for
        on this runner (Overlapping.overlap_auto_seqs)."""
        return self._overlap is not None and (self._overlap_seqs is None or len(plan.work) <= self._overlap_seqs)

    def _fold(
        self,
        plan: SchedulerOutput,
        output: RunnerOutput,
        begun: float,
        schedule_s: float,
        launched_at: float,
        own: bool,
        ahead: Launched | None,
    ) -> list[TokenOut]:
        """plan's results folded into the scheduler and the step's figures. launched_at: when
        plan's call was handed to the runner; own: by this step (not by an earlier one, ahead);
        ahead: the call this step launched after plan's before waiting for plan's results."""
        if plan.work:
            now = self._timer()
            took = now - max(launched_at, self._results_at)  # launched ahead: from the last results on
            self._results_at = now
            self._step_seconds.observe(took)
            decodes_only = all(w.plain_decode for w in plan.work)
            if decodes_only:
                self._decode_step_s[len(plan.work)] = took / plan.decode_steps
            if (plan.decode_steps == 1 or decodes_only) and self.runner.num_compilations == self._compilations:
                self._costs.observe(len(plan.work) if decodes_only else plan.num_tokens, took / plan.decode_steps)
            self._compilations = self.runner.num_compilations
            self._prompt_tokens.observe(plan.num_prompt_tokens)
            if output.mask_rows:  # the rows were filled together: each its share of the time
                self._mask_seconds.observe(output.mask_seconds / output.mask_rows, output.mask_rows)
        self._batch_tokens = plan.num_tokens
        self._num_steps += bool(plan.work)
        self._multi_step_calls += plan.decode_steps > 1
        outs = self.scheduler.update(plan, output)
        ahead_times = None if ahead is None else (ahead.started, ahead.packed, ahead.launched)
        self._host.step(begun, schedule_s, output.times, self._timer(), self.has_work(), own, ahead_times)
        return outs

    def _decode_steps(self, num_seqs: int) -> int:
        """Decode steps one call may run for num_seqs plain decodes: the runner's most (its
        program for that shape is compiled when first asked for), and only as many as fit
        decode_steps_max_ms at the last measured time of one decode step of that many sequences
        (none measured yet: one, which measures it)."""
        per_step = self._decode_step_s.get(num_seqs)
        if per_step is None:
            return 1
        fit = min(self.config.decode_steps, int(self.config.decode_steps_max_ms / 1000 / max(per_step, 1e-6)))
        if fit <= 1:  # not asked of the runner, which would compile the shape's program for nothing
            return 1
        return max(1, min(fit, self.runner.decode_steps(num_seqs)))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def stats(self) -> EngineStats:
        bm, c = self.block_manager, self.scheduler.counters
        return EngineStats(
            kv_blocks_free=bm.num_free,
            kv_blocks_used=bm.num_used,
            kv_blocks_cached=bm.num_cached,
            queue_depth=self.scheduler.num_waiting_requests(),
            running=len(self.scheduler.running),
            batch_tokens=self._batch_tokens,
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            preemptions=c.preemptions,
            evictions=bm.num_evictions,
            spec_drafts_proposed=c.spec_drafts_proposed,
            spec_drafts_accepted=c.spec_drafts_accepted,
            steps=self._num_steps,
            compilations=self.runner.num_compilations,
            multi_step_compilations=self.runner.num_several_compilations,
            compile_pending=self.runner.num_pending_compiles,
            capped_steps=c.capped_steps,
            aborts=c.aborts,
            multi_step_calls=self._multi_step_calls,
            overlapped_steps=self._overlapped_steps,
            step_seconds=self._step_seconds.snapshot(),
            prompt_tokens_per_step=self._prompt_tokens.snapshot(),
            mask_seconds=self._mask_seconds.snapshot(),
            host_gap_seconds=self._host.gap.snapshot(),
            step_part_seconds=tuple(self._host.parts.items()),
            timed_steps=self._host.steps,
        )


def _overlap(runner: Runner, config: EngineConfig) -> Overlapping | None:
    """The runner's two halves of a step where [engine] overlap wants them: "on", or "auto" where
    the runner launches ahead for some step (overlap_auto_seqs not 0); None: every step synchronous."""
    overlap = runner.overlap
    if overlap is None or config.overlap == "off" or (config.overlap == "auto" and overlap.overlap_auto_seqs == 0):
        return None
    return overlap


def _context_limit(runner: Runner, config: EngineConfig) -> int:
    """config.max_model_len (0: the runner's), never above the runner's nor the whole KV cache."""
    limit = min(config.max_model_len or runner.max_model_len, runner.max_model_len)
    return min(limit, runner.num_kv_blocks * runner.block_size)
