"""matmul_precision "high": float32 matmuls as three bf16 products on AMX (kernels/cpu_native.py).

The packing's layout and its hi + lo split, the kernel against a float64 product within the
bf16x3 error bound (and measurably off float32, so the AMX path is what ran) over row counts
that fill and do not fill its 32-row pairs, outputs and K that do not fill its tiles and out
axes of several dims, the dispatch by row count, a refusal of mismatched packed weights, and a
runner whose greedy tokens and logprobs match the float32 runner's. Tests of the kernel skip
on a machine without AMX-BF16 (they say so); the fallback's reason is tested everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu_native
from tests.helpers.runner import ENGINE, Seq, generate, make_runner
from tl.core.config import ConfigError, EngineConfig
from tl.model.weights import Bf16x3, Dense

AMX_TARGET = "sapphirerapids"  # the build with AMX-BF16 (kernels/cpu_build.py)
needs_amx = pytest.mark.skipif(not cpu_native.amx_available(AMX_TARGET), reason="no AMX-BF16 on this CPU")


def _lib() -> cpu_native.NativeLib:
    return cpu_native.library(AMX_TARGET)


def _f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_pack_layout_and_split() -> None:
    """Element (o, k) sits at [o // 16, k // 32, part, (k % 32) // 2, o % 16, k % 2]; hi is w
    rounded to bf16 and hi + lo is w to within 2^-16 of |w|; padding is zero."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 70)).astype(np.float32)
    p = cpu_native.pack_bf16x3(w)
    assert p.dtype == np.uint16 and p.shape == (4, 3, 2, 16, 32)  # 40 outputs -> 4 blocks (even), 70 k -> 3
    tiles = p.reshape(4, 3, 2, 16, 16, 2)
    for o, k in [(0, 0), (17, 33), (39, 69), (5, 31), (16, 32)]:
        hi, lo = (_f32(tiles[o // 16, k // 32, part, (k % 32) // 2, o % 16, k % 2]) for part in (0, 1))
        assert hi == np.float32(jnp.asarray(w[o, k]).astype(jnp.bfloat16).astype(jnp.float32))
        assert abs(float(hi) + float(lo) - float(w[o, k])) <= 2.0**-16 * abs(float(w[o, k]))
    whole = _f32(tiles[:, :, 0]) + _f32(tiles[:, :, 1])  # [OB, KB, kp, o, j] -> [O, K]
    dense = whole.transpose(0, 3, 1, 2, 4).reshape(64, 96)
    assert np.abs(dense[:40, :70] - w).max() <= 2.0**-16 * np.abs(w).max()
    assert not dense[40:].any() and not dense[:, 70:].any()


@needs_amx
@pytest.mark.parametrize("rows", [17, 31, 32, 33, 64, 100, 512])
@pytest.mark.parametrize(
    "shape",
    [(3, 5, 64, 576), (576, 1536), (23, 40), (6, 33), (13, 2, 48)],
    ids=["qkv", "down", "odd_k_and_o", "k_33", "o_26_k_48"],
)
def test_bf16x3_matches_float64(rows: int, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, shape[-1])).astype(np.float32)
    w = (rng.standard_normal(shape) / 8).astype(np.float32)
    got = np.asarray(
        jax.jit(_lib().matmul_bf16x3, static_argnums=2)(
            jnp.asarray(x), jnp.asarray(cpu_native.pack_bf16x3(w)), shape[:-1]
        )
    )
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want = np.einsum("nk,...k->n...", x64, w64)
    assert got.shape == want.shape
    # Each product carries ~2^-16 of |x w| (x_lo w_lo dropped, the splits' residues), plus the
    # float32 sums.
    bound = np.einsum("nk,...k->n...", np.abs(x64), np.abs(w64)) * 2.0**-15 + 1e-6
    assert (np.abs(got - want) <= bound).all()


@needs_amx
def test_stale_nan_does_not_reach_a_later_call() -> None:
    """The kernel reuses its activation tiles between calls and zeroes k past K itself: a
    17-row, K = 33 product right after a 512-row call whose input was all NaN (every element of
    the same two k blocks) is still exact to its bound."""
    rng = np.random.default_rng(2)
    big_w, small_w = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((20, 33)).astype(np.float32)
    small_x = rng.standard_normal((17, 33)).astype(np.float32)

    @jax.jit
    def both(bx: jax.Array, sx: jax.Array) -> jax.Array:
        y = _lib().matmul_bf16x3(bx, jnp.asarray(cpu_native.pack_bf16x3(big_w)), (32,))
        return _lib().matmul_bf16x3(
            sx + 0 * jnp.nan_to_num(y[:17, :1]), jnp.asarray(cpu_native.pack_bf16x3(small_w)), (20,)
        )

    got = np.asarray(both(jnp.full((512, 64), jnp.nan, jnp.float32), jnp.asarray(small_x)))
    want = small_x.astype(np.float64) @ small_w.astype(np.float64).T
    bound = np.abs(small_x.astype(np.float64)) @ np.abs(small_w.astype(np.float64)).T * 2.0**-15 + 1e-6
    assert (np.abs(got - want) <= bound).all()


@needs_amx
def test_high_differs_from_float32_where_bf16x3_runs() -> None:
    """The AMX path ran (not a float32 kernel): its results are off float32 by its own rounding."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 576)).astype(np.float32))
    w = rng.standard_normal((960, 576)).astype(np.float32) / 8
    high = np.asarray(jax.jit(_lib().matmul)(x, Bf16x3(jnp.asarray(w), jnp.asarray(cpu_native.pack_bf16x3(w)))))
    f32 = np.asarray(jax.jit(_lib().matmul)(x, Dense(jnp.asarray(w))))
    diff = np.abs(high - f32).max()
    assert 0 < diff < 1e-3


@needs_amx
def test_every_row_count_runs_bf16x3_and_a_row_is_its_own() -> None:
    """One arithmetic at every row count (issue 48): the AMX kernel at 1 row as at 300, and each
    row's result bit for bit the same alone as in a larger call."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 64)).astype(np.float32)
    packed = Bf16x3(jnp.asarray(w), jnp.asarray(cpu_native.pack_bf16x3(w)))
    lib = _lib()
    amx = lib.ffi_names["tl_gemm_bf16x3"]
    assert amx in str(jax.make_jaxpr(lib.matmul)(jnp.ones((1, 64)), packed))
    x = rng.standard_normal((300, 64)).astype(np.float32)
    mm = jax.jit(lib.matmul)
    whole = np.asarray(mm(jnp.asarray(x), packed))
    for a, b in ((0, 1), (5, 6), (3, 20), (17, 64), (250, 300)):
        np.testing.assert_array_equal(np.asarray(mm(jnp.asarray(x[a:b]), packed)), whole[a:b])


@needs_amx
def test_mismatched_packing_is_refused() -> None:
    packed = jnp.asarray(cpu_native.pack_bf16x3(np.ones((32, 64), np.float32)))  # K 64
    with pytest.raises(Exception, match="packed weights do not match"):
        jax.block_until_ready(_lib().matmul_bf16x3(jnp.ones((32, 100), jnp.float32), packed, (32,)))
    with pytest.raises(Exception, match="packed weights do not match"):  # 64 outputs from 32 packed
        jax.block_until_ready(_lib().matmul_bf16x3(jnp.ones((32, 64), jnp.float32), packed, (64,)))


@needs_amx
def test_runner_high_matches_float32_runner() -> None:
    """A tiny model with matmul_precision high (64-token prefill steps: the AMX kernel runs)
    generates the float32 runner's greedy tokens, logprobs within 1e-3, and says which ran."""
    engine = ENGINE.replace(token_buckets=(8, 32, 64), max_num_batched_tokens=64)
    prompts = [[5, 9, 2, 77, 31, 8, 150, 4, 19, 60, 3] * 4, [7, 7, 1] * 12, [99] * 40, list(range(100, 150))]

    def run(precision: str) -> tuple[object, list[Seq]]:
        runner, _ = make_runner(engine.replace(matmul_precision=precision))
        return runner, generate(runner, prompts, 10, chunk=16)

    high, got = run("high")
    highest, want = run("highest")
    assert high.backend_info.matmul_precision == "high" and high.plan.precision.reason.startswith("configured")
    assert highest.backend_info.matmul_precision == "highest"
    for a, b in zip(got, want, strict=True):
        assert a.out == b.out and np.allclose(a.logprobs, b.logprobs, atol=1e-3)


@pytest.mark.parametrize(
    ("kw", "why"),
    [({"weight_dtype": "int8"}, "weight_dtype int8"), ({"matmul_kernel": "xla"}, "the matmul is xla (configured)")],
)
def test_high_falls_back_with_a_reason(kw: dict, why: str) -> None:
    """int8 weights, or no native matmul (and, on a machine without AMX, everything) run
    highest, and say why."""
    runner, _ = make_runner(ENGINE.replace(matmul_precision="high", **kw))
    assert runner.backend_info.matmul_precision == "highest"
    assert "runs highest" in runner.plan.precision.reason
    assert why in runner.plan.precision.reason or not cpu_native.amx_available(AMX_TARGET)


def test_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match="matmul_precision"):
        EngineConfig(matmul_precision="medium")  # type: ignore[arg-type]
