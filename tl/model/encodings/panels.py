"""Block-format weights repacked at load into panels of 16 outputs, as the native CPU kernel streams them.

Owns: `Panels` (q8_0, q4_0 or q4_1 weights as kernels/cpu/quant_ffi.cc's TlQGemmPanels reads them:
uint8 [panels, blocks, 16 x block bytes], the outputs padded to a multiple of 16 with zero
blocks), `pack` (a `Blocks` weight -> `Panels`, numpy, at load), `stored` (the inverse inside
the step, jnp: XLA's arithmetic and the embedding's lookups read the stored blocks back from it)
and `PANEL_FORMATS`.
The layout of one panel's block of 32 inputs: its 16 outputs' stored blocks with their quant
bytes transposed to [G][16 outputs][4 bytes] (G = 8 for q8_0's 32 bytes, 4 for the nibble
formats' 16), then the 16 d and (q4_1) the 16 m, as halves: as many bytes as the 16 stored
blocks, so a model's resident size does not change. A 64-byte vector is then 16 outputs' 4
bytes each, the int32 lanes of vpdpbusd (quant_avx512.h says why that is faster). The values are the
GGUF's exactly: `stored(pack(w))` is w's bytes, padding aside.
Must not: decide when weights are packed (tl/runtime/execution.py's plan: `weight_layout`), place
arrays on devices. Tested by tests/model/test_panels.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from kernels.cpu_native import PANEL_KINDS
from tl.model import tree
from tl.model.encodings import Axes, flat_dot
from tl.model.encodings.blocks import Blocks
from tl.model.encodings.ggml_formats import FORMATS, dequantize

if TYPE_CHECKING:
    from kernels.cpu_native import NativeLib
    from tl.model.weights import Table, Tensor

PANEL_FORMATS = PANEL_KINDS
"""The formats that can be packed: those the panel kernel reads."""
LANES = 16
"""Outputs a panel."""


def _geometry(fmt: str) -> tuple[int, int, int]:
    """(block bytes, head bytes before the quant bytes: d and m, groups G of 4 quant bytes)."""
    bb = FORMATS[fmt].block_bytes
    heads = 4 if fmt == "q4_1" else 2
    return bb, heads, (bb - heads) // 4


@tree.dataclass
class Panels:
    """uint8 data [panels, blocks, 16 x block bytes] of `fmt`'s blocks repacked (module doc);
    `out` the weight's own output shape (its product the outputs before padding)."""

    data: Any
    fmt: str = struct.field(pytree_node=False)
    out: tuple[int, ...] = struct.field(pytree_node=False)
    axes: Axes = struct.field(pytree_node=False, default=())
    in_block: ClassVar[int] = 32

    @classmethod
    def encode(cls, w: np.ndarray, axes: Axes) -> Panels:
        raise ValueError("panels are packed from a block-format weight at load (pack), not encoded from floats")

    @classmethod
    def table(cls, w: np.ndarray, axes: Axes) -> Table:
        return cls.encode(w, axes)

    @classmethod
    def head_packing(cls, head: Table) -> Tensor | None:
        return None

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.out

    @property
    def n_in(self) -> int:
        return int(self.data.shape[1]) * 32

    @property
    def dtype(self) -> Any:
        return jnp.float32

    @property
    def matrix(self) -> Any:
        return jax.ShapeDtypeStruct((*self.out, self.n_in), jnp.float32)

    @property
    def n_out(self) -> int:
        return int(np.prod(self.out))

    def dot(self, x: jax.Array) -> jax.Array:
        """x [N, in] -> [N, *out]: the stored blocks read back, dequantized inside the step, XLA's
        float32 dot (Blocks.dot's arithmetic)."""
        w = dequantize(self.fmt, stored(self.fmt, self.data)[: self.n_out])
        return flat_dot(x.astype(jnp.float32), w.reshape(*self.out, -1)).astype(x.dtype)

    def logits(self, h: jax.Array) -> jax.Array:
        return self.dot(h.astype(jnp.float32)).astype(jnp.float32)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Only the looked-up rows' panels read back, each row's own lane kept and dequantized:
        [len(ids), in] float32."""
        n = ids.shape[0]
        back = stored(self.fmt, self.data[ids // LANES]).reshape(n, LANES, -1)
        return dequantize(self.fmt, back[jnp.arange(n), ids % LANES])

    def native(self, lib: NativeLib, x: jax.Array) -> jax.Array | None:
        """The panel kernel (kernels/cpu_native.py `qgemm_panels`), or None where the build has none."""
        y = lib.qgemm_panels(x, self.data, self.fmt)
        return None if y is None else y[:, : self.n_out].reshape(x.shape[0], *self.out)

    def specs(self) -> Panels:
        """Replicated: panels are packed only for a single device (tl/runtime/execution.py)."""
        return Panels(P(), self.fmt, self.out, self.axes)


def pack(w: Blocks) -> Panels:
    """`w`'s stored blocks [*out, nb * block bytes] repacked (numpy, on the host), the outputs padded
    to a multiple of 16 with zero blocks (d = 0: they add nothing and are cut from the results)."""
    fmt = w.fmt.name
    if fmt not in PANEL_FORMATS:
        raise ValueError(f"{fmt} weights are not packed into panels (only {', '.join(PANEL_FORMATS)})")
    bb, heads, g = _geometry(fmt)
    data = np.asarray(w.data)
    out = tuple(int(d) for d in data.shape[:-1])
    o, nb = int(np.prod(out)), data.shape[-1] // bb
    panels = -(-o // LANES)
    rows = np.zeros((panels * LANES, nb, bb), np.uint8)
    rows[:o] = data.reshape(o, nb, bb)
    rows = rows.reshape(panels, LANES, nb, bb)
    qs = rows[..., heads:].reshape(panels, LANES, nb, g, 4).transpose(0, 2, 3, 1, 4).reshape(panels, nb, 64 * g)
    parts = [
        rows[..., 2 * i : 2 * i + 2].transpose(0, 2, 1, 3).reshape(panels, nb, 2 * LANES) for i in range(heads // 2)
    ]
    return Panels(np.ascontiguousarray(np.concatenate([qs, *parts], axis=-1)), fmt, out, w.axes)


def stored(fmt: str, data: jax.Array) -> jax.Array:
    """Panels' uint8 [panels, nb, 16 bb] -> the stored rows [16 panels, nb * bb] (jnp, in the step)."""
    bb, heads, g = _geometry(fmt)
    panels, nb = data.shape[0], data.shape[1]
    qs = data[..., : 64 * g].reshape(panels, nb, g, LANES, 4).transpose(0, 3, 1, 2, 4).reshape(panels, LANES, nb, 4 * g)
    parts = [
        data[..., 64 * g + 32 * i : 64 * g + 32 * (i + 1)].reshape(panels, nb, LANES, 2).transpose(0, 2, 1, 3)
        for i in range(heads // 2)
    ]
    return jnp.concatenate([*parts, qs], axis=-1).reshape(panels * LANES, nb * bb)
