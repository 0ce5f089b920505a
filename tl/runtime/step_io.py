"""A step's inputs and outputs on the host: a SchedulerOutput packed into the buffers the compiled
step reads, and what it computed unpacked into a RunnerOutput.

Owns: the typed records of one step (`StepInputs`, the token axis as the step reads it; `Rows`,
which sample rows and pooled sequences belong to which SeqWork; `PackedStep`, everything packed
for one variant; `DecodeRows`, what several decode steps in one call add; `StepOutput`, the
step's device results; `Fetched`, those results on the host), `StepPacker` (tokens, positions,
block tables, sampling rows, penalties, the constraint bitmask, one flat buffer per dtype),
`fetch` and `unpack` (accepted drafts, logprobs, top logprobs, pooled sums), `fetch_steps` and
`unpack_steps` (several decode steps' tokens), and `MaskFiller`, the protocol through which the
text side fills a constraint's bitmask rows (tl/text/grammar.py's fill_masks, handed in by
tl/entry/build.py; `fill_rows`, each Guide's own `fill`, otherwise). Must not: put data on devices
(the runner does), schedule, import the text side. Tested through tests/runtime/test_runner.py,
tests/runtime/test_engine_runner.py, tests/runtime/test_decode_steps.py and tests/runtime/test_sampler.py.

Shapes of one step. T = tokens of the plan padded to the smallest token bucket >= T; S = its
sequences padded to the smallest seq bucket >= S; R = min(S * (1 + spec_tokens), T) sample rows,
packed front to back (a sequence with k drafts uses k+1 consecutive rows; a prompt chunk that
does not sample uses none). R is a function of (T, S), so each (token bucket, seq bucket) pair
is one compiled variant. Padding tokens belong to no sequence (seq -1) and write their KV into
the scratch block (id num_kv_blocks, the cache's last block).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np

from kernels.paged_attention import AttnMetadata, Operand
from tl.core.plan import POOL_BITS, RunnerOutput, SeqResult, SeqWork
from tl.core.request import Guide
from tl.runtime.frame import StepFrame
from tl.runtime.sampler import Penalties, SampleOut, SamplingBatch, pack_penalties, pack_rows


@dataclass(frozen=True)
class StepInputs:
    """The token axis of one step [T], its sequences [S] and its sample rows [R]."""

    token_ids: Operand  # [T] i32
    positions: Operand  # [T] i32
    kv_blocks: Operand  # [T] i32: cache block of each token's KV
    kv_offsets: Operand  # [T] i32: offset in that block
    meta: AttnMetadata
    row_token: Operand  # [R] i32: token whose hidden state each sample row reads


jax.tree_util.register_dataclass(StepInputs)


@dataclass(frozen=True)
class DecodeRows:
    """What several decode steps in one call (SeqWork.steps) add to a decode-only step's inputs,
    per token (token t is sequence t's one token and sample row t): the most tokens the row makes
    in the call (0: padding) and whether an end-of-sequence id ends it (0: ignore_eos)."""

    limit: Operand  # [T] i32
    eos_stops: Operand  # [T] i32


jax.tree_util.register_dataclass(DecodeRows)

HostLayout = tuple[Any, tuple[str, ...], tuple[tuple[int, int, tuple[int, ...]], ...]]
"""(treedef, dtype names, per leaf (buffer index, offset, shape)): how `to_host_buffers` packed a pytree."""


def to_host_buffers(tree: Any) -> tuple[tuple[np.ndarray, ...], HostLayout]:
    """A pytree of host arrays as one flat buffer per dtype, and the layout to undo it (static:
    the same for every step of a bucket). Packing plus one device_put of the 3 buffers took
    ~0.6 ms a step, the device_put of a step's 16 small arrays ~0.95 ms; handing the packed
    buffers to the jitted call itself is cheaper still (tl/runtime/runner.py)."""
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[str, list[np.ndarray]] = {}
    sizes: dict[str, int] = {}
    where = []
    for leaf in leaves:
        x = np.asarray(leaf)
        name = x.dtype.str
        groups.setdefault(name, []).append(x.ravel())
        where.append((name, sizes.get(name, 0), x.shape))
        sizes[name] = sizes.get(name, 0) + x.size
    names = tuple(groups)
    index = {n: i for i, n in enumerate(names)}
    layout = (treedef, names, tuple((index[n], off, shape) for n, off, shape in where))
    return tuple(np.concatenate(groups[n]) for n in names), layout


def from_buffers(bufs: tuple[jax.Array, ...], layout: HostLayout) -> Any:
    """The pytree `to_host_buffers` packed (traced inside the step: slices of its buffers)."""
    treedef, _, where = layout
    leaves = [bufs[i][off : off + int(np.prod(shape, dtype=np.int64))].reshape(shape) for i, off, shape in where]
    return jax.tree.unflatten(treedef, leaves)


@dataclass(frozen=True, slots=True)
class SampleSpan:
    """The sample rows of one sampled SeqWork: first_row .. first_row + num_drafts."""

    work: SeqWork
    first_row: int
    num_drafts: int


@dataclass(frozen=True, slots=True)
class PoolSpan:
    """A pooled SeqWork and where its tokens are on the step's token axis."""

    work: SeqWork
    first_token: int


@dataclass(frozen=True, slots=True)
class Rows:
    """Where each SeqWork's results are in the step's outputs."""

    spans: tuple[SampleSpan, ...]
    pools: tuple[PoolSpan, ...] = ()

    @property
    def num_sampled(self) -> int:
        return sum(1 + s.num_drafts for s in self.spans)


@dataclass(frozen=True, slots=True)
class MaskFill:
    """The constrained sample rows whose bitmask the host filled, and the seconds it took (together)."""

    rows: int = 0
    seconds: float = 0.0


class MaskFiller(Protocol):
    """Fills a step's [R, W] int32 token bitmask: each (guide, first row, drafts) its rows first ..
    first+len(drafts), now and after each draft (tl/text/grammar.py's fill_masks, in parallel)."""

    def __call__(self, mask: np.ndarray, rows: Sequence[tuple[Guide, int, Sequence[int]]]) -> None: ...


def fill_rows(mask: np.ndarray, rows: Sequence[tuple[Guide, int, Sequence[int]]]) -> None:
    """The plain MaskFiller: each Guide fills its own rows, one after another."""
    for guide, row, drafts in rows:
        guide.fill(mask, row, drafts)


@dataclass(frozen=True, slots=True)
class PackedStep:
    """One step packed for its compiled variant: the rows' places, the flat host buffers of its
    StepInputs and SamplingBatch (and their layout), the penalties (None: no row has any), the
    [R, W] bitmask (None: no row is constrained), and whether top-logprobs run."""

    variant: tuple[int, int]
    rows: Rows
    bufs: tuple[np.ndarray, ...]
    layout: HostLayout
    penalties: Penalties | None
    mask: np.ndarray | None
    mask_fill: MaskFill
    top: bool

    def frame(self) -> StepFrame:
        """What every process of a multi-host job runs for this step."""
        pen = None if self.penalties is None else tuple(jax.tree.leaves(self.penalties))
        return StepFrame(self.variant, self.bufs, pen, self.mask, self.top)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """The step's device results: the sampled rows, the logits [R, V] as masked, every token's
    final-normed hidden state [T, D] (the pooled tokens' are summed on the host), and the top
    logprobs ((ids, logprobs) [R, k]; None when not run)."""

    sample: SampleOut
    logits: jax.Array
    pooled: jax.Array
    tops: tuple[jax.Array, jax.Array] | None


@dataclass(frozen=True, slots=True)
class Fetched:
    """A step's results on the host: per sample row the token, its logprob and whether its draft
    was accepted; the top logprobs (None: not run); the final-normed hidden states [T, D] (None:
    nothing pooled)."""

    token: np.ndarray
    logprob: np.ndarray
    accepted: np.ndarray
    top_ids: np.ndarray | None
    top_vals: np.ndarray | None
    pooled: np.ndarray | None


@dataclass(frozen=True, slots=True)
class StepPacker:
    """Packs SchedulerOutputs for one runner's cache and model (the start-up record builds it)."""

    block_size: int
    num_kv_blocks: int  # the scratch block's id: padding writes there
    max_model_len: int
    max_blocks: int  # block-table width
    chunk_blocks: int
    spec_tokens: int
    vocab_size: int

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def num_rows(self, t_pad: int, s_pad: int) -> int:
        return min(s_pad * (1 + self.spec_tokens), t_pad)

    def pack(
        self, work: Sequence[SeqWork], variant: tuple[int, int], fill: MaskFiller, top_logprobs: bool
    ) -> PackedStep:
        """The step of `work` in `variant` (t_pad, s_pad); top_logprobs: the variant has the
        top-logprobs function (then it runs when a sampled row asks)."""
        t_pad, s_pad = variant
        num_rows = self.num_rows(t_pad, s_pad)
        inp, rows = self.tokens(work, t_pad, s_pad)
        sb, pen = self.sampling(rows, s_pad, num_rows)
        if any(w.steps > 1 for w in work):  # several decode steps: plain decodes (no mask, no top)
            bufs, layout = to_host_buffers((inp, sb, self.decode_rows(work, t_pad)))
            return PackedStep(variant, rows, bufs, layout, pen, None, MaskFill(), False)
        mask, fill_stats = self.mask(rows, num_rows, fill)
        bufs, layout = to_host_buffers((inp, sb))
        top = top_logprobs and any(s.work.params.top_logprobs for s in rows.spans)
        return PackedStep(variant, rows, bufs, layout, pen, mask, fill_stats, top)

    def decode_rows(self, work: Sequence[SeqWork], t_pad: int) -> DecodeRows:
        """The DecodeRows of a decode-only step's work (in token order)."""
        limit = np.zeros(t_pad, np.int32)
        eos_stops = np.zeros(t_pad, np.int32)
        for t, w in enumerate(work):
            if not w.plain_decode:
                raise ValueError(f"seq {w.seq_id}: several decode steps need every work a plain decode")
            limit[t], eos_stops[t] = w.steps, not w.params.ignore_eos
        return DecodeRows(limit, eos_stops)

    def _check(self, w: SeqWork) -> None:
        end = w.start_pos + max(len(w.token_ids), w.steps)
        if not w.token_ids or end > self.max_model_len:
            raise ValueError(f"seq {w.seq_id}: positions {w.start_pos}..{end - 1} outside 0..{self.max_model_len - 1}")
        if len(w.block_table) * self.block_size < end:
            raise ValueError(f"seq {w.seq_id}: block table of {len(w.block_table)} blocks does not cover {end} tokens")
        if len(w.draft_ids) > self.spec_tokens or w.token_ids[len(w.token_ids) - len(w.draft_ids) :] != w.draft_ids:
            raise ValueError(
                f"seq {w.seq_id}: drafts {w.draft_ids} must be the last tokens (at most {self.spec_tokens})"
            )

    def tokens(self, work: Sequence[SeqWork], t_pad: int, s_pad: int) -> tuple[StepInputs, Rows]:
        bs, scratch = self.block_size, self.num_kv_blocks
        tokens = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        seq_idx = np.full(t_pad, -1, np.int32)
        kv_blocks = np.full(t_pad, scratch, np.int32)
        tables = np.full((s_pad, self.max_blocks), scratch, np.int32)
        starts = np.zeros(s_pad, np.int32)
        row_token = np.zeros(self.num_rows(t_pad, s_pad), np.int32)
        spans, pools, t, r = [], [], 0, 0
        for s, w in enumerate(work):
            self._check(w)
            n = len(w.token_ids)
            table = np.asarray(w.block_table[: self.max_blocks], np.int32)
            tables[s, : len(table)] = table
            starts[s] = w.start_pos
            pos = np.arange(w.start_pos, w.start_pos + n, dtype=np.int32)
            tokens[t : t + n], positions[t : t + n], seq_idx[t : t + n] = w.token_ids, pos, s
            kv_blocks[t : t + n] = table[pos // bs]
            if w.pool:
                pools.append(PoolSpan(w, t))
            elif w.sample:
                k = len(w.draft_ids)
                row_token[r : r + k + 1] = np.arange(t + n - 1 - k, t + n)
                spans.append(SampleSpan(w, r, k))
                r += k + 1
            t += n
        meta = AttnMetadata(
            seq_idx=seq_idx,
            positions=positions,
            start_pos=starts,
            block_tables=tables,
            chunk_blocks=self.chunk_blocks,
            head_rows=self.num_rows(t_pad, s_pad),
        )
        inp = StepInputs(
            token_ids=tokens,
            positions=positions,
            kv_blocks=kv_blocks,
            kv_offsets=np.where(seq_idx >= 0, positions % bs, 0).astype(np.int32),
            meta=meta,
            row_token=row_token,
        )
        return inp, Rows(tuple(spans), tuple(pools))

    def sampling(self, rows: Rows, s_pad: int, num_rows: int) -> tuple[SamplingBatch, Penalties | None]:
        """The rows' sampling parameters, and their penalties (None: no row has any, so the
        step takes the device-resident all-zero ones)."""
        params, seeds, steps, drafts, row_seq, prior = [], [], [], [], [], []
        for s, span in enumerate(rows.spans):
            w, k = span.work, span.num_drafts
            for j in range(k + 1):
                params.append(w.params)
                seeds.append(w.seed)
                steps.append(w.num_generated + j)
                drafts.append(w.draft_ids[j] if j < k else -1)
                row_seq.append(s)
                prior.append(w.draft_ids[:j])
        sb = pack_rows(params, seeds, steps, drafts, num_rows)
        if not any(s.work.params.has_penalties for s in rows.spans):
            return sb, None
        works = [s.work for s in rows.spans]
        pen = pack_penalties(
            [w.params for w in works],
            [w.output_ids for w in works],
            row_seq,
            prior,
            s_pad,
            num_rows,
            max(1, self.spec_tokens),
            self.vocab_size,
        )
        return sb, pen

    def zero_penalties(self, s_pad: int, num_rows: int) -> Penalties:
        """The all-zero penalties of a shape (host arrays)."""
        return pack_penalties([], [], [], [], s_pad, num_rows, max(1, self.spec_tokens), self.vocab_size)

    def mask(self, rows: Rows, num_rows: int, fill: MaskFiller) -> tuple[np.ndarray | None, MaskFill]:
        """The step's [R, W] int32 token bitmask, filled in parallel, and what filling it took.
        Without a constrained row None: the step takes a device-resident all-ones mask (nothing
        copied)."""
        guided = [(s.work.guide, s.first_row, s.work.draft_ids) for s in rows.spans if s.work.guide is not None]
        if not guided:
            return None, MaskFill()
        mask = np.full((num_rows, self.mask_words), -1, np.int32)
        t0 = time.perf_counter()
        fill(mask, guided)
        return mask, MaskFill(sum(1 + len(d) for _, _, d in guided), time.perf_counter() - t0)


def fetch(out: StepOutput, rows: Rows) -> Fetched:
    """The step's results copied to the host (waiting for the step)."""
    token, logprob, accepted = jax.device_get((out.sample.token, out.sample.logprob, out.sample.accepted))
    top_ids = top_vals = None
    if out.tops is not None:
        top_ids, top_vals = jax.device_get(out.tops)
    pooled = np.asarray(out.pooled) if rows.pools else None
    return Fetched(token, logprob, accepted, top_ids, top_vals, pooled)


def fetch_steps(out: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Several decode steps' results on the host (waiting for them): tokens and logprobs [k, T],
    and how many each row made [T] (tl/runtime/step.py MultiOut)."""
    tokens, logprobs, made = jax.device_get((out.tokens, out.logprobs, out.made))
    return tokens, logprobs, made


def unpack_steps(rows: Rows, got: tuple[np.ndarray, np.ndarray, np.ndarray]) -> RunnerOutput:
    """Each decode's tokens from several decode steps: the n it made, n - 1 of them fed back."""
    tokens, logprobs, made = got
    results = []
    for span in rows.spans:
        r, n = span.first_row, int(made[span.first_row])
        results.append(
            SeqResult(
                seq_id=span.work.seq_id,
                token_ids=tuple(tokens[:n, r].tolist()),
                logprobs=tuple(logprobs[:n, r].tolist()),
                num_accepted=n - 1,
            )
        )
    return RunnerOutput(tuple(results))


def unpack(rows: Rows, got: Fetched, max_logprobs: int, mask_fill: MaskFill) -> RunnerOutput:
    """Each sampled SeqWork's accepted drafts and one sampled token (with logprobs and top
    logprobs), then each pooled one's sums."""
    results = [_sampled(s, got, max_logprobs) for s in rows.spans]
    if rows.pools and got.pooled is not None:
        hidden = got.pooled
        results += [
            SeqResult(
                seq_id=p.work.seq_id,
                token_ids=(),
                logprobs=(),
                pooled=pooled_sum(hidden[p.first_token : p.first_token + len(p.work.token_ids)]),
            )
            for p in rows.pools
        ]
    return RunnerOutput(tuple(results), mask_fill.rows, mask_fill.seconds)


def pooled_sum(hidden: np.ndarray) -> tuple[int, ...]:
    """The sum over rows of float32 hidden states [n, D] in units of 2^-POOL_BITS: each value
    rounded to that grid (exactly, in float64), then summed as integers, so that the chunks of
    an input add up to the same vector however its steps cut it (tl/core/plan.py SeqResult)."""
    fixed = np.rint(np.ldexp(hidden.astype(np.float64), POOL_BITS))
    if not np.isfinite(fixed).all():
        raise RuntimeError("a pooled hidden state is not finite")
    if np.abs(fixed).max(initial=0.0) * len(hidden) < 2.0**62:  # int64 sums cannot overflow
        return tuple(fixed.astype(np.int64).sum(axis=0).tolist())
    return tuple(sum(int(v) for v in col) for col in fixed.T)


def _sampled(span: SampleSpan, got: Fetched, max_logprobs: int) -> SeqResult:
    w, r, k = span.work, span.first_row, span.num_drafts
    n_acc = 0
    while n_acc < k and got.accepted[r + n_acc]:
        n_acc += 1
    sl = slice(r, r + n_acc + 1)
    tops: tuple[tuple[tuple[int, float], ...], ...] = ()
    n_top = min(w.params.top_logprobs, max_logprobs)
    if n_top and got.top_ids is not None and got.top_vals is not None:
        ids, vals = got.top_ids, got.top_vals
        tops = tuple(  # a constrained row lists allowed tokens only (a blocked one's logprob is -inf)
            tuple((t, v) for t, v in zip(ids[i, :n_top].tolist(), vals[i, :n_top].tolist(), strict=True) if v > -np.inf)
            for i in range(r, r + n_acc + 1)
        )
    return SeqResult(
        seq_id=w.seq_id,
        token_ids=tuple(got.token[sl].tolist()),
        logprobs=tuple(got.logprob[sl].tolist()),
        top_logprobs=tops,
        num_accepted=n_acc,
    )
