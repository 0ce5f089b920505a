"""llama.cpp's (ggml's) block formats, kept as the raw bytes a GGUF file stores.

Owns: the formats' geometry (`Format`, `FORMATS`, `by_ggml_type`, `row_bytes`: q4_0, q4_1,
q5_0, q5_1, q8_0 with blocks of 32 inputs; q4_k, q5_k, q6_k with super-blocks of 256; f16 and
bf16, "blocks" of one 16-bit value, `HALVES`), their
dequantization inside a jitted step (`dequantize`: pure jnp/lax over uint8 bytes, as
ggml-quants.c's dequantize_row_* reads them) and quantization at load for the formats gguf-py
can write (`quantize`, numpy, through gguf.quants).
Exactness: every product ggml forms here is exact in float32 (a float16 scale has 11
significant bits; times a 6-bit sub-scale and a nibble or 6-bit code is at most 23 bits), so
the only rounding is the one addition of q4_1/q5_1's min or the one subtraction of the
K-quants' dmin * min: the result is the same whatever the order or FMA contraction of the
compiler, and equals gguf-py's numpy and ggml's C bit for bit.
Must not: place arrays on devices, know about layers or encodings' dots.
Tested by tests/model/test_ggml_formats.py (against gguf.quants.dequantize / quantize).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from jax import lax


@dataclass(frozen=True, slots=True)
class Format:
    """One ggml block format: `block_size` inputs stored in `block_bytes` bytes."""

    name: str  # "q4_0", ...
    ggml_type: int  # gguf.GGMLQuantizationType value
    block_size: int  # inputs per block: 32, or 256 for the K-quants
    block_bytes: int


def _format(t: GGMLQuantizationType) -> Format:
    block_size, block_bytes = GGML_QUANT_SIZES[t]
    return Format(t.name.lower(), int(t), block_size, block_bytes)


_T = GGMLQuantizationType
FORMATS: dict[str, Format] = {
    f.name: f
    for f in map(_format, (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K, _T.F16, _T.BF16))
}
QUANTIZABLE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "f16", "bf16")
"""The formats gguf-py quantizes (it has no K-quant quantizer)."""
HALVES = ("f16", "bf16")
"""The 16-bit float formats: a "block" of one value in 2 bytes (IEEE half; bfloat16, the top half
of a float32), kept as the file's bytes like the block formats and widened inside the step."""


def by_ggml_type(t: int) -> Format | None:
    """The format of a GGUF tensor's type, or None when it is not one of FORMATS."""
    return next((f for f in FORMATS.values() if f.ggml_type == t), None)


def get(name: str) -> Format:
    """FORMATS[name], or a ValueError naming the known formats."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown ggml format {name!r}: known are {', '.join(FORMATS)}")
    return fmt


def row_bytes(fmt: Format, n_in: int) -> int:
    """Bytes of one row of n_in inputs; n_in must be a multiple of the block size."""
    if n_in <= 0 or n_in % fmt.block_size:
        raise ValueError(f"{fmt.name} stores blocks of {fmt.block_size} inputs: n_in={n_in} is not a positive multiple")
    return n_in // fmt.block_size * fmt.block_bytes


def quantize(name: str, w: np.ndarray) -> np.ndarray:
    """float [..., n_in] -> uint8 [..., row_bytes]: gguf-py's quantizer (ggml's reference rule)."""
    fmt = get(name)
    if name not in QUANTIZABLE:
        raise ValueError(
            f"{name} cannot be quantized at load (gguf-py has no quantizer for it): only {', '.join(QUANTIZABLE)} can"
        )
    x = np.asarray(w, np.float32)
    if x.ndim == 0:
        raise ValueError(f"{name} quantizes rows: got a scalar")
    row_bytes(fmt, x.shape[-1])
    out: np.ndarray = gguf_quants.quantize(x, GGMLQuantizationType(fmt.ggml_type))
    if name == "f16":  # gguf-py returns float16 values, not their bytes
        out = np.ascontiguousarray(out.astype("<f2")).view(np.uint8)
    return out


def dequantize(name: str, data: jax.Array) -> jax.Array:
    """uint8 [..., nb * block_bytes] (raw ggml rows) -> float32 [..., nb * block_size].
    `name` is static; pure jnp/lax, so it runs inside jit on any backend."""
    fmt = get(name)
    n = data.shape[-1]
    if data.dtype != jnp.uint8 or data.ndim == 0 or n % fmt.block_bytes:
        raise ValueError(f"{name} rows are uint8 multiples of {fmt.block_bytes} bytes: got {data.dtype} {data.shape}")
    blocks = data.reshape(*data.shape[:-1], n // fmt.block_bytes, fmt.block_bytes)
    out = _DEQUANT[name](blocks)
    return out.reshape(*data.shape[:-1], n // fmt.block_bytes * fmt.block_size)


# Each reader: uint8 blocks [..., block_bytes] -> float32 [..., block_size].


def _f16(b: jax.Array, at: int) -> jax.Array:
    """The little-endian float16 at byte `at` of each block, as float32 [..., 1]."""
    return lax.bitcast_convert_type(b[..., at : at + 2], jnp.float16).astype(jnp.float32)[..., None]


def _nibbles(qs: jax.Array) -> jax.Array:
    """[..., k, n] bytes -> [..., 2k, n]: for each n-byte group its low nibbles, then its high."""
    both = jnp.stack([qs & 0x0F, qs >> 4], axis=-2)
    return both.reshape(*qs.shape[:-2], 2 * qs.shape[-2], qs.shape[-1])


def _bits(qh: jax.Array, step: int) -> jax.Array:
    """[..., n] bytes -> [..., 8 // step, n]: field i holds bits step*i .. step*i + step-1."""
    shifts = jnp.arange(0, 8, step, dtype=jnp.uint8)[:, None]
    return (qh[..., None, :] >> shifts) & ((1 << step) - 1)


def _q32(qs: jax.Array, qh: jax.Array | None) -> jax.Array:
    """The 32 codes of a 32-block: element j is qs[j]'s low nibble, j+16 its high nibble, plus
    (5-bit formats) bit j of the little-endian uint32 qh as bit 4. int32 [..., 32]."""
    q = _nibbles(qs[..., None, :]).reshape(*qs.shape[:-1], 32).astype(jnp.int32)
    if qh is not None:  # bit j of the uint32 is bit j % 8 of byte j // 8
        high = _bits(qh[..., None], 1)[..., 0]  # [..., 4 bytes, 8 bits]
        q = q | (high.reshape(*qh.shape[:-1], 32).astype(jnp.int32) << 4)
    return q


def _q4_0(b: jax.Array) -> jax.Array:
    return _f16(b, 0) * (_q32(b[..., 2:18], None) - 8).astype(jnp.float32)


def _q4_1(b: jax.Array) -> jax.Array:
    return _f16(b, 0) * _q32(b[..., 4:20], None).astype(jnp.float32) + _f16(b, 2)


def _q5_0(b: jax.Array) -> jax.Array:
    return _f16(b, 0) * (_q32(b[..., 6:22], b[..., 2:6]) - 16).astype(jnp.float32)


def _q5_1(b: jax.Array) -> jax.Array:
    return _f16(b, 0) * _q32(b[..., 8:24], b[..., 4:8]).astype(jnp.float32) + _f16(b, 2)


def _q8_0(b: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(b[..., 2:34], jnp.int8).astype(jnp.float32) * _f16(b, 0)


def _scale_min_k4(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """ggml's get_scale_min_k4 over the 12 scale bytes: (scales, mins), 8 six-bit values each."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(jnp.float32), mn.astype(jnp.float32)


def _k_minus_min(b: jax.Array, q: jax.Array) -> jax.Array:
    """q4_k / q5_k: d * scale * q - dmin * min per sub-block of 32; q int32 [..., 8, 32]."""
    sc, mn = _scale_min_k4(b[..., 4:16])
    d = (_f16(b, 0) * sc)[..., None]
    dm = (_f16(b, 2) * mn)[..., None]
    return (d * q.astype(jnp.float32) - dm).reshape(*b.shape[:-1], 256)


def _ql_k(qs: jax.Array) -> jax.Array:
    """128 bytes -> [..., 8, 32]: 64-input chunk c is bytes 32c.. low nibbles, then high."""
    return _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).astype(jnp.int32)


def _q4_k(b: jax.Array) -> jax.Array:
    return _k_minus_min(b, _ql_k(b[..., 16:144]))


def _q5_k(b: jax.Array) -> jax.Array:
    qh = _bits(b[..., 16:48], 1).astype(jnp.int32)  # [..., 8, 32]: bit i of qh[l] tops sub-block i
    return _k_minus_min(b, _ql_k(b[..., 48:176]) | (qh << 4))


def _q6_k(b: jax.Array) -> jax.Array:
    lead = b.shape[:-1]
    # per 128-input half: ql 64 bytes (low nibbles of quarters 0, 1; high of 2, 3), qh 32 bytes
    # (bit pairs 0-1, 2-3, 4-5, 6-7 the top of quarters 0..3)
    ql = _nibbles(b[..., 0:128].reshape(*lead, 2, 1, 64)).reshape(*lead, 8, 32)
    qh = _bits(b[..., 128:192].reshape(*lead, 2, 32), 2).reshape(*lead, 8, 32)
    q = (ql.astype(jnp.int32) | (qh.astype(jnp.int32) << 4)) - 32
    sc = lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    d = (_f16(b, 208) * sc)[..., None]  # [..., 16, 1]: one scale per 16 inputs
    return (d * q.reshape(*lead, 16, 16).astype(jnp.float32)).reshape(*lead, 256)


def _f16_value(b: jax.Array) -> jax.Array:
    return _f16(b, 0)


def _bf16_value(b: jax.Array) -> jax.Array:
    """The little-endian bfloat16 of each 2-byte block: the top 16 bits of its float32 (exact)."""
    bits = lax.bitcast_convert_type(b, jnp.uint16).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(bits, jnp.float32)[..., None]


_DEQUANT: dict[str, Callable[[jax.Array], jax.Array]] = {
    "f16": _f16_value,
    "bf16": _bf16_value,
    "q4_0": _q4_0,
    "q4_1": _q4_1,
    "q5_0": _q5_0,
    "q5_1": _q5_1,
    "q8_0": _q8_0,
    "q4_k": _q4_k,
    "q5_k": _q5_k,
    "q6_k": _q6_k,
}
