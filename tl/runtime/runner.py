"""ModelRunner: packs one step's host data, runs the compiled step, unpacks its results.

Rule (vLLM's second runner): only code every model needs lives here. Model specifics belong
in tl/model/, attention in kernels/, token selection in tl/runtime/sampler.py, every backend decision
in tl/runtime/execution.py (the plan this runner reads), placing weights and the KV cache in
tl/runtime/placement.py, compiling the step's variants in tl/runtime/compiler.py, the dense embedding
reference in tl/model/embedding.py.

Owns: the step function (forward + KV write + sampling + pooling, traced once per variant, KV
donated), packing a SchedulerOutput into its host buffers, unpacking the sampled rows and
pooled sums into a RunnerOutput, the compilation count. Must not: schedule, allocate blocks,
keep request state, decide kernels. Tested by tests/test_runner.py (paged == dense, donation,
flat compile count).

Shapes of one step. T = tokens of the plan padded to the smallest token bucket >= T; S = its
sequences padded to the smallest seq bucket >= S; R = min(S * (1 + spec_tokens), T) sample rows,
packed front to back (a sequence with k drafts uses k+1 consecutive rows; a prompt chunk that
does not sample uses none). R is a function of (T, S), so each (token bucket, seq bucket) pair
is one compiled variant. Padding tokens belong to no sequence (seq -1) and write their KV into
the scratch block (id num_kv_blocks, the cache's last block).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels import paged_attention
from kernels import select as attention_select
from kernels.paged_attention import AttnMetadata, Operand
from tl.core.config import EngineConfig
from tl.core.plan import RunnerOutput, SchedulerOutput, SeqResult, SeqWork
from tl.core.stats import BackendInfo
from tl.model import llama
from tl.model.config import ModelConfig, load_model_config
from tl.model.files import eos_token_ids, read_tensors
from tl.ops.multihost import StepFrame
from tl.runtime import backend, execution, placement, verdicts
from tl.runtime.compiler import StepCompiler, enable_compile_cache
from tl.runtime.execution import bucket
from tl.runtime.sampler import (
    Penalties,
    SampleOut,
    SamplingBatch,
    apply_mask,
    pack_penalties,
    pack_rows,
    sample,
    top_logprobs,
)
from tl.runtime.sampler import argmax_lse as sampler_argmax_lse
from tl.text.grammar import fill_masks


@dataclass(frozen=True)
class StepInputs:
    """The token axis of one step [T], its sequences [S] and its sample rows [R]."""

    token_ids: Operand  # [T] i32
    positions: Operand  # [T] i32
    kv_blocks: Operand  # [T] i32: cache block of each token's KV
    kv_offsets: Operand  # [T] i32: offset in that block
    meta: AttnMetadata
    row_token: Operand  # [R] i32: token whose hidden state each sample row reads
    pool_seq: Operand  # [T] i32: the step's sequence index of each pooled token, S (none) elsewhere


jax.tree_util.register_dataclass(StepInputs)

HostLayout = tuple[Any, tuple[str, ...], tuple[tuple[int, int, tuple[int, ...]], ...]]
"""(treedef, dtype names, per leaf (buffer index, offset, shape)): how `_to_host_buffers` packed a pytree."""


def _to_host_buffers(tree: Any) -> tuple[tuple[np.ndarray, ...], HostLayout]:
    """A pytree of host arrays as one flat buffer per dtype, and the layout to undo it (static:
    the same for every step of a bucket). Packing plus one device_put of the 3 buffers took
    ~0.6 ms a step, the device_put of a step's 16 small arrays ~0.95 ms; handing the packed
    buffers to the jitted call itself is cheaper still (`_run_step`)."""
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


def _from_buffers(bufs: tuple[jax.Array, ...], layout: HostLayout) -> Any:
    treedef, _, where = layout
    leaves = [bufs[i][off : off + int(np.prod(shape, dtype=np.int64))].reshape(shape) for i, off, shape in where]
    return jax.tree.unflatten(treedef, leaves)


def _step(
    params: llama.Weights,
    kv: tuple[jax.Array, jax.Array],
    bufs: tuple[jax.Array, ...],
    pen: Penalties,
    mask: jax.Array,
    *,
    layout: HostLayout,
    cfg: ModelConfig,
    on_trace: Any,
    attention: Any,
    matmul: Any,
    argmax_lse: Any = None,
) -> tuple[Any, SampleOut, jax.Array, jax.Array]:
    """Forward, KV write, sample-row selection, the constraint bitmask, sampling, pooling; returns
    (kv, SampleOut, logits [R,V] as masked, pooled [S,D]: each sequence's sum of the
    final-normed hidden states of its pooled tokens, 0 for a sequence without). bufs/layout: the
    step's StepInputs and SamplingBatch as packed by `_to_host_buffers`; mask [R, W] int32: the
    rows' allowed tokens (all ones for a row without a constraint)."""
    inp, sb = _from_buffers(bufs, layout)
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


def _no_native(x: jax.Array, w: Any) -> None:
    """The matmul at row counts the verdicts give to XLA: None, so llama.linear runs XLA's dot."""
    return None


def _top_logprobs(logits: jax.Array, *, k: int, on_trace: Any) -> tuple[jax.Array, jax.Array]:
    on_trace()
    return top_logprobs(logits, k)


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with the shardings of device arrays) of a pytree, to lower against."""

    def one(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


@dataclass(frozen=True, slots=True)
class _Variant:
    """One compiled variant: the host layout its inputs are packed in, the step, top-logprobs."""

    layout: HostLayout
    step: Any  # jax.stages.Compiled of _step
    top: Any  # of _top_logprobs at its row count; None when max_logprobs is 0


@dataclass(frozen=True, slots=True)
class _Rows:
    """Host view of where each sampled SeqWork's rows are: (work, first row, number of drafts)."""

    spans: tuple[tuple[SeqWork, int, int], ...]
    pools: tuple[tuple[SeqWork, int], ...] = ()  # (pooled work, its sequence index in the step)


class StepPeers(Protocol):
    """The leader's end of the multi-host step channel (tl/ops/multihost.py's Leader)."""

    def send_step(self, frame: StepFrame) -> None: ...

    def step_ended(self) -> None: ...

    def stop(self) -> None: ...


class ModelRunner:
    """Runs SchedulerOutputs on one model; implements tl.core.plan.Runner.

    Start-up, in this order: the mesh and the execution plan (tl/runtime/execution.py), the KV cache and
    the weights placed as the plan says (tl/runtime/placement.py), the kernel verdicts measured over them
    (tl/runtime/verdicts.py) completing the plan, then the step traced from the plan and its variants
    compiled by `warmup` (tl/runtime/compiler.py)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: Mapping[str, np.ndarray],
        engine_cfg: EngineConfig,
        eos_token_ids: Sequence[int] = (),
        mesh: Mesh | None = None,
    ) -> None:
        enable_compile_cache(engine_cfg.compile_cache_dir)
        self.model_config = cfg
        self.engine_config = engine_cfg
        self.block_size = engine_cfg.block_size
        self.num_kv_blocks = engine_cfg.num_kv_blocks
        self.max_model_len = engine_cfg.max_model_len or cfg.max_position_embeddings
        self.eos_token_ids = tuple(eos_token_ids) or cfg.eos_token_ids
        platform = backend.resolve_platform(engine_cfg.backend)
        self.layout = backend.tp_layout(cfg, mesh.shape["model"] if mesh else engine_cfg.tensor_parallel)
        self.mesh = mesh or backend.make_mesh(platform, engine_cfg.tensor_parallel)
        t0 = time.perf_counter()
        plan, self.kernels = execution.plan_execution(engine_cfg, cfg, platform, self.mesh, self.layout)
        t1 = time.perf_counter()
        self._spec_tokens = engine_cfg.spec_tokens
        self._chunk_blocks, self._max_blocks = plan.chunk_blocks, plan.max_blocks
        self._replicated = NamedSharding(self.mesh, P())
        self._kv = placement.alloc_kv(
            cfg, self.mesh, self.layout.kv_spec, self.num_kv_blocks + 1, self.block_size, plan.kv_dtype
        )
        t2 = time.perf_counter()
        self._num_compilations = 0
        self._zero_penalties: dict[tuple[int, int], Penalties] = {}
        self._open_masks: dict[int, jax.Array] = {}
        self._mask_words = (cfg.vocab_size + 31) // 32
        placed = placement.place_weights(
            tensors,
            cfg,
            self.mesh,
            self.layout,
            plan.compute_dtype,
            engine_cfg.weight_dtype,
            pack_bf16x3=plan.precision.value == "high",
            huge_pages=plan.weight_pages.value == "huge",
        )
        self._params = placed.params
        t3 = time.perf_counter()
        measured = verdicts.measure_runner(plan, self.kernels, cfg, self._params, self._kv)
        self.startup_seconds = {"plan": t1 - t0, "kv_cache": t2 - t1, "weights": t3 - t2}
        self.startup_seconds["verdicts"] = time.perf_counter() - t3
        self.plan = plan.measured(measured, placed.pages, placed.reason or plan.weight_pages.reason)
        attention, matmul, argmax_lse = self._dispatch()
        kv_sh = NamedSharding(self.mesh, self.layout.kv_spec)
        self._step = jax.jit(
            functools.partial(
                _step, cfg=cfg, on_trace=self._count, attention=attention, matmul=matmul, argmax_lse=argmax_lse
            ),
            donate_argnames=("kv",),
            static_argnames=("layout",),
            out_shardings=((kv_sh, kv_sh), self._replicated, self._replicated, self._replicated),
        )
        self._top_lp = jax.jit(
            functools.partial(_top_logprobs, k=max(1, engine_cfg.max_logprobs), on_trace=self._count)
        )
        self.compiler = StepCompiler(self._compile_variant, self.plan.variants)
        self.peers: StepPeers | None = None
        """Multi-host leader: every step's frame goes to the followers first (tl/ops/build.py sets it)."""

    @classmethod
    def from_model_dir(cls, engine_cfg: EngineConfig, mesh: Mesh | None = None) -> ModelRunner:
        cfg = load_model_config(engine_cfg.model_dir)
        return cls(
            cfg,
            read_tensors(engine_cfg.model_dir),
            engine_cfg,
            eos_token_ids=eos_token_ids(engine_cfg.model_dir),
            mesh=mesh,
        )

    @property
    def params(self) -> llama.Weights:
        """The placed step-layout weights (read-only by contract)."""
        return self._params

    def _dispatch(self) -> tuple[Any, Any, Any]:
        """(attention, matmul, argmax_lse) for the step: where a kernel was measured, each step
        shape takes the plan's verdict (kernels/select.py per_shape); else the choice as made."""
        plan, k = self.plan, self.kernels
        attention = k.attention.fn
        if plan.attention_measured:
            attention = attention_select.per_shape(plan.attention_native, attention, paged_attention.paged_attention)
        matmul, argmax_lse = k.matmul.fn, k.matmul.argmax_lse
        if plan.matmul_measured and matmul is not None and argmax_lse is not None:
            matmul = attention_select.per_shape(plan.matmul_native, matmul, _no_native)
            argmax_lse = attention_select.per_shape(plan.matmul_native, argmax_lse, sampler_argmax_lse)
        return attention, matmul, argmax_lse

    @property
    def backend_info(self) -> BackendInfo:
        return self.plan.backend_info(self.mesh)

    @property
    def kv_cache(self) -> tuple[jax.Array, jax.Array]:
        """The current (k, v) device buffers; each step donates them and installs new ones."""
        return self._kv

    @property
    def num_compilations(self) -> int:
        """Traced variants of the step and top-logprob functions (one trace = one compile)."""
        return self._num_compilations

    @property
    def num_pending_compiles(self) -> int:
        """Step variants not compiled yet (the background compilation's backlog)."""
        return len(self.plan.variants) - self.compiler.num_compiled

    def _count(self) -> None:
        self._num_compilations += 1

    def num_rows(self, t_pad: int, s_pad: int) -> int:
        return min(s_pad * (1 + self._spec_tokens), t_pad)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if not plan.work:
            return RunnerOutput(())
        rows, out, logits, pooled, tops, masked = self._forward(plan)
        return self._results(rows, out, logits, pooled, tops, masked)

    def logits(self, plan: SchedulerOutput) -> np.ndarray:
        """The float32 logits [sample rows, V] of a non-empty plan, run as `execute` runs it (its
        keys written to the cache); for quality checks (bench/quant_bench.py)."""
        rows, _, logits, _, _, _ = self._forward(plan)
        return np.asarray(logits)[: sum(1 + k for _, _, k in rows.spans)]

    def _forward(self, plan: SchedulerOutput) -> tuple[_Rows, SampleOut, jax.Array, jax.Array, Any, tuple[int, float]]:
        """Runs the plan in the smallest compiled variant that holds it (tl/runtime/compiler.py); a
        multi-host leader sends the step's frame to the followers first."""
        p = self.plan
        need_t = bucket(plan.num_tokens, p.token_buckets, "step tokens")
        need_s = bucket(len(plan.work), p.seq_buckets, "step sequences")
        (t_pad, s_pad), variant = self.compiler.pick(need_t, need_s)
        inp, rows = self._pack_tokens(plan.work, t_pad, s_pad)
        sb, pen = self._pack_sampling(rows, s_pad, self.num_rows(t_pad, s_pad))
        mask, masked = self._pack_mask(rows, self.num_rows(t_pad, s_pad))
        bufs, layout = _to_host_buffers((inp, sb))
        if layout != variant.layout:
            raise RuntimeError(f"step {t_pad}x{s_pad}: packed inputs do not match the compiled layout")
        top = variant.top is not None and any(w.params.top_logprobs for w, _, _ in rows.spans)
        pen_leaves = None if pen is None else tuple(jax.tree.leaves(pen))
        frame = StepFrame((t_pad, s_pad), bufs, pen_leaves, mask, top)
        if self.peers is not None:
            self.peers.send_step(frame)
        out, logits, pooled, tops = self._run(variant, frame)
        return rows, out, logits, pooled, tops, masked

    def _run(self, variant: _Variant, frame: StepFrame) -> tuple[SampleOut, jax.Array, jax.Array, Any]:
        """One step on the device from its frame (what every process of a multi-host job runs
        alike): the donated KV cache replaced, the outputs and top-logprobs dispatched."""
        t_pad, s_pad = frame.variant
        num_rows = self.num_rows(t_pad, s_pad)
        pen = (
            self._no_penalties(s_pad, num_rows)
            if frame.penalties is None
            else jax.device_put(Penalties(*frame.penalties), self._replicated)
        )
        mask = self._open_mask(num_rows) if frame.mask is None else frame.mask
        # The host buffers go in as numpy arrays: the compiled call's own transfer (C++) took
        # ~0.6 ms less a step than a jax.device_put of them first (one-row decode, alternated).
        self._kv, out, logits, pooled = variant.step(self._params, self._kv, frame.bufs, pen, mask)
        tops = variant.top(logits) if frame.top else None
        return out, logits, pooled, tops

    def run_frame(self, frame: StepFrame) -> None:
        """A multi-host follower's step: the leader's frame run in the same variant (compiled
        now if this process has not compiled it yet), waited for; its outputs are the leader's."""
        variant = self.compiler.ensure(frame.variant)
        out, _, _, _ = self._run(variant, frame)
        jax.block_until_ready(out.token)  # bounded by the group's step watchdog (peer_timeout_s)

    def _compile_variant(self, v: tuple[int, int]) -> _Variant:
        """Variant v of the step (and of the top-logprobs function at its row count) compiled
        ahead of time over abstract arguments: nothing runs, the KV cache is not touched."""
        t_pad, s_pad = v
        num_rows = self.num_rows(t_pad, s_pad)
        inp, rows = self._pack_tokens([], t_pad, s_pad)
        sb, _ = self._pack_sampling(rows, s_pad, num_rows)
        bufs, layout = _to_host_buffers((inp, sb))
        # Shapes only: compiles run on worker threads, and a device_put there would be one more
        # collective in this process's order (in a multi-host job, out of step with the others).
        pen = self._zero_penalties_host(s_pad, num_rows)
        mask = np.zeros((num_rows, self._mask_words), np.int32)
        step = self._step.lower(
            _abstract(self._params),
            _abstract(self._kv),
            _abstract(bufs),
            self._replicated_abstract(pen),
            self._replicated_abstract(mask),
            layout=layout,
        ).compile()
        top = None
        if self.engine_config.max_logprobs:
            logits = jax.ShapeDtypeStruct(
                (num_rows, self.model_config.vocab_size), jnp.float32, sharding=self._replicated
            )
            top = self._top_lp.lower(logits).compile()
        return _Variant(layout, step, top)

    def _replicated_abstract(self, tree: Any) -> Any:
        """ShapeDtypeStructs of host arrays as the step receives them: replicated on the mesh."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated), tree)

    def _check(self, w: SeqWork) -> None:
        end = w.start_pos + len(w.token_ids)
        if not w.token_ids or end > self.max_model_len:
            raise ValueError(f"seq {w.seq_id}: positions {w.start_pos}..{end - 1} outside 0..{self.max_model_len - 1}")
        if len(w.block_table) * self.block_size < end:
            raise ValueError(f"seq {w.seq_id}: block table of {len(w.block_table)} blocks does not cover {end} tokens")
        if len(w.draft_ids) > self._spec_tokens or w.token_ids[len(w.token_ids) - len(w.draft_ids) :] != w.draft_ids:
            raise ValueError(
                f"seq {w.seq_id}: drafts {w.draft_ids} must be the last tokens (at most {self._spec_tokens})"
            )

    def _pack_tokens(self, work: Sequence[SeqWork], t_pad: int, s_pad: int) -> tuple[StepInputs, _Rows]:
        bs, scratch = self.block_size, self.num_kv_blocks
        tokens = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        seq_idx = np.full(t_pad, -1, np.int32)
        kv_blocks = np.full(t_pad, scratch, np.int32)
        tables = np.full((s_pad, self._max_blocks), scratch, np.int32)
        starts = np.zeros(s_pad, np.int32)
        row_token = np.zeros(self.num_rows(t_pad, s_pad), np.int32)
        pool_seq = np.full(t_pad, s_pad, np.int32)
        spans, pools, t, r = [], [], 0, 0
        for s, w in enumerate(work):
            self._check(w)
            n = len(w.token_ids)
            table = np.asarray(w.block_table[: self._max_blocks], np.int32)
            tables[s, : len(table)] = table
            starts[s] = w.start_pos
            pos = np.arange(w.start_pos, w.start_pos + n, dtype=np.int32)
            tokens[t : t + n], positions[t : t + n], seq_idx[t : t + n] = w.token_ids, pos, s
            kv_blocks[t : t + n] = table[pos // bs]
            if w.pool:
                pool_seq[t : t + n] = s
                pools.append((w, s))
            elif w.sample:
                k = len(w.draft_ids)
                row_token[r : r + k + 1] = np.arange(t + n - 1 - k, t + n)
                spans.append((w, r, k))
                r += k + 1
            t += n
        meta = AttnMetadata(
            seq_idx=seq_idx,
            positions=positions,
            start_pos=starts,
            block_tables=tables,
            chunk_blocks=self._chunk_blocks,
            head_rows=self.num_rows(t_pad, s_pad),
        )
        inp = StepInputs(
            token_ids=tokens,
            positions=positions,
            kv_blocks=kv_blocks,
            kv_offsets=np.where(seq_idx >= 0, positions % bs, 0).astype(np.int32),
            meta=meta,
            row_token=row_token,
            pool_seq=pool_seq,
        )
        return inp, _Rows(tuple(spans), tuple(pools))

    def _pack_sampling(self, rows: _Rows, s_pad: int, num_rows: int) -> tuple[SamplingBatch, Penalties | None]:
        """The rows' sampling parameters, and their penalties (None: no row has any, so the
        step takes the device-resident all-zero ones)."""
        params, seeds, steps, drafts, row_seq, prior = [], [], [], [], [], []
        for s, (w, _, k) in enumerate(rows.spans):
            for j in range(k + 1):
                params.append(w.params)
                seeds.append(w.seed)
                steps.append(w.num_generated + j)
                drafts.append(w.draft_ids[j] if j < k else -1)
                row_seq.append(s)
                prior.append(w.draft_ids[:j])
        sb = pack_rows(params, seeds, steps, drafts, num_rows)
        if not any(w.params.has_penalties for w, _, _ in rows.spans):
            return sb, None
        spans = rows.spans
        pen = pack_penalties(
            [w.params for w, _, _ in spans],
            [w.output_ids for w, _, _ in spans],
            row_seq,
            prior,
            s_pad,
            num_rows,
            max(1, self._spec_tokens),
            self.model_config.vocab_size,
        )
        return sb, pen

    def _pack_mask(self, rows: _Rows, num_rows: int) -> tuple[np.ndarray | None, tuple[int, float]]:
        """The step's [R, W] int32 token bitmask and (constrained rows, host seconds filling them,
        in parallel). Without a constrained row None: the step takes a device-resident all-ones
        mask (nothing copied)."""
        guided = [(w.guide, r, w.draft_ids) for w, r, _ in rows.spans if w.guide is not None]
        if not guided:
            return None, (0, 0.0)
        mask = np.full((num_rows, self._mask_words), -1, np.int32)
        t0 = time.perf_counter()
        fill_masks(mask, guided)
        return mask, (sum(1 + len(d) for _, _, d in guided), time.perf_counter() - t0)

    def _open_mask(self, num_rows: int) -> jax.Array:
        """Device-resident all-ones bitmask per row count: every token allowed."""
        if num_rows not in self._open_masks:
            ones = np.full((num_rows, self._mask_words), -1, np.int32)
            self._open_masks[num_rows] = jax.device_put(ones, self._replicated)
        return self._open_masks[num_rows]

    def _no_penalties(self, s_pad: int, num_rows: int) -> Penalties:
        """Device-resident all-zero penalties per shape, so penalty-free steps copy nothing."""
        key = (s_pad, num_rows)
        if key not in self._zero_penalties:
            self._zero_penalties[key] = jax.device_put(self._zero_penalties_host(s_pad, num_rows), self._replicated)
        return self._zero_penalties[key]

    def _zero_penalties_host(self, s_pad: int, num_rows: int) -> Penalties:
        return pack_penalties([], [], [], [], s_pad, num_rows, max(1, self._spec_tokens), self.model_config.vocab_size)

    def _results(
        self,
        rows: _Rows,
        out: SampleOut,
        logits: jax.Array,
        pooled: jax.Array,
        tops_out: Any,
        masked: tuple[int, float],
    ) -> RunnerOutput:
        token, logprob, accepted = jax.device_get((out.token, out.logprob, out.accepted))
        top_ids = top_vals = None
        if tops_out is not None:
            top_ids, top_vals = jax.device_get(tops_out)
        if self.peers is not None:
            self.peers.step_ended()
        results = []
        for w, r, k in rows.spans:
            n_acc = 0
            while n_acc < k and accepted[r + n_acc]:
                n_acc += 1
            sl = slice(r, r + n_acc + 1)
            tops: tuple[tuple[tuple[int, float], ...], ...] = ()
            n_top = min(w.params.top_logprobs, self.engine_config.max_logprobs)
            if n_top and top_ids is not None and top_vals is not None:
                tops = tuple(  # a constrained row lists allowed tokens only (a blocked one's logprob is -inf)
                    tuple(
                        (t, v)
                        for t, v in zip(top_ids[i, :n_top].tolist(), top_vals[i, :n_top].tolist(), strict=True)
                        if v > -np.inf
                    )
                    for i in range(r, r + n_acc + 1)
                )
            results.append(
                SeqResult(
                    seq_id=w.seq_id,
                    token_ids=tuple(token[sl].tolist()),
                    logprobs=tuple(logprob[sl].tolist()),
                    top_logprobs=tops,
                    num_accepted=n_acc,
                )
            )
        if rows.pools:
            sums = np.asarray(pooled)
            results += [
                SeqResult(seq_id=w.seq_id, token_ids=(), logprobs=(), pooled=tuple(sums[s].tolist()))
                for w, s in rows.pools
            ]
        return RunnerOutput(tuple(results), *masked)

    def close(self) -> None:
        """Stop the background compilation (after the variant in progress; not waiting for it);
        a multi-host leader stops its followers."""
        self.compiler.stop(wait=False)
        if self.peers is not None:
            self.peers.stop()

    def warmup(self, background: bool = False) -> None:
        """Compile the step's variants ahead of time: the plan's start-up variants now, then the
        rest here (background False: serving then never compiles) or on a background thread
        (steps meanwhile run in the smallest compiled variant that holds them)."""
        self.compiler.compile_startup(self.plan.startup_variants)
        if background:
            self.compiler.start_background()
        else:
            self.compiler.compile_rest()
