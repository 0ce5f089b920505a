"""Typed weights: each parameter as a Flax struct that says its encoding and its sharding.

Owns: the parameter types of the step layout (`flax.struct` dataclasses, registered pytrees
whose array fields are leaves and whose `axes` are static metadata): `Tensor` (a norm scale or
a bias), and the linear encodings `Dense` (float [*out, in]), `Int8` (int8 [*out, in] with a
float32 scale per output channel: W8A8 dots) and `Bf16x3` (float32 [*out, in] with its bf16x3
packing for the AMX kernel, matmul_precision "high"). Each linear has one `dot` (XLA's
arithmetic for its encoding) and one `rows` (embedding lookup); a native kernel dispatches on
the type (kernels/cpu_native.py). `axes` names, per array axis, the mesh axis it is split over
("model") or None: declared where the parameter is built (tl/model/llama.py `load_weights`),
and `partition_specs` reads them, so no other module parses parameter names or paths.
Must not: place arrays on devices (tl/runtime/placement.py does), know about the model's layers.
Tested by tests/test_llama_reference.py, tests/test_int8.py and tests/test_backend.py.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

Axes: TypeAlias = tuple[str | None, ...]

# XLA:CPU's int8 dot takes a matrix-vector path at 1 row, 9x slower (the 30 SmolLM2 layers'
# matmuls: 113 vs 12.7 ms); 2 and 3 rows ran as fast unpadded as padded, and 1 row padded to 2
# as fast as to 4 (re-measured, alternated in one process). Only one-row steps without the
# native kernel (kernels/cpu_native.py) reach this padding.
INT8_MIN_ROWS = 4


def _flat_dot(x: jax.Array, w: jax.Array, preferred: Any = None) -> jax.Array:
    """x [N, in] . w [*out, in] -> [N, *out], the out axes flattened for the dot (XLA:CPU's dot
    ran 2.5x slower on [2,F,D] than on [2F,D])."""
    y = lax.dot_general(x, w.reshape(-1, w.shape[-1]), (((1,), (1,)), ((), ())), preferred_element_type=preferred)
    return y.reshape(x.shape[0], *w.shape[:-1])


@struct.dataclass
class Tensor:
    """A parameter used as it is (a norm's scale, a bias)."""

    value: Any
    axes: Axes = struct.field(pytree_node=False, default=())

    def specs(self) -> Tensor:
        return Tensor(P(*self.axes), self.axes)


@struct.dataclass
class Dense:
    """A float linear [*out, in] (PyTorch's layout: XLA:CPU's dot transposed [in, out] weights
    on every call). An embedding [V, D] is one too ([out = V, in = D] as a tied LM head)."""

    w: Any
    axes: Axes = struct.field(pytree_node=False, default=())

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape[:-1])

    @property
    def dtype(self) -> Any:
        return self.w.dtype

    def dot(self, x: jax.Array) -> jax.Array:
        return _flat_dot(x, self.w)

    def logits(self, h: jax.Array) -> jax.Array:
        """float32 [N, V] of an LM head: contracted with [V, D] as stored (`h @ embed.T` copied
        113 MB a step)."""
        return lax.dot_general(h, self.w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def rows(self, ids: jax.Array) -> jax.Array:
        out: jax.Array = self.w[ids]
        return out

    def specs(self) -> Dense:
        return Dense(P(*self.axes), self.axes)


@struct.dataclass
class Int8:
    """int8 q [*out, in] with float32 scale [*out] per output channel: w ~= q * scale[..., None].
    The dot quantizes the activations per row and runs int8 x int8 -> int32 (XLA:CPU's int8 ->
    f32 convert runs ~10x slower than the f32 dot it would feed; its integer dot is fast)."""

    q: Any
    scale: Any
    axes: Axes = struct.field(pytree_node=False, default=())

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape[:-1])

    @property
    def dtype(self) -> Any:
        return jnp.float32

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

    def specs(self) -> Int8:
        return Int8(P(*self.axes), P(*self.axes[:-1]), self.axes)


@struct.dataclass
class Bf16x3:
    """A float32 linear [*out, in] with its bf16x3 packing (kernels/cpu_native.pack_bf16x3):
    matmul_precision "high" runs the packing on AMX for many rows; XLA and the few-row kernels
    use `w`. Only on one device (the native kernels do not run under tensor parallelism), so the
    packing is never split."""

    w: Any
    packed: Any
    axes: Axes = struct.field(pytree_node=False, default=())

    @property
    def dense(self) -> Dense:
        """The float32 matrix alone: what XLA and the few-row kernels run."""
        return Dense(self.w, self.axes)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.dense.out_shape

    @property
    def dtype(self) -> Any:
        return self.w.dtype

    def dot(self, x: jax.Array) -> jax.Array:
        return self.dense.dot(x)

    def logits(self, h: jax.Array) -> jax.Array:
        return self.dense.logits(h)

    def rows(self, ids: jax.Array) -> jax.Array:
        return self.dense.rows(ids)

    def specs(self) -> Bf16x3:
        return Bf16x3(P(*self.axes), P(), self.axes)


Linear: TypeAlias = Dense | Int8 | Bf16x3
PARAM_TYPES = (Tensor, Dense, Int8, Bf16x3)


def is_param(x: Any) -> bool:
    return isinstance(x, PARAM_TYPES)


def partition_specs(tree: Any) -> Any:
    """The tree with each parameter's arrays replaced by the PartitionSpec its axes declare."""
    return jax.tree.map(lambda p: p.specs(), tree, is_leaf=is_param)


def matrix(w: Linear) -> Any:
    """The [*out, in] array of a linear (int8's q)."""
    return w.q if isinstance(w, Int8) else w.w
