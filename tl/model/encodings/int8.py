"""The int8 encoding: int8 q [*out, in] with a float32 scale per output channel (W8A8 dots).

Owns: `Int8`, per-output-channel symmetric quantization at load (`quantize_int8`), its XLA
arithmetic (activations quantized per row, int8 x int8 -> int32), its lookup as an embedding,
and its native kernel (kernels/cpu_native.py `gemv_int8`: one row, bit for bit the same W8A8
arithmetic). Must not: place arrays on devices. Tested by tests/model/test_int8.py and
tests/kernels/test_cpu_native.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from tl.model import tree
from tl.model.encodings import Axes

if TYPE_CHECKING:
    from kernels.cpu_native import NativeLib
    from tl.model.weights import Table, Tensor

# XLA:CPU's int8 dot takes a matrix-vector path at 1 row, 9x slower (the 30 SmolLM2 layers'
# matmuls: 113 vs 12.7 ms); 2 and 3 rows ran as fast unpadded as padded, and 1 row padded to 2
# as fast as to 4 (re-measured, alternated in one process). Only one-row steps without the
# native kernel (kernels/cpu_native.py) reach this padding.
INT8_MIN_ROWS = 4


def quantize_int8(w_out_in: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[out,in] float -> (int8 q [out,in], f32 scale [out]): w ~= q * scale[:, None]."""
    w = np.asarray(w_out_in, np.float32)
    scale = np.maximum(np.abs(w).max(axis=1), 1e-12) / 127.0
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


@tree.dataclass
class Int8:
    """int8 q [*out, in] with float32 scale [*out] per output channel: w ~= q * scale[..., None].
    The dot quantizes the activations per row and runs int8 x int8 -> int32 (XLA:CPU's int8 ->
    f32 convert runs ~10x slower than the f32 dot it would feed; its integer dot is fast)."""

    q: Any
    scale: Any
    axes: Axes = struct.field(pytree_node=False, default=())
    in_block: ClassVar[int] = 1

    @classmethod
    def encode(cls, w: np.ndarray, axes: Axes) -> Int8:
        q, scale = quantize_int8(w.reshape(-1, w.shape[-1]))
        return cls(q.reshape(w.shape), scale.reshape(w.shape[:-1]), axes)

    @classmethod
    def table(cls, w: np.ndarray, axes: Axes) -> Table:
        q, scale = quantize_int8(w)
        return cls(q, scale, axes)

    @classmethod
    def head_packing(cls, head: Table) -> Tensor | None:
        return None

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape[:-1])

    @property
    def dtype(self) -> Any:
        return jnp.float32

    @property
    def matrix(self) -> Any:
        return self.q

    def dot(self, x: jax.Array) -> jax.Array:
        n, q = x.shape[0], self.q
        xf = jnp.pad(x.astype(jnp.float32), ((0, max(0, INT8_MIN_ROWS - n)), (0, 0)))
        x_scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=1, keepdims=True), 1e-12) / 127.0
        xq = jnp.round(xf / x_scale).astype(jnp.int8)
        # q as the left operand ([*out, in] is then the dot's natural [M, K]): with q on the right,
        # XLA:CPU copied every int8 weight into [in, out] every step (44 of 61 ms at 4 rows).
        acc = lax.dot_general(
            q.reshape(-1, q.shape[-1]), xq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32
        )
        acc = acc.T.reshape(xq.shape[0], *q.shape[:-1])
        row_scale = x_scale[:n].reshape((n,) + (1,) * (q.ndim - 1))
        out: jax.Array = (acc[:n].astype(jnp.float32) * row_scale * self.scale).astype(x.dtype)
        return out

    def logits(self, h: jax.Array) -> jax.Array:
        return self.dot(h).astype(jnp.float32)

    def rows(self, ids: jax.Array) -> jax.Array:
        out: jax.Array = self.q[ids].astype(jnp.float32) * self.scale[ids][:, None]
        return out

    def native(self, lib: NativeLib, x: jax.Array) -> jax.Array | None:
        """The one-row W8A8 kernel (from 2 rows XLA's int8 dot, padded to 4, is faster)."""
        return lib.gemv_int8(x, self.q, self.scale)

    def specs(self) -> Int8:
        return Int8(P(*self.axes), P(*self.axes[:-1]), self.axes)
