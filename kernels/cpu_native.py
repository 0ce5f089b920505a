"""Native CPU kernels (C++, XLA FFI): paged attention, matmuls, argmax.

Owns: loading one built target's library (kernels/cpu_build.py builds it) and registering its
FFI targets under names that carry the target, so that several builds live in one process (the
tests run every build this CPU runs); and, per library (`NativeLib`), the calls with their
contracts: `paged_attention` with the reference's contract (each token as a decode of its own),
the matmuls over arrays, each saying
by None what it does not take (`gemv`: float32, up to max_rows() rows; `gemv_int8`: one row of
W8A8; `qgemm`: up to qgemm_max_rows(kind) rows over ggml's q8_0 / q4_0 / q4_1 / q5_0 / q5_1 blocks
and q4_k / q5_k / q6_k super-blocks as a GGUF stores them; `gemv_half`: up to gemv_half_max_rows(kind) rows
over 16-bit float weights, f16 or bf16, widened as they stream (bf16 on AVX512-BF16: vdpbf16ps);
`matmul_bf16x3`: three bf16 products on AMX over weights `pack_bf16x3` packed at load,
matmul_precision "high"), `matmul` (a weight that says which of them runs it, `NativeLinear`,
at any row count: a call past a kernel's rows in runs of RUN_ROWS; None: the caller's own dot)
and `argmax_lse` (the sampler's
greedy token and logsumexp of each logits row in one pass).
Must not: write the cache, know about requests or the model's weight types (kernels/ imports
nothing from tl), decide when a kernel is worth calling (tl/runtime/verdicts.py measures that).
Tested by tests/kernels/test_cpu_native.py against the jnp reference, float64 products, XLA's int8 dot
and jnp's argmax/logsumexp, once per build.

Why one arithmetic for every token (`paged_attention`): each token is computed as a decode of its
own, by the one-call kernel over metadata that makes it a sequence of one (its keys before it
read from the cache, where the forward wrote this step's keys first; its own from k_new), so a
token's result depends on its sequence's keys alone: not on the step's size, its place in the
step, or how much of its prompt came from the prefix cache or an earlier chunk (issue 48: the
tiled local part and the cached part, merged, summed a prompt token's keys in an order set by
where its chunk began, and the quantized model's int8 activations turned those last-bit
differences into other answers). The kernel reads each block where it lies, keeps an online
softmax per (token, KV head) and splits a token's blocks into runs by its own context alone,
work items over both threads. What it cost against the tiled local part: docs/bench/
batch-invariance.md.

Why the few-row matmul: XLA:CPU runs a matrix-vector product on one thread and few-row
products far below the FMA units' rate; kernels/cpu/matmul.cc says how the native one is
blocked for each target's registers. After a one-row matmul its helper thread lingers,
spinning up to 50 us for the next one (kernels/cpu/threads.h says why): a one-row decode step
1.01-1.03x in the runner, 1.045x over HTTP (AVX-512).

Sliding windows (`AttnMetadata.window` > 0): every call takes the window as an FFI attribute;
the kernels skip the blocks and key chunks before a token's window and mask the rest.

float32 caches, and bf16 ones (uint16 bits: a bf16 model, or kv_cache_dtype "bfloat16") for the
shapes of the vector fold (`bf16_supported`); other bf16 shapes raise NativeUnavailable, and
kernels/select.py falls back to the reference with that reason.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from kernels import cpu_build
from kernels.cpu_build import NativeUnavailable
from kernels.paged_attention import AttnArgs, AttnMetadata, grouped_query

__all__ = [
    "NativeLib",
    "NativeLinear",
    "NativeUnavailable",
    "QUANT_KINDS",
    "library",
    "amx_available",
    "pack_bf16x3",
    "bf16_supported",
]

RUN_ROWS = 64  # a matmul of more rows than its kernel takes runs in slices of this many (each few-row kernel
# takes 64; int8's takes one row, with XLA's own arithmetic, which then runs the rest)
HANDLERS = {  # FFI target base name -> the library's handler symbol
    "tl_small_attention": "TlSmallAttention",
    "tl_small_attention_bf16": "TlSmallAttentionBf16",
    "tl_gemv": "TlGemv",
    "tl_gemv_int8": "TlGemvInt8",
    "tl_gemm_bf16x3": "TlGemmBf16x3",
    "tl_argmax_lse": "TlArgmaxLse",
    "tl_qgemm": "TlQGemm",
    "tl_qgemm_panels": "TlQGemmPanels",
    "tl_gemv_half": "TlGemvHalf",
}
PANEL_KINDS = ("q8_0", "q4_0", "q4_1")  # the kinds quant_ffi.cc's TlQGemmPanels reads repacked
HALF_KINDS = {"f16": 0, "bf16": 1}  # half.cc's kind of a 16-bit float format
QUANT_KINDS = {  # ggml block format -> (quant.h Kind, bytes a block, weights a block)
    "q8_0": (0, 34, 32),
    "q4_0": (1, 18, 32),
    "q4_1": (2, 20, 32),
    "q5_0": (3, 22, 32),
    "q5_1": (4, 24, 32),
    "q4_k": (5, 144, 256),
    "q5_k": (6, 176, 256),
    "q6_k": (7, 210, 256),
}


class NativeLinear(Protocol):
    """A linear weight that says which of a library's kernels runs it (each encoding of
    tl/model/encodings/ does): x [N,K] float32 -> [N,*out], or None for the caller's own dot."""

    def native(self, lib: NativeLib, x: jax.Array, /) -> jax.Array | None: ...


class NativeLib:
    """One target's built library with its FFI targets registered (kernels/cpu_build.py TARGETS)."""

    def __init__(self, target: cpu_build.Target, *, cache_dir: str = "", cxx: str = "") -> None:
        """Build (kernels/cpu_build.py `build`: into `cache_dir`, by `cxx`) and load `target`'s library."""
        self.target = target
        self.path = cpu_build.build(target, cache_dir=cache_dir, cxx=cxx)
        lib = self._lib = ctypes.cdll.LoadLibrary(str(self.path))
        lib.TlGemvMaxRows.restype = ctypes.c_int64
        lib.TlQGemmMaxRows.restype = ctypes.c_int64
        lib.TlQGemmPanelsBuilt.restype = ctypes.c_int64
        lib.TlGemvHalfMaxRows.restype = ctypes.c_int64
        lib.TlAmxAvailable.restype = ctypes.c_int64
        suffix = "_" + target.name.replace("-", "_")
        self.ffi_names = {base: base + suffix for base in HANDLERS}
        for base, symbol in HANDLERS.items():
            jax.ffi.register_ffi_target(self.ffi_names[base], jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")

    def __repr__(self) -> str:
        return f"NativeLib({self.target.name})"

    def max_rows(self) -> int:
        """Rows the native float matmul takes (matmul.cc kGemmRows)."""
        return int(self._lib.TlGemvMaxRows())

    def qgemm_max_rows(self, kind: str) -> int:
        """Rows the native quantized matmul takes of a QUANT_KINDS kind (quant_ffi.cc max_rows: any
        count where this build has the panel kernel for it, else 64)."""
        return int(self._lib.TlQGemmMaxRows(ctypes.c_int32(QUANT_KINDS[kind][0])))

    def panels_built(self) -> bool:
        """Whether this build has the kernels of weights repacked into panels (quant_ffi.cc
        TlQGemmPanels: AVX-512 VNNI builds); elsewhere the engine keeps the stored rows."""
        return bool(self._lib.TlQGemmPanelsBuilt())

    def gemv_half_max_rows(self, kind: str) -> int:
        """Rows the native 16-bit float matmul takes of a HALF_KINDS kind (half.cc max_rows: any
        count for bf16 where this build has AVX512-BF16's vdpbf16ps, else 64)."""
        return int(self._lib.TlGemvHalfMaxRows(ctypes.c_int32(HALF_KINDS[kind])))

    def amx_available(self) -> bool:
        """Whether this build and process can run AMX-BF16 (the CPU has it, the build has it, and
        Linux granted the tile state): the precondition of matmul_precision "high"."""
        return bool(self._lib.TlAmxAvailable())

    def set_linger_us(self, us: float) -> None:
        """How long a helper thread of the one-row matmul spins for the next one (threads.h;
        default 50 us, 0 = off): for benchmarks that compare values."""
        self._lib.TlSetLingerNs(ctypes.c_int64(int(us * 1000)))

    def _call(self, base: str, out: Any) -> Any:
        return jax.ffi.ffi_call(self.ffi_names[base], out)

    def matmul_bf16x3(self, x: jax.Array, packed: jax.Array, out: tuple[int, ...]) -> jax.Array:
        """x [N,K] float32 times the weights `pack_bf16x3` packed -> [N,*out] at "high" precision."""
        y = jax.ShapeDtypeStruct((x.shape[0], math.prod(out)), jnp.float32)
        return self._call("tl_gemm_bf16x3", y)(x.astype(jnp.float32), packed).reshape(x.shape[0], *out)

    def gemv(self, x: jax.Array, w: jax.Array) -> jax.Array | None:
        """float32 x [N,K] times float32 w [*out,K] -> [N,*out] by the few-row kernel; None where it
        does not take them (more than max_rows() rows, another dtype)."""
        if x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.shape[0] > self.max_rows():
            return None
        out = jax.ShapeDtypeStruct((x.shape[0], *w.shape[:-1]), jnp.float32)
        return self._call("tl_gemv", out)(x, w)

    def gemv_int8(self, x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array | None:
        """float32 x [1,K] times int8 q [*out,K] with float32 scale [*out] per output -> [1,*out],
        XLA's W8A8 arithmetic bit for bit; None for more rows or other dtypes (one row only:
        XLA's int8 dot pads to 4 rows and is faster from 2 rows on)."""
        if x.dtype != jnp.float32 or x.shape[0] > 1 or q.dtype != jnp.int8 or scale.dtype != jnp.float32:
            return None
        out = jax.ShapeDtypeStruct((x.shape[0], *q.shape[:-1]), jnp.float32)
        return self._call("tl_gemv_int8", out)(x, q, scale)

    def qgemm(self, x: jax.Array, w: jax.Array, kind: str) -> jax.Array | None:
        """float32 x [N,K] times uint8 w [*out, row_bytes], each output's row the raw ggml blocks of
        its K weights as a GGUF stores them (`kind`: a QUANT_KINDS key) -> float32 [N,*out], with
        llama.cpp's arithmetic (x quantized to int8 per block of 32, or 256 for the K-quants,
        integer block dots, float scaling; kernels/cpu/quant.h). None where it does not take the
        call: another kind or dtype, more than qgemm_max_rows(kind) rows, K not a multiple of the
        block's weights (32, 256) or rows not K / that many blocks."""
        if kind not in QUANT_KINDS or x.dtype != jnp.float32 or w.dtype != jnp.uint8 or x.ndim != 2 or w.ndim < 2:
            return None
        code, block, size = QUANT_KINDS[kind]
        n, k = x.shape
        if n > self.qgemm_max_rows(kind) or k % size != 0 or w.shape[-1] != k // size * block:
            return None
        out = jax.ShapeDtypeStruct((n, *w.shape[:-1]), jnp.float32)
        return self._call("tl_qgemm", out)(x, w, kind=np.int32(code))

    def qgemm_panels(self, x: jax.Array, w: jax.Array, kind: str) -> jax.Array | None:
        """float32 x [N,K] times uint8 w [panels, K/32, 16 x block bytes], `kind`'s blocks repacked
        16 outputs a panel (tl/model/encodings/panels.py) -> float32 [N, 16 panels], the stored
        kernel's arithmetic and results bit for bit (kernels/cpu/quant_ffi.cc TlQGemmPanels). None where
        it does not take the call: a build without the panel kernels, a kind other than q8_0,
        q4_0, q4_1, or shapes that do not match."""
        if not self.panels_built() or kind not in PANEL_KINDS or x.dtype != jnp.float32 or w.dtype != jnp.uint8:
            return None
        code, block, size = QUANT_KINDS[kind]
        if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] * size or w.shape[2] != 16 * block:
            return None
        out = jax.ShapeDtypeStruct((x.shape[0], 16 * w.shape[0]), jnp.float32)
        return self._call("tl_qgemm_panels", out)(x, w, kind=np.int32(code))

    def gemv_half(self, x: jax.Array, w: jax.Array, kind: str) -> jax.Array | None:
        """float32 x [N,K] times uint8 w [*out, 2K], each output's K weights as IEEE half ("f16")
        or bfloat16 ("bf16") bytes -> float32 [N,*out]: the weights widened exactly, float32
        products and sums; bf16 on AVX512-BF16 builds x rounded to bfloat16 and vdpbf16ps, as
        llama.cpp (kernels/cpu/half.cc). None where it does not take the call: another kind or
        dtype, more than gemv_half_max_rows(kind) rows, rows not 2K bytes."""
        if kind not in HALF_KINDS or x.dtype != jnp.float32 or w.dtype != jnp.uint8 or x.ndim != 2 or w.ndim < 2:
            return None
        n, k = x.shape
        if n > self.gemv_half_max_rows(kind) or w.shape[-1] != 2 * k:
            return None
        out = jax.ShapeDtypeStruct((n, *w.shape[:-1]), jnp.float32)
        return self._call("tl_gemv_half", out)(x, w, kind=np.int32(HALF_KINDS[kind]))

    def matmul(self, x: jax.Array, w: NativeLinear) -> jax.Array | None:
        """x [N,K] times the linear w -> [N,*out] by the native kernels, else None (the caller's own
        matmul). Which kernel runs an encoding, and on which rows, is the encoding's own `native`
        (tl/model/encodings/): float32 x only."""
        if x.dtype != jnp.float32:
            return None
        y = w.native(self, x)
        if y is not None or x.shape[0] <= RUN_ROWS:
            return y
        # More rows than the kernel takes (the few-row float kernels, the SSE2 and ARM integer
        # ones): slices of RUN_ROWS, so that a row is the kernel's arithmetic at every step size
        # (never XLA's at some and the kernel's at others) and a row's result its own alone.
        runs = [w.native(self, x[i : i + RUN_ROWS]) for i in range(0, x.shape[0], RUN_ROWS)]
        if any(r is None for r in runs):
            return None
        return jnp.concatenate(runs)

    def argmax_lse(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(first index of each row's max [R] int32, log-sum-exp of each row [R] f32) of float32
        logits x [R,V]: jnp.argmax and jax.nn.logsumexp in one native pass (finite logits)."""
        out = (jax.ShapeDtypeStruct(x.shape[:1], jnp.int32), jax.ShapeDtypeStruct(x.shape[:1], jnp.float32))
        return self._call("tl_argmax_lse", out)(x.astype(jnp.float32))

    def _cache_target(self, base: str, qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> str:
        """The FFI target for these caches: float32, or uint16 (bf16 bits) where `bf16_supported`.
        Raises NativeUnavailable otherwise."""
        if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (jnp.float32, jnp.uint16):
            raise NativeUnavailable(f"the native kernel reads float32 or bf16 (uint16) caches, not {k_cache.dtype}")
        if k_cache.dtype == jnp.float32:
            return base
        _, _, G, hd = qg.shape
        if not bf16_supported(block_size=k_cache.shape[-1], head_dim=hd, group=G):
            raise NativeUnavailable(
                f"a bf16 cache needs block_size 16 with head_dim 64 (1-4 query heads a KV head) "
                f"or 128 (1-2); got block_size {k_cache.shape[-1]}, head_dim {hd}, {G} a KV head"
            )
        return base + "_bf16"

    def small_attention(
        self,
        qg: jax.Array,
        k_new: jax.Array,
        v_new: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        layer: jax.Array,
        meta: AttnMetadata,
    ) -> jax.Array:
        """Attention [T,Hk,G,hd] (qg scaled, float32 or bf16 caches): each token over its cached keys
        (positions before its sequence's start_pos) and this step's keys of its sequence up to it,
        merged and normalised in one native call (padding rows 0)."""
        base = self._cache_target("tl_small_attention", qg, k_cache, v_cache)
        f32, i32 = jnp.float32, jnp.int32
        call = self._call(base, jax.ShapeDtypeStruct(qg.shape, f32))
        return call(
            qg.astype(f32),
            k_new.astype(f32),
            v_new.astype(f32),
            k_cache,
            v_cache,
            jnp.asarray(layer, i32).reshape(1),
            meta.seq_idx.astype(i32),
            meta.positions.astype(i32),
            meta.start_pos.astype(i32),
            meta.block_tables.astype(i32),
            window=np.int32(meta.window),
        )

    def paged_attention(self, a: AttnArgs) -> jax.Array:
        """kernels/paged_attention.py's `PagedAttention`, every token computed as a decode of its
        own (the module's note says why): the one-call kernel over metadata that makes each token
        a sequence of one, its keys before it read from the cache (the forward writes the step's
        keys there before attention) and its own key from k_new."""
        meta = a.meta
        seq = meta.seq_idx.astype(jnp.int32)
        own = AttnMetadata(
            seq_idx=jnp.where(seq >= 0, jnp.arange(seq.shape[0], dtype=jnp.int32), -1),
            positions=meta.positions,
            start_pos=meta.positions.astype(jnp.int32),
            block_tables=meta.block_tables[jnp.maximum(seq, 0)],
            window=meta.window,
        )
        out = self.small_attention(grouped_query(a), a.k_new, a.v_new, a.k_cache, a.v_cache, a.layer, own)
        return out.reshape(a.q.shape).astype(a.q.dtype)


_libraries: dict[str, NativeLib] = {}


def library(target: str = "auto", *, cache_dir: str = "", cxx: str = "") -> NativeLib:
    """The loaded library of `target` ("auto": the most capable build this CPU runs), built on
    first use (into `cache_dir`, by `cxx`; empty: the defaults) and kept for the process: a
    target's FFI names carry only its name, so its first load serves every later call.
    Raises NativeUnavailable (one line: why)."""
    t = cpu_build.best() if target == "auto" else cpu_build.BY_NAME.get(target)
    if t is None:
        raise NativeUnavailable(f"unknown native target {target!r}; known: {', '.join(cpu_build.BY_NAME)}")
    if t.name not in _libraries:
        _libraries[t.name] = NativeLib(t, cache_dir=cache_dir, cxx=cxx)
    return _libraries[t.name]


def amx_available(target: str = "auto") -> bool:
    """Whether `target`'s library can run AMX-BF16 here (False where it cannot be built)."""
    try:
        return library(target).amx_available()
    except NativeUnavailable:
        return False


def bf16_supported(block_size: int, head_dim: int, group: int) -> bool:
    """Whether attention.cc's vector fold (the only one reading bf16 caches) covers these shapes."""
    return block_size == 16 and ((head_dim in (64, 256) and 1 <= group <= 4) or (head_dim == 128 and 1 <= group <= 2))


def pack_bf16x3(w: np.ndarray) -> np.ndarray:
    """float32 w [*out, K] -> uint16 [OB, KB, 2, 16, 32]: w as bf16 pairs (hi = bf16(w) rounded to
    nearest even, lo = bf16(w - hi)) in AMX B tiles (amx.cc says why): column block ob of 16
    outputs, k block kb of 32, [hi, lo], then 16 k pairs x 16 outputs x 2. Outputs are
    zero-padded to an even number of blocks, K to a multiple of 32."""
    w = np.asarray(w, np.float32)
    k = w.shape[-1]
    w = w.reshape(-1, k)
    o = w.shape[0]
    ob, kb = -(-o // 32) * 2, -(-k // 32)
    padded = np.zeros((ob * 16, kb * 32), np.float32)
    padded[:o, :k] = w
    hi = _bf16_bits(padded)
    lo = _bf16_bits(padded - (hi.astype(np.uint32) << 16).view(np.float32))
    parts = np.stack([hi, lo])  # [2, O, K]
    # [2, OB, 16 o, KB, 16 kp, 2 j] -> [OB, KB, 2, 16 kp, 16 o, 2 j]
    tiles = parts.reshape(2, ob, 16, kb, 16, 2).transpose(1, 3, 0, 4, 2, 5)
    return np.ascontiguousarray(tiles).reshape(ob, kb, 2, 16, 32)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounded to nearest even (finite x), as AVX512-BF16's vcvtneps2bf16."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
