"""The execution plan: every backend decision of one runner, made in one place at start-up.

Owns: `ExecutionPlan` (frozen: platform, compute dtype, KV-cache storage, attention kernel,
layer matmul kernel, float32 matmul precision, weight placement, each with its reason; the
callables those choices name; the native kernels' verdicts and the step's dispatch resolved
from them (`StepKernels`: one implementation a kernel slot, at every step shape); the token and
sequence buckets, every compiled step variant and the ones compiled before the server is ready)
and `plan_execution`, the function that makes it from the `EngineConfig`, the platform (mesh,
tensor-parallel layout, the native library or why not) and, once measured, the kernel verdicts
(tl/runtime/measure_classes.py's record, measured by tl/runtime/verdicts.py) and the weight
placement's outcome (tl/runtime/placement.py): both come in through `measured`, called by the
start-up pipeline (tl/runtime/startup.py). Every other module reads the plan: the step is traced
from its dispatch, the start-up log prints `lines()`, /v1/models and tl_engine_backend_info show
`backend_info()`.
Must not: place data, compile steps, measure. Tested by tests/runtime/test_execution.py.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kernels import cpu_build, paged_attention
from kernels import select as kernel_select
from kernels.paged_attention import AttnArgs, AttnMetadata
from tl.core.config import ConfigError, EngineConfig
from tl.core.stats import BackendInfo
from tl.model.config import ModelConfig
from tl.runtime import backend, weight_pages
from tl.runtime.measure_classes import MATMUL_ROWS, Verdicts

if TYPE_CHECKING:
    from kernels.cpu_native import NativeLib

ATTN_CHUNK_TOKENS = 128  # keys per iteration of the cached-attention loop (rounded to whole blocks)


@dataclass(frozen=True, slots=True)
class Decision:
    """One choice of the plan and why it was made."""

    value: str
    reason: str


@dataclass(frozen=True, slots=True)
class Kernels:
    """The callables each choice of the plan names (jax functions), as chosen before measurement."""

    native: NativeLib | None
    attention: kernel_select.Choice
    matmul: kernel_select.MatmulChoice


@dataclass(frozen=True, slots=True)
class StepKernels:
    """What the step calls in each kernel slot, resolved once the verdicts are in: where a kernel
    was measured, its verdict's implementation at every step shape; else the choice as made."""

    attention: Callable[..., Any]
    matmul: Callable[..., Any] | None  # None: XLA's dot
    argmax_lse: Callable[..., Any] | None  # None: jnp's


def bucket(n: int, buckets: Sequence[int], what: str) -> int:
    """The smallest bucket >= n."""
    i = bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class ExecutionPlan:
    platform: Decision
    dtype: Decision  # the compute dtype's name
    tensor_parallel: int
    kv_heads: Decision  # "sharded" over the model axis, or "replicated"
    kv_storage: Decision  # what the KV cache holds: float32, or bfloat16 (kept as uint16 bits)
    attention: Decision  # the paged-attention implementation (kernels/select.py)
    matmul: Decision  # the layers' matmul: "xla" or "cpu_native"
    precision: Decision  # float32 matmuls: "highest", or "high" (bf16x3 on AMX)
    weight_pages: Decision  # "huge" (one mapping advised MADV_HUGEPAGE) or "default"
    weight_layout: Decision  # "panels" (q8_0 / q4_0 / q4_1 repacked for the native kernels) or "stored"
    native_target: str  # the native library's build where a kernel uses it, else ""
    weight_dtype: str  # "float32", "int8" or "q8_0" linears (configured)
    block_size: int
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    variants: tuple[tuple[int, int], ...]  # every (token bucket, seq bucket) a step can land in
    startup_variants: tuple[tuple[int, int], ...]  # compiled before ready; the rest in the background
    chunk_blocks: int  # KV blocks per cached-attention iteration
    max_blocks: int  # block-table width (whole chunks covering max_model_len)
    kernels: Kernels  # the callables the choices above name
    verdicts: Verdicts = dataclasses.field(default_factory=Verdicts)
    matmul_measured: bool = False
    step_kernels: StepKernels | None = None  # the dispatch the step traces; set by `measured`

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype.value)

    @property
    def kv_dtype(self) -> Any:
        """The cache buffers' element type: bf16 is stored as uint16 bits (XLA:CPU scatters into a
        donated bf16 buffer by copying it)."""
        return jnp.dtype(jnp.uint16) if self.kv_storage.value == "bfloat16" else self.compute_dtype

    def shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The (token bucket, seq bucket) a step of num_tokens tokens over num_seqs sequences
        needs: the smallest of each that holds it."""
        return bucket(num_tokens, self.token_buckets, "step tokens"), bucket(
            num_seqs, self.seq_buckets, "step sequences"
        )

    def measure_classes(self) -> list[tuple[str, int]]:
        """(kernel, rows) of every class whose kernel is chosen by measurement: the matmul's row
        classes up to the largest token bucket (a native kernel takes any row count)."""
        classes: list[tuple[str, int]] = []
        if self.matmul_measured:
            top = self.token_buckets[-1]
            classes += [("matmul", r) for r in sorted({min(r, top) for r in (*MATMUL_ROWS, top)})]
        return classes

    def measured(self, v: Verdicts, pages: str, pages_reason: str) -> ExecutionPlan:
        """The plan completed by the measured verdicts and the weight placement's outcome, with
        the step's dispatch resolved from them."""
        k = self.kernels
        attention, matmul, argmax_lse = k.attention.fn, k.matmul.fn, k.matmul.argmax_lse
        if self.matmul_measured and not v.native("matmul"):
            matmul, argmax_lse = None, None
        return dataclasses.replace(
            self,
            verdicts=v,
            weight_pages=Decision(pages, pages_reason),
            step_kernels=StepKernels(attention, matmul, argmax_lse),
        )

    def summary(self, kernel: str) -> str:
        """A kernel's implementation as run: one name, or "native+other" where classes differ."""
        if kernel == "attention":
            return self.attention.value
        if not self.matmul_measured:
            return self.matmul.value
        return self.verdicts.summary("matmul", "cpu_native", "xla")

    def decision_lines(self) -> list[str]:
        """One line a decision, with its reason."""
        return [
            f"platform {self.platform.value} ({self.platform.reason}), tensor_parallel {self.tensor_parallel}"
            f" (KV heads {self.kv_heads.value}: {self.kv_heads.reason})",
            f"dtype {self.dtype.value} ({self.dtype.reason});"
            f" KV cache {self.kv_storage.value} ({self.kv_storage.reason})",
            f"attention: {self.summary('attention')} ({self.attention.reason})",
            f"layer matmuls: {self.summary('matmul')} ({self.matmul.reason}), precision {self.precision.value}"
            f" ({self.precision.reason})",
            f"weight pages: {self.weight_pages.value} ({self.weight_pages.reason});"
            f" block weights {self.weight_layout.value} ({self.weight_layout.reason})",
            f"buckets: tokens {list(self.token_buckets)}, sequences {list(self.seq_buckets)}: {len(self.variants)}"
            f" step variants, {len(self.startup_variants)} compiled before ready {list(self.startup_variants)}",
        ]

    def lines(self) -> list[str]:
        """The start-up log: the decisions, then each measured class."""
        out = self.decision_lines()
        if self.verdicts.verdicts:
            cpu = cpu_build.cpu_model()
            out.append(f"native kernels ({self.native_target} build, {cpu}): verdicts {self.verdicts.source}")
            out += [f"  {v.line()}" for v in self.verdicts.verdicts]
        return out

    def backend_info(self, mesh: Mesh) -> BackendInfo:
        return BackendInfo(
            platform=self.platform.value,
            device_kind=next(iter(mesh.devices.flat)).device_kind,
            device_count=mesh.devices.size,
            tensor_parallel=self.tensor_parallel,
            process_count=jax.process_count(),
            dtype=self.dtype.value,
            kv_cache_dtype=self.kv_storage.value,
            attention_kernel=self.summary("attention"),
            matmul_precision=self.precision.value,
            matmul_kernel=self.summary("matmul"),
            native_target=self.native_target,
            kernel_choices=tuple(v.line() for v in self.verdicts.verdicts),
            kv_heads=self.kv_heads.value,
            weight_pages=self.weight_pages.value,
            reasons=tuple(self.decision_lines()),
        )


def step_variants(ec: EngineConfig) -> tuple[tuple[int, int], ...]:
    """Every (token bucket, seq bucket) a plan within the engine limits can land in."""
    pairs = set()
    top = bucket(ec.max_num_batched_tokens, ec.token_buckets, "max_num_batched_tokens")
    for t in ec.token_buckets[: ec.token_buckets.index(top) + 1]:
        for s in range(1, min(t, ec.max_num_seqs) + 1):
            pairs.add((t, bucket(s, ec.seq_buckets, "sequences")))
    return tuple(sorted(pairs))


def startup_variants(variants: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """What is compiled before ready: the smallest variant (one sequence decoding) and the
    largest (every step fits it: a step whose own variant is not compiled yet runs in the
    smallest compiled one that holds it)."""
    return tuple(sorted({min(variants), max(variants)}))


def _huge_pages(ec: EngineConfig, platform: str, mesh: Mesh) -> Decision:
    if ec.weight_pages == "default":
        return Decision("default", "configured")
    why = ""
    if platform != "cpu":
        why = f"the {platform} backend holds its own memory"
    elif mesh.size != 1:
        why = f"the weights are sharded over {mesh.size} devices"
    else:
        why = weight_pages.unavailable_reason()
    return Decision("default", f"huge configured; default pages: {why}") if why else Decision("huge", "configured")


def _weight_layout(
    ec: EngineConfig, matmul: kernel_select.MatmulChoice, native: NativeLib | None, mesh: Mesh
) -> Decision:
    """ "panels" where the layer matmuls run the native kernels of a build with the panel kernels,
    on one device (a panel holds 16 whole outputs: a tensor-parallel split of the outputs would
    cut them); "stored" otherwise or as configured."""
    if ec.weight_layout == "stored":
        return Decision("stored", "configured")
    if matmul.name != "cpu_native" or native is None:
        why = "the layer matmuls are XLA's"
    elif not native.panels_built():
        why = f"the {native.target.name} build has no panel kernels (AVX-512 VNNI)"
    elif mesh.devices.size > 1:
        why = f"{mesh.devices.size} devices: panels are packed for one"
    else:
        return Decision(
            "panels", "configured" if ec.weight_layout == "panels" else "auto: the native kernels read them"
        )
    return Decision(
        "stored", f"{ec.weight_layout} configured; {why}" if ec.weight_layout == "panels" else f"auto: {why}"
    )


def _precision(ec: EngineConfig, dtype: str, matmul: kernel_select.MatmulChoice, native: NativeLib | None) -> Decision:
    """ "high" where configured and the native CPU matmul can run it (AMX-BF16, float32 weights
    and activations), else "highest"."""
    if ec.matmul_precision == "highest":
        return Decision("highest", "configured")
    why = ""
    if matmul.name != "cpu_native":
        why = f"the matmul is {matmul.name} ({matmul.reason})"
    elif dtype != "float32" or ec.weight_dtype != "float32":
        why = f"dtype {dtype}, weight_dtype {ec.weight_dtype}: high applies to float32 weights"
    elif native is None or not native.amx_available():
        why = "no AMX-BF16 on this CPU or build"
    if why:
        return Decision("highest", f"high configured; runs highest: {why}")
    return Decision("high", "configured: bf16x3 on AMX")


def _attention_probe(
    cfg: ModelConfig, ec: EngineConfig, dtype: Any, kv_dtype: Any, chunk_blocks: int, max_blocks: int
) -> AttnArgs:
    """ShapeDtypeStructs of one attention call at the smallest step shape (the kernel's trial)."""
    t, s = ec.token_buckets[0], ec.seq_buckets[0]
    i32 = jnp.int32

    def sds(*shape: int, dt: Any = dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dt)

    meta = AttnMetadata(
        seq_idx=sds(t, dt=i32),
        positions=sds(t, dt=i32),
        start_pos=sds(s, dt=i32),
        block_tables=sds(s, max_blocks, dt=i32),
        chunk_blocks=chunk_blocks,
    )
    dims = (cfg.num_hidden_layers, ec.num_kv_blocks + 1, ec.block_size, cfg.num_key_value_heads, cfg.head_dim)
    k, v = (sds(*paged_attention.cache_shape(kind, *dims), dt=kv_dtype) for kind in ("k", "v"))
    hq, hk, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return AttnArgs(sds(t, hq, hd), sds(t, hk, hd), sds(t, hk, hd), k, v, sds(dt=i32), meta)


def kv_storage_of(ec: EngineConfig, dtype: str) -> Decision:
    """What the KV cache holds, and why: bfloat16 (kept as uint16 bits) when kv_cache_dtype or the
    compute dtype says so, float32 when kv_cache_dtype asks for it (a float32 model only), else
    the compute dtype."""
    if ec.kv_cache_dtype == "float32":
        if dtype != "float32":
            raise ConfigError(f'kv_cache_dtype = "float32" needs dtype float32; the compute dtype here is {dtype}')
        return Decision("float32", "kv_cache_dtype float32")
    if ec.kv_cache_dtype == "bfloat16":
        return Decision("bfloat16", "kv_cache_dtype bfloat16")
    return Decision(dtype, "the compute dtype")


def plan_execution(
    ec: EngineConfig, cfg: ModelConfig, platform: str, mesh: Mesh, layout: backend.TPLayout
) -> ExecutionPlan:
    """The plan before measurement (verdicts empty; weight pages as intended; its kernels chosen,
    the step's dispatch not resolved yet). `ExecutionPlan.measured` completes it once the weights
    are placed and the classes of `measure_classes()` are timed."""
    dtype = backend.resolve_dtype(ec.dtype, platform)
    dtype_why = "configured" if ec.dtype != "auto" else f"auto on {platform}"
    kv_storage = kv_storage_of(ec, dtype)
    if ec.attention_kernel not in ("auto", "cpu_native") and ec.matmul_kernel == "xla":
        native, why_native = None, "configured: attention and matmuls without native kernels"
    else:
        native, why_native = kernel_select.native_library(
            platform, ec.native_target, cache_dir=ec.native_cache_dir, cxx=ec.native_cxx
        )
    chunk_blocks = max(1, ATTN_CHUNK_TOKENS // ec.block_size)
    max_model_len = ec.max_model_len or cfg.max_position_embeddings
    blocks_per_seq = -(-max_model_len // ec.block_size)
    max_blocks = -(-blocks_per_seq // chunk_blocks) * chunk_blocks
    kv_dtype = jnp.uint16 if kv_storage.value == "bfloat16" else jnp.dtype(dtype)
    probe = _attention_probe(cfg, ec, jnp.dtype(dtype), kv_dtype, chunk_blocks, max_blocks)
    windows = tuple(sorted({cfg.window(i) for i in range(cfg.num_hidden_layers)} - {0}))
    attention = kernel_select.select(
        ec.attention_kernel, platform, mesh, layout.kv_sharded, probe, native, why_native, windows=windows
    )
    matmul = kernel_select.select_matmul(ec.matmul_kernel, native, why_native, mesh)
    tp = mesh.shape["model"]
    kv_heads = (
        Decision("sharded", f"{cfg.num_key_value_heads} KV heads over tensor_parallel {tp}")
        if layout.kv_sharded
        else Decision("replicated", f"tensor_parallel {tp} does not divide {cfg.num_key_value_heads} KV heads")
    )
    uses_native = native is not None and "cpu_native" in (attention.name, matmul.name)
    variants = step_variants(ec)
    plan = ExecutionPlan(
        platform=Decision(platform, "configured" if ec.backend != "auto" else "auto: the best platform present"),
        dtype=Decision(dtype, dtype_why),
        tensor_parallel=tp,
        kv_heads=kv_heads,
        kv_storage=kv_storage,
        attention=Decision(attention.name, attention.reason),
        matmul=Decision(matmul.name, matmul.reason),
        precision=_precision(ec, dtype, matmul, native),
        weight_pages=_huge_pages(ec, platform, mesh),
        weight_layout=_weight_layout(ec, matmul, native, mesh),
        native_target=native.target.name if uses_native and native is not None else "",
        weight_dtype=ec.weight_dtype,
        block_size=ec.block_size,
        token_buckets=ec.token_buckets,
        seq_buckets=ec.seq_buckets,
        variants=variants,
        startup_variants=startup_variants(variants),
        chunk_blocks=chunk_blocks,
        max_blocks=max_blocks,
        kernels=Kernels(native, attention, matmul),
        matmul_measured=matmul.measured,
    )
    return plan
