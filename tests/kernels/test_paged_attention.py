"""kernels/paged_attention.py reference vs a naive dense attention (gather everything, mask, softmax).

Random small shapes, non-contiguous block tables, a batch mixing a fresh prefill chunk, decodes,
chunks with cached prefixes and padding tokens; float32 and uint16-stored bf16 caches; sliding
windows (1, under a block, not a multiple of the block size, over the context) in every form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunk_blocks", [1, 3])
def test_matches_naive_on_mixed_batch(seed: int, chunk_blocks: int) -> None:
    c = build_case(np.random.default_rng(seed), MIXED, pad=5)
    got = run(c, chunk_blocks)
    assert np.abs(got - naive(c))[c["seq_idx"] >= 0].max() < 1e-5
    assert np.isfinite(got).all()  # padding rows too


@pytest.mark.parametrize("seqs", [MIXED[:1], MIXED[2:6], MIXED[:4] + [(0, 2)]])
def test_per_seq_and_per_token_forms_match_naive(seqs: list[tuple[int, int]]) -> None:
    """S <= SEQ_DENSE_MAX_SEQS takes the per-sequence form, S above it the per-token form."""
    c = build_case(np.random.default_rng(len(seqs)), seqs, pad=3)
    assert np.abs(run(c, 2) - naive(c))[c["seq_idx"] >= 0].max() < 1e-5


@pytest.mark.parametrize("head_rows", [1, 3, 9, 14])
def test_split_rows_match_naive(head_rows: int) -> None:
    """The per-token form over rows [:H] and [H:] apart (decodes first, then chunks) is exact for any H."""
    seqs = [(13, 1), (5, 1), (22, 1), (9, 2), (0, 7), (17, 4), (0, 3)]
    c = build_case(np.random.default_rng(head_rows), seqs, pad=4)
    for chunk_blocks in (1, 2):
        assert np.abs(run(c, chunk_blocks, head_rows=head_rows) - naive(c))[c["seq_idx"] >= 0].max() < 1e-5


def test_fresh_prefill_only_and_decode_only() -> None:
    rng = np.random.default_rng(7)
    for seqs in ([(0, 9)], [(17, 1), (3, 1), (30, 1)]):
        c = build_case(rng, seqs, pad=2)
        assert np.abs(run(c, 2) - naive(c))[c["seq_idx"] >= 0].max() < 1e-5


def test_bf16_bits_cache() -> None:
    c = build_case(np.random.default_rng(3), MIXED, pad=1)
    got = run(c, 2, bf16=True)
    assert np.abs(got - naive(c))[c["seq_idx"] >= 0].max() < 5e-2


# Decodes first (the split form's head), then a fresh prefill, chunks over cached prefixes (one
# reaching past several 4-key blocks), padding. At most SEQ_DENSE_MAX_SEQS sequences: per sequence.
WINDOW_FEW = [(13, 1), (33, 1), (0, 7), (22, 5)]
WINDOW_MANY = [(13, 1), (33, 1), (5, 1), (0, 7), (22, 5), (9, 4)]  # more: per token


@pytest.mark.parametrize("window,chunk_blocks", [(1, 1), (3, 3), (6, 1), (6, 3), (100, 1)])
def test_sliding_window_matches_naive_in_every_form(window: int, chunk_blocks: int) -> None:
    """Window 1 (the diagonal only), 3 (under a 4-key block), 6 (not a multiple of it), 100 (over
    every context); chunks of 4 keys (shorter than most windows) and 12 (longer), so that the
    loop's first chunk is past 0 for some steps and at 0 for others. Per sequence (few sequences)
    and per token split at head_rows (many): each part is the plain per-token loop."""
    rng = np.random.default_rng(window)
    for seqs, head_rows, cb in ((WINDOW_FEW, 0, chunk_blocks), (WINDOW_MANY, 3, 4 - chunk_blocks)):
        c = build_case(rng, seqs, pad=3)
        got = run(c, cb, head_rows=head_rows, window=window)
        err = np.abs(got - naive(c, window))[c["seq_idx"] >= 0].max()
        assert err < 1e-5, (seqs, head_rows, cb, err)
        assert np.isfinite(got).all()


def test_window_in_the_unsplit_per_token_form_changes_the_answer() -> None:
    """The per-token form without a split; and the window reaches the output (the cases above can fail)."""
    c = build_case(np.random.default_rng(0), WINDOW_MANY, pad=1)
    real = c["seq_idx"] >= 0
    got = run(c, 1, window=6)
    assert np.abs(got - naive(c, 6))[real].max() < 1e-5
    assert np.abs(got - naive(c))[real].max() > 1e-2
