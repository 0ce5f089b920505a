"""tl/sampler.py: support restriction, frequencies, seeds, draft verification, penalties, logprobs.

Statistical checks draw thousands of independent rows in one call (same logits, steps 0..N-1)
with fixed seeds, so they are deterministic; thresholds are chi-square at p ~ 1e-4.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tl.request import SamplingParams
from tl.sampler import pack_penalties, pack_rows, sample, top_logprobs

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
