"""Typed weights: each parameter as a Flax struct that says its encoding and its sharding.

Owns: the parameter types of the step layout (`flax.struct` dataclasses, registered pytrees
whose array fields are leaves and whose `axes` are static metadata): `Tensor` (a norm scale or
a bias), and the one registry of linear encodings: `ENCODING_TYPES` (every encoding class, one
module each under tl/model/encodings/, which owns everything that depends on its encoding:
encoding at load, XLA's arithmetic, its native kernel, its packing; `Linear` is their union),
and of these `ENCODINGS`, the ones loading makes, by the name a config gives (`Panels` is not
named: it is made from `Blocks` at placement). `axes` names, per array axis, the mesh axis it
is split over ("model") or None: declared where the parameter is built (tl/model/loader.py
`WeightLoader`), and `partition_specs` reads them, so no other module parses parameter names
or paths.
Must not: place arrays on devices (tl/runtime/placement.py does), know about the model's layers.
Tested by tests/model/test_llama_reference.py, tests/model/test_int8.py, tests/model/test_blocks.py,
tests/runtime/test_backend.py and tests/test_layering.py (the registry lists every encoding module).
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax

from tl.model.encodings import Axes, Encoding
from tl.model.encodings.bf16x3 import Bf16x3
from tl.model.encodings.blocks import BLOCK_ENCODINGS, Blocks
from tl.model.encodings.dense import Dense
from tl.model.encodings.int8 import Int8
from tl.model.encodings.panels import Panels
from tl.model.tensor import Tensor

__all__ = [
    "ENCODINGS",
    "ENCODING_TYPES",
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


Linear: TypeAlias = Dense | Int8 | Blocks | Bf16x3 | Panels
"""Any linear encoding: the union of ENCODING_TYPES (mypy needs it spelled out)."""
ENCODING_TYPES: tuple[type[Linear], ...] = (Dense, Int8, Blocks, Bf16x3, Panels)
"""Every linear encoding, one module of tl/model/encodings/ each (`Blocks` with one subclass
per ggml format); a new one joins here and in `Linear`, and in ENCODINGS where loading makes it."""
Table: TypeAlias = Dense | Int8 | Blocks | Panels
"""What an embedding / LM head is kept as (looked up by rows): each encoding's `table`."""
ENCODINGS: dict[str, type[Linear]] = {"float32": Dense, "int8": Int8, **BLOCK_ENCODINGS, "bf16x3": Bf16x3}
"""The encodings loading makes, by the name tl/model/loader.py takes ("float32": the float
dtype as loaded; "int8": weight_dtype int8; "q8_0", "q4_1", "q4_k", ...: llama.cpp's block
formats, as a GGUF stores them or quantized at load; "bf16x3": matmul_precision "high").
`Panels` is not among them: tl/runtime/placement.py makes it from `Blocks`."""
_HOOKED: tuple[type[Encoding], ...] = ENCODING_TYPES  # mypy: each has every hook of Encoding
PARAM_TYPES = (Tensor, *ENCODING_TYPES)


def is_param(x: Any) -> bool:
    return isinstance(x, PARAM_TYPES)


def partition_specs(tree: Any) -> Any:
    """The tree with each parameter's arrays replaced by the PartitionSpec its axes declare."""
    return jax.tree.map(lambda p: p.specs(), tree, is_leaf=is_param)


def matrix(w: Linear) -> Any:
    """The [*out, in] array of a linear (int8's q)."""
    return w.matrix
