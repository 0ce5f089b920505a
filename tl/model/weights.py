"""Typed weights: each parameter as a Flax struct that says its encoding and its sharding.

Owns: the parameter types of the step layout (`flax.struct` dataclasses, registered pytrees
whose array fields are leaves and whose `axes` are static metadata): `Tensor` (a norm scale or
a bias), and the registry of linear encodings (`ENCODINGS`: name -> class, one module each
under tl/model/encodings/, which owns everything that depends on its encoding: encoding at
load, XLA's arithmetic, its native kernel, its packing). `axes` names, per array axis, the mesh
axis it is split over ("model") or None: declared where the parameter is built
(tl/model/llama.py `load_weights`), and `partition_specs` reads them, so no other module
parses parameter names or paths.
Must not: place arrays on devices (tl/runtime/placement.py does), know about the model's layers.
Tested by tests/model/test_llama_reference.py, tests/model/test_int8.py, tests/model/test_blocks.py and
tests/runtime/test_backend.py.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax
from flax import struct
from jax.sharding import PartitionSpec as P

from tl.model import tree
from tl.model.encodings import Axes, Encoding
from tl.model.encodings.bf16x3 import Bf16x3
from tl.model.encodings.blocks import BLOCK_ENCODINGS, Blocks
from tl.model.encodings.dense import Dense
from tl.model.encodings.int8 import Int8
from tl.model.encodings.panels import Panels

__all__ = [
    "ENCODINGS",
    "Axes",
    "Bf16x3",
    "Blocks",
    "Dense",
    "Int8",
    "Linear",
    "Panels",
    "Table",
    "Tensor",
    "is_param",
    "matrix",
    "partition_specs",
]


@tree.dataclass
class Tensor:
    """A parameter used as it is (a norm's scale, a bias)."""

    value: Any
    axes: Axes = struct.field(pytree_node=False, default=())

    def specs(self) -> Tensor:
        return Tensor(P(*self.axes), self.axes)


Linear: TypeAlias = Dense | Int8 | Blocks | Bf16x3 | Panels
"""Every registered encoding (a new one joins here and in ENCODINGS)."""
Table: TypeAlias = Dense | Int8 | Blocks | Panels
"""What an embedding / LM head is kept as (looked up by rows): each encoding's `table`."""
ENCODINGS: dict[str, type[Linear]] = {"float32": Dense, "int8": Int8, **BLOCK_ENCODINGS, "bf16x3": Bf16x3}
"""Each linear encoding by the name load_weights takes ("float32": the float dtype as loaded;
"int8": weight_dtype int8; "q8_0", "q4_1", "q4_k", ...: llama.cpp's block formats, as a GGUF
stores them or quantized at load; "bf16x3": matmul_precision "high")."""
_HOOKED: list[type[Encoding]] = list(ENCODINGS.values())  # mypy: each has every hook of Encoding
PARAM_TYPES = (Tensor, *ENCODINGS.values(), Panels)  # Panels: made from Blocks at placement, not loaded


def is_param(x: Any) -> bool:
    return isinstance(x, PARAM_TYPES)


def partition_specs(tree: Any) -> Any:
    """The tree with each parameter's arrays replaced by the PartitionSpec its axes declare."""
    return jax.tree.map(lambda p: p.specs(), tree, is_leaf=is_param)


def matrix(w: Linear) -> Any:
    """The [*out, in] array of a linear (int8's q)."""
    return w.matrix
