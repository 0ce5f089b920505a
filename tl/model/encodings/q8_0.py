"""The Q8_0 encoding (llama.cpp's block format): blocks of 32 inputs, one float16 scale each.

Owns: `Q8_0`, quantization at load exactly as ggml-quants.c `quantize_row_q8_0_ref` does
(`quantize_q8_0`: d = max|w| / 127 per block of 32 consecutive inputs, q = roundf(w * (1/d)),
half away from zero, d stored as float16, w ~= d * q), the same rule over activations inside
the step (`quantize_act`, d kept float32), XLA's arithmetic (per block int8 x int8 summed in
int32, as llama.cpp's vec_dot_q8_0_q8_0 does, then scaled by d_w * d_x and summed over blocks
in float32; for many rows the same operands dequantized into XLA's float32 dot), its lookup
as an embedding, and its sharding. No native kernel yet (`native` is None: integer-dot CPU
kernels are issue 31's next step).
Must not: place arrays on devices. Tested by tests/test_q8_0.py (against gguf.quants' Q8_0,
a float64 reference of the block arithmetic, and the engine on a tiny model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from tl.model.encodings import Axes, IntegerCodes

if TYPE_CHECKING:
    from kernels.cpu_native import NativeLib
    from tl.model.weights import Table

QK8_0 = 32
"""Inputs per block (ggml's QK8_0)."""
# XLA:CPU (2-core Zen 5, alternated in one process on a machine shared with another test run,
# so rough): the per-block integer dot (a dot_general batched over blocks, K = 32) over
# SmolLM2's 30 gate-up matrices at one row took 40 ms padded to 2 rows, 48 to 4, 91 to 8, 204
# to 16, ~100 unpadded; dequantizing the weights inside the step into XLA's float32 dot, 61
# (at 64 rows the integer dot 200-480 ms, the dequantized one 41-57, float32's own 39). Whole
# SmolLM2 decode steps (python -m bench runner; padded to 8 rows, before the block-diagonal
# form below): integer 146 / 156 / 892 ms at batch 1 / 8 / 64, dequantized 222 / 269 / 450;
# after it (the block sums reduced as [O, N, nb]), alternated twice: integer 140-147 / 259-277
# / 560-605 ms at batch 16 / 32 / 64, dequantized 176-184 / 199-204 / 224-232.
# So steps of INT_DOT_MIN_ROWS to INT_DOT_MAX_ROWS rows (one-stream and small-batch decode;
# one row padded to two) take the integer path, larger ones (prefill, wide decode) the
# dequantized one, over the same quantized activations. Both are far slower than float32 on
# XLA:CPU (its int8 -> float32 convert and its batched small-K int8 dot are not vectorized
# well): the native integer-dot kernels of issue 31's next step are the fast path.
INT_DOT_MIN_ROWS = 2
INT_DOT_MAX_ROWS = 16
# One row over at most DIAGONAL_MAX_BLOCKS blocks: the integer dot as one 2-D int8 dot against
# the activations spread block-diagonally ([nb, in], zero off the block: the same exact block
# sums). One row, 30 SmolLM2 gate-up matrices (18 blocks): 19.7 ms against 25.9 batched; the
# LM head 16.5 against 24.4; the down matrices (48 blocks) 11.4 against 6.2, so those stay
# batched.
DIAGONAL_MAX_BLOCKS = 24


def quantize_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., in] -> (int8 q [..., in], float16 d [..., in/32]): ggml's reference rule in
    float32 (the block max over 127, its reciprocal, roundf of the product). in % 32 == 0."""
    x = np.asarray(w, np.float32)
    if x.ndim == 0 or x.shape[-1] % QK8_0:
        raise ValueError(f"q8_0 stores blocks of {QK8_0} inputs: the last axis of shape {x.shape} is not a multiple")
    blocks = x.reshape(*x.shape[:-1], -1, QK8_0)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = _roundf(blocks * inv[..., None]).astype(np.int8)
    return q.reshape(x.shape), d.astype(np.float16)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf (half away from zero), exactly: floor(|v| + 0.5) rounds 0.49999997 up."""
    a = np.abs(v)
    f = np.floor(a)
    out: np.ndarray = np.copysign(f + (a - f >= 0.5), v)
    return out


def quantize_act(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [N, in] float -> (int8 [N, in/32, 32], float32 d [N, in/32]): `quantize_q8_0`'s rule
    in the step (lax.round rounds half away from zero, as roundf), d left in float32."""
    xb = x.astype(jnp.float32).reshape(x.shape[0], -1, QK8_0)
    d = jnp.max(jnp.abs(xb), axis=-1) / jnp.float32(127)
    inv = jnp.where(d == 0, jnp.float32(0), 1 / d)  # ggml's `d ? 1.0f/d : 0.0f`
    return lax.round(xb * inv[..., None]).astype(jnp.int8), d


@struct.dataclass
class Q8_0(IntegerCodes):
    """int8 q [*out, in] with float16 d [*out, in/32], one per block of 32 inputs: w ~= d * q
    (llama.cpp's block_q8_0, its two arrays apart: 34 bytes per 32 weights either way). float16
    d as in the file; the dot converts [*out, in/32] to float32, 1/32 of q's elements."""

    q: Any
    d: Any
    axes: Axes = struct.field(pytree_node=False, default=())
    in_block: ClassVar[int] = QK8_0

    @classmethod
    def encode(cls, w: np.ndarray, axes: Axes) -> Q8_0:
        return cls(*quantize_q8_0(w), axes)

    @classmethod
    def table(cls, w: np.ndarray, axes: Axes) -> Table:
        return cls.encode(w, axes)

    def dot(self, x: jax.Array) -> jax.Array:
        """x [N, in] -> [N, *out] over x quantized per block (`quantize_act`): up to
        INT_DOT_MAX_ROWS rows `int_dot` (at least INT_DOT_MIN_ROWS, padded), more
        `dequantized_dot` (the same products, summed in float32 over `in`, not int32 per block)."""
        n, nb = x.shape[0], x.shape[1] // QK8_0
        if n > INT_DOT_MAX_ROWS:
            return self.dequantized_dot(x)
        if n == 1 and 2 <= nb <= DIAGONAL_MAX_BLOCKS:
            return self.int_dot(x, diagonal=True)
        xp = jnp.pad(x, ((0, max(0, INT_DOT_MIN_ROWS - n)), (0, 0)))
        return self.int_dot(xp)[:n]

    def int_dot(self, x: jax.Array, diagonal: bool = False) -> jax.Array:
        """y[n,o] = sum_b d_w[o,b] d_x[n,b] S[n,o,b], S the int32 sum of a block's 32 int8 x int8
        products (llama.cpp's vec_dot_q8_0_q8_0; exact: |S| <= 32 * 127^2 < 2^24, so its float32
        is exact too), scaled and summed over blocks in float32. S from a dot batched over blocks,
        or (`diagonal`) one 2-D dot against the activations spread block-diagonally."""
        n, q = x.shape[0], self.q
        xq, dx = quantize_act(x)  # [N, nb, 32], [N, nb]
        nb = xq.shape[1]
        if diagonal:  # [N*nb, in]: row (n, b) holds block b of row n, zeros elsewhere
            xe = (jnp.eye(nb, dtype=jnp.int8)[None, :, :, None] * xq[:, None, :, :]).reshape(n * nb, -1)
            s = lax.dot_general(
                q.reshape(-1, q.shape[-1]), xe, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32
            ).reshape(-1, n, nb)  # [O, N, nb]
        else:
            qb = q.reshape(-1, nb, QK8_0)  # [O, nb, 32]
            s = lax.dot_general(qb, xq, (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.int32)
            s = s.transpose(1, 2, 0)  # [nb, O, N] -> [O, N, nb]
        dw = self.d.reshape(-1, nb).astype(jnp.float32)  # [O, nb]
        y = jnp.sum(s.astype(jnp.float32) * dw[:, None, :] * dx[None], axis=-1)  # [O, N]
        out: jax.Array = y.T.reshape(n, *q.shape[:-1]).astype(x.dtype)
        return out

    def dequantized_dot(self, x: jax.Array) -> jax.Array:
        """The same quantized operands as float32 (q * d_w exact: 8 by 11 significant bits;
        q_x * d_x rounded once) in XLA's float32 dot: no [nb, O, N] int32 intermediate."""
        n, q = x.shape[0], self.q
        xq, dx = quantize_act(x)
        xf = (xq.astype(jnp.float32) * dx[..., None]).reshape(n, -1)
        nb = xq.shape[1]
        w = q.reshape(-1, nb, QK8_0).astype(jnp.float32) * self.d.reshape(-1, nb).astype(jnp.float32)[..., None]
        y = lax.dot_general(xf, w.reshape(-1, q.shape[-1]), (((1,), (1,)), ((), ())))
        out: jax.Array = y.reshape(n, *q.shape[:-1]).astype(x.dtype)
        return out

    def logits(self, h: jax.Array) -> jax.Array:
        return self.dot(h.astype(jnp.float32)).astype(jnp.float32)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Only the looked-up rows dequantized: [len(ids), in] float32."""
        q = self.q[ids].reshape(ids.shape[0], -1, QK8_0).astype(jnp.float32)
        out: jax.Array = (q * self.d[ids].astype(jnp.float32)[..., None]).reshape(ids.shape[0], -1)
        return out

    def native(self, lib: NativeLib, x: jax.Array) -> jax.Array | None:
        """None: no native Q8_0 kernel yet (XLA's `dot` runs it)."""
        return None

    def specs(self) -> Q8_0:
        """q and d split alike: d's block axis stands where q's input axis does. A split input
        axis (row-parallel) must hold whole blocks on each device: tl/model/llama.py
        `load_weights` declares it whole where in/32 is not a multiple of the degree."""
        return Q8_0(P(*self.axes), P(*self.axes), self.axes)
