"""TPU paged attention: jax's Pallas `ragged_paged_attention` behind our interface.

Owns: adapting our ragged token axis and cache layout to the kernel jax ships in
`jax.experimental.pallas.ops.tpu.ragged_paged_attention`. Must not: write the cache or know
about requests. Tested on CPU by tests/kernels/test_pallas_attention.py: the adaptation against our
reference with jax's own `ref_ragged_paged_attention` (same signature) in the kernel's place,
and the kernel itself in TPU interpret mode (which jax 0.10.2's interpreter cannot run yet:
see the test); natively on a TPU only.

Adaptation. The kernel takes sequences as contiguous query ranges (cu_q_lens) whose last
q_len positions end at kv_len, keys read through page_indices from one combined page array
[pages, block_size, 2*Hk, hd] with K at even and V at odd head slots. Our runner packs each
sequence's tokens contiguously in sequence order with padding at the end, so
q_len = tokens of the sequence, kv_len = start_pos + q_len, page_indices = our block tables,
num_seqs = sequences with tokens. Our cache keeps K and V apart (kernels/paged_attention.py's stored
layout), so each call interleaves one layer (a copy of that layer). Padding tokens come back as zeros.
A sliding window (`AttnMetadata.window` > 0) is the kernel's own `sliding_window` (it masks keys at
positions <= the query's - window, as our reference does); window 0 passes None, the full causal kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kernels.paged_attention import AttnArgs, AttnMetadata, layer_pages


def ragged_inputs(meta: AttnMetadata) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(kv_lens [S], cu_q_lens [S+1], num_seqs [1]) of the kernel from our metadata."""
    S = meta.start_pos.shape[0]
    real = meta.seq_idx >= 0
    q_lens = jax.ops.segment_sum(real.astype(jnp.int32), jnp.where(real, meta.seq_idx, S), num_segments=S + 1)[:S]
    cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    kv_lens = jnp.where(q_lens > 0, meta.start_pos + q_lens, 0).astype(jnp.int32)
    num_seqs = jnp.sum(q_lens > 0, dtype=jnp.int32).reshape(1)
    return kv_lens, cu_q_lens, num_seqs


def combined_pages(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, dtype: Any) -> jax.Array:
    """One layer as the kernel's [pages, block_size, 2*Hk, hd]: K at even head slots, V at odd."""
    k, v = layer_pages(k_cache, "k", layer, dtype), layer_pages(v_cache, "v", layer, dtype)
    NB, bs, Hk, hd = k.shape
    return jnp.stack([k, v], axis=3).reshape(NB, bs, 2 * Hk, hd)


def paged_attention(a: AttnArgs, *, interpret: bool = False, impl: Callable[..., jax.Array] | None = None) -> jax.Array:
    """kernels/paged_attention.py's `PagedAttention`; reads this step's keys from the cache.

    `impl` replaces the kernel (tests pass jax's ref_ragged_paged_attention, which needs
    concrete inputs); `interpret` runs the kernel in Pallas TPU interpret mode.
    """
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    q, meta = a.q, a.meta
    T, _, hd = q.shape
    dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
    kv_lens, cu_q_lens, num_seqs = ragged_inputs(meta)
    pages = combined_pages(a.k_cache, a.v_cache, a.layer, dtype)
    args = (q.astype(dtype), pages, kv_lens, meta.block_tables.astype(jnp.int32), cu_q_lens, num_seqs)
    scale, window = hd**-0.5, meta.window or None
    if impl is not None:
        out = impl(*args, sm_scale=scale, sliding_window=window)
    elif interpret:
        with pltpu.force_tpu_interpret_mode():
            out = kernel.ragged_paged_attention(*args, sm_scale=scale, sliding_window=window)
    else:
        out = kernel.ragged_paged_attention(*args, sm_scale=scale, sliding_window=window)
    out = out[:T]
    n_real = jnp.sum(meta.seq_idx >= 0)
    out = jnp.pad(out, ((0, T - out.shape[0]), (0, 0), (0, 0)))
    return jnp.where((jnp.arange(T) < n_real)[:, None, None], out, 0).astype(q.dtype)
