"""Native CPU kernels (C++, XLA FFI): paged attention (both parts), and matmuls of a few rows.

Owns: building kernels/cpu/native.cc into a shared library on first use (g++, cached per
source, jaxlib version and CPU), registering its FFI targets, `paged_attention` with the
reference's contract (one call for small steps; else native local and cached parts, merged by
log-sum-exp),
`matmul` (x [N,K] @ w: native for N <= max_rows() float32 rows (64 with AVX-512), one row for int8
weights; with matmul_precision "high", from HIGH_MIN_ROWS rows on any count, three bf16 products
on AMX over weights `pack_bf16x3` packed at load; None otherwise, and the caller's own dot runs)
and `argmax_lse` (the sampler's greedy
token and logsumexp of each logits row in one pass: 8.1 -> 0.8 ms at 64 rows of 49152).
Must not: write the cache, know about requests. Tested by tests/test_cpu_native.py against
kernels/paged_attention.py's reference, XLA's dot and jnp's argmax/logsumexp.

Why the cached part: on XLA:CPU it is a gather of every block into a copy, element by element,
then tiny batched dots; it was half of a decode step at 64 sequences. The native part reads
each block where it lies and keeps an online softmax per token and KV head, one token range
per thread of XLA's intra-op pool.

Why one call for small steps (`small_attention`, at most SMALL_MAX_TOKENS tokens): both parts,
their merge and the normalisation in one native call, work items (token, KV head) over both
threads, in place of two calls, a cond and the merge's ops a layer: a decode step 1.01x at 1
sequence, 1.06x at 4, 1.0x at 16 (runner, alternated with the two-part path).

Why the local part (this step's own keys): in jnp it is a dense [T,T] masked softmax per KV
head, and XLA:CPU runs its elementwise passes (mask, max, exp, sum over 9.4 MB of scores a
layer at T=512) on one thread: 4.7-7 ms a layer, ~20% of a 512-token prefill. The native one
is a flash-attention forward over tiles of 16 query tokens x 64 keys that visits only the key
chunks a tile can see (a causal prompt: half; a batch of decodes: its diagonal): 1.8 ms a layer
at T=512; prefill of 512 tokens 610 -> 489 ms a step (`python -m bench runner`). Head dims
other than 32/64/128 keep the jnp local part.

The library is built with -O3 -march=native -ffast-math into $TL_NATIVE_CACHE (default
~/.cache/tl/native), named by a hash of the source, the compiler flags, jaxlib's version and
the CPU's flags, and renamed into place when complete (concurrent builders are harmless).
float32 caches, and bf16 ones (uint16 bits: a bf16 model, or kv_cache_dtype "bfloat16") for the
shapes of the vector fold (`bf16_supported`); other bf16 shapes or a missing compiler raise
`NativeUnavailable`, and kernels/select.py falls back to the reference with that reason.

Why the few-row matmul: XLA:CPU runs a matrix-vector product on one thread; a decode step of one
sequence is 120 of them in a dependent chain. The native kernel splits w's rows (one per
output, [O,K] as llama.linear stores them) over both threads, 4 outputs x up to 4 x rows in
registers, the next rows prefetched: against XLA's dot on the 30 SmolLM2 layers' matmuls alone
(`python -m bench kernels`), 1.27x at 1 row, 2.03x at 2, 2.15x at 4, 1.89x at 8 and 1.45x at
16. From 17 to 64 rows the kernel turns to a broadcast form (native.cc says how): 1.27-1.57x
XLA's dot on the same 30 layers at 32-64 rows (1.31x at 48), the LM head (49152 x 576) 1.37x
at 32 rows and 1.67x at 64; a decode step of the real model 1.32x at 32 sequences and 1.17x
at 64 (runner, both limits alternated in one process). At 128 rows (two 64-row tiles) it was
only 1.07x XLA and at 96 0.84x, hence the library's limit of 64 (`max_rows()`; 16 without
AVX-512). int8 weights, one row: 1.27-1.37x XLA's int8 dot (which pads to 4 rows; at 4 and 8
rows XLA's is 1.6-2.2x faster than this kernel, so it keeps them).
After a one-row matmul its helper thread lingers, spinning up to 50 us for the next one
(native.cc says why): a one-row decode step 1.07-1.08x (runner, alternated with it off; 50 and
200 us alike), 1.09-1.10x over HTTP (`bench http --compare` against a server with
$TL_NATIVE_LINGER_US=0), where 50 us beat 200 by 1.02x (it spins less beside the host's work).
Re-measured on top of the one-call attention and the native LM head (which took some of the
wake-ups away): 1.01-1.03x in the runner, 1.045x over HTTP.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.paged_attention import AttnMetadata, local_state

SOURCE = Path(__file__).parent / "cpu" / "native.cc"
TARGET = "tl_paged_attention_cached"
TARGET_BF16 = "tl_paged_attention_cached_bf16"
GEMV_TARGET = "tl_gemv"
GEMV_INT8_TARGET = "tl_gemv_int8"
GEMM_BF16X3_TARGET = "tl_gemm_bf16x3"
LOCAL_TARGET = "tl_local_attention"
SMALL_TARGET = "tl_small_attention"
SMALL_TARGET_BF16 = "tl_small_attention_bf16"
HIGH_MIN_ROWS = 17  # "high" precision: from this many rows the AMX kernel, below it the float32 few-row one
SMALL_MAX_TOKENS = 16  # steps of at most this many tokens take both parts in one call
ARGMAX_LSE_TARGET = "tl_argmax_lse"
LOCAL_HEAD_DIMS = (32, 64, 128)  # the native local part's head dims; others keep the jnp one
FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC")


class NativeUnavailable(RuntimeError):
    """The native kernel cannot run here (no compiler, a failed build, an unsupported dtype)."""


def cache_dir() -> Path:
    return Path(os.environ.get("TL_NATIVE_CACHE") or Path.home() / ".cache" / "tl" / "native")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path() -> Path:
    """Where the library for this source, jaxlib and CPU lives (built or not)."""
    import jaxlib

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(),
                 platform.machine().encode(), _cpu_flags().encode()):
        key.update(part)
    return cache_dir() / f"native-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """The library, compiled now if this machine has none yet. Raises NativeUnavailable."""
    out = library_path()
    if out.exists():
        return out
    want = os.environ.get("CXX") or "g++"
    cxx = shutil.which(want) or (None if os.environ.get("CXX") else shutil.which("c++"))
    if not cxx:
        raise NativeUnavailable(f"no C++ compiler ({want!r} not found) to build kernels/cpu/native.cc")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if res.returncode != 0:
            raise NativeUnavailable(f"building {SOURCE.name} failed: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_registered = False
_lib: ctypes.CDLL | None = None


def set_linger_us(us: float) -> None:
    """How long a helper thread of the one-row matmul spins for the next one (native.cc's
    lingering helpers; default 50 us, 0 = off; $TL_NATIVE_LINGER_US sets it at load): for
    benchmarks that compare values."""
    register()
    assert _lib is not None
    _lib.TlSetLingerNs(ctypes.c_int64(int(us * 1000)))


def register() -> None:
    """Build (if needed), load and register the FFI targets, once per process."""
    global _registered, _lib
    if _registered:
        return
    lib = _lib = ctypes.cdll.LoadLibrary(str(build()))
    lib.TlGemvMaxRows.restype = ctypes.c_int64
    lib.TlAmxAvailable.restype = ctypes.c_int64
    if os.environ.get("TL_NATIVE_LINGER_US"):  # A/B of whole servers (bench http --compare)
        lib.TlSetLingerNs(ctypes.c_int64(int(float(os.environ["TL_NATIVE_LINGER_US"]) * 1000)))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.TlPagedAttentionCached), platform="cpu")
    jax.ffi.register_ffi_target(GEMV_TARGET, jax.ffi.pycapsule(lib.TlGemv), platform="cpu")
    jax.ffi.register_ffi_target(GEMV_INT8_TARGET, jax.ffi.pycapsule(lib.TlGemvInt8), platform="cpu")
    jax.ffi.register_ffi_target(GEMM_BF16X3_TARGET, jax.ffi.pycapsule(lib.TlGemmBf16x3), platform="cpu")
    jax.ffi.register_ffi_target(ARGMAX_LSE_TARGET, jax.ffi.pycapsule(lib.TlArgmaxLse), platform="cpu")
    jax.ffi.register_ffi_target(LOCAL_TARGET, jax.ffi.pycapsule(lib.TlLocalAttention), platform="cpu")
    jax.ffi.register_ffi_target(SMALL_TARGET, jax.ffi.pycapsule(lib.TlSmallAttention), platform="cpu")
    jax.ffi.register_ffi_target(TARGET_BF16, jax.ffi.pycapsule(lib.TlPagedAttentionCachedBf16), platform="cpu")
    jax.ffi.register_ffi_target(SMALL_TARGET_BF16, jax.ffi.pycapsule(lib.TlSmallAttentionBf16), platform="cpu")
    _registered = True


def max_rows() -> int:
    """Rows the native float matmul takes, as the built library reports them (native.cc
    gemv_max_rows): 64 with AVX-512, else 16 (the broadcast form's 24 accumulators would spill
    from AVX2's 16 vector registers)."""
    register()
    assert _lib is not None
    return int(_lib.TlGemvMaxRows())


def amx_available() -> bool:
    """Whether this build and process can run AMX-BF16 (the CPU has it, native.cc was built with
    it, and Linux granted the tile state): the precondition of matmul_precision "high"."""
    try:
        register()
    except NativeUnavailable:
        return False
    assert _lib is not None
    return bool(_lib.TlAmxAvailable())


def pack_bf16x3(w: np.ndarray) -> np.ndarray:
    """float32 w [*out, K] -> uint16 [OB, KB, 2, 16, 32]: w as bf16 pairs (hi = bf16(w) rounded to
    nearest even, lo = bf16(w - hi)) in AMX B tiles (native.cc's GemmBf16x3 says why): column
    block ob of 16 outputs, k block kb of 32, [hi, lo], then 16 k pairs x 16 outputs x 2. Outputs
    are zero-padded to an even number of blocks, K to a multiple of 32."""
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


def matmul_bf16x3(x: jax.Array, packed: jax.Array, out: tuple[int, ...]) -> jax.Array:
    """x [N,K] float32 times the weights `pack_bf16x3` packed -> [N,*out] at "high" precision."""
    register()
    y = jax.ShapeDtypeStruct((x.shape[0], math.prod(out)), jnp.float32)
    return jax.ffi.ffi_call(GEMM_BF16X3_TARGET, y)(x.astype(jnp.float32), packed).reshape(x.shape[0], *out)


def matmul(x: jax.Array, w: Any) -> jax.Array | None:
    """x [N,K] times w -> [N,*out] by the native kernels, else None (the caller's own matmul).
    w as tl/model/llama.py's `linear` takes it: float32 [*out,K]; int8 {"q" [*out,K], "scale"
    [*out]} (with its W8A8 arithmetic bit for bit); or "high" {"f32" [*out,K], "bf16x3"
    (pack_bf16x3)}: rows up to HIGH_MIN_ROWS - 1 take the float32 kernels on "f32", more rows
    the AMX kernel. Float32 weights take the few-row kernel up to max_rows() rows."""
    if x.dtype != jnp.float32:
        return None
    if isinstance(w, dict) and "bf16x3" in w:
        if x.shape[0] >= HIGH_MIN_ROWS:
            return matmul_bf16x3(x, w["bf16x3"], w["f32"].shape[:-1])
        w = w["f32"]
    if x.shape[0] > max_rows():
        return None
    if isinstance(w, dict):
        q, scale = w["q"], w["scale"]
        if x.shape[0] > 1 or q.dtype != jnp.int8 or scale.dtype != jnp.float32:
            return None  # one row only: XLA's int8 dot pads to 4 rows and is faster from 2 rows on
        register()
        out = jax.ShapeDtypeStruct((x.shape[0], *q.shape[:-1]), jnp.float32)
        return jax.ffi.ffi_call(GEMV_INT8_TARGET, out)(x, q, scale)
    if w.dtype != jnp.float32:
        return None
    register()
    out = jax.ShapeDtypeStruct((x.shape[0], *w.shape[:-1]), jnp.float32)
    return jax.ffi.ffi_call(GEMV_TARGET, out)(x, w)


def _cache_target(f32_target: str, bf16_target: str, qg: jax.Array, k_cache: jax.Array,
                  v_cache: jax.Array) -> str:
    """The FFI target for these caches: float32, or uint16 (bf16 bits) where `bf16_supported`.
    Raises NativeUnavailable otherwise."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (jnp.float32, jnp.uint16):
        raise NativeUnavailable(f"the native kernel reads float32 or bf16 (uint16) caches, not {k_cache.dtype}")
    if k_cache.dtype == jnp.float32:
        return f32_target
    _, _, G, hd = qg.shape
    if not bf16_supported(block_size=k_cache.shape[-1], head_dim=hd, group=G):
        raise NativeUnavailable(f"a bf16 cache needs block_size 16 with head_dim 64 (1-4 query heads a KV head) "
                                f"or 128 (1-2); got block_size {k_cache.shape[-1]}, head_dim {hd}, {G} a KV head")
    return bf16_target


def bf16_supported(block_size: int, head_dim: int, group: int) -> bool:
    """Whether native.cc's vector fold (the only one reading bf16 caches) covers these shapes."""
    return block_size == 16 and ((head_dim == 64 and 1 <= group <= 4) or (head_dim == 128 and 1 <= group <= 2))


def cached_state(qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                 meta: AttnMetadata) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(m, l [T,Hk,G], acc [T,Hk,G,hd]) of each token over its cached keys (m = -inf, l = 0 if none)."""
    target = _cache_target(TARGET, TARGET_BF16, qg, k_cache, v_cache)
    register()
    T, Hk, G, hd = qg.shape
    f32 = jnp.float32
    call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct((T, Hk, G), f32), jax.ShapeDtypeStruct((T, Hk, G), f32),
                                     jax.ShapeDtypeStruct((T, Hk, G, hd), f32)))
    i32 = jnp.int32
    return call(qg.astype(f32), k_cache, v_cache, jnp.asarray(layer, i32).reshape(1), meta.seq_idx.astype(i32),
                meta.start_pos.astype(i32), meta.block_tables.astype(i32))


def argmax_lse(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first index of each row's max [R] int32, log-sum-exp of each row [R] f32) of float32
    logits x [R,V]: jnp.argmax and jax.nn.logsumexp in one native pass (finite logits)."""
    register()
    call = jax.ffi.ffi_call(ARGMAX_LSE_TARGET, (jax.ShapeDtypeStruct(x.shape[:1], jnp.int32),
                                                jax.ShapeDtypeStruct(x.shape[:1], jnp.float32)))
    return call(x.astype(jnp.float32))


def local_state_native(qg: jax.Array, k: jax.Array, v: jax.Array, meta: AttnMetadata) -> tuple[jax.Array, ...]:
    """kernels.paged_attention.local_state by the native kernel (float32, head dim in
    LOCAL_HEAD_DIMS; padding rows get m 0, l 1, acc 0); other head dims take the jnp one."""
    T, Hk, G, hd = qg.shape
    if hd not in LOCAL_HEAD_DIMS:
        return local_state(qg, k, v, meta)
    register()
    f32, i32 = jnp.float32, jnp.int32
    call = jax.ffi.ffi_call(LOCAL_TARGET, (jax.ShapeDtypeStruct((T, Hk, G), f32), jax.ShapeDtypeStruct((T, Hk, G), f32),
                                           jax.ShapeDtypeStruct((T, Hk, G, hd), f32)))
    return call(qg.astype(f32), k.astype(f32), v.astype(f32), meta.seq_idx.astype(i32), meta.positions.astype(i32))


def small_attention(qg: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    layer: jax.Array, meta: AttnMetadata) -> jax.Array:
    """Attention [T,Hk,G,hd] of a step of at most SMALL_MAX_TOKENS tokens (qg scaled, float32 or
    bf16 caches): both parts, their merge and the normalisation in one native call (padding rows 0)."""
    target = _cache_target(SMALL_TARGET, SMALL_TARGET_BF16, qg, k_cache, v_cache)
    register()
    f32, i32 = jnp.float32, jnp.int32
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(qg.shape, f32))
    return call(qg.astype(f32), k_new.astype(f32), v_new.astype(f32), k_cache, v_cache,
                jnp.asarray(layer, i32).reshape(1), meta.seq_idx.astype(i32), meta.positions.astype(i32),
                meta.start_pos.astype(i32), meta.block_tables.astype(i32))


def paged_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    layer: jax.Array, meta: AttnMetadata) -> jax.Array:
    """Same contract as kernels.paged_attention.paged_attention (float32 caches): steps of at most
    SMALL_MAX_TOKENS tokens in one call (`small_attention`), larger ones in two parts."""
    if q.shape[0] <= SMALL_MAX_TOKENS:
        return small_path(q, k_new, v_new, k_cache, v_cache, layer, meta)
    return two_part_attention(q, k_new, v_new, k_cache, v_cache, layer, meta)


def small_path(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
               layer: jax.Array, meta: AttnMetadata) -> jax.Array:
    """`paged_attention` by the one-call kernel (steps of at most SMALL_MAX_TOKENS tokens)."""
    T, Hq, hd = q.shape
    qg = q.reshape(T, k_new.shape[1], Hq // k_new.shape[1], hd).astype(jnp.float32) * (hd ** -0.5)
    return small_attention(qg, k_new, v_new, k_cache, v_cache, layer, meta).reshape(T, Hq, hd).astype(q.dtype)


def two_part_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                       layer: jax.Array, meta: AttnMetadata) -> jax.Array:
    """`paged_attention` for steps of more than SMALL_MAX_TOKENS tokens: the local part (tiled),
    the cached part when any sequence has cached keys, merged by log-sum-exp."""
    T, Hq, hd = q.shape
    Hk = k_new.shape[1]
    qg = q.reshape(T, Hk, Hq // Hk, hd).astype(jnp.float32) * (hd ** -0.5)
    m1, l1, acc1 = local_state_native(qg, k_new.astype(jnp.float32), v_new.astype(jnp.float32), meta)

    def with_cached() -> jax.Array:
        m2, l2, acc2 = cached_state(qg, k_cache, v_cache, layer, meta)
        m = jnp.maximum(m1, m2)  # m1 is finite: the local part keeps the diagonal
        c1, c2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
        return (acc1 * c1[..., None] + acc2 * c2[..., None]) / (l1 * c1 + l2 * c2)[..., None]

    # A step of fresh prompts only (no cached keys anywhere) skips the call and its merge.
    out = lax.cond(jnp.any(meta.start_pos > 0), with_cached, lambda: acc1 / l1[..., None])
    return out.reshape(T, Hq, hd).astype(q.dtype)
