"""The two records of one engine step: what the scheduler asks the runner to compute
(SchedulerOutput) and what comes back (RunnerOutput).

Owns: SeqWork, SchedulerOutput, SeqResult, Launched, RunnerOutput, and the Runner protocol with its
optional half, Overlapping (a step's StepTimes are tl/core/stats.py's). Pure
host data (tuples, ints, floats): must not import jax or numpy, so the scheduler stays free of both.

Semantics of one SeqWork (the vLLM v1 rule: computed tokens catch up with known tokens):
- `token_ids` are fed at positions start_pos .. start_pos+len-1. `start_pos` equals the
  sequence's num_computed_tokens; KV for positions < start_pos is already in the cache.
- `block_table` covers at least positions 0 .. start_pos+len-1.
- `draft_ids` are the last len(draft_ids) entries of token_ids (speculative drafts).
- If `sample` is True the runner samples at the last 1+len(draft_ids) positions: row j < k
  verifies draft j, the last row is the bonus token. The result holds the accepted drafts
  followed by exactly one sampled token (correction or bonus). If `sample` is False (a
  prompt chunk that does not reach the prompt's end) nothing is sampled.
- `num_generated` counts output tokens produced before this step; the per-row random key
  is fold_in(key(seed), num_generated + j), so a request's samples do not depend on its
  batch neighbours.
- `output_ids` are the request's generated tokens so far (for penalties only; empty when
  the request has no penalties).
- `guide` (a constrained sampled work): the runner fills its sample rows' token bitmask from
  it (row j: after drafts 0..j-1, which the scheduler trimmed to what the grammar allows);
  every other row allows every token.
- `steps` > 1 (a plain decode: one token fed, sampled, no drafts, no guide): the runner decodes
  up to `steps` tokens in one call, each sampled token fed back on the device at the next
  position (KV written at start_pos .. start_pos+steps-1, which `block_table` covers); it stops
  the row early after an end-of-sequence id (unless ignore_eos). The result holds the n tokens
  made (1 <= n <= steps) with num_accepted = n - 1: the first n - 1 of them had their KV computed,
  as accepted drafts do. The host applies every stop to them in order and drops the rest.
- `fed_back` (a plain decode of a step launched before the previous call's tokens reached the
  host: tl/core/engine.py's overlap): its one token is the last token the sequence made in that
  call, taken on the device; `token_ids` holds a placeholder (0) and `start_pos`/`num_generated`
  count the previous call's tokens as made.
- `pool` (an embeddings input; never sampled): the runner returns the sum over this work's
  tokens of their final-normed hidden states as `SeqResult.pooled` (no tokens), in integer
  units of 2^-POOL_BITS; the scheduler adds the chunks' sums up and divides by the input's
  length. Integers, so that the sum is exact in any order: an input's vector is the same
  whatever chunks its steps cut it into (issue 48).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tl.core.request import Guide, SamplingParams
from tl.core.stats import BackendInfo, StepTimes


@dataclass(frozen=True, slots=True)
class SeqWork:
    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool
    params: SamplingParams
    seed: int
    num_generated: int
    draft_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    pool: bool = False
    guide: Guide | None = None
    steps: int = 1
    fed_back: bool = False

    @property
    def plain_decode(self) -> bool:
        """One token fed and sampled, nothing the host must see between tokens (a constraint's
        mask, drafts to verify, top logprobs): what several decode steps in one call may run."""
        return (
            self.sample
            and not self.pool
            and len(self.token_ids) == 1
            and self.guide is None
            and not self.params.top_logprobs
        )


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    work: tuple[SeqWork, ...]
    num_prompt_tokens: int = 0  # tokens of prompt work (everything but decodes and their drafts)
    capped: bool = False  # the cadence bound (prompt tokens or ms while decoding) cut this step's prompt work

    @property
    def decode_steps(self) -> int:
        """The most decode steps any work of this step runs in its one call (SeqWork.steps)."""
        return max((w.steps for w in self.work), default=1)

    @property
    def num_tokens(self) -> int:
        return sum(len(w.token_ids) for w in self.work)


POOL_BITS = 32
"""SeqResult.pooled's fixed point: a pooled sum is in units of 2^-POOL_BITS."""


@dataclass(frozen=True, slots=True)
class SeqResult:
    """Tokens produced for one sampled SeqWork (accepted drafts then one sampled token), or
    the summed final-normed hidden states of a pooled one (`pooled`, no tokens)."""

    seq_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    num_accepted: int = 0
    pooled: tuple[int, ...] = ()  # units of 2^-POOL_BITS (each hidden value rounded to them, then summed exactly)


@dataclass(frozen=True, slots=True)
class Launched:
    """A call in flight (Runner.launch): its plan, when it entered `launch`, was packed and was
    launched (time.perf_counter seconds), and the runner's own handle on its device results
    (opaque here; only the runner that made it reads it)."""

    plan: SchedulerOutput
    started: float
    packed: float
    launched: float
    handle: object


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    results: tuple[SeqResult, ...]
    mask_rows: int = 0  # constrained sample rows whose bitmask the host filled
    mask_seconds: float = 0.0  # the host time filling them (together)
    times: StepTimes | None = None  # None: a runner that does not time its stages (a fake)


class Overlapping(Protocol):
    """A runner's `execute` in two halves (Runner.overlap), so the engine can launch the next call
    before waiting for this one (tl/core/engine.py's overlapped step)."""

    @property
    def overlap_auto_seqs(self) -> int | None:
        """The most sequences a step may carry for [engine] overlap "auto" to launch the next call
        ahead (None: any; 0: "auto" never does)."""
        ...

    def launch(self, plan: SchedulerOutput, after: Launched | None = None) -> Launched | None:
        """plan's call launched, not waited for. after: the call in flight whose tokens plan's
        fed_back works read on the device; then None: it cannot follow `after` yet."""
        ...

    def collect(self, launched: Launched) -> RunnerOutput:
        """A launched call's results on the host (waiting for them)."""
        ...


class Runner(Protocol):
    """What the engine needs from a model runner (tl/runtime/runner.py, or a fake in tests)."""

    block_size: int
    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    attention_window: int
    """W when every layer attends to its last W positions only (the scheduler then releases the
    blocks behind each sequence's window); 0: the whole context."""

    @property
    def backend_info(self) -> BackendInfo | None:
        """Where it runs (tl/core/stats.py), for the start-up log, /v1/models and /metrics; None: a fake."""
        ...

    @property
    def num_compilations(self) -> int:
        """Compiled step variants so far (EngineStats.compilations)."""
        ...

    @property
    def num_several_compilations(self) -> int:
        """Compiled programs of several decode steps so far (EngineStats.multi_step_compilations)."""
        ...

    @property
    def num_pending_compiles(self) -> int:
        """Step variants still compiling in the background (EngineStats.compile_pending)."""
        ...

    @property
    def overlap(self) -> Overlapping | None:
        """Its `execute` in two halves, where a call may be launched before the previous one's
        results are fetched; None: every step is synchronous."""
        ...

    def decode_steps(self, num_seqs: int) -> int:
        """The most decode steps one call runs for a step of num_seqs plain decodes (SeqWork.steps;
        1: the runner has no such program, or none compiled for that shape yet)."""
        ...

    def execute(self, plan: SchedulerOutput) -> RunnerOutput: ...

    def close(self) -> None:
        """Stop what the runner runs besides steps (tl/runtime/compiler.py's background compilation)."""
        ...
