"""tl/model/rowwise.py: a row's sums are the same bit for bit at every row count, and right.

Each function, jitted, on rows of several lengths (37, 64: Qwen3's head norms, 576: SmolLM2's
hidden size, 640: Gemma 3 270M's, 49152: SmolLM2's vocabulary), for a row alone and the same
row among 1 to 511 others at several places; and against float64 within float32's bound.
jnp's own mean is shown to differ for some of these (the reason the module exists): if a JAX
release makes it invariant, that check fails and says so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.bounds import gamma
from tl.model import llama, rowwise

LENGTHS = [37, 64, 576, 640, 49152]
COUNTS = [1, 2, 7, 9, 64, 512]


def _rows(n: int, length: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, length)) * 3).astype(np.float32)


FUNCS = {
    "row_sum": rowwise.row_sum,
    "logsumexp": rowwise.logsumexp,
    "softmax": rowwise.softmax,
    "log_softmax": rowwise.log_softmax,
    "cumsum": rowwise.cumsum,
}


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("name", list(FUNCS))
def test_a_rows_result_is_its_own_at_every_row_count(name: str, length: int) -> None:
    if name == "cumsum" and length > 640:
        length = 4096  # the scan's programs grow with the length: one long row is enough
    fn = jax.jit(FUNCS[name])
    x = _rows(512, length)
    alone = {i: np.asarray(fn(x[i : i + 1]))[0] for i in (0, 3, 100, 511)}
    for n in COUNTS:
        got = np.asarray(fn(x[:n]))
        for i, want in alone.items():
            if i < n:
                np.testing.assert_array_equal(got[i], want, err_msg=f"{name}, row {i} of {n}")
    shifted = np.asarray(fn(x[3:103]))  # row 100 at place 97 of 100
    np.testing.assert_array_equal(shifted[97], alone[100])


@pytest.mark.parametrize("length", LENGTHS)
def test_sums_within_float32s_bound_of_float64(length: int) -> None:
    x = _rows(4, length, seed=1)
    got = np.asarray(jax.jit(rowwise.row_sum)(x), np.float64)
    want = x.astype(np.float64).sum(axis=1)
    assert (np.abs(got - want) <= gamma(length) * np.abs(x).astype(np.float64).sum(axis=1)).all()
    lse = np.asarray(jax.jit(rowwise.logsumexp)(x), np.float64)
    m = x.max(axis=1).astype(np.float64)
    np.testing.assert_allclose(lse, m + np.log(np.exp(x.astype(np.float64) - m[:, None]).sum(axis=1)), rtol=1e-6)
    cs = np.asarray(jax.jit(rowwise.cumsum)(x[:, :512]), np.float64)
    bound = gamma(512) * np.cumsum(np.abs(x[:, :512]).astype(np.float64), axis=1)
    assert (np.abs(cs - np.cumsum(x[:, :512].astype(np.float64), axis=1)) <= bound).all()


def test_edges() -> None:
    neg = jnp.full((2, 8), -jnp.inf)
    assert np.isneginf(np.asarray(rowwise.logsumexp(neg))).all()
    p = np.asarray(rowwise.softmax(jnp.asarray([[0.0, -jnp.inf, 0.0, 1e30]])))
    assert p[0, 3] == 1.0 and p[0, 1] == 0.0
    assert np.asarray(rowwise.row_sum(jnp.ones((3, 1)))).tolist() == [1.0, 1.0, 1.0]


def test_rms_norm_of_a_row_is_its_own_and_jnps_mean_was_not() -> None:
    """RMSNorm (every layer, twice) over rows of SmolLM2's and Gemma 3's widths: the row alone and
    among others agree; the mean by jnp.mean did not at some row count for these widths."""
    differed = []
    for length in (576, 640, 64):
        x = _rows(512, length, seed=2)
        w = np.random.default_rng(3).standard_normal(length).astype(np.float32)
        norm = jax.jit(lambda x, w=w: llama.rms_norm(x, w, 1e-5))
        plain = jax.jit(lambda x: jnp.mean(x * x, axis=-1))
        alone = np.asarray(norm(x[:1]))[0]
        plain_alone = np.asarray(plain(x[:1]))[0]
        for n in COUNTS:
            np.testing.assert_array_equal(np.asarray(norm(x[:n]))[0], alone, err_msg=f"width {length}, {n} rows")
            if np.asarray(plain(x[:n]))[0] != plain_alone:
                differed.append((length, n))
    assert differed, "jnp.mean is batch invariant on this jaxlib: tl/model/rowwise.py could go"
