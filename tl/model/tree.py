"""tl's parameter dataclasses: flax.struct's, with the class itself in the treedef.

Owns: `dataclass`, the decorator every parameter type of the step layout uses (the encodings
of tl/model/encodings/, `Tensor`, `Layer`, `Weights`, `Experts`) instead of
`flax.struct.dataclass`, and why.

Why. flax.struct registers a class with `jax.tree_util.register_dataclass`, and jaxlib 0.10's
treedef equality for such nodes compares their static fields' values and their children, not
their class, while the treedef's hash does include the class. Two encodings with the same static
fields and leaves of the same shapes and dtypes are then "equal" with different hashes: an F16
and a BF16 matrix ([*out, 2 in] bytes either way), Q4_0 and Q4_K at 512 inputs (288 bytes a row),
`Dense` and `Tensor` over one array. jit's compiled-program cache is a hash table: where the two
hashes meet in a probe the lookup compares equal and runs the one's program on the other's
arguments. It did: tests/model/test_blocks.py's BF16 product came out as the F16 program's reading of
the same bytes, deterministically wrong, in about one run in ten (it had been called with the
F16 weights just before). So each class here carries its qualified name as one more static
field, `tree_class` (keyword only, defaulted, never passed): treedefs of two classes differ in
their static values and so compare unequal, and the register_dataclass fast path is kept.
Must not: hold arrays or know about any parameter type. Tested by tests/model/test_tree.py.
"""

from __future__ import annotations

from typing import Any, TypeVar, dataclass_transform

from flax import struct

T = TypeVar("T")

FIELD = "tree_class"
"""The static field naming the class (module.qualname)."""


@dataclass_transform(field_specifiers=(struct.field,))
def dataclass(cls: type[T]) -> type[T]:
    """`flax.struct.dataclass(cls)` with the static field FIELD = cls's qualified name. A
    subclass of a class made by this is made by this too (its own name replaces the parent's)."""
    annotations: dict[str, Any] = dict(cls.__dict__.get("__annotations__", {}))
    annotations[FIELD] = "str"
    cls.__annotations__ = annotations
    name = f"{cls.__module__}.{cls.__qualname__}"
    setattr(cls, FIELD, struct.field(pytree_node=False, default=name, repr=False, kw_only=True))
    return struct.dataclass(cls)
