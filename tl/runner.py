"""ModelRunner: packs one step's host data for the device and runs the compiled step.

Rule (vLLM's second runner): only code every model needs lives here. Model specifics belong
in tl/model/, attention in kernels/, token selection in tl/sampler.py.

Owns: the device mesh, parameter and KV-cache placement (explicit NamedShardings), the bucket
choice, the compiled step (forward + KV write + sampling, built once, KV donated), warm-up,
the compilation count and embeddings. Must not: schedule, allocate blocks or keep request
state. Tested by tests/test_runner.py (paged == dense, donation, flat compile count).

Shapes of one step. T = tokens of the plan padded to the smallest token bucket >= T; S = its
sequences padded to the smallest seq bucket >= S; R = min(S * (1 + spec_tokens), T) sample rows,
packed front to back (a sequence with k drafts uses k+1 consecutive rows; a prompt chunk that
does not sample uses none). R is a function of (T, S), so each (token bucket, seq bucket) pair
is one compiled variant. Padding tokens belong to no sequence (seq -1) and write their KV into
the scratch block (id num_kv_blocks, the cache's last block).
"""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels import paged_attention
from kernels import select as attention_select
from kernels.paged_attention import AttnMetadata
from tl import backend, verdicts, weight_pages
from tl.config import EngineConfig
from tl.model import llama
from tl.model.config import ModelConfig, load_model_config
from tl.model.files import eos_token_ids, read_tensors
from tl.plan import RunnerOutput, SchedulerOutput, SeqResult, SeqWork
from tl.sampler import Penalties, SampleOut, SamplingBatch, pack_penalties, pack_rows, sample, top_logprobs
from tl.sampler import argmax_lse as sampler_argmax_lse
from tl.stats import BackendInfo

ATTN_CHUNK_TOKENS = 128  # keys per iteration of the cached-attention loop (rounded to whole blocks)


@dataclass(frozen=True)
class StepInputs:
    """The token axis of one step [T], its sequences [S] and its sample rows [R]."""

    token_ids: jax.Array  # [T] i32
    positions: jax.Array  # [T] i32
    kv_blocks: jax.Array  # [T] i32: cache block of each token's KV
    kv_offsets: jax.Array  # [T] i32: offset in that block
    meta: AttnMetadata
    row_token: jax.Array  # [R] i32: token whose hidden state each sample row reads
    pool_seq: jax.Array  # [T] i32: the step's sequence index of each pooled token, S (none) elsewhere


jax.tree_util.register_dataclass(StepInputs)

_compile_cache_dir: str | None = None


def enable_compile_cache(path: str) -> None:
    """Turn on JAX's persistent compilation cache (process-wide; the first directory wins)."""
    global _compile_cache_dir
    if not path or _compile_cache_dir is not None:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _compile_cache_dir = path


def default_mesh() -> Mesh:
    """One device, axes ("data", "model"); tensor parallelism widens "model" without new code."""
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def _bucket(n: int, buckets: Sequence[int], what: str) -> int:
    i = bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


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
    params: llama.Params,
    kv: tuple[jax.Array, jax.Array],
    bufs: tuple[jax.Array, ...],
    pen: Penalties,
    *,
    layout: HostLayout,
    cfg: ModelConfig,
    on_trace: Any,
    attention: Any,
    matmul: Any,
    argmax_lse: Any = None,
) -> tuple[Any, SampleOut, jax.Array, jax.Array]:
    """Forward, KV write, sample-row selection and sampling, pooling; returns (kv, SampleOut,
    logits [R,V], pooled [S,D]: each sequence's sum of the final-normed hidden states of its
    pooled tokens, 0 for a sequence without). bufs/layout: the step's StepInputs and
    SamplingBatch as packed by `_to_host_buffers`."""
    inp, sb = _from_buffers(bufs, layout)
    on_trace()
    hidden, kv = llama.forward(
        params, cfg, inp.token_ids, inp.positions, kv, inp.kv_blocks, inp.kv_offsets, inp.meta, attention, matmul
    )
    logits = llama.lm_logits(params, cfg, hidden[inp.row_token], matmul)
    return kv, sample(logits, sb, pen, argmax_lse), logits, _pooled(params, cfg, hidden, inp)


def _pooled(params: llama.Params, cfg: ModelConfig, hidden: jax.Array, inp: StepInputs) -> jax.Array:
    """[S, D] sums of final-normed hidden states by pool_seq, as a one-hot [S, T] dot (a scatter-add
    is a serial loop on XLA:CPU; this is ~0.03% of a 512-token step's FLOPs)."""
    s_pad = inp.meta.block_tables.shape[0]
    normed = llama.rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps).astype(jnp.float32)
    onehot = (inp.pool_seq[None, :] == jnp.arange(s_pad, dtype=jnp.int32)[:, None]).astype(jnp.float32)
    return jnp.dot(onehot, normed, precision=lax.Precision.HIGHEST)


def _no_native(x: jax.Array, w: Any) -> None:
    """The matmul at row counts the verdicts give to XLA: None, so llama.linear runs XLA's dot."""
    return None


def _embed(
    params: llama.Params, token_ids: jax.Array, length: jax.Array, *, cfg: ModelConfig, on_trace: Any
) -> jax.Array:
    """Mean of the final-normed hidden states of the first `length` tokens, L2-normalised [D]."""
    on_trace()
    hidden, _ = llama.forward_dense(params, cfg, token_ids)
    mask = (jnp.arange(token_ids.shape[0]) < length)[:, None]
    mean = jnp.sum(jnp.where(mask, hidden.astype(jnp.float32), 0.0), axis=0) / length
    return mean / jnp.maximum(jnp.linalg.norm(mean), 1e-12)


def _top_logprobs(logits: jax.Array, *, k: int, on_trace: Any) -> tuple[jax.Array, jax.Array]:
    on_trace()
    return top_logprobs(logits, k)


@dataclass(frozen=True, slots=True)
class _Rows:
    """Host view of where each sampled SeqWork's rows are: (work, first row, number of drafts)."""

    spans: tuple[tuple[SeqWork, int, int], ...]
    pools: tuple[tuple[SeqWork, int], ...] = ()  # (pooled work, its sequence index in the step)


class ModelRunner:
    """Runs SchedulerOutputs on one model; implements tl.plan.Runner."""

    def __init__(
        self,
        cfg: ModelConfig,
        params_host: dict[str, Any],
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
        self.platform = backend.resolve_platform(engine_cfg.backend)
        self.layout = backend.tp_layout(cfg, mesh.shape["model"] if mesh else engine_cfg.tensor_parallel)
        self.mesh = mesh or backend.make_mesh(self.platform, engine_cfg.tensor_parallel)
        self.dtype = jnp.dtype(backend.resolve_dtype(engine_cfg.dtype, self.platform))
        self._spec_tokens = engine_cfg.spec_tokens
        self._chunk_blocks = max(1, ATTN_CHUNK_TOKENS // self.block_size)
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        self._max_blocks = -(-blocks_per_seq // self._chunk_blocks) * self._chunk_blocks
        self._replicated = NamedSharding(self.mesh, P())
        self._kv = self._alloc_kv()
        self._num_compilations = 0
        self._zero_penalties: dict[tuple[int, int], Penalties] = {}
        self.native, why_native = self._native_library()
        self.attention = self._select_attention(why_native)
        self.matmul = attention_select.select_matmul(engine_cfg.matmul_kernel, self.native, why_native, self.mesh)
        self.matmul_precision, self.precision_reason = self._resolve_precision()
        self._params = self._place_params(params_host)
        self.verdicts = self._measure_verdicts()
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
        self._embed = jax.jit(functools.partial(_embed, cfg=cfg, on_trace=self._count))
        self._top_lp = jax.jit(
            functools.partial(_top_logprobs, k=max(1, engine_cfg.max_logprobs), on_trace=self._count)
        )

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

    # ---- placement ----

    def _place_params(self, params_host: dict[str, Any]) -> llama.Params:
        tree = params_host if "layers" in params_host else llama.params_from_hf(params_host, self.model_config)
        shapes = llama.param_shapes(self.model_config, self.dtype)
        if jax.tree.structure(tree) != jax.tree.structure(shapes):
            raise ValueError(f"parameter tree does not match the model layout: {jax.tree.structure(tree)}")
        host = jax.tree.map(lambda x, s: np.asarray(x, dtype=s.dtype), tree, shapes)
        pack = None
        if self.matmul_precision == "high":
            from kernels import cpu_native

            pack = cpu_native.pack_bf16x3
        step = llama.step_params(
            host, self.model_config, self.engine_config.weight_dtype, fused_qkv=self.layout.kv_sharded, pack=pack
        )
        shardings = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s),
            backend.partition_specs(step, self.layout),
            is_leaf=lambda x: isinstance(x, P),
        )
        self.weight_pages, self.weight_pages_reason = "default", "configured"
        if self.engine_config.weight_pages == "default":
            return jax.device_put(step, shardings)
        why = self._huge_pages_unavailable()
        if not why:
            try:
                params, nbytes = weight_pages.place(step, shardings)
            except OSError as e:
                why = str(e)
            else:
                self.weight_pages, self.weight_pages_reason = "huge", f"{nbytes >> 20} MiB advised MADV_HUGEPAGE"
                return params
        self.weight_pages_reason = f"huge configured; default pages: {why}"
        return jax.device_put(step, shardings)

    def _huge_pages_unavailable(self) -> str:
        """Empty when the weights can go on huge pages here (tl/weight_pages.py), else why not."""
        if self.platform != "cpu":
            return f"the {self.platform} backend holds its own memory"
        if self.mesh.size != 1:
            return f"the weights are sharded over {self.mesh.size} devices"
        return weight_pages.unavailable_reason()

    def _resolve_precision(self) -> tuple[str, str]:
        """The float32 matmul precision this runner runs, and why: "high" where configured and the
        native CPU matmul can run it (AMX-BF16, float32 weights and activations), else "highest"."""
        ec = self.engine_config
        if ec.matmul_precision == "highest":
            return "highest", "configured"
        why = ""
        if self.matmul.name != "cpu_native":
            why = f"the matmul is {self.matmul.name} ({self.matmul.reason})"
        elif self.dtype != jnp.float32 or ec.weight_dtype != "float32":
            why = f"dtype {self.dtype.name}, weight_dtype {ec.weight_dtype}: high applies to float32 weights"
        elif self.native is None or not self.native.amx_available():
            why = "no AMX-BF16 on this CPU or build"
        if why:
            return "highest", f"high configured; runs highest: {why}"
        return "high", "configured: bf16x3 on AMX"

    @property
    def kv_storage_dtype(self) -> Any:
        """bf16 KV (a bf16 model, or kv_cache_dtype "bfloat16") is kept as uint16 bits: XLA:CPU
        scatters into bf16 donated buffers by copying."""
        bf16 = self.dtype == jnp.bfloat16 or self.engine_config.kv_cache_dtype == "bfloat16"
        return jnp.uint16 if bf16 else self.dtype

    def _alloc_kv(self) -> tuple[jax.Array, jax.Array]:
        c = self.model_config
        dims = (c.num_hidden_layers, self.num_kv_blocks + 1, self.block_size, c.num_key_value_heads, c.head_dim)
        sh = NamedSharding(self.mesh, self.layout.kv_spec)
        dtype = self.kv_storage_dtype

        def alloc(kind: str) -> jax.Array:
            return jax.jit(lambda: jnp.zeros(paged_attention.cache_shape(kind, *dims), dtype), out_shardings=sh)()

        return alloc("k"), alloc("v")

    # ---- backend ----

    def _native_library(self) -> tuple[Any, str]:
        """The native CPU library (kernels/select.py native_library), built only where a kernel
        may use it (neither attention_kernel "reference" nor matmul_kernel "xla" everywhere)."""
        ec = self.engine_config
        if ec.attention_kernel not in ("auto", "cpu_native") and ec.matmul_kernel == "xla":
            return None, "configured: attention and matmuls without native kernels"
        return attention_select.native_library(self.platform, ec.native_target)

    def _select_attention(self, why_native: str) -> attention_select.Choice:
        """The paged-attention implementation, tried once at the smallest step shape."""
        c, ec = self.model_config, self.engine_config
        t, s = ec.token_buckets[0], ec.seq_buckets[0]

        def sds(*shape: int, dtype: Any = self.dtype) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype)

        i32 = jnp.int32
        meta = AttnMetadata(
            seq_idx=sds(t, dtype=i32),
            positions=sds(t, dtype=i32),
            start_pos=sds(s, dtype=i32),
            block_tables=sds(s, self._max_blocks, dtype=i32),
            chunk_blocks=self._chunk_blocks,
        )
        k, v = (sds(*x.shape, dtype=x.dtype) for x in self._kv)
        probe = (
            sds(t, c.num_attention_heads, c.head_dim),
            sds(t, c.num_key_value_heads, c.head_dim),
            sds(t, c.num_key_value_heads, c.head_dim),
            k,
            v,
            sds(dtype=i32),
            meta,
        )
        return attention_select.select(
            ec.attention_kernel, self.platform, self.mesh, self.layout.kv_sharded, probe, self.native, why_native
        )

    # ---- kernel verdicts: native or XLA, per step shape ----

    def _verdict_key(self, classes: list[tuple[str, int]]) -> dict[str, Any]:
        """What the verdicts depend on besides the library build and the CPU (tl/verdicts.py)."""
        c, ec = self.model_config, self.engine_config
        return {
            "model": [
                c.hidden_size,
                c.intermediate_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.vocab_size,
            ],
            "dtype": self.dtype.name,
            "weight_dtype": ec.weight_dtype,
            "kv": str(jnp.dtype(self.kv_storage_dtype)),
            "precision": self.matmul_precision,
            "block_size": self.block_size,
            "tp": self.mesh.shape["model"],
            "classes": sorted(classes),
        }

    def _measure_verdicts(self) -> verdicts.Verdicts:
        """Each measured kernel's classes (tl/verdicts.py), from the cache beside the library or
        timed now at this model's shapes over its own weights and KV cache."""
        ec = self.engine_config
        classes: list[tuple[str, int]] = []
        if self.matmul.measured:
            top = ec.token_buckets[-1]
            rows = sorted({min(r, top) for r in verdicts.MATMUL_ROWS})
            if self.matmul_precision == "high" and top > rows[-1]:
                rows.append(top)  # the AMX kernel takes any row count
            classes += [("matmul", r) for r in rows]
        attn = {}
        if self.attention.measured:
            attn = {
                t: decode
                for t, decode in verdicts.attention_classes(
                    ec.token_buckets, ec.max_num_seqs, ec.max_num_batched_tokens
                )
            }
            classes += [("attention", t) for t in attn]
        if not classes:
            return verdicts.Verdicts()
        assert self.native is not None
        c = self.model_config
        layers = verdicts.stream_layers(self._params["layers"])

        def prepare(kernel: str, rows: int) -> verdicts.Timed:
            if kernel == "matmul":
                # One row streams the weights (a chain past the cache); more rows are compute-bound.
                return verdicts.matmul_case(
                    layers if rows == 1 else layers[:1],
                    self._lm_head(),
                    self.matmul.fn,
                    rows,
                    llama.linear,
                    self.matmul.argmax_lse,
                )
            case = verdicts.attention_case(
                rows,
                attn[rows],
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                self._kv[0],
                self._chunk_blocks,
                self._max_blocks,
                self.dtype,
            )
            return verdicts.attention_timed(
                self.attention.fn, paged_attention.paged_attention, case, *self._kv, layers=2
            )

        key = self._verdict_key(classes)
        return verdicts.measure(verdicts.cache_path(self.native.path, key), key, classes, prepare)

    def _lm_head(self) -> Any:
        """The LM head as llama.linear takes it ([V,D]: the tied embedding, or lm_head; "high"
        precision's packed copy beside it)."""
        p = self._params
        w = p["embed"] if self.model_config.tie_word_embeddings else p["lm_head"]
        return {"f32": w, "bf16x3": p["lm_head_bf16x3"]} if "lm_head_bf16x3" in p else w

    def _dispatch(self) -> tuple[Any, Any, Any]:
        """(attention, matmul, argmax_lse) for the step: where a kernel was measured, each step
        shape takes the verdict's pick (kernels/select.py per_shape); else the choice as made."""
        v = self.verdicts
        attention = self.attention.fn
        if self.attention.measured:
            attention = attention_select.per_shape(
                lambda t: v.native("attention", t), attention, paged_attention.paged_attention
            )
        matmul, argmax_lse = self.matmul.fn, self.matmul.argmax_lse
        if self.matmul.measured and matmul is not None and argmax_lse is not None:
            matmul = attention_select.per_shape(lambda n: v.native("matmul", n), matmul, _no_native)
            argmax_lse = attention_select.per_shape(lambda n: v.native("matmul", n), argmax_lse, sampler_argmax_lse)
        return attention, matmul, argmax_lse

    @property
    def kernel_lines(self) -> list[str]:
        """The kernel choices for the start-up log: each measured class with its ratio."""
        return [v.line() for v in self.verdicts.verdicts]

    @property
    def backend_info(self) -> BackendInfo:
        devices = self.mesh.devices.flat
        return BackendInfo(
            platform=self.platform,
            device_kind=next(iter(devices)).device_kind,
            device_count=self.mesh.devices.size,
            tensor_parallel=self.mesh.shape["model"],
            process_count=jax.process_count(),
            dtype=self.dtype.name,
            kv_cache_dtype="bfloat16" if self.kv_storage_dtype == jnp.uint16 else self.dtype.name,
            attention_kernel=self._attention_summary(),
            matmul_precision=self.matmul_precision,
            matmul_kernel=self._matmul_summary(),
            native_target=self.native.target.name if "cpu_native" in (self.attention.name, self.matmul.name) else "",
            kernel_choices=tuple(self.kernel_lines),
            kv_heads="sharded" if self.layout.kv_sharded else "replicated",
        )

    def _attention_summary(self) -> str:
        if not self.attention.measured:
            return self.attention.name
        return self.verdicts.summary("attention", self.attention.name, "reference")

    def _matmul_summary(self) -> str:
        if not self.matmul.measured:
            return self.matmul.name
        return self.verdicts.summary("matmul", "cpu_native", "xla")

    @property
    def kv_cache(self) -> tuple[jax.Array, jax.Array]:
        """The current (k, v) device buffers; each step donates them and installs new ones."""
        return self._kv

    @property
    def num_compilations(self) -> int:
        """Traced variants of the step, top-logprob and embed functions (one trace = one compile)."""
        return self._num_compilations

    def _count(self) -> None:
        self._num_compilations += 1

    # ---- one step ----

    def num_rows(self, t_pad: int, s_pad: int) -> int:
        return min(s_pad * (1 + self._spec_tokens), t_pad)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if not plan.work:
            return RunnerOutput(())
        rows, out, logits, pooled = self._forward(plan)
        return self._results(rows, out, logits, pooled)

    def logits(self, plan: SchedulerOutput) -> np.ndarray:
        """The float32 logits [sample rows, V] of a non-empty plan, run as `execute` runs it (its
        keys written to the cache); for quality checks (bench/quant_bench.py)."""
        rows, _, logits, _ = self._forward(plan)
        return np.asarray(logits)[: sum(1 + k for _, _, k in rows.spans)]

    def _forward(self, plan: SchedulerOutput) -> tuple[_Rows, SampleOut, jax.Array, jax.Array]:
        ec = self.engine_config
        t_pad = _bucket(plan.num_tokens, ec.token_buckets, "step tokens")
        s_pad = _bucket(len(plan.work), ec.seq_buckets, "step sequences")
        inp, rows = self._pack_tokens(plan.work, t_pad, s_pad)
        sb, pen = self._pack_sampling(rows, s_pad, self.num_rows(t_pad, s_pad))
        self._kv, out, logits, pooled = self._run_step(inp, sb, pen)
        return rows, out, logits, pooled

    def _run_step(
        self, inp: StepInputs, sb: SamplingBatch, pen: Penalties
    ) -> tuple[Any, SampleOut, jax.Array, jax.Array]:
        # The host buffers go in as numpy arrays: the jitted call's own transfer (C++) took ~0.6 ms
        # less a step than a jax.device_put of them first (one-row decode, alternated).
        bufs, layout = _to_host_buffers((inp, sb))
        return self._step(self._params, self._kv, bufs, pen, layout=layout)

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
        )  # type: ignore[arg-type]
        return inp, _Rows(tuple(spans), tuple(pools))

    def _pack_sampling(self, rows: _Rows, s_pad: int, num_rows: int) -> tuple[SamplingBatch, Penalties]:
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
            return sb, self._no_penalties(s_pad, num_rows)
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
        return sb, jax.device_put(pen, self._replicated)

    def _no_penalties(self, s_pad: int, num_rows: int) -> Penalties:
        """Device-resident all-zero penalties per shape, so penalty-free steps copy nothing."""
        key = (s_pad, num_rows)
        if key not in self._zero_penalties:
            pen = pack_penalties(
                [], [], [], [], s_pad, num_rows, max(1, self._spec_tokens), self.model_config.vocab_size
            )
            self._zero_penalties[key] = jax.device_put(pen, self._replicated)
        return self._zero_penalties[key]

    def _results(self, rows: _Rows, out: SampleOut, logits: jax.Array, pooled: jax.Array) -> RunnerOutput:
        token, logprob, accepted = jax.device_get((out.token, out.logprob, out.accepted))
        top_ids = top_vals = None
        if self.engine_config.max_logprobs and any(w.params.top_logprobs for w, _, _ in rows.spans):
            top_ids, top_vals = jax.device_get(self._top_lp(logits))
        results = []
        for w, r, k in rows.spans:
            n_acc = 0
            while n_acc < k and accepted[r + n_acc]:
                n_acc += 1
            sl = slice(r, r + n_acc + 1)
            tops: tuple[tuple[tuple[int, float], ...], ...] = ()
            n_top = min(w.params.top_logprobs, self.engine_config.max_logprobs)
            if n_top and top_ids is not None and top_vals is not None:
                tops = tuple(
                    tuple(zip(top_ids[i, :n_top].tolist(), top_vals[i, :n_top].tolist(), strict=True))
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
        return RunnerOutput(tuple(results))

    # ---- warm-up and embeddings ----

    def bucket_pairs(self) -> list[tuple[int, int]]:
        """Every (token bucket, seq bucket) a plan within the engine limits can land in."""
        ec = self.engine_config
        pairs = set()
        top = _bucket(ec.max_num_batched_tokens, ec.token_buckets, "max_num_batched_tokens")
        for t in ec.token_buckets[: ec.token_buckets.index(top) + 1]:
            for s in range(1, min(t, ec.max_num_seqs) + 1):
                pairs.add((t, _bucket(s, ec.seq_buckets, "sequences")))
        return sorted(pairs)

    def warmup(self) -> None:
        """Compile (and run on padding only) every step variant, so serving never compiles."""
        wants_top = self.engine_config.max_logprobs > 0
        for t_pad, s_pad in self.bucket_pairs():
            inp, rows = self._pack_tokens([], t_pad, s_pad)
            sb, pen = self._pack_sampling(rows, s_pad, self.num_rows(t_pad, s_pad))
            self._kv, out, logits, _ = self._run_step(inp, sb, pen)
            if wants_top:
                self._top_lp(logits)
        jax.block_until_ready(self._kv)

    def embed(self, token_ids: Sequence[int]) -> list[float]:
        """One input alone through the dense forward, no cache: the reference the scheduled
        pooling (the step's `pooled` output) is tested against; serving never calls it."""
        n = len(token_ids)
        if not 0 < n <= self.max_model_len:
            raise ValueError(f"embedding input of {n} tokens; need 1..{self.max_model_len}")
        buckets = self.engine_config.token_buckets
        t_pad = buckets[bisect_left(buckets, n)] if n <= buckets[-1] else 1 << (n - 1).bit_length()
        ids = np.zeros(t_pad, np.int32)
        ids[:n] = token_ids
        ids_d, n_d = jax.device_put((ids, np.int32(n)), self._replicated)
        return np.asarray(self._embed(self._params, ids_d, n_d)).tolist()
