"""Parameter dataclasses in a treedef (tl/model/tree.py): two classes never make equal treedefs,
so jit's program cache cannot hand one encoding's compiled step to another's weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import struct

from tl.model import tree
from tl.model.encodings.blocks import BLOCK_ENCODINGS
from tl.model.llama import Layer, Weights
from tl.model.moe import Experts
from tl.model.weights import ENCODINGS, Tensor

ts = jax.tree_util.tree_structure


def test_jaxlib_equates_dataclass_nodes_of_different_classes() -> None:
    """Why tree.dataclass exists: with flax.struct alone two classes of the same static values
    give treedefs that compare equal although their hashes differ (jaxlib 0.10). Where a jax
    release fixes this, this test fails and tree.py's extra field can go."""

    @struct.dataclass
    class A:
        data: object

    @struct.dataclass
    class B:
        w: object

    a, b = ts(A(np.zeros(4))), ts(B(np.zeros(4)))
    assert a == b and hash(a) != hash(b)


# Pairs with leaves of the same shapes and dtypes, so only the class tells them apart.
SAME_LEAVES = [
    (BLOCK_ENCODINGS["f16"](np.zeros((12, 1024), np.uint8)), BLOCK_ENCODINGS["bf16"](np.zeros((12, 1024), np.uint8))),
    (BLOCK_ENCODINGS["q4_0"](np.zeros((12, 288), np.uint8)), BLOCK_ENCODINGS["q4_k"](np.zeros((12, 288), np.uint8))),
    (ENCODINGS["float32"](np.zeros((12, 512), np.float32)), Tensor(np.zeros((12, 512), np.float32))),
]


@pytest.mark.parametrize(("a", "b"), SAME_LEAVES, ids=lambda w: type(w).__name__)
def test_two_classes_over_the_same_leaves_make_unequal_treedefs(a: object, b: object) -> None:
    assert [np.shape(x) for x in jax.tree.leaves(a)] == [np.shape(x) for x in jax.tree.leaves(b)]
    assert ts(a) != ts(b) and ts({"w": a}) != ts({"w": b})
    assert ts(a) == ts(type(a)(*jax.tree.leaves(a)))  # the same class still matches itself


def test_a_jitted_function_runs_each_encodings_own_program() -> None:
    """The F16 and BF16 readings of the same bytes through one jit: each its own answer."""
    raw = np.frombuffer(np.float32([1.5, -2.25]).tobytes(), np.uint8).reshape(1, 8)  # 4 16-bit words
    f16, bf16 = BLOCK_ENCODINGS["f16"](raw), BLOCK_ENCODINGS["bf16"](raw)
    rows = jax.jit(lambda w: w.rows(np.zeros(1, np.int32)))
    want_bf16 = raw.view(np.uint16).astype(np.uint32) << 16
    np.testing.assert_array_equal(np.asarray(rows(bf16)), want_bf16.view(np.float32))
    np.testing.assert_array_equal(np.asarray(rows(f16)), raw.view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(rows(bf16)), want_bf16.view(np.float32))


PARAM_CLASSES = [*ENCODINGS.values(), Tensor, Layer, Weights, Experts]  # ENCODINGS holds the block ones


@pytest.mark.parametrize("cls", PARAM_CLASSES, ids=lambda c: c.__name__)
def test_every_parameter_class_names_itself_in_its_static_fields(cls: type) -> None:
    field = cls.__dataclass_fields__[tree.FIELD]
    assert field.default == f"{cls.__module__}.{cls.__qualname__}" and field.kw_only
    assert field.metadata["pytree_node"] is False


def test_no_two_parameter_classes_share_a_name() -> None:
    names = [c.__dataclass_fields__[tree.FIELD].default for c in PARAM_CLASSES]
    assert len(set(names)) == len(names) == len(set(PARAM_CLASSES))
