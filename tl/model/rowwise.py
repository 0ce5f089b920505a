"""Reductions along the last axis whose arithmetic is fixed by that axis's length alone.

Owns: `row_sum` (a pairwise tree of elementwise adds, then the odd remainder in order), and what
is built on it: `row_mean`, `logsumexp`, `softmax`, `log_softmax`, `cumsum` (an associative scan:
elementwise adds again). Must not: know about models or steps.

Why: XLA:CPU emits a reduction's loops by the array's whole shape, so one row's sum came out
differently with 1, 4 or 64 rows beside it (an RMSNorm over 576 values: up to 1e-6 apart at 1-4
rows; over 640: from 7 rows on; over 64, Qwen3's head norms: from 64 rows on), and a step's
answer then depended on what else the step held (issue 48). Elementwise ops compute each
element alone, so a sum written as them is the same for a row whatever the other rows are; XLA
does not reassociate float adds. Max and argmax need nothing: they are exact in any order.
Tested by tests/test_rowwise.py (a row alone against it among others, at many row counts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def row_sum(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """Sum over the last axis: halves added while the length is even, then the odd rest left to
    right (576 = 9 x 64: six halvings, then nine columns)."""
    n = x.shape[-1]
    while n > 1 and n % 2 == 0:
        n //= 2
        x = x[..., :n] + x[..., n:]
    acc = x[..., 0]
    for i in range(1, n):
        acc = acc + x[..., i]
    return acc[..., None] if keepdims else acc


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
