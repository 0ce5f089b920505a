"""Linear-weight encodings: one module per encoding, each a Flax struct with the same hooks.

Owns: what every encoding provides (`Encoding`), and the pieces they share (`Axes`,
`flat_dot`). Each encoding module owns, for
its one encoding, everything that depends on it: turning a float Hugging Face matrix into it at
load (`encode`, `table` for an embedding or LM head, `head_packing`), XLA's arithmetic for it
(`dot`, `logits`, `rows`), which native CPU kernel runs it and on which rows (`native`: a
kernels/cpu_native.py call over its arrays, or None for XLA's `dot`), and its sharding (`specs`,
from the `axes` declared where it is built). The encodings, one module each:
tl/model/encodings/dense.py (float [*out, in]), tl/model/encodings/int8.py (int8 per output
channel, W8A8 dots), tl/model/encodings/blocks.py (llama.cpp's block formats as a GGUF stores
them: Q8_0, Q4_1, Q4_K, ..., their geometry and dequantization in
tl/model/encodings/ggml_formats.py, which is no encoding), tl/model/encodings/bf16x3.py (float32
with its AMX packing, matmul_precision "high") and tl/model/encodings/panels.py (q8_0 / q4_0 /
q4_1 blocks repacked at placement for the native kernel); tl/model/weights.py registers them
(`ENCODING_TYPES`; `ENCODINGS` by name, those loading makes), so a new encoding is one module
here and its entries there. Must not: place arrays on devices, know about the model's layers.
Tested by tests/model/test_llama_reference.py, tests/model/test_int8.py, tests/model/test_blocks.py,
tests/kernels/test_matmul_high.py, tests/model/test_panels.py and tests/kernels/test_cpu_native.py;
tests/test_layering.py checks the registry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

if TYPE_CHECKING:
    from kernels.cpu_native import NativeLib
    from tl.model.weights import Table, Tensor

Axes: TypeAlias = tuple[str | None, ...]
"""Per array axis of a parameter, the mesh axis it is split over ("model") or None."""


class Encoding(Protocol):
    """The hooks of a linear weight's encoding (a flax.struct dataclass, arrays as leaves)."""

    axes: Axes
    in_block: ClassVar[int]
    """The input axis holds blocks of this many values (Q8_0: 32; 1 where it has none): its
    length must be a multiple, and tensor parallelism splits it only at block boundaries."""

    @classmethod
    def encode(cls, w: np.ndarray, axes: Axes) -> Self:
        """A float host matrix [*out, in] (Hugging Face's layout) in this encoding."""
        ...

    @classmethod
    def table(cls, w: np.ndarray, axes: Axes) -> Table:
        """An embedding / LM head [V, D] as this encoding keeps it (it is also looked up by rows)."""
        ...

    @classmethod
    def head_packing(cls, head: Table) -> Tensor | None:
        """What the LM head needs beside its table (bf16x3's packing), or None."""
        ...

    @property
    def out_shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> Any: ...

    @property
    def matrix(self) -> Any:
        """The [*out, in] array (int8's q)."""
        ...

    def dot(self, x: jax.Array) -> jax.Array:
        """x [N, in] -> [N, *out]: XLA's arithmetic for this encoding."""
        ...

    def logits(self, h: jax.Array) -> jax.Array:
        """float32 [N, V] of an LM head."""
        ...

    def rows(self, ids: jax.Array) -> jax.Array:
        """Embedding lookup: rows `ids` as float."""
        ...

    def native(self, lib: NativeLib, x: jax.Array) -> jax.Array | None:
        """x [N, in] float32 -> [N, *out] by `lib`'s kernel for this encoding, or None where none
        takes these rows (the caller then runs `dot`)."""
        ...

    def specs(self) -> Self:
        """The same struct with each array replaced by its PartitionSpec."""
        ...


def flat_dot(x: jax.Array, w: jax.Array, preferred: Any = None) -> jax.Array:
    """x [N, in] . w [*out, in] -> [N, *out], the out axes flattened for the dot (XLA:CPU's dot
    ran 2.5x slower on [2,F,D] than on [2F,D]). One row goes in as two (a zero row beside it):
    XLA:CPU's matrix-vector product sums in another order than its matrix product, whose rows
    come out the same at any row count (issue 48: a row's result must not depend on its step)."""
    n = x.shape[0]
    if n == 1:
        x = jnp.concatenate([x, jnp.zeros_like(x)])
    y = lax.dot_general(x, w.reshape(-1, w.shape[-1]), (((1,), (1,)), ((), ())), preferred_element_type=preferred)
    return y[:n].reshape(n, *w.shape[:-1])
