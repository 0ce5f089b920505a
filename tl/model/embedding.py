"""The dense embedding reference: one input through the no-cache forward, mean-pooled.

Owns: `dense_embedding`, the reference the scheduled pooling (the runner's step output
`pooled`, summed by tl/core/scheduler.py) is tested against; serving never calls it.
Tested by tests/runtime/test_runner.py and tests/runtime/test_smollm2_engine.py.
"""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tl.model import llama
from tl.model.config import ModelConfig


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(params: llama.Weights, token_ids: jax.Array, length: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """Mean of the final-normed hidden states of the first `length` tokens, L2-normalised [D]."""
    hidden, _ = llama.forward_dense(params, cfg, token_ids)
    mask = (jnp.arange(token_ids.shape[0]) < length)[:, None]
    mean = jnp.sum(jnp.where(mask, hidden.astype(jnp.float32), 0.0), axis=0) / length
    return mean / jnp.maximum(jnp.linalg.norm(mean), 1e-12)


def dense_embedding(
    params: llama.Weights, cfg: ModelConfig, token_ids: Sequence[int], token_buckets: Sequence[int], max_len: int
) -> list[float]:
    """The embedding of token_ids over step-layout params (a runner's `params`), padded to a
    token bucket (or the next power of two past the largest) so that few lengths compile."""
    n = len(token_ids)
    if not 0 < n <= max_len:
        raise ValueError(f"embedding input of {n} tokens; need 1..{max_len}")
    t_pad = token_buckets[bisect_left(token_buckets, n)] if n <= token_buckets[-1] else 1 << (n - 1).bit_length()
    ids = np.zeros(t_pad, np.int32)
    ids[:n] = token_ids
    out: list[float] = np.asarray(_embed(params, ids, np.int32(n), cfg=cfg)).tolist()
    return out
