"""tl/runtime/sampler.py: support restriction, frequencies, seeds, draft verification, penalties, logprobs.

Statistical checks draw thousands of independent rows in one call (same logits, steps 0..N-1)
with fixed seeds, so they are deterministic; thresholds are chi-square at p ~ 1e-4.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tl.core.request import SamplingParams
from tl.runtime.sampler import allowed, apply_mask, pack_penalties, pack_rows, sample, top_logprobs

CHI2_CRIT = {4: 23.5, 5: 25.7, 9: 33.7}  # chi-square 0.9999 quantiles by degrees of freedom
_sample = jax.jit(sample)


def run(
    logits: np.ndarray,
    params: list[SamplingParams],
    seeds: list[int],
    steps: list[int],
    drafts: list[int] | None = None,
    outputs: list[list[int]] | None = None,
) -> tuple[np.ndarray, ...]:
    R, V = logits.shape
    drafts = drafts or [-1] * R
    sb = pack_rows(params, seeds, steps, drafts, R)
    pen = pack_penalties(params, outputs or [[]] * R, list(range(R)), [[]] * R, R, R, 1, V)
    out = _sample(logits.astype(np.float32), sb, pen)
    return np.asarray(out.token), np.asarray(out.logprob), np.asarray(out.accepted)


def draws(logits_row: np.ndarray, p: SamplingParams, n: int, seed: int = 1, draft: int = -1) -> np.ndarray:
    logits = np.tile(logits_row, (n, 1))
    return run(logits, [p] * n, [seed] * n, list(range(n)), [draft] * n)[0]


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expect = probs * counts.sum()
    m = expect > 0
    assert counts[~m].sum() == 0, "drew a token of probability 0"
    return float(((counts[m] - expect[m]) ** 2 / expect[m]).sum())


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


LOGITS = np.log(np.array([0.30, 0.20, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03, 0.015, 0.005]))


def test_frequencies_match_softmax_with_temperature() -> None:
    p = SamplingParams(temperature=0.7)
    got = np.bincount(draws(LOGITS, p, 6000), minlength=10)
    assert chi2(got, softmax(LOGITS / 0.7)) < CHI2_CRIT[9]


@pytest.mark.parametrize(
    "kw,support",
    [
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_p=0.6), [0, 1, 2]),  # 0.30+0.20 = 0.50 < 0.6 <= 0.65
        (dict(top_p=0.45), [0, 1]),
        (dict(min_p=0.45), [0, 1, 2]),  # >= 0.135
        (dict(top_k=4, top_p=0.9, min_p=0.45), [0, 1, 2]),  # top-k 4, top-p keeps 4; min-p drops .12
        (dict(top_k=5, top_p=0.8), [0, 1, 2, 3]),  # top-p over the top-5 mass .85: .68 < .8*.85 <= .77
    ],
)
def test_truncation_support_and_frequencies(kw: dict, support: list[int]) -> None:
    got = np.bincount(draws(LOGITS, SamplingParams(temperature=1.0, **kw), 4000), minlength=10)
    assert set(np.nonzero(got)[0]) == set(support)
    probs = np.zeros(10)
    probs[support] = softmax(LOGITS)[support]
    assert chi2(got, probs / probs.sum()) < CHI2_CRIT[4]


def test_top_k_1_is_greedy() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 200)) * 3
    p = SamplingParams(temperature=1.3, top_k=1)
    tok, lp, _ = run(logits, [p] * 64, list(range(64)), [5] * 64)
    assert (tok == logits.argmax(1)).all()
    greedy, _, _ = run(logits, [SamplingParams(temperature=0.0)] * 64, [0] * 64, [0] * 64)
    assert (greedy == tok).all()
    ref = logits - np.log(np.exp(logits).sum(1, keepdims=True))  # raw log_softmax
    assert np.allclose(lp, ref[np.arange(64), tok], atol=1e-5)


def test_same_seed_same_token_whatever_the_neighbours() -> None:
    rng = np.random.default_rng(1)
    row = rng.standard_normal(100)
    p = SamplingParams(temperature=1.0, top_p=0.9)
    alone = run(row[None], [p], [1234], [7])[0][0]
    others = rng.standard_normal((6, 100))
    batch = np.concatenate([others[:3], row[None], others[3:]])
    params = [SamplingParams(temperature=0.5, top_k=3)] * 3 + [p] + [SamplingParams(temperature=0.0)] * 3
    mixed = run(batch, params, [1, 2, 3, 1234, 5, 6, 7], [0, 1, 2, 7, 4, 5, 6])[0]
    assert mixed[3] == alone
    big_seed = run(row[None], [p], [2**63 - 1], [7])[0][0]
    assert 0 <= big_seed < 100
    steps = run(np.tile(row, (50, 1)), [p] * 50, [1234] * 50, list(range(50)))[0]
    assert len(set(steps.tolist())) > 5  # the step changes the draw


def test_greedy_draft_accept_reject_is_exact() -> None:
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((6, 30))
    am = logits.argmax(1)
    drafts = [int(am[0]), int((am[1] + 1) % 30), -1, int(am[3]), 0 if am[4] else 1, int(am[5])]
    tok, _, acc = run(logits, [SamplingParams(temperature=0.0)] * 6, [0] * 6, [0] * 6, drafts)
    assert acc.tolist() == [True, False, False, True, False, True]
    assert (tok == am).all()


@pytest.mark.parametrize("draft", [0, 3, 9])
def test_draft_verification_preserves_distribution(draft: int) -> None:
    p = SamplingParams(temperature=1.0, top_k=6)
    got = draws(LOGITS, p, 6000, seed=3, draft=draft)
    probs = np.zeros(10)
    probs[:6] = softmax(LOGITS)[:6]
    assert chi2(np.bincount(got, minlength=10), probs / probs.sum()) < CHI2_CRIT[5]


def test_draft_accept_rate_is_its_probability() -> None:
    n = 6000
    logits = np.tile(LOGITS, (n, 1))
    _, _, acc = run(logits, [SamplingParams(temperature=1.0)] * n, [9] * n, list(range(n)), [1] * n)
    q = softmax(LOGITS)[1]
    assert abs(acc.mean() - q) < 4 * np.sqrt(q * (1 - q) / n)


def test_penalties_and_logit_bias() -> None:
    V = 12
    logits = np.linspace(2.0, -1.0, V)[None].repeat(4, 0)
    ps = [
        SamplingParams(temperature=0.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)),
    ]
    outs = [[0, 0], [0, 1], [0, 1, 2], []]
    tok, lp, _ = run(logits, ps, [0] * 4, [0] * 4, outputs=outs)
    # freq: 2 - 4 = -2 -> token 1 (1.727); presence: 0,1 both -2 -> token 2; repetition: 0..2 at most 1 < 1.18 -> 3
    assert tok.tolist() == [1, 2, 3, 7]
    raw = logits[3] - np.log(np.exp(logits[3]).sum())
    assert np.isclose(lp[3], raw[7], atol=1e-5)  # logprob is of the raw distribution


def test_top_logprobs_matches_sort() -> None:
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((3, 300)).astype(np.float32)
    ids, vals = jax.jit(top_logprobs, static_argnums=1)(logits, 5)
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True))
    order = np.argsort(-logits, axis=1)[:, :5]
    assert (np.asarray(ids) == order).all()
    assert np.allclose(np.asarray(vals), np.take_along_axis(ref, order, 1), atol=1e-5)


def test_a_sampled_tokens_logprob_is_its_top_logprobs_entry_whatever_computes_the_lse() -> None:
    """Both take the logsumexp from the same kernel (the native one where the plan runs it):
    with one whose rounding differs from jnp's, the two numbers are still one, bit for bit (they
    were 6e-8 apart when top_logprobs took jnp's while the sampler took the native kernel's)."""
    from tl.runtime.sampler import argmax_lse

    def other_kernel(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        tok, lse = argmax_lse(x)
        return tok, lse + 3e-7  # another summation order's last bits

    logits = np.random.default_rng(5).standard_normal((3, 300)).astype(np.float32)
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=4)] * 3
    sb = pack_rows(params, [0, 0, 0], [0, 0, 0], [-1, -1, -1], 3)
    pen = pack_penalties(params, [[]] * 3, [0, 1, 2], [[]] * 3, 3, 3, 1, 300)
    for lse_fn in (None, other_kernel):
        out = jax.jit(sample, static_argnums=3)(logits, sb, pen, lse_fn)
        ids, vals = jax.jit(top_logprobs, static_argnums=(1, 2))(logits, 4, lse_fn)
        assert (np.asarray(ids)[:, 0] == np.asarray(out.token)).all()
        assert (np.asarray(vals)[:, 0] == np.asarray(out.logprob)).all(), lse_fn


def bitmask(rows: list[set[int]], vocab: int) -> np.ndarray:
    """[R, W] int32 bitmask with the given allowed ids per row (the layout llguidance fills)."""
    bits = np.zeros((len(rows), (vocab + 31) // 32 * 32), np.uint8)
    for r, ids in enumerate(rows):
        bits[r, sorted(ids)] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_bitmask_unpacks_to_the_allowed_ids() -> None:
    rows = [{0, 31, 32, 63, 64, 69}, set(range(70)), {5}]
    got = np.asarray(allowed(bitmask(rows, 70), 70))
    assert [set(np.flatnonzero(r).tolist()) for r in got] == rows


MASK_CASES = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.3),
    SamplingParams(temperature=1.0, presence_penalty=1.5, logit_bias=((0, 20.0),)),
]


@pytest.mark.parametrize("p", MASK_CASES, ids=lambda p: repr(p)[15:60])
def test_a_constrained_row_samples_the_constrained_distribution(p: SamplingParams) -> None:
    """Blocked tokens are never drawn (even a logit_bias of +20 on one does not revive it), the
    draw follows the distribution renormalised over the allowed tokens, and the logprob is that
    distribution's (log_softmax over the allowed raw logits)."""
    keep = {1, 3, 4, 7}
    n = 4000
    logits = np.tile(LOGITS, (n, 1)).astype(np.float32)
    masked = np.asarray(apply_mask(logits, bitmask([keep] * n, 10)))
    tokens, logprobs, _ = run(masked, [p] * n, [3] * n, list(range(n)))
    assert set(np.unique(tokens).tolist()) <= keep
    ref = np.full(10, -np.inf)
    ref[sorted(keep)] = LOGITS[sorted(keep)]
    lsm = ref - np.log(np.exp(ref[sorted(keep)]).sum())
    np.testing.assert_allclose(logprobs, lsm[tokens], rtol=0, atol=1e-5)
    if p.temperature == 1.0 and not p.has_penalties and p.min_p == 0.0:
        assert chi2(np.bincount(tokens, minlength=10), np.exp(lsm)) < CHI2_CRIT[9]
    if p.greedy:
        assert (tokens == 1).all()  # the most likely allowed token


def test_an_open_mask_changes_nothing() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 70)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(apply_mask(logits, bitmask([set(range(70))] * 6, 70))), logits)
    ones = np.full((6, 3), -1, np.int32)  # what the runner sends for unconstrained rows (bits past 70 set too)
    np.testing.assert_array_equal(np.asarray(apply_mask(logits, ones)), logits)


def test_a_draft_the_mask_blocks_is_never_accepted() -> None:
    keep = {2, 5}
    for temperature in (0.0, 1.0):
        p = SamplingParams(temperature=temperature)
        n = 500
        logits = np.tile(LOGITS, (n, 1)).astype(np.float32)
        masked = np.asarray(apply_mask(logits, bitmask([keep] * n, 10)))
        tokens, _, accepted = run(masked, [p] * n, [1] * n, list(range(n)), [0] * n)  # draft 0: the argmax, blocked
        assert not accepted.any() and set(tokens.tolist()) <= keep
