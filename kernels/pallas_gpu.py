"""GPU paged attention: jax's Pallas (Triton) `paged_attention` behind our interface.

Owns: adapting our ragged token axis and cache layout to the kernel jax ships in
`jax.experimental.pallas.ops.gpu.paged_attention`. Must not: write the cache or know about
requests. Tested in Pallas interpret mode on CPU by tests/kernels/test_pallas_attention.py against
kernels/paged_attention.py's reference; natively by bench/gpu_check.sh.

Adaptation. The kernel is a decode kernel: one query row per batch entry, keys [0, length)
read through the entry's block table. Every token of our flat axis becomes one entry whose
table is its sequence's and whose length is its position + 1: keys at positions <= its own,
so causal masking of prefill chunks falls out of the length and one call covers prefill
chunks, decodes, drafts and mixed lengths (this step's keys are already in the cache).
Padding tokens get length 1 and their rows are ignored. The kernel wants pages
[Hk, pages, block_size, hd]; ours are stored as kernels/paged_attention.py lays them out
(K [L, pages, Hk, hd, bs], V [L, pages, Hk, bs, hd]), so each call transposes one layer of
the cache (a copy of that layer: the price of a layout shared with the reference and the TPU
kernel). Softmax scale 1/sqrt(hd) is folded into q.

Shapes. Compiled for a GPU, the kernel's Triton dots need every dimension >= 16: head_dim, and
the keys of a compute block (pages_per_compute_block x block_size). Below that the compiled kernel
returned wrong numbers, not an error (head_dim 8 with 4-key blocks: every output doubled, on an
H200 with jax 0.11.2), so such shapes are refused at trace time and selection falls back to the
reference; interpret mode, which computes in jnp, takes any shape.

Sliding windows. The kernel reads keys [0, length) of an entry: it has no first key, so a window
(`AttnMetadata.window` > 0) cannot be expressed (shifting the entry's table by whole pages would
still read up to a page before the window). Such calls are refused at trace time, and a model
whose layers have windows falls back to the reference (kernels/select.py traces each window).

jax 0.11 deprecates the module (a DeprecationWarning at import; it still ran there, on jax 0.11.2
on an H200 with bench/gpu_check.sh): the import silences that one warning, so that a process
turning warnings into errors (pytest here) does not take it for a refusal. When jax drops the
module, this file has to carry the kernel itself.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from kernels.paged_attention import AttnArgs, layer_pages


def _pick_pages_per_block(max_blocks: int, block_size: int) -> int:
    """Largest of 8, 4, 2, 1 dividing the table width, with >= 16 keys per block (Triton dots)."""
    for n in (8, 4, 2, 1):
        if max_blocks % n == 0 and (n * block_size >= 16 or n == 1):
            return n
    return 1


def paged_attention(a: AttnArgs, *, interpret: bool = False) -> jax.Array:
    """kernels/paged_attention.py's `PagedAttention`; reads this step's keys from the cache."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "jax.experimental.pallas.ops.gpu.paged_attention is deprecated", DeprecationWarning
        )
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu

    q, meta = a.q, a.meta
    if meta.window:
        raise ValueError(
            f"pallas_gpu has no sliding window (jax's kernel reads keys from position 0); got window {meta.window}"
        )
    hd = q.shape[-1]
    dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
    real = meta.seq_idx >= 0
    tables = meta.block_tables[jnp.where(real, meta.seq_idx, 0)]  # [T, MB]
    lengths = jnp.where(real, meta.positions + 1, 1).astype(jnp.int32)  # [T]
    k_pages = layer_pages(a.k_cache, "k", a.layer, dtype).transpose(2, 0, 1, 3)  # [Hk, NB, bs, hd]
    v_pages = layer_pages(a.v_cache, "v", a.layer, dtype).transpose(2, 0, 1, 3)
    bs = k_pages.shape[2]
    per_block = _pick_pages_per_block(tables.shape[1], bs)
    if not interpret and (hd < 16 or per_block * bs < 16):
        raise ValueError(
            f"pallas_gpu needs head_dim >= 16 and >= 16 keys a compute block (Triton dots); got "
            f"head_dim {hd} and {per_block} page(s) of {bs} tokens"
        )
    qs = (q.astype(jnp.float32) * hd**-0.5).astype(dtype)
    out = gpu.paged_attention(
        qs, k_pages, v_pages, tables, lengths, k_splits=1, pages_per_compute_block=per_block, interpret=interpret
    )
    return out.astype(q.dtype)
