"""kernels/cpu_native.py `qgemm` (kernels/cpu/quant.h): matmuls over llama.cpp's q8_0, q4_0, q4_1,
q5_0 and q5_1 blocks and q4_k, q5_k, q6_k super-blocks, once per build this CPU runs (as
tests/kernels/test_cpu_native.py's `lib`).

Weights are real ggml blocks (gguf.quants.quantize), x random. Two checks a case:
- against float64: the product of gguf's own dequantized weights with x, within the error of
  the arithmetic. x is quantized per block b of 32 to xhat = d_x q (d_x = amax / 127, q =
  roundf(x / d_x) with 1 / d_x and x / d_x rounded to float32: |x/d_x - q| <= 1/2 + 256 u), so
  |w . (x - xhat)| <= sum_k |w_k| d_x(b) (1/2 + 256 u); plus the float32 rounding of the scaled
  block sums (`emulated`'s bound), plus gguf's own rounding of d w + m to float32 (u a weight).
- against a numpy emulation of the same integer arithmetic (x quantized the ggml way in float32,
  exact integer block sums, scaling in float64): within gamma_{K+4} T, T = sum_b |d_w d_x| sum_k
  |w_k q_k| + |m_w d_x sum(q)|: each of at most K lane or block terms is rounded twice (by d_x,
  by d_w) before a sum of at most K terms in any order. This one is tight: a wrong nibble,
  sign or rounding moves some output by a whole d_w d_x w q, far beyond it.
The K-quants the same two ways, on random raw super-blocks (gguf-py has no K quantizer): x
quantized per 256; each super-block's integer sums (isum = sum sc u q over its groups of 16, msum
= sum mn bsum) exact, the float terms d_w d_x isum and dmin d_x msum (or those of the int32 lanes
they are summed from, (d_w lane - dmin lane') d_x) rounded at most four times before a sum of
at most K/8 of them (16 lanes each of isum and msum a super-block on AVX-512, fewer elsewhere),
so gamma_{K/8+8} T with T = sum |d_w d_x| sum |sc u q| + |dmin d_x| sum |mn bsum|; against
float64 the same x quantization bound, and gguf's one rounding of
each d sc u - dmin mn (U (|d sc u| + |dmin mn|), not U |w|: the difference can cancel).
"""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from kernels import cpu_build, cpu_native
from tests.helpers.bounds import U, gamma

KINDS = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q5_0": gguf.GGMLQuantizationType.Q5_0,
    "q5_1": gguf.GGMLQuantizationType.Q5_1,
}


@pytest.fixture(scope="module", params=[t.name for t in cpu_build.runnable()])
def lib(request: pytest.FixtureRequest) -> cpu_native.NativeLib:
    return cpu_native.library(request.param)


ROWS = (1, 2, 3, 5, 8, 16, 17, 64, 65, 300)  # 65, 300: the panels (300: past a run of 256 rows)
PANEL_BUILDS = ("x86-64-v3", "x86-64-v4", "x86-64-v4-vnni", "sapphirerapids")  # the panel kernels': any row count
SHAPES = [((37,), 32), ((3, 40), 576), ((24,), 1536)]  # (out, K)


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float64)


def blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw ggml rows [O, row_bytes] -> (signed weights [O, nb, 32] int64, d [O, nb], m [O, nb]) with
    value = d w + m, read from the bytes as ggml's block structs lay them out."""
    o = raw.shape[0]
    b = raw.reshape(o, -1, cpu_native.QUANT_KINDS[kind][1])
    d = _half(b[..., 0:2])
    m = _half(b[..., 2:4]) if kind in ("q4_1", "q5_1") else np.zeros_like(d)
    if kind == "q8_0":
        return np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.int64), d, m
    qs = b[..., -16:].astype(np.int64)
    w = np.concatenate([qs & 15, qs >> 4], axis=-1)  # byte j: element j (low nibble), j + 16 (high)
    if kind in ("q5_0", "q5_1"):
        at = 2 if kind == "q5_0" else 4
        qh = np.ascontiguousarray(b[..., at : at + 4]).view(np.uint32)[..., 0].astype(np.int64)
        w |= ((qh[..., None] >> np.arange(32)) & 1) << 4
    return w - {"q4_0": 8, "q5_0": 16}.get(kind, 0), d, m


def quantize_x(x: np.ndarray, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_0_ref with a float32 d, per block of `size` (256: the K-quants' Q8_K
    geometry, same rule): x [N, K] -> (q [N, nb, size] int64, d [N, nb])."""
    xb = x.reshape(x.shape[0], -1, size).astype(np.float32)
    d = np.abs(xb).max(-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    v = (xb * inv[..., None]).astype(np.float64)  # the float32 product, exactly
    return (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int64), d.astype(np.float64)


def emulated(x: np.ndarray, raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(y [N, O] of llama.cpp's arithmetic, integer sums exact and scaling in float64; its float32
    rounding bound [N, O] as the module docstring derives it)."""
    w, dw, m = blocks(raw, kind)
    q, dx = quantize_x(x)
    isum = np.einsum("nbk,obk->nob", q, w).astype(np.float64)
    iabs = np.einsum("nbk,obk->nob", np.abs(q), np.abs(w)).astype(np.float64)
    sq = q.sum(-1).astype(np.float64)  # [N, nb]
    scale = dw[None] * dx[:, None]  # [N, O, nb]
    y = (scale * isum).sum(-1) + (m[None] * (dx * sq)[:, None]).sum(-1)
    t = (np.abs(scale) * iabs).sum(-1) + (np.abs(m[None]) * np.abs(dx * sq)[:, None]).sum(-1)
    return y, gamma(x.shape[1] + 4) * t


def case(rng: np.random.Generator, kind: str, out: tuple[int, ...], k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """x [n, k] float32 and ggml rows [*out, row_bytes] of random weights (an offset for the _1 kinds)."""
    w = rng.standard_normal((*out, k)).astype(np.float32) * 0.1
    if kind.endswith("_1"):
        w += np.float32(0.05)
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[:, :32] *= 100  # blocks of very different scales
    if k > 32:
        x[:, 32:64] = 0  # an all-zero block: d = 0
    return x, quantize(w, KINDS[kind])


@pytest.mark.parametrize("out,k", SHAPES, ids=[f"K{k}" for _, k in SHAPES])
@pytest.mark.parametrize("kind", list(KINDS))
def test_qgemm_matches_float64_and_llama_cpp_arithmetic(
    lib: cpu_native.NativeLib, kind: str, out: tuple[int, ...], k: int
) -> None:
    rng = np.random.default_rng(k + len(kind))
    x, raw = case(rng, kind, out, k, max(ROWS))
    rows = raw.reshape(-1, raw.shape[-1])
    w, dw, m = blocks(rows, kind)
    deq = dequantize(rows, KINDS[kind]).astype(np.float64)  # gguf's float32 d w + m
    exact_w = (dw[..., None] * w + m[..., None]).reshape(deq.shape)
    assert (np.abs(deq - exact_w) <= U * (np.abs(dw[..., None] * w) + np.abs(m[..., None])).reshape(deq.shape)).all()
    assert lib.qgemm_max_rows(kind) == (1 << 16 if lib.target.name in PANEL_BUILDS else 64)
    for n in (n for n in ROWS if n <= lib.qgemm_max_rows(kind)):
        xn = x[:n]
        got = lib.qgemm(jnp.asarray(xn), jnp.asarray(raw), kind)
        assert got is not None
        got = np.asarray(got)
        assert got.shape == (n, *out) and got.dtype == np.float32
        got = got.reshape(n, -1).astype(np.float64)

        want, fp_bound = emulated(xn, rows, kind)
        err = np.abs(got - want)
        assert (err <= fp_bound).all(), f"n={n}: {err.max():.3g} from the emulation, bound {fp_bound.min():.3g}"

        _, dx = quantize_x(xn)
        quant_bound = np.einsum("ok,nk->no", np.abs(deq), np.repeat(dx, 32, axis=1)) * (0.5 + 256 * U)
        deq_bound = U * np.abs(xn.astype(np.float64)) @ np.abs(exact_w).T
        err64 = np.abs(got - xn.astype(np.float64) @ deq.T)
        bound = quant_bound + fp_bound + deq_bound
        assert (err64 <= bound).all(), f"n={n}: {err64.max():.3g} from float64, bound {bound.min():.3g}"
        assert err64.max() > 0  # the x quantization is really there


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("k", [576, 608])  # 18 and 19 blocks: whole pairs, and an odd last block
def test_a_rows_result_does_not_depend_on_the_other_rows(lib: cpu_native.NativeLib, kind: str, k: int) -> None:
    """Batch invariance, bit for bit, at every row count a build takes: each row of a call equals
    that row alone and that row in other slices (other kernels: on AVX-512 VNNI one row, a few
    rows, and the panels from 8 rows, one arithmetic), so a request alone or in a batch of
    decodes, and a prompt's last rows computed again after a prefix-cache hit, give the same
    tokens."""
    rng = np.random.default_rng(len(kind) + k)
    n = min(300, lib.qgemm_max_rows(kind))  # 300: past a panel run of 256 rows
    x, raw = case(rng, kind, (45,), k, n)
    w = jnp.asarray(raw)
    whole = np.asarray(lib.qgemm(jnp.asarray(x), w, kind))
    for i in (0, 1, 5, 63, n - 1):
        np.testing.assert_array_equal(np.asarray(lib.qgemm(jnp.asarray(x[i : i + 1]), w, kind)), whole[i : i + 1])
    for a, b in ((0, 2), (2, 5), (3, 10), (7, 15), (1, 64), (32, 64)):
        np.testing.assert_array_equal(np.asarray(lib.qgemm(jnp.asarray(x[a:b]), w, kind)), whole[a:b])


K_KINDS = ("q4_k", "q5_k", "q6_k")
K_ROWS = (1, 3, 16, 64, 150)  # 150: past the tiles' 64 (the SIMD builds: several runs of x)
K_ANY_ROWS = (*PANEL_BUILDS, "aarch64-dotprod")  # the builds whose K-quant tiles take any row count
K_SHAPES = [((37,), 256), ((3, 40), 768), ((24,), 2048)]  # (out, K): 1, 3 and 8 super-blocks


def scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4, sub-block by sub-block: 12 bytes [..., 12] -> (scales, mins) [..., 8]."""
    sc, mn = np.empty(s.shape[:-1] + (8,), np.int64), np.empty(s.shape[:-1] + (8,), np.int64)
    for j in range(8):
        if j < 4:
            sc[..., j], mn[..., j] = s[..., j] & 63, s[..., j + 4] & 63
        else:
            sc[..., j] = (s[..., j + 4] & 0xF) | ((s[..., j - 4] >> 6) << 4)
            mn[..., j] = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
    return sc, mn


def k_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, ...]:
    """Raw ggml rows [O, row_bytes] -> (codes u [O, ns, 256], scale sc and min mn per 16 inputs
    [O, ns, 16] int64, d, dmin [O, ns]) with weight = d sc u - dmin mn (q6_k: d sc (u - 32), so
    mn = 32 sc and dmin = d), read from the bytes as ggml's block_q*_K structs lay them out."""
    o = raw.shape[0]
    raw = raw.reshape(o, -1, cpu_native.QUANT_KINDS[kind][1])
    b = raw.astype(np.int64)
    u = np.empty(b.shape[:-1] + (256,), np.int64)
    if kind == "q6_k":  # ql[128], qh[64], int8 scales[16], f16 d
        for h in range(2):
            for c in range(4):  # quarter c of half h: ql's low (c < 2) or high nibbles, qh's bits 2c, 2c+1
                ql = b[..., 64 * h + 32 * (c & 1) : 64 * h + 32 * (c & 1) + 32]
                qh = b[..., 128 + 32 * h : 128 + 32 * h + 32]
                at = 128 * h + 32 * c
                u[..., at : at + 32] = ((ql >> 4 * (c >> 1)) & 15) | (((qh >> 2 * c) & 3) << 4)
        sc = np.ascontiguousarray(raw[..., 192:208]).view(np.int8).astype(np.int64)
        d = _half(raw[..., 208:210])
        return u, sc, 32 * sc, d, d
    qs = b[..., 16:144] if kind == "q4_k" else b[..., 48:176]
    for s in range(8):  # sub-block s: the low (even s) or high nibbles of 32 bytes, q5_k's bit s of qh on top
        u[..., 32 * s : 32 * s + 32] = (qs[..., 32 * (s // 2) : 32 * (s // 2) + 32] >> 4 * (s & 1)) & 15
        if kind == "q5_k":
            u[..., 32 * s : 32 * s + 32] |= ((b[..., 16:48] >> s) & 1) << 4
    sc, mn = scale_min_k4(b[..., 4:16])
    return u, np.repeat(sc, 2, -1), np.repeat(mn, 2, -1), _half(raw[..., 0:2]), _half(raw[..., 2:4])


def k_case(rng: np.random.Generator, kind: str, out: tuple[int, ...], k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """x [n, k] float32 and random raw super-blocks [*out, row_bytes] (every byte random, the float16
    d and dmin random normal * 0.01, either sign)."""
    _, bb, size = cpu_native.QUANT_KINDS[kind]
    raw = rng.integers(0, 256, (*out, k // size, bb), dtype=np.uint8)
    scales = (rng.standard_normal((*out, k // size, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if kind == "q6_k":
        raw[..., 208:210] = scales[..., :2]
    else:
        raw[..., 0:4] = scales
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[:, :16] *= 100  # groups of very different scales
    if k > 256:
        x[:, 256:512] = 0  # an all-zero super-block: d = 0
    return x, raw.reshape(*out, -1)


def emulated_k(x: np.ndarray, raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(y [N, O] of the K-quant arithmetic, integer sums exact and scaling in float64; its float32
    rounding bound [N, O] as the module docstring derives it)."""
    u, sc, mn, d, dmin = k_blocks(raw, kind)
    q, dx = quantize_x(x, 256)
    o, ns = u.shape[:2]
    qg, ug = q.reshape(len(x), ns, 16, 16), u.reshape(o, ns, 16, 16)
    gsum = np.einsum("nsgi,osgi->nosg", qg, ug)  # exact int64 group sums
    gabs = np.einsum("nsgi,osgi->nosg", np.abs(qg), ug)
    bs = qg.sum(-1)  # [N, ns, 16]: ggml's bsums
    isum = (gsum * sc[None]).sum(-1).astype(np.float64)  # [N, O, ns]
    msum = np.einsum("nsg,osg->nos", bs, mn).astype(np.float64)
    scale, mscale = d[None] * dx[:, None], dmin[None] * dx[:, None]
    y = (scale * (isum - msum)).sum(-1) if kind == "q6_k" else (scale * isum - mscale * msum).sum(-1)
    iabs = (gabs * np.abs(sc[None])).sum(-1)
    mabs = np.einsum("nsg,osg->nos", np.abs(bs), np.abs(mn))
    t = (np.abs(scale) * iabs + np.abs(mscale) * mabs).sum(-1)
    return y, gamma(x.shape[1] // 8 + 8) * t


@pytest.mark.parametrize("out,k", K_SHAPES, ids=[f"K{k}" for _, k in K_SHAPES])
@pytest.mark.parametrize("kind", K_KINDS)
def test_qgemm_k_quants_match_float64_and_llama_cpp_arithmetic(
    lib: cpu_native.NativeLib, kind: str, out: tuple[int, ...], k: int
) -> None:
    rng = np.random.default_rng(k + 7 * len(kind) + K_KINDS.index(kind))
    x, raw = k_case(rng, kind, out, k, max(K_ROWS))
    rows = raw.reshape(-1, raw.shape[-1])
    u, sc, mn, d, dmin = k_blocks(rows, kind)
    parts = np.abs(np.repeat(d[..., None] * sc, 16, -1) * u) + np.abs(np.repeat(dmin[..., None] * mn, 16, -1))
    exact_w = np.repeat(d[..., None] * sc, 16, -1) * u - np.repeat(dmin[..., None] * mn, 16, -1)
    exact_w, parts = exact_w.reshape(len(rows), k), parts.reshape(len(rows), k)
    deq = dequantize(rows, gguf.GGMLQuantizationType[kind.upper()]).astype(np.float64)
    assert (np.abs(deq - exact_w) <= U * parts).all()  # our reading of the bytes is gguf's
    assert lib.qgemm_max_rows(kind) == (1 << 16 if lib.target.name in K_ANY_ROWS else 64)
    for n in (n for n in K_ROWS if n <= lib.qgemm_max_rows(kind)):
        xn = x[:n]
        got = lib.qgemm(jnp.asarray(xn), jnp.asarray(raw), kind)
        assert got is not None
        got = np.asarray(got)
        assert got.shape == (n, *out) and got.dtype == np.float32
        got = got.reshape(n, -1).astype(np.float64)

        want, fp_bound = emulated_k(xn, rows, kind)
        err = np.abs(got - want)
        assert (err <= fp_bound).all(), f"n={n}: {err.max():.3g} from the emulation, bound {fp_bound.min():.3g}"

        _, dx = quantize_x(xn, 256)
        quant_bound = np.einsum("ok,nk->no", np.abs(deq), np.repeat(dx, 256, axis=1)) * (0.5 + 256 * U)
        deq_bound = U * np.abs(xn.astype(np.float64)) @ parts.T
        err64 = np.abs(got - xn.astype(np.float64) @ deq.T)
        bound = quant_bound + fp_bound + deq_bound
        assert (err64 <= bound).all(), f"n={n}: {err64.max():.3g} from float64, bound {bound.min():.3g}"
        assert err64.max() > 0


@pytest.mark.parametrize("kind", K_KINDS)
@pytest.mark.parametrize("k", [768, 2048])  # runs of x of 40 or 16 rows: many in 150 rows
def test_a_k_quant_rows_result_does_not_depend_on_the_other_rows(lib: cpu_native.NativeLib, kind: str, k: int) -> None:
    """The K-quants' batch invariance, bit for bit: each row of a call equals that row alone and
    in other slices, whatever tile and run of x it falls in."""
    rng = np.random.default_rng(len(kind) + k)
    n = min(150, lib.qgemm_max_rows(kind))
    x, raw = k_case(rng, kind, (21,), k, n)
    w = jnp.asarray(raw)
    whole = np.asarray(lib.qgemm(jnp.asarray(x), w, kind))
    for i in (0, 1, 5, 63, n - 1):
        np.testing.assert_array_equal(np.asarray(lib.qgemm(jnp.asarray(x[i : i + 1]), w, kind)), whole[i : i + 1])
    for a, b in ((0, 2), (2, 5), (3, 10), (7, 15), (1, 64), (17, n)):
        np.testing.assert_array_equal(np.asarray(lib.qgemm(jnp.asarray(x[a:b]), w, kind)), whole[a:b])


def test_qgemm_declines_what_it_does_not_take(lib: cpu_native.NativeLib) -> None:
    rng = np.random.default_rng(0)
    x, raw = case(rng, "q4_0", (8,), 64, 2)
    xj, wj = jnp.asarray(x), jnp.asarray(raw)
    assert lib.qgemm(xj, wj, "q4_0") is not None
    assert lib.qgemm(xj, wj, "q6_k") is None
    assert lib.qgemm(xj, wj, "q8_0") is None  # rows are not K/32 q8_0 blocks
    assert lib.qgemm(xj.astype(jnp.bfloat16), wj, "q4_0") is None
    assert lib.qgemm(xj, wj.view(jnp.int8), "q4_0") is None
    many = jnp.zeros((lib.qgemm_max_rows("q4_0") + 1, 64), jnp.float32)
    assert lib.qgemm(many, wj, "q4_0") is None
    assert lib.qgemm_max_rows("q4_k") == (1 << 16 if lib.target.name in K_ANY_ROWS else 64)
    assert lib.qgemm(jnp.zeros((1, 48), jnp.float32), jnp.zeros((8, 27), jnp.uint8), "q4_0") is None  # K % 32
    assert lib.qgemm(jnp.zeros((1, 288), jnp.float32), jnp.zeros((8, 162), jnp.uint8), "q4_k") is None  # K % 256
    assert lib.qgemm(jnp.zeros((1, 256), jnp.float32), jnp.zeros((8, 145), jnp.uint8), "q4_k") is None  # not 144
