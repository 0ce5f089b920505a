"""The step program: one engine step as a traced function, jitted once, compiled per variant.

Owns: the step function (forward + KV write + the constraint bitmask + sampling + pooling; KV
donated), the top-logprobs function run after it when a row asks, both jitted once with the
plan's resolved dispatch (tl/runtime/execution.py StepKernels), compiling a variant of both ahead
of time over abstract arguments (what tl/runtime/compiler.py calls), and the count of traces (one
trace = one compile). Must not: pack inputs (tl/runtime/step_io.py), run steps or hold the KV
cache (tl/runtime/runner.py), decide kernels. Tested by tests/test_runner.py (flat compile
count) and tests/test_verdicts.py (each variant's kernels, in its HLO).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
from tl.runtime.step_io import HostLayout, StepInputs, StepPacker, from_buffers, to_host_buffers


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
    (kv, SampleOut, logits [R,V] as masked, pooled [S,D]: each sequence's sum of the
    final-normed hidden states of its pooled tokens, 0 for a sequence without). bufs/layout: the
    step's StepInputs and SamplingBatch as packed by `to_host_buffers`; mask [R, W] int32: the
    rows' allowed tokens (all ones for a row without a constraint)."""
    inp, sb = from_buffers(bufs, layout)
    on_trace()
    hidden, kv = llama.forward(
        params, cfg, inp.token_ids, inp.positions, kv, inp.kv_blocks, inp.kv_offsets, inp.meta, attention, matmul
    )
    logits = apply_mask(llama.lm_logits(params, cfg, hidden[inp.row_token], matmul), mask)
    return kv, sample(logits, sb, pen, argmax_lse), logits, _pooled(params, cfg, hidden, inp)


def _pooled(params: llama.Weights, cfg: ModelConfig, hidden: jax.Array, inp: StepInputs) -> jax.Array:
    """[S, D] sums of final-normed hidden states by pool_seq, as a one-hot [S, T] dot (a scatter-add
    is a serial loop on XLA:CPU; this is ~0.03% of a 512-token step's FLOPs)."""
    s_pad = inp.meta.block_tables.shape[0]
    normed = llama.rms_norm(hidden, params.final_norm.value, cfg.rms_norm_eps).astype(jnp.float32)
    onehot = (inp.pool_seq[None, :] == jnp.arange(s_pad, dtype=jnp.int32)[:, None]).astype(jnp.float32)
    return jnp.dot(onehot, normed, precision=lax.Precision.HIGHEST)


def _top_logprobs(logits: jax.Array, *, k: int, on_trace: Callable[[], None]) -> tuple[jax.Array, jax.Array]:
    on_trace()
    return top_logprobs(logits, k)


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with the shardings of device arrays) of a pytree, to lower against."""

    def one(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


@dataclass(frozen=True, slots=True)
class CompiledVariant:
    """One compiled variant: the host layout its inputs are packed in, the step, top-logprobs."""

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
    ) -> None:
        self.num_compilations = 0
        self._cfg, self._packer, self._max_logprobs = cfg, packer, max_logprobs
        self.replicated = NamedSharding(mesh, P())
        self._params, self._kv = _abstract(params), _abstract(kv)
        kv_sh = NamedSharding(mesh, kv_spec)
        self.step = jax.jit(
            functools.partial(
                _step,
                cfg=cfg,
                on_trace=self._count,
                attention=kernels.attention,
                matmul=kernels.matmul,
                argmax_lse=kernels.argmax_lse,
            ),
            donate_argnames=("kv",),
            static_argnames=("layout",),
            out_shardings=((kv_sh, kv_sh), self.replicated, self.replicated, self.replicated),
        )
        self.top = jax.jit(functools.partial(_top_logprobs, k=max(1, max_logprobs), on_trace=self._count))

    def _count(self) -> None:
        self.num_compilations += 1

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

    def _replicated_abstract(self, tree: Any) -> Any:
        """ShapeDtypeStructs of host arrays as the step receives them: replicated on the mesh."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated), tree)
