"""Reductions along the last axis whose arithmetic is fixed by the row alone, not by the batch.

Owns: `row_sum` (a row's sum as XLA's matrix product against a block of ones, a one-row call
padded to two rows), and what is built on it: `row_mean`, `logsumexp`, `softmax`,
`log_softmax`; and `cumsum` (an associative scan: elementwise adds, their order fixed by the
row's length). Must not: know about models or steps.

Why: XLA:CPU emits a reduction's loops by the array's whole shape, so one row's sum came out
differently with 1, 4 or 64 rows beside it (an RMSNorm over 576 values: up to 1e-6 apart at 1-4
rows; over 640: from 7 rows on; over 64, Qwen3's head norms: from 64 rows on), and a step's
answer then depended on what else the step held (issue 48). Its matrix product computes a row
of the result the same way at any row count from two (measured at widths 37 to 49,152 and 1 to
512 rows, tests/model/test_rowwise.py, which fails on a jaxlib where that stops holding); a
matrix-vector product sums in another order, hence the padding. Written as elementwise trees
instead (slices and adds: order-fixed by construction), a SmolLM2 step's 61 RMSNorms took 35
ms at 512 rows against 3.5 by jnp.mean; as this product, 7 ms. Max and argmax need nothing: they
are exact in any order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def row_sum(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """Sum over the last axis: x's rows [M, n] times ones [8, n] by XLA's matrix product (float32
    throughout), column 0; one row goes in as two (a zero row beside it)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    m = rows.shape[0]
    if m == 1:
        rows = jnp.concatenate([rows, jnp.zeros_like(rows)])
    ones = jnp.ones((8, n), x.dtype)
    y = lax.dot_general(rows, ones, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)
    out = y[:m, 0].reshape(x.shape[:-1])
    return out[..., None] if keepdims else out


def row_mean(x: jax.Array, keepdims: bool = False) -> jax.Array:
    return row_sum(x, keepdims) / x.shape[-1]


def logsumexp(x: jax.Array) -> jax.Array:
    """log(sum(exp(x))) over the last axis, shifted by the row's max (a row of -inf gives -inf)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return jnp.log(row_sum(jnp.exp(x - m))) + m[..., 0]


def softmax(x: jax.Array) -> jax.Array:
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0.0))
    return e / row_sum(e, keepdims=True)


def log_softmax(x: jax.Array) -> jax.Array:
    return x - logsumexp(x)[..., None]


def cumsum(x: jax.Array) -> jax.Array:
    """Inclusive prefix sums over the last axis (lax.associative_scan: slices and adds)."""
    out: jax.Array = lax.associative_scan(jnp.add, x, axis=x.ndim - 1)
    return out
