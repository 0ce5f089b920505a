"""The bf16x3 encoding (matmul_precision "high"): a float32 linear with its AMX packing.

Owns: `Bf16x3`, packing a float32 matrix at load (kernels/cpu_native.py `pack_bf16x3`: three
bf16 products on AMX tiles), which kernel runs it natively (the AMX kernel on its packing at
every row count: a row's arithmetic must not depend on the step's size, issue 48), and the LM head's
packing beside its float32 table. XLA runs its float32 matrix (as `Dense`). Only on one device
(the native kernels do not run under tensor parallelism), so the packing is never split.
Must not: place arrays on devices. Tested by tests/kernels/test_matmul_high.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import jax
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from kernels import cpu_native
from tl.model import tree
from tl.model.encodings import Axes
from tl.model.encodings.dense import Dense
from tl.model.tensor import Tensor

if TYPE_CHECKING:
    from tl.model.weights import Table


@tree.dataclass
class Bf16x3:
    """A float32 linear [*out, in] `w` with its bf16x3 packing (kernels/cpu_native.pack_bf16x3):
    the AMX kernel runs the packing for many rows; XLA and the few-row kernels use `w`."""

    w: Any
    packed: Any
    axes: Axes = struct.field(pytree_node=False, default=())
    in_block: ClassVar[int] = 1

    @classmethod
    def encode(cls, w: np.ndarray, axes: Axes) -> Bf16x3:
        w = np.ascontiguousarray(w)
        return cls(w, cpu_native.pack_bf16x3(w), axes)

    @classmethod
    def table(cls, w: np.ndarray, axes: Axes) -> Table:
        """float32 as stored: looked up by rows; the LM head's packing goes beside it."""
        return Dense.encode(w, axes)

    @classmethod
    def head_packing(cls, head: Table) -> Tensor | None:
        return Tensor(cpu_native.pack_bf16x3(head.w), ()) if isinstance(head, Dense) else None

    @classmethod
    def of(cls, head: Dense, packed: Any) -> Bf16x3:
        """An LM head's table with the packing `head_packing` made of it."""
        return cls(head.w, packed, head.axes)

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

    @property
    def matrix(self) -> Any:
        return self.w

    def dot(self, x: jax.Array) -> jax.Array:
        return self.dense.dot(x)

    def logits(self, h: jax.Array) -> jax.Array:
        return self.dense.logits(h)

    def rows(self, ids: jax.Array) -> jax.Array:
        return self.dense.rows(ids)

    def native(self, lib: cpu_native.NativeLib, x: jax.Array) -> jax.Array | None:
        return lib.matmul_bf16x3(x, self.packed, self.out_shape)

    def specs(self) -> Bf16x3:
        return Bf16x3(P(*self.axes), P(), self.axes)
