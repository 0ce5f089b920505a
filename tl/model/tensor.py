"""A parameter used as it is: `Tensor` (a norm's scale, a bias, an LM head's packing).

Owns `Tensor`. A leaf: tl/model/weights.py re-exports it beside the encodings, and an encoding
that makes one (tl/model/encodings/bf16x3.py's head packing) imports it from here, so no module
of tl/model/encodings/ imports tl/model/weights.py at run time. Tested by
tests/model/test_llama_reference.py.
"""

from __future__ import annotations

from typing import Any

from flax import struct
from jax.sharding import PartitionSpec as P

from tl.model import tree
from tl.model.encodings import Axes


@tree.dataclass
class Tensor:
    """A parameter used as it is (a norm's scale, a bias)."""

    value: Any
    axes: Axes = struct.field(pytree_node=False, default=())

    def specs(self) -> Tensor:
        return Tensor(P(*self.axes), self.axes)
