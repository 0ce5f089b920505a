"""The block encodings: llama.cpp's quantized formats kept as the bytes a GGUF stores them in.

Owns: `Blocks` (a linear whose every output row is ggml blocks of its inputs: uint8
[*out, row_bytes]) and one subclass a format (`Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`, `Q4_K`,
`Q5_K`, `Q6_K`, and `F16`, `BF16`: a GGUF's 16-bit float tensors, kept at 2 bytes a weight,
registered in `BLOCK_ENCODINGS` by format name), each naming its format of
tl/model/encodings/ggml_formats.py. For each: quantization at load of a float Hugging Face
matrix (`encode`, gguf-py's reference quantizers: the formats it can make), XLA's arithmetic
(the rows dequantized inside the step into XLA's float32 dot: runs on CPU, GPU and TPU, and is
the reference the native kernels are tested against), lookups (only the looked-up rows
dequantized), the native CPU kernel (kernels/cpu_native.py `qgemm`: activations quantized per
block of 32, or of 256 for the K formats, to int8 and integer dot products, as llama.cpp
computes; the formats it reads and the rows it takes are its own to say, None elsewhere; f16 /
bf16: `gemv_half`, float32 products of the widened weights, or for bf16 on AVX512-BF16 x rounded
to bfloat16 and vdpbf16ps), and
sharding (the byte axis split only at block boundaries: `in_block`).
A GGUF's tensors arrive packed already (tl/model/files.py `Packed`) and are wrapped as they
are, never expanded to float: the resident bytes of a weight are the file's.
Must not: place arrays on devices. Tested by tests/model/test_blocks.py (against gguf-py's
dequantization and float64 products, and the engine on a tiny model in each format).
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
from tl.model.encodings.ggml_formats import FORMATS, HALVES, Format, dequantize, quantize

if TYPE_CHECKING:
    from kernels.cpu_native import NativeLib
    from tl.model.weights import Table, Tensor


@tree.dataclass
class Blocks:
    """uint8 data [*out, row_bytes]: for each output, the ggml blocks of its inputs, exactly as a
    GGUF stores them (the format is the subclass's `fmt`)."""

    data: Any
    axes: Axes = struct.field(pytree_node=False, default=())
    fmt: ClassVar[Format]
    in_block: ClassVar[int]

    @classmethod
    def encode(cls, w: np.ndarray, axes: Axes) -> Blocks:
        """A float matrix [*out, in] quantized by gguf-py's reference quantizer for the format."""
        return cls(quantize(cls.fmt.name, np.asarray(w, np.float32)), axes)

    @classmethod
    def table(cls, w: np.ndarray, axes: Axes) -> Table:
        return cls.encode(w, axes)

    @classmethod
    def head_packing(cls, head: Table) -> Tensor | None:
        return None

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape[:-1])

    @property
    def n_in(self) -> int:
        return int(self.data.shape[-1]) // self.fmt.block_bytes * self.fmt.block_size

    @property
    def dtype(self) -> Any:
        return jnp.float32

    @property
    def matrix(self) -> Any:
        """The [*out, in] float32 values (dequantized: for shapes and tests, not for the step)."""
        return jax.ShapeDtypeStruct((*self.out_shape, self.n_in), jnp.float32)

    def dot(self, x: jax.Array) -> jax.Array:
        """x [N, in] -> [N, *out]: the weights dequantized inside the step, XLA's float32 dot."""
        w = dequantize(self.fmt.name, self.data)
        return flat_dot(x.astype(jnp.float32), w).astype(x.dtype)

    def logits(self, h: jax.Array) -> jax.Array:
        return self.dot(h.astype(jnp.float32)).astype(jnp.float32)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Only the looked-up rows dequantized: [len(ids), in] float32."""
        return dequantize(self.fmt.name, self.data[ids])

    def native(self, lib: NativeLib, x: jax.Array) -> jax.Array | None:
        """The integer-dot kernel where it reads this format and takes these rows; for f16 / bf16
        the few-row float kernel that widens the 16-bit weights as it streams them."""
        if self.fmt.name in HALVES:
            return lib.gemv_half(x, self.data, self.fmt.name)
        return lib.qgemm(x, self.data, self.fmt.name)

    def specs(self) -> Blocks:
        """The byte axis stands where the input axis does: a row-parallel split must hold whole
        blocks on each device (tl/model/loader.py `WeightLoader.row_axes` keeps it whole otherwise)."""
        return type(self)(P(*self.axes), self.axes)


def _format(name: str) -> type[Blocks]:
    fmt = FORMATS[name]
    cls = type(name.upper(), (Blocks,), {"fmt": fmt, "in_block": fmt.block_size, "__module__": __name__})
    cls.__doc__ = f"ggml's {name.upper()} blocks ({fmt.block_bytes} bytes a block of {fmt.block_size} inputs)."
    return tree.dataclass(cls)


Q4_0 = _format("q4_0")
Q4_1 = _format("q4_1")
Q5_0 = _format("q5_0")
Q5_1 = _format("q5_1")
Q8_0 = _format("q8_0")
Q4_K = _format("q4_k")
Q5_K = _format("q5_k")
Q6_K = _format("q6_k")
F16 = _format("f16")
BF16 = _format("bf16")
BLOCK_ENCODINGS: dict[str, type[Blocks]] = {
    c.fmt.name: c for c in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16)
}
"""Each block encoding by its format's name (a GGUF tensor's type, lowercased)."""
