"""The float encoding: a linear [*out, in] as stored (float32, or the model's float dtype).

Owns: `Dense`, its XLA arithmetic (a dot contracting the last axes), its lookup as an
embedding, and its native kernel (kernels/cpu_native.py `gemv`: float32, up to the library's
max_rows() rows). Must not: place arrays on devices. Tested by tests/model/test_llama_reference.py
and tests/kernels/test_cpu_native.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from tl.model import tree
from tl.model.encodings import Axes, flat_dot

if TYPE_CHECKING:
    from kernels.cpu_native import NativeLib
    from tl.model.weights import Table, Tensor


@tree.dataclass
class Dense:
    """A float linear [*out, in] (PyTorch's layout: XLA:CPU's dot transposed [in, out] weights
    on every call). An embedding [V, D] is one too ([out = V, in = D] as a tied LM head)."""

    w: Any
    axes: Axes = struct.field(pytree_node=False, default=())
    in_block: ClassVar[int] = 1

    @classmethod
    def encode(cls, w: np.ndarray, axes: Axes) -> Dense:
        """w itself where it is contiguous (no copy: placement copies each weight once)."""
        return cls(np.ascontiguousarray(w), axes)

    @classmethod
    def table(cls, w: np.ndarray, axes: Axes) -> Table:
        return cls.encode(w, axes)

    @classmethod
    def head_packing(cls, head: Table) -> Tensor | None:
        return None

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape[:-1])

    @property
    def dtype(self) -> Any:
        return self.w.dtype

    @property
    def matrix(self) -> Any:
        return self.w

    def dot(self, x: jax.Array) -> jax.Array:
        return flat_dot(x, self.w)

    def logits(self, h: jax.Array) -> jax.Array:
        """float32 [N, V] of an LM head: contracted with [V, D] as stored (`h @ embed.T` copied
        113 MB a step)."""
        return flat_dot(h, self.w, jnp.float32)

    def rows(self, ids: jax.Array) -> jax.Array:
        out: jax.Array = self.w[ids]
        return out

    def native(self, lib: NativeLib, x: jax.Array) -> jax.Array | None:
        """The few-row float32 kernel, up to lib.max_rows() rows."""
        return lib.gemv(x, self.w)

    def specs(self) -> Dense:
        return Dense(P(*self.axes), self.axes)
