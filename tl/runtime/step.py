"""The step program: one engine step as a traced function, jitted once, compiled per variant.

Owns: the step function (forward + KV write + the constraint bitmask + sampling + pooling; KV
donated), the top-logprobs function run after it when a row asks, both jitted once with the
plan's resolved dispatch (tl/runtime/execution.py StepKernels), the overlap's small programs that
feed a call's tokens (and penalty counts) into the next call's inputs on the device, compiling a
variant of both ahead of time over abstract arguments (what tl/runtime/compiler.py calls), and the count of traces (one
trace = one compile). Must not: pack inputs (tl/runtime/step_io.py), run steps or hold the KV
cache (tl/runtime/runner.py), decide kernels. Tested by tests/runtime/test_runner.py (flat compile
count) and tests/runtime/test_verdicts.py (each variant's kernels, in its HLO).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tl.model import llama
from tl.model.config import ModelConfig
from tl.runtime.execution import StepKernels
from tl.runtime.sampler import Penalties, SampleOut, apply_mask, sample, top_logprobs
from tl.runtime.step_io import HostLayout, StepPacker, from_buffers, to_host_buffers


def _step(
    params: llama.Weights,
    kv: tuple[jax.Array, jax.Array],
    bufs: tuple[jax.Array, ...],
    pen: Penalties,
    mask: jax.Array,
    *,
    layout: HostLayout,
    cfg: ModelConfig,
    on_trace: Callable[[], None],
    attention: Any,
    matmul: Any,
    argmax_lse: Any = None,
) -> tuple[Any, SampleOut, jax.Array, jax.Array]:
    """Forward, KV write, sample-row selection, the constraint bitmask, sampling, pooling; returns
    (kv, SampleOut, logits [R,V] as masked, pooled [T,D]: the final-normed hidden states of
    every token, the pooled ones' summed on the host). bufs/layout: the
    step's StepInputs and SamplingBatch as packed by `to_host_buffers`; mask [R, W] int32: the
    rows' allowed tokens (all ones for a row without a constraint)."""
    inp, sb = from_buffers(bufs, layout)
    on_trace()
    hidden, kv = llama.forward(
        params, cfg, inp.token_ids, inp.positions, kv, inp.kv_blocks, inp.kv_offsets, inp.meta, attention, matmul
    )
    logits = apply_mask(llama.lm_logits(params, cfg, hidden[inp.row_token], matmul), mask)
    return kv, sample(logits, sb, pen, argmax_lse), logits, _pooled(params, cfg, hidden)


class MultiOut(NamedTuple):
    """A multi-step decode's results: tokens and their logprobs [k, T] by step, and how many each
    row made [T]."""

    tokens: jax.Array
    logprobs: jax.Array
    made: jax.Array


def _decode_steps(
    params: llama.Weights,
    kv: tuple[jax.Array, jax.Array],
    bufs: tuple[jax.Array, ...],
    pen: Penalties,
    *,
    layout: HostLayout,
    cfg: ModelConfig,
    steps: int,
    block_size: int,
    scratch: int,
    eos_ids: tuple[int, ...],
    on_trace: Callable[[], None],
    attention: Any,
    matmul: Any,
    argmax_lse: Any = None,
) -> tuple[Any, MultiOut]:
    """Up to `steps` decode steps of a decode-only step (token t is sequence t's one token and
    sample row t) in one program: each step's sampled tokens are the next step's inputs at the
    next positions, KV written in place; a row stops after `limit` tokens or an end-of-sequence
    id (when eos_stops), its later writes going to the scratch block; the loop ends when every
    row has. Sampling keys fold in num_generated + i, as `steps` single steps would."""
    inp, sb, rows = from_buffers(bufs, layout)
    on_trace()
    t_pad = inp.token_ids.shape[0]
    num_rows = inp.row_token.shape[0]
    meta = inp.meta
    seq = jnp.maximum(meta.seq_idx, 0)
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
    row_of = jnp.minimum(jnp.arange(num_rows, dtype=jnp.int32), meta.block_tables.shape[0] - 1)

    def body(c: tuple[Any, ...]) -> tuple[Any, ...]:
        i, kv, tok, pos, start, counts, live, out_tok, out_lp, made = c
        write = live > 0
        blocks = jnp.where(write, meta.block_tables[seq, pos // block_size], scratch)
        offsets = jnp.where(write, pos % block_size, 0)
        m = dataclasses.replace(meta, positions=pos, start_pos=start)
        hidden, kv = llama.forward(params, cfg, tok, pos, kv, blocks, offsets, m, attention, matmul)
        logits = llama.lm_logits(params, cfg, hidden[inp.row_token], matmul)
        out = sample(
            logits, dataclasses.replace(sb, step=sb.step + i), dataclasses.replace(pen, counts=counts), argmax_lse
        )
        new = jnp.zeros(t_pad, jnp.int32).at[:num_rows].set(out.token)  # row r is token r (R <= T)
        row_live = live[:num_rows] > 0
        counts = counts.at[row_of, out.token].add(row_live.astype(counts.dtype))
        out_tok = lax.dynamic_update_index_in_dim(out_tok, new, i, 0)
        out_lp = lax.dynamic_update_index_in_dim(out_lp, jnp.zeros(t_pad).at[:num_rows].set(out.logprob), i, 0)
        made = made + write.astype(jnp.int32)
        ended = (made >= rows.limit) | ((rows.eos_stops > 0) & jnp.isin(new, eos))
        live = jnp.where(write & ~ended, 1, 0).astype(jnp.int32)
        return i + 1, kv, new, pos + 1, start + 1, counts, live, out_tok, out_lp, made

    def more(c: tuple[Any, ...]) -> Any:
        return (c[0] < steps) & jnp.any(c[6] > 0)

    live0 = jnp.where((meta.seq_idx >= 0) & (rows.limit > 0), 1, 0).astype(jnp.int32)
    zeros_tok = jnp.zeros((steps, t_pad), jnp.int32)
    zeros_lp = jnp.zeros((steps, t_pad), jnp.float32)
    c = (
        0,
        kv,
        inp.token_ids,
        inp.positions,
        meta.start_pos,
        pen.counts,
        live0,
        zeros_tok,
        zeros_lp,
        jnp.zeros(t_pad, jnp.int32),
    )
    c = lax.while_loop(more, body, c)
    return c[1], MultiOut(c[7], c[8], c[9])


def _by_step(tokens: jax.Array, made: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """A call's tokens as [k, X] by step and how many each column made [X]: tokens [R] of one
    step (each row made one), or [k, T] of several with their `made`."""
    if made is None:
        return tokens[None, :], jnp.ones(tokens.shape[0], jnp.int32)
    return tokens, made


def _feed(buf: jax.Array, tokens: jax.Array, made: jax.Array | None, src: jax.Array, *, off: int) -> jax.Array:
    """A step's int32 input buffer with its token ids (at `off`, one per entry of src) taken from
    a call still on the device where src >= 0: that call's last token of column src (`_by_step`);
    src < 0 keeps the host's."""
    steps, n_made = _by_step(tokens, made)
    last = steps[jnp.maximum(n_made - 1, 0), jnp.arange(steps.shape[1])]
    n = src.shape[0]
    fed = jnp.where(src >= 0, last[jnp.maximum(src, 0)], buf[off : off + n])
    return buf.at[off : off + n].set(fed)


def _feed_counts(counts: jax.Array, tokens: jax.Array, made: jax.Array | None, src: jax.Array) -> jax.Array:
    """Penalty counts [S, V] of a step whose sequence s continues column src[s] (>= 0) of a call
    still on the device, with that call's tokens added: what the host's counts lack."""
    steps, n = _by_step(tokens, made)
    cols = jnp.maximum(src, 0)
    toks = steps[:, cols]  # [k, S]
    valid = (jnp.arange(steps.shape[0])[:, None] < n[cols][None, :]) & (src >= 0)[None, :]
    rows = jnp.broadcast_to(jnp.arange(src.shape[0])[None, :], toks.shape)
    return counts.at[rows, toks].add(valid.astype(counts.dtype))


def _pooled(params: llama.Weights, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """[T, D] float32 final-normed hidden states, for the pooled tokens' sums: taken on the host
    (step_io.unpack), exactly, so that an input's sum does not depend on the steps it ran in."""
    return llama.rms_norm(hidden, params.final_norm.value, cfg.rms_norm_eps).astype(jnp.float32)


def _top_logprobs(
    logits: jax.Array, *, k: int, on_trace: Callable[[], None], argmax_lse: Any = None
) -> tuple[jax.Array, jax.Array]:
    on_trace()
    return top_logprobs(logits, k, argmax_lse)


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with the shardings of device arrays) of a pytree, to lower against."""

    def one(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


@dataclass(frozen=True, slots=True)
class CompiledVariant:
    """One compiled variant: the host layout its inputs are packed in, the step (or the several
    decode steps of `compile_steps`), top-logprobs."""

    layout: HostLayout
    step: Any  # jax.stages.Compiled of _step
    top: Any  # of _top_logprobs at its row count; None when max_logprobs is 0


class StepProgram:
    """The step and top-logprobs functions of one runner, jitted once; `compile(variant)` for
    tl/runtime/compiler.py. Holds the abstract weights and KV cache it lowers against, never
    the arrays (the runner's steps donate the cache)."""

    def __init__(
        self,
        cfg: ModelConfig,
        kernels: StepKernels,
        packer: StepPacker,
        mesh: Mesh,
        kv_spec: P,
        max_logprobs: int,
        params: llama.Weights,
        kv: tuple[jax.Array, jax.Array],
        decode_steps: int = 1,
        eos_ids: tuple[int, ...] = (),
    ) -> None:
        self.num_compilations = 0  # traces of the step and top-logprobs functions (one trace = one compile)
        self.num_several_compilations = 0  # traces of the several decode steps' program
        self._cfg, self._packer, self._max_logprobs = cfg, packer, max_logprobs
        self.replicated = NamedSharding(mesh, P())
        self._params, self._kv = _abstract(params), _abstract(kv)
        kv_sh = NamedSharding(mesh, kv_spec)
        model: dict[str, Any] = {
            "cfg": cfg,
            "attention": kernels.attention,
            "matmul": kernels.matmul,
            "argmax_lse": kernels.argmax_lse,
        }
        self.step = jax.jit(
            functools.partial(_step, on_trace=self._count, **model),
            donate_argnames=("kv",),
            static_argnames=("layout",),
            out_shardings=((kv_sh, kv_sh), self.replicated, self.replicated, self.replicated),
        )
        self.feed = jax.jit(_feed, static_argnames=("off",), out_shardings=self.replicated)
        self.feed_counts = jax.jit(_feed_counts, out_shardings=self.replicated)
        self.top = jax.jit(
            functools.partial(
                _top_logprobs, k=max(1, max_logprobs), on_trace=self._count, argmax_lse=kernels.argmax_lse
            )
        )
        self.decode_steps = decode_steps
        self.several = jax.jit(
            functools.partial(
                _decode_steps,
                steps=decode_steps,
                block_size=packer.block_size,
                scratch=packer.num_kv_blocks,
                eos_ids=tuple(eos_ids),
                on_trace=self._count_several,
                **model,
            ),
            donate_argnames=("kv",),
            static_argnames=("layout",),
            out_shardings=((kv_sh, kv_sh), self.replicated),
        )

    def _count(self) -> None:
        self.num_compilations += 1

    def _count_several(self) -> None:
        self.num_several_compilations += 1

    def lowered(self, v: tuple[int, int]) -> tuple[Any, HostLayout]:
        """Variant v of the step traced and lowered over abstract arguments (nothing runs), and
        the host layout its inputs are packed in."""
        t_pad, s_pad = v
        num_rows = self._packer.num_rows(t_pad, s_pad)
        inp, rows = self._packer.tokens([], t_pad, s_pad)
        sb, _ = self._packer.sampling(rows, s_pad, num_rows)
        bufs, layout = to_host_buffers((inp, sb))
        # Shapes only: compiles run on worker threads, and a device_put there would be one more
        # collective in this process's order (in a multi-host job, out of step with the others).
        pen = self._packer.zero_penalties(s_pad, num_rows)
        mask = np.zeros((num_rows, self._packer.mask_words), np.int32)
        lowered = self.step.lower(
            self._params,
            self._kv,
            _abstract(bufs),
            self._replicated_abstract(pen),
            self._replicated_abstract(mask),
            layout=layout,
        )
        return lowered, layout

    def compile(self, v: tuple[int, int]) -> CompiledVariant:
        """Variant v of the step (and of the top-logprobs function at its row count) compiled
        ahead of time: nothing runs, the KV cache is not touched."""
        lowered, layout = self.lowered(v)
        step = lowered.compile()
        top = None
        if self._max_logprobs:
            num_rows = self._packer.num_rows(*v)
            logits = jax.ShapeDtypeStruct((num_rows, self._cfg.vocab_size), jnp.float32, sharding=self.replicated)
            top = self.top.lower(logits).compile()
        return CompiledVariant(layout, step, top)

    def compile_steps(self, v: tuple[int, int]) -> CompiledVariant:
        """Variant v's decode-only step run `decode_steps` times in one program (`_decode_steps`),
        compiled ahead of time; its layout packs the step's inputs with their DecodeRows."""
        t_pad, s_pad = v
        num_rows = self._packer.num_rows(t_pad, s_pad)
        inp, rows = self._packer.tokens([], t_pad, s_pad)
        sb, _ = self._packer.sampling(rows, s_pad, num_rows)
        bufs, layout = to_host_buffers((inp, sb, self._packer.decode_rows([], t_pad)))
        pen = self._packer.zero_penalties(s_pad, num_rows)
        lowered = self.several.lower(
            self._params, self._kv, _abstract(bufs), self._replicated_abstract(pen), layout=layout
        )
        return CompiledVariant(layout, lowered.compile(), None)

    def lower_feed(self, buf: Any, tokens: Any, made: Any, src: Any, off: int) -> Any:
        """`feed` lowered for these arguments' shapes (host arrays or a call's device results)."""
        return self.feed.lower(_abstract(buf), _abstract(tokens), _abstract(made), _abstract(src), off=off)

    def lower_feed_counts(self, counts: Any, tokens: Any, made: Any, src: Any) -> Any:
        """`feed_counts` lowered for these arguments' shapes."""
        return self.feed_counts.lower(_abstract(counts), _abstract(tokens), _abstract(made), _abstract(src))

    def _replicated_abstract(self, tree: Any) -> Any:
        """ShapeDtypeStructs of host arrays as the step receives them: replicated on the mesh."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated), tree)
