"""Float rows to the bytes of a ggml tensor type, K-quants included, in numpy.

Owns: quantizers for the K-quants gguf-py cannot write (`quantize_q4_k`, `quantize_q5_k`,
`quantize_q6_k`: float [..., n], n a multiple of 256 -> uint8 [n // 256 blocks, block bytes],
laid out as ggml-common.h's block_q4_K / block_q5_K / block_q6_K) and `quantize_rows`, any type
bench synth writes (these, gguf-py's quantizers for the 32-value formats, F16 and F32 as their
values' bytes).
The K-quant rule is a plain one, not ggml's search for the best scales: each sub-block's
6-bit (Q6_K: 8-bit) scale and min and the super-block's f16 scales are rounded up so the
sub-block's range is covered, and every value goes to its nearest level, so a value is off by at
most half its sub-block's step and every scale is a finite f16. Random weights need valid,
fast blocks, not the best ones.
Must not import tl (tests import these quantizers as well). Tested by tests/bench/test_synth.py
(gguf.quants.dequantize as the independent decoder) and by the K-quant tests of
tests/model/test_blocks.py and tests/model/test_moe.py, which build blocks with them.
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
_TINY = np.float32(2.0**-24)  # the smallest f16 subnormal: a floor that keeps divisions finite


def _f16_up(x: np.ndarray) -> np.ndarray:
    """float16 >= x elementwise (x float32 >= 0), at least the smallest subnormal."""
    h = np.maximum(x, _TINY).astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def _f16_bytes(h: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(h, dtype="<f2").reshape(-1, 1).view(np.uint8)


def _scales_and_mins(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's quantization of blocks [nb, 8, 32]: (d, dmin f16 [nb], sc, mn uint8
    [nb, 8], q uint8 [nb, 8, 32] in 0..levels). A value is d*sc*q - dmin*mn."""
    need_min = -np.minimum(blocks.min(-1), 0.0)  # [nb, 8]: how far below zero each sub-block reaches
    dmin = _f16_up(need_min.max(-1) / 63)
    mn = np.clip(np.ceil(need_min / dmin.astype(np.float32)[:, None]), 0, 63)
    offset = dmin.astype(np.float32)[:, None] * mn  # >= need_min: the lowest value is covered
    need_scale = (blocks.max(-1) + offset) / levels  # the step that reaches the highest value
    d = _f16_up(need_scale.max(-1) / 63)
    sc = np.clip(np.ceil(need_scale / d.astype(np.float32)[:, None]), 1, 63)
    q = _levels(blocks + offset[..., None], d.astype(np.float32)[:, None] * sc, 0, levels)
    return d, dmin, sc.astype(np.uint8), mn.astype(np.uint8), q


def _levels(y: np.ndarray, step: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """round(y / step) clipped to lo..hi, in place over y [nb, sub-blocks, n] (step [nb, sub-blocks]):
    a product by the reciprocal and no temporaries (three times the plain expression's speed)."""
    y *= (1 / step)[..., None]
    np.rint(y, out=y)
    np.clip(y, lo, hi, out=y)
    return y.astype(np.int8 if lo < 0 else np.uint8)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """ggml's 12 bytes of eight 6-bit scales and mins (get_scale_min_k4's inverse)."""
    packed = np.empty((len(sc), 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return packed


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[nb, 8, 32] -> [nb, 128]: sub-blocks 2j and 2j+1 share bytes 32j.. (low, high nibble)."""
    return ((q[:, 0::2, :] & 15) | ((q[:, 1::2, :] & 15) << 4)).reshape(len(q), 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """block_q4_K: f16 d, f16 dmin, 12 bytes of scales and mins, 128 bytes of 4-bit values."""
    d, dmin, sc, mn, q = _scales_and_mins(np.asarray(x, np.float32).reshape(-1, 8, 32), 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn), _nibbles(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """block_q5_K: f16 d, f16 dmin, 12 bytes of scales and mins, 32 bytes of the values' fifth
    bits (bit s of byte l: sub-block s, value l), 128 bytes of their low 4 bits."""
    d, dmin, sc, mn, q = _scales_and_mins(np.asarray(x, np.float32).reshape(-1, 8, 32), 31)
    high = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)  # [nb, 32]
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn), high, _nibbles(q)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """block_q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d; a
    value is d*sc*(q - 32), q in 0..63."""
    blocks = np.asarray(x, np.float32).reshape(-1, 16, 16)  # [nb, sub-block, 16]
    amax = np.abs(blocks).max(-1)
    d = _f16_up(amax.max(-1) / (31 * 127))
    sc = np.clip(np.ceil(amax / 31 / d.astype(np.float32)[:, None]), 1, 127)
    q = (_levels(blocks.copy(), d.astype(np.float32)[:, None] * sc, -32, 31) + 32).view(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [nb, half, quarter, l]
    ql = np.concatenate([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], axis=2)
    qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scales, _f16_bytes(d)], axis=1)


K_QUANTIZERS = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}


def quantize_rows(x: np.ndarray, qtype: Q) -> np.ndarray:
    """float [rows, n] -> uint8 [rows, bytes of a row] in `qtype` (F32, F16, gguf-py's
    quantizable formats, or a K-quant of K_QUANTIZERS)."""
    rows = x.shape[0]
    if qtype in (Q.F32, Q.F16):
        return np.ascontiguousarray(x, dtype="<f4" if qtype == Q.F32 else "<f2").view(np.uint8).reshape(rows, -1)
    if qtype in K_QUANTIZERS:
        return K_QUANTIZERS[qtype](x).reshape(rows, -1)
    return np.asarray(gguf.quants.quantize(np.asarray(x, np.float32), qtype)).reshape(rows, -1)
