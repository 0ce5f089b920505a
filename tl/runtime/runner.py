"""ModelRunner: packs one step's host data, runs the compiled step, unpacks its results.

Rule (vLLM's second runner): only code every model needs lives here. Everything the runner runs
is made at start-up by tl/runtime/startup.py (the plan, the placed weights and KV cache, the step
program and its compiled variants) and handed over in one record; packing and unpacking a step
is tl/runtime/step_io.py's, the step itself tl/runtime/step.py's, compiling its variants
tl/runtime/compiler.py's, the model tl/model/'s, attention kernels/', token selection
tl/runtime/sampler.py's. The text side (a constraint's bitmask rows) and the multi-host channel
reach it only through the protocols step_io.MaskFiller and frame.StepPeers, passed in by
tl/entry/build.py.

Owns: running one step (the variant picked, its inputs packed, the frame sent to a multi-host
job's followers, the donated KV cache replaced, the results fetched and unpacked), in two halves
when the engine overlaps (`launch`, `collect`: a call launched after another takes its fed-back
tokens, and penalty counts, from that call's device results through the small programs of
`feeds`, compiled when a pair of shapes first needs one), a follower's
run of the leader's frame, the device-resident all-ones masks and all-zero penalties that
unconstrained, penalty-free steps take instead of a copy. Must not: schedule, allocate blocks,
keep request state, decide kernels. Tested by tests/runtime/test_runner.py (paged == dense, donation,
flat compile count).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from jax.sharding import Mesh

from tl.core.config import EngineConfig
from tl.core.plan import Launched, RunnerOutput, SchedulerOutput
from tl.core.stats import BackendInfo, StepTimes
from tl.model import llama
from tl.runtime import startup, step_io
from tl.runtime.compiler import LazyPrograms
from tl.runtime.execution import Kernels
from tl.runtime.frame import StepFrame, StepPeers
from tl.runtime.sampler import Penalties
from tl.runtime.startup import Startup
from tl.runtime.step import CompiledVariant, MultiOut
from tl.runtime.step_io import MaskFiller, PackedStep, StepOutput

_Fed = tuple[tuple[jax.Array | np.ndarray, ...], Penalties | None]
"""A step's input buffers and penalties (None: the frame's) with a previous call's tokens fed in."""


@dataclasses.dataclass(frozen=True, slots=True)
class _InFlight:
    """The runner's handle on a launched call (Launched.handle): how it was packed and its device
    results."""

    packed: PackedStep
    out: StepOutput | MultiOut


class ModelRunner:
    """Runs SchedulerOutputs on one model; implements tl.core.plan.Runner and Overlapping.

    Built from start-up's record (tl/runtime/startup.py `start`, or `from_model_dir`). peers: a
    multi-host leader's channel (every step's frame goes to the followers first); fill_masks:
    how a step's constraint bitmask rows are filled (tl/text/grammar.py's fill_masks in serving)."""

    def __init__(
        self, started: Startup, peers: StepPeers | None = None, fill_masks: MaskFiller = step_io.fill_rows
    ) -> None:
        self.model_config = started.model_config
        self.engine_config: EngineConfig = started.engine_config
        self.block_size = started.engine_config.block_size
        self.num_kv_blocks = started.engine_config.num_kv_blocks
        self.max_model_len = started.packer.max_model_len
        self.attention_window = started.model_config.attention_window  # the scheduler frees KV behind it
        self.eos_token_ids = started.eos_token_ids
        self.mesh: Mesh = started.mesh
        self.plan = started.plan
        self.startup_seconds = dict(started.seconds)
        self.packer = started.packer
        self.program = started.program
        self.compiler = started.compiler
        self.several = started.several  # several decode steps' programs (None: decode_steps 1)
        self.peers = peers
        self._fill_masks = fill_masks
        self._params = started.weights.params
        self._kv = started.kv
        self._zero_penalties: dict[tuple[int, int], Penalties] = {}
        self._open_masks: dict[int, jax.Array] = {}
        self.feeds = LazyPrograms("feed")
        """The programs that feed a call's tokens into the next call (one per pair of shapes met;
        background=False: compiled when first needed, for tests and benchmarks)."""

    @classmethod
    def from_model_dir(cls, engine_cfg: EngineConfig, mesh: Mesh | None = None) -> ModelRunner:
        """A runner of the model in engine_cfg.model_dir (nothing compiled yet: `warmup`)."""
        return cls(startup.load(engine_cfg, mesh))

    @property
    def kernels(self) -> Kernels:
        """The callables the plan chose (before measurement: the plan's step_kernels dispatch them)."""
        return self.plan.kernels

    @property
    def params(self) -> llama.Weights:
        """The placed step-layout weights (read-only by contract)."""
        return self._params

    @property
    def backend_info(self) -> BackendInfo:
        return dataclasses.replace(
            self.plan.backend_info(self.mesh),
            kv_cache_bytes=sum(x.nbytes for x in self._kv),
            kv_capacity_tokens=self.num_kv_blocks * self.block_size,
        )

    @property
    def kv_cache(self) -> tuple[jax.Array, jax.Array]:
        """The current (k, v) device buffers; each step donates them and installs new ones."""
        return self._kv

    @property
    def num_compilations(self) -> int:
        """Traced variants of the step and top-logprob functions (one trace = one compile)."""
        return self.program.num_compilations

    @property
    def num_several_compilations(self) -> int:
        """Traced variants of the several decode steps' program (compiled when first asked for)."""
        return self.program.num_several_compilations

    @property
    def num_pending_compiles(self) -> int:
        """Step variants not compiled yet, and several decode steps' and token feeds asked for
        and not compiled yet (the background compilation's backlog)."""
        several = 0 if self.several is None else self.several.num_requested_pending
        return len(self.plan.variants) - self.compiler.num_compiled + several + self.feeds.num_pending

    def num_rows(self, t_pad: int, s_pad: int) -> int:
        return self.packer.num_rows(t_pad, s_pad)

    def warmup(self, background: bool = False) -> None:
        """The plan's variants compiled ahead of time (tl/runtime/compiler.py `warm_up`; several
        decode steps' are compiled when a step first asks for its shape: `decode_steps`)."""
        self.compiler.warm_up(self.plan.startup_variants, background)

    @property
    def overlap(self) -> ModelRunner | None:
        """Itself (`launch`, `collect`): a call may be launched before the previous call's results
        are fetched (its fed-back tokens taken on the device); None in a multi-host job, whose
        frame carries host tokens to the followers."""
        return self if self.peers is None else None

    @property
    def overlap_auto_seqs(self) -> int | None:
        """The most sequences a step may carry for [engine] overlap "auto" to launch the next call
        ahead (None: any). Off a CPU, any. On a CPU the step runs on the cores the host's work
        overlaps with, so "auto" launches ahead only for one sequence, where the host's share of
        a token is largest: 2-core Zen 4, SmolLM2 Q4_1, `bench http --compare` against the same
        server with overlap "on" everywhere, alternated: one stream 1.056x tokens/s, 4 streams
        0.99x, 16 streams 1.05x with TTFT p50 1.20x (a prompt arriving during a call waits for
        the call launched ahead of it too), 64 streams 0.99x."""
        return None if self.plan.platform.value != "cpu" else 1

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if not plan.work:
            return RunnerOutput(())
        launched = self.launch(plan)
        assert launched is not None, "a call that follows none is always launched"
        return self.collect(launched)

    def launch(self, plan: SchedulerOutput, after: Launched | None = None) -> Launched | None:
        """plan packed and its call launched, not waited for (`collect` waits). after: the call
        in flight whose tokens plan's fed_back works take on the device (Scheduler.schedule_ahead:
        its decodes, beside any prompt admitted); then None when a program feeding them is not
        compiled yet (asked for in the background: the engine waits for `after` and schedules as
        usual)."""
        started = time.perf_counter()
        try:
            if plan.decode_steps > 1:
                return self._launch_several(plan, after, started)
            packed, variant, frame = self._pack(plan)
            fed = None if after is None else self._fed_back(plan, packed, after)
            if after is not None and fed is None:
                return None
            packed_at = time.perf_counter()
            out = self._run(variant, frame, fed)
        except Exception as e:
            if self.peers is None:
                raise
            raise self.peers.broken(e) from e  # a multi-host step: the group has failed
        return Launched(plan, started, packed_at, time.perf_counter(), _InFlight(packed, out))

    def collect(self, launched: Launched) -> RunnerOutput:
        """A launched call's results on the host (waiting for them), unpacked."""
        h = launched.handle
        assert isinstance(h, _InFlight), "a call this runner launched"
        if isinstance(h.out, MultiOut):
            got_steps = step_io.fetch_steps(h.out)
            fetched = time.perf_counter()
            output = step_io.unpack_steps(h.packed.rows, got_steps)
        else:
            try:
                got = step_io.fetch(h.out, h.packed.rows)
            except Exception as e:
                if self.peers is None:
                    raise
                raise self.peers.broken(e) from e
            fetched = time.perf_counter()
            if self.peers is not None:
                self.peers.step_ended()
            output = step_io.unpack(h.packed.rows, got, self.engine_config.max_logprobs, h.packed.mask_fill)
        times = StepTimes(launched.started, launched.packed, launched.launched, fetched, time.perf_counter())
        return dataclasses.replace(output, times=times)

    def _fed_back(self, plan: SchedulerOutput, packed: PackedStep, after: Launched) -> _Fed | None:
        """packed's buffers with each fed-back work's one token replaced on the device by the last
        token its sequence made in `after` (step.py `_feed`; after is decode-only, so a sequence's
        column there is its work's index), and its penalties (None: none) on the device with that
        call's tokens added to the counts; None while a program this needs is still compiling
        (self.feeds)."""
        h = after.handle
        assert isinstance(h, _InFlight), "a call this runner launched"
        i, off, shape = packed.layout[2][0]  # the first leaf: StepInputs.token_ids [T], works in order
        columns = {w.seq_id: c for c, w in enumerate(after.plan.work)}  # decode-only: one token, one row each
        src = np.full(shape, -1, np.int32)
        t = 0
        for w in plan.work:
            if w.fed_back:
                src[t] = columns[w.seq_id]
            t += len(w.token_ids)
        if isinstance(h.out, MultiOut):
            tokens, made = h.out.tokens, h.out.made
        else:
            tokens, made = h.out.sample.token, None
        buf = packed.bufs[i]
        shapes = (tokens.shape, None if made is None else made.shape)
        feed = self.feeds.get(
            ("tokens", buf.shape, off, src.shape, *shapes),
            lambda: self.program.lower_feed(buf, tokens, made, src, off),
        )
        if feed is None:
            return None
        pen = None
        if packed.penalties is not None:
            pen = self._penalties(0, 0, packed.penalties)
            seqs = np.full(pen.counts.shape[0], -1, np.int32)  # counts' rows: the sampled works in order
            for r, span in enumerate(packed.rows.spans):
                if span.work.fed_back:
                    seqs[r] = columns[span.work.seq_id]
            counts = pen.counts
            feed_counts = self.feeds.get(
                ("counts", counts.shape, *shapes),
                lambda: self.program.lower_feed_counts(counts, tokens, made, seqs),
            )
            if feed_counts is None:
                return None
            pen = dataclasses.replace(pen, counts=feed_counts(counts, tokens, made, seqs))
        bufs: list[jax.Array | np.ndarray] = list(packed.bufs)
        bufs[i] = feed(buf, tokens, made, src)
        return tuple(bufs), pen

    def decode_steps(self, num_seqs: int) -> int:
        """The most decode steps one call runs for num_seqs plain decodes: the program's count
        where its variant for that many sequences is compiled, else 1 (and that variant is asked
        for, compiled in the background once the step variants' compilation is done). A
        multi-host job runs one step per call (its frame carries one)."""
        if self.several is None or self.peers is not None:
            return 1
        v = self.plan.shape(num_seqs, num_seqs)
        if v not in self.several.variants:
            return 1
        if v not in self.several.compiled:
            self.several.request(v, wait_while=lambda: self.compiler.compiling)
            return 1
        return self.program.decode_steps

    def compile_several(self) -> None:
        """Every variant of the several decode steps compiled now (tests, benchmarks)."""
        if self.several is not None:
            self.several.compile_rest()

    def _launch_several(self, plan: SchedulerOutput, after: Launched | None, started: float) -> Launched | None:
        """A step of plain decodes run SeqWork.steps times in one compiled program (step.py
        `_decode_steps`), launched: each row's tokens, stopped on the device at its limit or EOS."""
        assert self.several is not None and self.peers is None, "decode_steps() said 1"
        v = self.plan.shape(plan.num_tokens, len(plan.work))
        variant = self.several.ensure(v)
        packed = self.packer.pack(plan.work, v, self._fill_masks, False)
        if packed.layout != variant.layout:
            raise RuntimeError(f"steps {v[0]}x{v[1]}: packed inputs do not match the compiled layout")
        fed = (packed.bufs, None) if after is None else self._fed_back(plan, packed, after)
        if fed is None:
            return None
        bufs, pen = fed
        packed_at = time.perf_counter()
        pen = pen or self._penalties(v[1], self.num_rows(*v), packed.penalties)
        self._kv, out = variant.step(self._params, self._kv, bufs, pen)
        return Launched(plan, started, packed_at, time.perf_counter(), _InFlight(packed, out))

    def logits(self, plan: SchedulerOutput) -> np.ndarray:
        """The float32 logits [sample rows, V] of a non-empty plan, run as `execute` runs it (its
        keys written to the cache); for quality checks (bench/quant_bench.py)."""
        packed, variant, frame = self._pack(plan)
        out = self._run(variant, frame)
        return np.asarray(out.logits)[: packed.rows.num_sampled]

    def _pack(self, plan: SchedulerOutput) -> tuple[PackedStep, CompiledVariant, StepFrame]:
        """The plan packed for the smallest compiled variant that holds it (tl/runtime/compiler.py);
        a multi-host leader sends the step's frame to the followers first."""
        v, variant = self.compiler.pick(*self.plan.shape(plan.num_tokens, len(plan.work)))
        packed = self.packer.pack(plan.work, v, self._fill_masks, variant.top is not None)
        if packed.layout != variant.layout:
            raise RuntimeError(f"step {v[0]}x{v[1]}: packed inputs do not match the compiled layout")
        frame = packed.frame()
        if self.peers is not None:
            self.peers.send_step(frame)
        return packed, variant, frame

    def _run(self, variant: CompiledVariant, frame: StepFrame, fed: _Fed | None = None) -> StepOutput:
        """One step on the device from its frame (what every process of a multi-host job runs
        alike): the donated KV cache replaced, the outputs and top-logprobs dispatched. fed: the
        frame's buffers and penalties with a previous call's tokens fed in (`_fed_back`)."""
        t_pad, s_pad = frame.variant
        num_rows = self.num_rows(t_pad, s_pad)
        bufs, pen = (frame.bufs, None) if fed is None else fed
        if pen is None:
            pen = self._penalties(s_pad, num_rows, None if frame.penalties is None else Penalties(*frame.penalties))
        mask = self._open_mask(num_rows) if frame.mask is None else frame.mask
        # The host buffers go in as numpy arrays: the compiled call's own transfer (C++) took
        # ~0.6 ms less a step than a jax.device_put of them first (one-row decode, alternated).
        self._kv, out, logits, pooled = variant.step(self._params, self._kv, bufs, pen, mask)
        tops = variant.top(logits) if frame.top else None
        return StepOutput(out, logits, pooled, tops)

    def run_frame(self, frame: StepFrame) -> None:
        """A multi-host follower's step: the leader's frame run in the same variant (compiled
        now if this process has not compiled it yet), waited for; its outputs are the leader's."""
        variant = self.compiler.ensure(frame.variant)
        out = self._run(variant, frame)
        jax.block_until_ready(out.sample.token)  # bounded by the group's step watchdog (peer_timeout_s)

    def _penalties(self, s_pad: int, num_rows: int, host: Penalties | None) -> Penalties:
        """A step's penalties on the device: the shape's all-zero ones when no row has any."""
        if host is None:
            return self._no_penalties(s_pad, num_rows)
        placed: Penalties = jax.device_put(host, self.program.replicated)
        return placed

    def _open_mask(self, num_rows: int) -> jax.Array:
        """Device-resident all-ones bitmask per row count: every token allowed."""
        if num_rows not in self._open_masks:
            ones = np.full((num_rows, self.packer.mask_words), -1, np.int32)
            self._open_masks[num_rows] = jax.device_put(ones, self.program.replicated)
        return self._open_masks[num_rows]

    def _no_penalties(self, s_pad: int, num_rows: int) -> Penalties:
        """Device-resident all-zero penalties per shape, so penalty-free steps copy nothing."""
        key = (s_pad, num_rows)
        if key not in self._zero_penalties:
            zeros = self.packer.zero_penalties(s_pad, num_rows)
            self._zero_penalties[key] = jax.device_put(zeros, self.program.replicated)
        return self._zero_penalties[key]

    def close(self) -> None:
        """Stop the background compilation (after the variant in progress; not waiting for it);
        a multi-host leader stops its followers."""
        self.compiler.stop(wait=False)
        self.feeds.stop()
        if self.several is not None:
            self.several.stop(wait=False)
        if self.peers is not None:
            self.peers.stop()
