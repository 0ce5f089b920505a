"""kernels/paged_attention.py reference vs a naive dense attention (gather everything, mask, softmax).

Random small shapes, non-contiguous block tables, a batch mixing a fresh prefill chunk, decodes,
chunks with cached prefixes and padding tokens; float32 and uint16-stored bf16 caches; sliding
windows (1, under a block, not a multiple of the block size, over the context) in every form.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.attention_cases import MIXED, WINDOW_MANY, build_case, naive, run


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
