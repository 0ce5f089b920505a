"""Paged-attention cases and their naive reference, shared by the jnp reference's tests
(tests/kernels/test_paged_attention.py) and the native and Pallas kernels' tests: build_case
(random caches, non-contiguous block tables, mixed prefill/decode/cached-prefix sequences), naive
(the loop over every query), inputs (AttnArgs) and run (the jnp reference). Must hold no tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels.paged_attention import AttnArgs, AttnMetadata, paged_attention, to_stored

L, BS, NB, HK, G, HD = 2, 4, 40, 2, 2, 8


def build_case(
    rng: np.random.Generator, seqs: list[tuple[int, int]], pad: int, max_blocks: int = 10, bs: int = BS, hd: int = HD
) -> dict:
    """seqs: (start_pos, num_new) per sequence. Returns cache, step tensors and full per-seq K/V."""
    k_cache = rng.standard_normal((L, NB, bs, HK, hd)).astype(np.float32)
    v_cache = rng.standard_normal((L, NB, bs, HK, hd)).astype(np.float32)
    free = rng.permutation(NB - 1)  # last block is scratch, never in a table
    tables = np.full((len(seqs), max_blocks), NB - 1, np.int32)
    seq_idx, positions, k_new, v_new = [], [], [], []
    used = 0
    layer = 1
    for s, (start, n) in enumerate(seqs):
        nblk = -(-(start + n) // bs)
        tables[s, :nblk] = free[used : used + nblk]
        used += nblk
        kn = rng.standard_normal((n, HK, hd)).astype(np.float32)
        vn = rng.standard_normal((n, HK, hd)).astype(np.float32)
        for i in range(n):  # the model writes this step's keys before attention
            p = start + i
            k_cache[layer, tables[s, p // bs], p % bs] = kn[i]
            v_cache[layer, tables[s, p // bs], p % bs] = vn[i]
        seq_idx += [s] * n
        positions += list(range(start, start + n))
        k_new.append(kn)
        v_new.append(vn)
    k_new.append(rng.standard_normal((pad, HK, hd)).astype(np.float32))
    v_new.append(rng.standard_normal((pad, HK, hd)).astype(np.float32))
    T = len(seq_idx) + pad
    return dict(
        k_cache=k_cache,
        v_cache=v_cache,
        tables=tables,
        layer=layer,
        bs=bs,
        hd=hd,
        seq_idx=np.array(seq_idx + [-1] * pad, np.int32),
        positions=np.array(positions + [0] * pad, np.int32),
        start=np.array([s for s, _ in seqs], np.int32),
        k_new=np.concatenate(k_new),
        v_new=np.concatenate(v_new),
        q=rng.standard_normal((T, HK * G, hd)).astype(np.float32),
    )


def naive(c: dict, window: int = 0) -> np.ndarray:
    """Each real token: gather its sequence's keys 0..pos (with a window: pos - window < key <= pos)
    from the cache, softmax, weighted sum."""
    out = np.zeros_like(c["q"])
    bs, hd = c["bs"], c["hd"]
    for t, (s, p) in enumerate(zip(c["seq_idx"], c["positions"], strict=True)):
        if s < 0:
            continue
        first = max(0, p - window + 1) if window else 0
        slots = [(c["tables"][s, j // bs], j % bs) for j in range(first, p + 1)]
        k = np.stack([c["k_cache"][c["layer"], b, o] for b, o in slots])  # [P, HK, hd]
        v = np.stack([c["v_cache"][c["layer"], b, o] for b, o in slots])
        for h in range(HK * G):
            sc = k[:, h // G] @ c["q"][t, h] / np.sqrt(hd)
            w = np.exp(sc - sc.max())
            out[t, h] = (w / w.sum()) @ v[:, h // G]
    return out


def inputs(c: dict, chunk_blocks: int = 2, bf16: bool = False, head_rows: int = 0, window: int = 0) -> AttnArgs:
    """A case as the arguments of the attention interface (stored cache layout; bf16 as uint16 bits)."""
    kc, vc = to_stored("k", jnp.asarray(c["k_cache"])), to_stored("v", jnp.asarray(c["v_cache"]))
    if bf16:
        kc = jax.lax.bitcast_convert_type(kc.astype(jnp.bfloat16), jnp.uint16)
        vc = jax.lax.bitcast_convert_type(vc.astype(jnp.bfloat16), jnp.uint16)
    meta = AttnMetadata(
        seq_idx=jnp.asarray(c["seq_idx"]),
        positions=jnp.asarray(c["positions"]),
        start_pos=jnp.asarray(c["start"]),
        block_tables=jnp.asarray(c["tables"]),
        chunk_blocks=chunk_blocks,
        head_rows=head_rows,
        window=window,
    )
    q, k_new, v_new = jnp.asarray(c["q"]), jnp.asarray(c["k_new"]), jnp.asarray(c["v_new"])
    return AttnArgs(q, k_new, v_new, kc, vc, jnp.int32(c["layer"]), meta)


def run(c: dict, chunk_blocks: int, bf16: bool = False, head_rows: int = 0, window: int = 0) -> np.ndarray:
    return np.asarray(jax.jit(paged_attention)(inputs(c, chunk_blocks, bf16, head_rows, window)))


MIXED = [(0, 7), (13, 1), (5, 1), (9, 4), (0, 1), (22, 3)]  # prefill, decodes, cached-prefix chunks


WINDOW_MANY = [(13, 1), (33, 1), (5, 1), (0, 7), (22, 5), (9, 4)]  # more: per token
