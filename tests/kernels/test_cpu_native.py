"""kernels/cpu_native.py: every native kernel against float64, the jnp reference and XLA, once per
build this CPU runs.

`lib` is each target of kernels/cpu_build.py that this machine can execute (an AMX Xeon: the
sapphirerapids, x86-64-v4, x86-64-v3 and x86-64 builds; an AVX2 EPYC: x86-64-v3 and x86-64; an
ARM machine: aarch64), so the AVX2 and SSE2 code paths run on every developer's machine and in
CI, whatever the CPU. Bounds come from float32 arithmetic (tests/helpers/bounds.py), not from one
host's rounding: a matmul within gamma_K of the exact product, attention within the softmax
bound of a float64 reference, int8 bit for bit XLA's. The small cases of
tests/helpers/attention_cases.py (block size 4, head dim 8: the kernel's generic path), SmolLM2's
shapes (block size 16, head dim 64, 3 query heads per KV head: the vector fold) over long
contexts, bf16 caches, sliding windows (both folds), a token alone and in any step alike, bad block tables
refused with an error.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kernels import cpu_build, cpu_native, select
from kernels.paged_attention import AttnArgs, AttnMetadata, paged_attention, to_stored
from tests.helpers.attention_cases import MIXED, WINDOW_MANY, build_case, inputs, naive
from tests.helpers.bounds import U, attention64, gamma, matmul_bound
from tl.model.encodings import ggml_formats
from tl.model.weights import Dense

RUNNABLE = [t.name for t in cpu_build.runnable()]


@pytest.fixture(scope="module", params=RUNNABLE)
def lib(request: pytest.FixtureRequest) -> cpu_native.NativeLib:
    return cpu_native.library(request.param)


def _within(got: np.ndarray, want: np.ndarray, bound: np.ndarray) -> None:
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"max error {err.max():.3g} at bound {bound.flat[np.argmax(err - bound)]:.3g}"


def _case_bound(c: dict) -> tuple[np.ndarray, np.ndarray]:
    out, b = attention64(c["q"], c["k_cache"], c["v_cache"], c["layer"], c["seq_idx"], c["positions"], c["tables"])
    return out, b[..., None]


@pytest.mark.parametrize(
    "seqs",
    [MIXED, [(0, 9), (0, 2)], [(3, 1), (17, 1), (0, 1), (30, 1)], MIXED[:4] + [(0, 2)]],
    ids=["mixed", "fresh_prefill", "decodes", "with_padding_seq"],
)
def test_matches_float64(lib: cpu_native.NativeLib, seqs: list[tuple[int, int]]) -> None:
    c = build_case(np.random.default_rng(len(seqs)), seqs, pad=3)
    got = np.asarray(jax.jit(lib.paged_attention)(inputs(c)))
    want, bound = _case_bound(c)
    real = c["seq_idx"] >= 0
    _within(got[real], want[real], bound[real])
    assert np.isfinite(got).all()  # padding rows too


def _smol_case(
    rng: np.random.Generator, contexts: list[int], new: int, HK: int = 3, G: int = 3, HD: int = 64
) -> tuple[tuple, dict]:
    """SmolLM2 attention shapes (Hk 3, G 3, hd 64, block 16) unless given; each sequence decodes
    `new` tokens. Returns the kernel's arguments and the logical case for attention64."""
    L, NB, BS = 2, 96, 16
    k = rng.standard_normal((L, NB, BS, HK, HD)).astype(np.float32)
    v = rng.standard_normal((L, NB, BS, HK, HD)).astype(np.float32)
    free = rng.permutation(NB - 1)
    mb = max(-(-(c + new) // BS) for c in contexts)
    tables = np.full((len(contexts), mb), NB - 1, np.int32)
    used, seq_idx, positions = 0, [], []
    for s, ctx in enumerate(contexts):
        n = -(-(ctx + new) // BS)
        tables[s, :n] = free[used : used + n]
        used += n
        seq_idx += [s] * new
        positions += list(range(ctx, ctx + new))
    T = len(seq_idx)
    q = rng.standard_normal((T, HK * G, HD)).astype(np.float32)
    kn = rng.standard_normal((T, HK, HD)).astype(np.float32)
    vn = rng.standard_normal((T, HK, HD)).astype(np.float32)
    layer = 1
    for t in range(T):  # the model writes this step's keys before attention
        b, o = tables[seq_idx[t], positions[t] // BS], positions[t] % BS
        k[layer, b, o], v[layer, b, o] = kn[t], vn[t]
    meta = AttnMetadata(
        seq_idx=jnp.asarray(seq_idx, jnp.int32),
        positions=jnp.asarray(positions, jnp.int32),
        start_pos=jnp.asarray(contexts, jnp.int32),
        block_tables=jnp.asarray(tables),
        chunk_blocks=8,
    )
    args = AttnArgs(
        jnp.asarray(q),
        jnp.asarray(kn),
        jnp.asarray(vn),
        to_stored("k", jnp.asarray(k)),
        to_stored("v", jnp.asarray(v)),
        jnp.int32(layer),
        meta,
    )
    case = dict(
        q=q,
        k_cache=k,
        v_cache=v,
        layer=layer,
        seq_idx=np.asarray(seq_idx),
        positions=np.asarray(positions),
        tables=tables,
    )
    return args, case


# (contexts, new tokens a sequence, (Hk, G, hd)): the vector fold's shapes (block 16; hd 64 and 256 with
# G 1-4, hd 128 with G 1-2), which read float32 and bf16 caches alike.
VECTOR_FOLD_CASES = [
    pytest.param([300, 5, 16, 0, 129], 1, (3, 3, 64), id="decodes"),
    pytest.param([47, 200], 4, (3, 3, 64), id="drafts"),
    pytest.param([100, 17, 0], 2, (2, 2, 128), id="hd128_g2"),
    pytest.param([33, 64], 1, (4, 1, 64), id="mha"),
    pytest.param([40, 2], 1, (2, 4, 64), id="g4"),
    pytest.param([300, 5, 129], 1, (1, 4, 256), id="hd256_g4"),  # Gemma 3 270M
    pytest.param([70, 33], 2, (2, 2, 256), id="hd256_g2"),
]


@pytest.mark.parametrize(
    "contexts,new,shape", [*VECTOR_FOLD_CASES, pytest.param([70, 3], 3, (2, 5, 64), id="g5_generic")]
)
def test_smollm2_shapes_match_float64_and_reference(
    lib: cpu_native.NativeLib, contexts: list[int], new: int, shape: tuple[int, int, int]
) -> None:
    """The vectorised cached part (block 16, accumulators in registers or chunked, by the
    target's registers) and the generic one, with the jnp reference inside the same bound."""
    args, case = _smol_case(np.random.default_rng(7), contexts, new, *shape)
    got = np.asarray(jax.jit(lib.paged_attention)(args))
    ref = np.asarray(jax.jit(paged_attention)(args))
    want, bound = _case_bound(case)
    _within(got, want, bound)
    _within(ref, want, bound)


def test_sliding_window_matches_naive_and_reference(lib: cpu_native.NativeLib) -> None:
    """Windows in the generic fold (block 4, head dim 8: window 1, where no cached key is seen,
    and 6, not a multiple of a block; the jnp local part) against the naive reference; and
    in the vector fold with the native local part (block 16, head dim 64: decodes whose window
    starts inside a block, 20-token chunks with windows of a block and of 37) against the jnp
    reference. A window changes every answer here (tests/helpers/attention_cases.py checks that)."""
    for window in (1, 6):
        c = build_case(np.random.default_rng(window), WINDOW_MANY, pad=3)
        got = np.asarray(jax.jit(lib.paged_attention)(inputs(c, window=window)))
        real = c["seq_idx"] >= 0
        np.testing.assert_allclose(got[real], naive(c, window)[real], atol=2e-5, rtol=2e-5, err_msg=f"window {window}")
        assert np.isfinite(got).all()
    for case in range(len(WINDOWED_SMOL)):
        args, want = _windowed_smol(case)
        got = np.asarray(jax.jit(lib.paged_attention)(args))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=f"window {args.meta.window}")


WINDOWED_SMOL = [  # contexts, new, window: the last split into runs (SmallAttention) from inside a block
    ([300, 5, 16, 0, 129], 1, 20),
    ([47, 0, 100], 20, 16),
    ([47, 0, 100], 20, 37),
    ([300, 129, 250], 1, 150),
]


@functools.cache
def _windowed_smol(case: int) -> tuple[AttnArgs, np.ndarray]:
    """WINDOWED_SMOL[case]'s arguments and the jnp reference's answer (computed once for every build)."""
    contexts, new, window = WINDOWED_SMOL[case]
    args, _ = _smol_case(np.random.default_rng(window), contexts, new)
    args = args._replace(meta=dataclasses.replace(args.meta, window=window))
    return args, np.asarray(jax.jit(paged_attention)(args))


def test_a_tokens_answer_does_not_depend_on_the_steps_other_tokens(lib: cpu_native.NativeLib) -> None:
    """Every token is computed as a decode of its own, its blocks split into runs by its own
    context alone (one run up to 5 blocks; 2, 3, 8 runs; a window): a token's output is bit for
    bit the same alone as beside other sequences' tokens and as one of a chunk of its own
    sequence's tokens (a prompt chunk, or drafts), whatever the chunk's first position (how much
    of a prompt came from the prefix cache)."""
    for window in (0, 150):
        for new in (1, 5):
            args, _ = _smol_case(np.random.default_rng(3), [300, 47, 0, 129, 90, 700], new)
            args = args._replace(meta=dataclasses.replace(args.meta, window=window))
            together = np.asarray(jax.jit(lib.paged_attention)(args))
            for t in range(args.q.shape[0]):
                s, p = int(args.meta.seq_idx[t]), int(args.meta.positions[t])
                meta = dataclasses.replace(  # the token alone: a decode at its position, step of one
                    args.meta,
                    seq_idx=jnp.zeros(1, jnp.int32),
                    positions=args.meta.positions[t : t + 1],
                    start_pos=jnp.full(1, p, jnp.int32),
                    block_tables=args.meta.block_tables[s : s + 1],
                )
                alone = args._replace(
                    q=args.q[t : t + 1], k_new=args.k_new[t : t + 1], v_new=args.v_new[t : t + 1], meta=meta
                )
                got = np.asarray(jax.jit(lib.paged_attention)(alone))
                assert np.array_equal(got[0], together[t]), f"token {t} (new {new}), window {window}"


def _bf16_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("contexts,new,shape", VECTOR_FOLD_CASES)
def test_bf16_cache_matches_float64(
    lib: cpu_native.NativeLib, contexts: list[int], new: int, shape: tuple[int, int, int]
) -> None:
    """A cache of bf16 bits (kv_cache_dtype "bfloat16"): the native fold widens each cached key
    and value exactly (bf16 is a float's top half), so it meets the float32 bound against a
    float64 attention over the bf16-rounded cache (this step's keys, which the one-call path
    reads as float32 from k_new, are rounded as the model writes them); and it differs from the
    float32 cache's result, by bf16 rounding."""
    (q, kn, vn, kc, vc, layer, meta), case = _smol_case(np.random.default_rng(7), contexts, new, *shape)
    kn, vn = (jnp.asarray(_bf16_round(np.asarray(a))) for a in (kn, vn))
    got = np.asarray(jax.jit(lib.paged_attention)(AttnArgs(q, kn, vn, _bf16_bits(kc), _bf16_bits(vc), layer, meta)))
    rounded = dict(case, k_cache=_bf16_round(case["k_cache"]), v_cache=_bf16_round(case["v_cache"]))
    want, bound = _case_bound(rounded)
    _within(got, want, bound)
    exact, _ = _case_bound(case)
    assert np.abs(got - exact).max() > bound.max()  # off by more than float32 rounding: the cache was read as bf16


def test_bad_block_table_is_an_error_not_a_read(lib: cpu_native.NativeLib) -> None:
    (q, kn, vn, kc, vc, layer, meta), _ = _smol_case(np.random.default_rng(1), [40, 3], 1)
    bad = meta.block_tables.at[0, 1].set(10_000)
    meta = AttnMetadata(seq_idx=meta.seq_idx, positions=meta.positions, start_pos=meta.start_pos, block_tables=bad)
    with pytest.raises(Exception, match="block id out of range"):
        jax.block_until_ready(jax.jit(lib.paged_attention)(AttnArgs(q, kn, vn, kc, vc, layer, meta)))


def test_mismatched_cache_shapes_are_an_error(lib: cpu_native.NativeLib) -> None:
    (q, _, _, kc, vc, layer, meta), _ = _smol_case(np.random.default_rng(1), [40, 3], 1)
    qg = q.reshape(q.shape[0], 3, 3, 64) * 0.125
    with pytest.raises(Exception, match="v_cache is not"):
        jax.block_until_ready(lib.small_attention(qg, qg[:, :, 0], qg[:, :, 0], kc, vc[:, :-1], layer, meta))
    with pytest.raises(Exception, match="start_pos is not"):
        short = AttnMetadata(
            seq_idx=meta.seq_idx, positions=meta.positions, start_pos=meta.start_pos[:1], block_tables=meta.block_tables
        )
        jax.block_until_ready(lib.small_attention(qg, qg[:, :, 0], qg[:, :, 0], kc, vc, layer, short))


def _local_case(runs: list[tuple[int, int]], pad: int, hk: int, g: int, hd: int) -> tuple:
    """This step's tokens only: runs of (first position, tokens) per sequence, then padding."""
    rng = np.random.default_rng(hk * 100 + g * 10 + hd + pad)
    seq_idx = [s for s, (_, n) in enumerate(runs) for _ in range(n)] + [-1] * pad
    positions = [p for start, n in runs for p in range(start, start + n)] + [0] * pad
    T = len(seq_idx)
    qg = jnp.asarray(rng.standard_normal((T, hk, g, hd), dtype=np.float32) * hd**-0.25)
    k = jnp.asarray(rng.standard_normal((T, hk, hd), dtype=np.float32) * hd**-0.25)
    v = jnp.asarray(rng.standard_normal((T, hk, hd), dtype=np.float32))
    meta = AttnMetadata(
        seq_idx=jnp.asarray(seq_idx, jnp.int32),
        positions=jnp.asarray(positions, jnp.int32),
        start_pos=jnp.asarray([s for s, _ in runs], jnp.int32),
        block_tables=jnp.zeros((len(runs), 1), jnp.int32),
    )
    return qg, k, v, meta


@pytest.mark.parametrize(
    "seq_idx,positions,msg",
    [
        ([0, 1, 0], [0, 0, 1], "not contiguous"),
        ([0, 0, 0], [0, 2, 1], "not increasing"),
        ([0, 0, 1 << 30], [0, 1, 0], "seq_idx out of range"),  # not a huge allocation
    ],
)
def test_local_part_refuses_a_layout_it_would_misread(
    lib: cpu_native.NativeLib, seq_idx: list[int], positions: list[int], msg: str
) -> None:
    """The kernel relies on each sequence being one run in position order; anything else is an error."""
    qg, k, v, _ = _local_case([(0, 3)], 0, 3, 3, 64)
    meta = AttnMetadata(
        seq_idx=jnp.asarray(seq_idx, jnp.int32),
        positions=jnp.asarray(positions, jnp.int32),
        start_pos=jnp.zeros(2, jnp.int32),
        block_tables=jnp.zeros((2, 1), jnp.int32),
    )
    kc = jnp.zeros((1, 2, 3, 64, 16), jnp.float32)
    vc = jnp.zeros((1, 2, 3, 16, 64), jnp.float32)
    with pytest.raises(Exception, match=msg):
        jax.block_until_ready(lib.small_attention(qg, k, v, kc, vc, jnp.int32(0), meta))


def test_every_step_size_takes_the_one_call(lib: cpu_native.NativeLib) -> None:
    """One kernel, one arithmetic, at every step size: a token's result must not depend on its step."""
    small = lib.ffi_names["tl_small_attention"]
    for new in (1, 16, 17, 100):
        args, _ = _smol_case(np.random.default_rng(3), [20], new)
        hlo = jax.jit(lib.paged_attention).lower(args).as_text()
        assert hlo.count(f"@{small}(") == 1


def _probe(dtype: jnp.dtype) -> AttnArgs:
    (q, kn, vn, kc, vc, layer, meta), _ = _smol_case(np.random.default_rng(2), [20], 1)
    return AttnArgs(q, kn, vn, kc.astype(dtype), vc.astype(dtype), layer, meta)


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1), ("data", "model"))


def test_auto_picks_native_on_cpu_unmeasured_and_a_forced_choice_is_honoured(lib: cpu_native.NativeLib) -> None:
    """auto: the native kernel, not timed against the reference (whose rows depend on their step)."""
    auto = select.select("auto", "cpu", _mesh(), True, _probe(jnp.float32), lib)
    assert auto.name == "cpu_native" and lib.target.name in auto.reason and "do not depend" in auto.reason
    forced = select.select("cpu_native", "cpu", _mesh(), True, _probe(jnp.float32), lib)
    assert forced.name == "cpu_native" and forced.reason == f"{lib.target.name} build: configured"


def test_an_unbuildable_library_falls_back_with_its_reason() -> None:
    why = "no C++ compiler for x86-64-v3: 'nope' not found"
    choice = select.select("auto", "cpu", _mesh(), True, _probe(jnp.float32), None, why)
    assert choice.name == "reference" and choice.reason == f"cpu_native unavailable: {why}"
    mm = select.select_matmul("auto", None, why, _mesh())
    assert mm.fn is None and mm.reason == f"cpu_native unavailable: {why}"


def test_bf16_cache_is_native_where_the_vector_fold_covers_it(lib: cpu_native.NativeLib) -> None:
    assert select.select("cpu_native", "cpu", _mesh(), True, _probe(jnp.uint16), lib).name == "cpu_native"
    assert cpu_native.bf16_supported(16, 64, 3) and cpu_native.bf16_supported(16, 128, 2)
    q, kn, vn, kc, vc, layer, meta = _probe(jnp.uint16)
    one_kv_head = AttnArgs(q, kn[:, :1], vn[:, :1], kc[:, :, :1], vc[:, :, :1], layer, meta)  # 9 query heads a KV head
    choice = select.select("cpu_native", "cpu", _mesh(), True, one_kv_head, lib)
    assert choice.name == "reference" and "bf16 cache needs" in choice.reason
    assert select.select("cpu_native", "cpu", _mesh(), True, _probe(jnp.int8), lib).name == "reference"


def test_not_offered_off_cpu(lib: cpu_native.NativeLib) -> None:
    choice = select.select("cpu_native", "gpu", _mesh(), True, _probe(jnp.float32), lib)
    assert choice.name == "reference" and "runs on cpu" in choice.reason
    assert select.native_library("gpu", "auto") == (None, "native kernels run on cpu, not gpu")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 17, 31, 32, 33, 47, 48, 49, 64])
@pytest.mark.parametrize(
    "shape",
    [(3, 5, 64, 576), (5, 3, 37), (576, 1536), (2, 3), (23, 40), (6, 33), (13, 2, 48)],
    ids=["qkv", "odd_3d", "down", "tiny", "odd_k_and_o", "o_multiple_of_4", "o_26_k_48"],
)
def test_matmul_within_gamma_k_of_the_exact_product(
    lib: cpu_native.NativeLib, rows: int, shape: tuple[int, ...]
) -> None:
    """Row counts up to the limit: the one-row form, the dot form's row blocks and the broadcast
    form's tiles (of 8 to 64 rows, by target), full and partial; K not a multiple of any vector
    width (nor of a packing transpose's), O not of any output block; w with several out axes."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, shape[-1]), dtype=np.float32)
    w = rng.standard_normal(shape, dtype=np.float32)  # [*out, K], as llama.linear takes it
    got = np.asarray(jax.jit(lib.matmul)(jnp.asarray(x), Dense(jnp.asarray(w))))
    want = np.einsum("nk,...k->n...", x.astype(np.float64), w.astype(np.float64))
    assert got.shape == want.shape
    bound = matmul_bound(x, w).reshape(want.shape)
    _within(got, want, bound)


def _bf16_dot(lib: cpu_native.NativeLib, kind: str) -> bool:
    """Whether this build runs `kind` by vdpbf16ps (x rounded to bfloat16): bf16 on AVX512-BF16."""
    return kind == "bf16" and lib.gemv_half_max_rows(kind) > 64


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 64, 65, 300])
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_half_weights_within_gamma_k_of_the_exact_product(lib: cpu_native.NativeLib, kind: str, rows: int) -> None:
    """16-bit float weights (a GGUF's F16 / BF16 matrices, kept at 2 bytes): widened exactly,
    then float32 products and sums, so within gamma_K of the exact product of the widened
    weights; K a multiple of no vector width, O of no output block; more rows are declined.
    bf16 on AVX512-BF16 builds (any row count): x rounded to bfloat16 first (|x^ - x| <= 2^-8 |x|),
    then exact products summed in float32 (gamma_K of |x^| |w|), denormal products flushed
    (under 2^-126 each)."""
    if rows > lib.gemv_half_max_rows(kind):
        pytest.skip(f"{lib.target.name} takes {lib.gemv_half_max_rows(kind)} rows of {kind}")
    rng = np.random.default_rng(rows)
    for shape in ((37, 40), (3, 13, 576), (5, 17)):
        x = rng.standard_normal((rows, shape[-1]), dtype=np.float32)
        raw = ggml_formats.quantize(kind, rng.standard_normal(shape, dtype=np.float32))
        w = np.asarray(ggml_formats.dequantize(kind, jnp.asarray(raw)), np.float64)  # exact (checked vs gguf-py)
        got = np.asarray(jax.jit(lambda x, r: lib.gemv_half(x, r, kind))(jnp.asarray(x), jnp.asarray(raw)))
        want = np.einsum("nk,...k->n...", x.astype(np.float64), w)
        assert got.shape == want.shape
        bound = matmul_bound(x, w).reshape(want.shape)
        if _bf16_dot(lib, kind):
            k = shape[-1]
            xw = (np.abs(x.astype(np.float64)) @ np.abs(w.reshape(-1, k)).T).reshape(want.shape)
            bound = bound * (1 + 2.0**-8) + 2.0**-8 * xw + k * 2.0**-126
            assert np.abs(got - want).max() > gamma(k) * xw.max() / 64  # x really is rounded (not the widening)
        _within(got, want, bound)
    too_many = lib.gemv_half_max_rows(kind) + 1
    assert lib.gemv_half(jnp.zeros((too_many, 8), jnp.float32), jnp.zeros((3, 16), jnp.uint8), kind) is None
    assert lib.gemv_half(jnp.zeros((1, 8), jnp.float32), jnp.zeros((3, 15), jnp.uint8), kind) is None  # not 2K bytes
    assert lib.gemv_half(jnp.zeros((1, 8), jnp.float32), jnp.zeros((3, 16), jnp.uint8), "f32") is None


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_half_rows_result_does_not_depend_on_the_other_rows(lib: cpu_native.NativeLib, kind: str) -> None:
    """Batch invariance, bit for bit, at every row count the build takes of 16-bit weights (the
    vdpbf16ps kernel's tiles of 1, 2 and 4 rows, its lanes summed by one tree for all)."""
    rng = np.random.default_rng(7)
    n = min(300, lib.gemv_half_max_rows(kind))
    x = jnp.asarray(rng.standard_normal((n, 600), dtype=np.float32))  # K = 600: a tail of 24 past 32-wide steps
    raw = jnp.asarray(ggml_formats.quantize(kind, rng.standard_normal((45, 600), dtype=np.float32)))
    whole = np.asarray(lib.gemv_half(x, raw, kind))
    for a, b in ((0, 1), (5, 6), (n - 1, n), (0, 2), (2, 5), (3, 10), (1, 64), (32, 64)):
        np.testing.assert_array_equal(np.asarray(lib.gemv_half(x[a:b], raw, kind)), whole[a:b])


@pytest.mark.parametrize("linger_us", [0.0, 0.001, 50.0], ids=["off", "expires_at_once", "default"])
def test_one_row_matmul_chain_with_lingering_helpers(lib: cpu_native.NativeLib, linger_us: float) -> None:
    """One-row matmuls in a dependent chain (a decode step's shape), from two Python threads at
    once: every hand-off to a lingering helper (or a fresh pool task when the slot is taken or
    its helper has just left) computes the same numbers as the helper-free path."""
    rng = np.random.default_rng(0)
    ws = [
        Dense(jnp.asarray(rng.standard_normal(s, dtype=np.float32) / 16)) for s in ((256, 128), (128, 128), (512, 128))
    ]

    @jax.jit
    def chain(x: jax.Array) -> jax.Array:
        for _ in range(8):
            for w in ws:
                x = lib.matmul(x, w)
                x = jnp.tanh(x[:, :128])
        return x

    xs = [jnp.asarray(rng.standard_normal((1, 128), dtype=np.float32)) for _ in range(2)]
    try:
        lib.set_linger_us(0)
        want = [np.asarray(chain(x)) for x in xs]
        lib.set_linger_us(linger_us)
        got: list[list[np.ndarray]] = [[], []]

        def run(i: int) -> None:
            for _ in range(20):
                got[i].append(np.asarray(chain(xs[i])))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        lib.set_linger_us(50)
    for i in range(2):
        assert len(got[i]) == 20 and all(np.array_equal(g, want[i]) for g in got[i])


def test_independent_calls_at_once_do_not_wait_on_each_other(lib: cpu_native.NativeLib) -> None:
    """Thirty independent matmuls in one program: XLA runs them at once on its pool's threads, each
    call's helper tasks queued behind the others' calls. (A call that waited for every helper it
    scheduled deadlocked here; it now waits only for helpers that started.)"""
    rng = np.random.default_rng(5)
    ws = [jnp.asarray(rng.standard_normal((512, 64), dtype=np.float32)) for _ in range(30)]
    x = jnp.asarray(rng.standard_normal((4, 64), dtype=np.float32))
    got = np.asarray(jax.jit(lambda ws, x: sum(lib.matmul(x, Dense(w)).sum(axis=1) for w in ws))(ws, x))
    want = sum(np.asarray(x, np.float64) @ np.asarray(w, np.float64).T for w in ws).sum(axis=1)
    bound = sum(matmul_bound(np.asarray(x), np.asarray(w)).sum(axis=1) for w in ws) + gamma(30 * 512) * np.abs(want)
    _within(got, want, bound)


def test_max_rows_and_what_stays_with_xla(lib: cpu_native.NativeLib) -> None:
    """The native float kernel takes up to 64 rows on every build; `matmul` runs more in slices of
    RUN_ROWS (never XLA's dot past them); bf16 stays with XLA."""
    assert lib.max_rows() == 64 == cpu_native.RUN_ROWS
    x = jnp.ones((lib.max_rows() + 1, 8), jnp.float32)
    w = Dense(jnp.ones((4, 8), jnp.float32))
    assert lib.gemv(x, w.w) is None
    assert jax.jit(lib.matmul).lower(x, w).as_text().count(f"@{lib.ffi_names['tl_gemv']}(") == 2
    assert lib.matmul(x[:2].astype(jnp.bfloat16), Dense(w.w.astype(jnp.bfloat16))) is None
    assert lib.ffi_names["tl_gemv"] in str(jax.jit(lib.matmul).lower(x[:2], w).as_text())


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0", "q4_1"])
def test_a_rows_matmul_does_not_depend_on_the_other_rows(lib: cpu_native.NativeLib, kind: str) -> None:
    """`matmul` at any row count (one kernel's arithmetic for every row, slices past its rows):
    each row of a 300-row call bit for bit that row alone and in other slices (issue 48)."""
    from tl.model.encodings.blocks import BLOCK_ENCODINGS

    rng = np.random.default_rng(11)
    wf = rng.standard_normal((45, 608), dtype=np.float32) / 8  # K 608: 19 blocks, a tail past 32-wide steps
    w = Dense(jnp.asarray(wf)) if kind == "f32" else BLOCK_ENCODINGS[kind].encode(wf, ())
    mm = jax.jit(lib.matmul)
    x = rng.standard_normal((300, 608), dtype=np.float32)
    whole = np.asarray(mm(jnp.asarray(x), w))
    for a, b in ((0, 1), (5, 6), (299, 300), (0, 2), (2, 5), (3, 10), (1, 64), (60, 130), (100, 300)):
        np.testing.assert_array_equal(np.asarray(mm(jnp.asarray(x[a:b]), w)), whole[a:b], err_msg=f"rows {a}:{b}")


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", [(576, 960), (3, 5, 64), (7, 3), (37, 2)], ids=["qkv", "3d_out", "tiny", "odd_k"])
def test_matmul_int8_is_bitwise_xla_w8a8(lib: cpu_native.NativeLib, rows: int, shape: tuple[int, ...]) -> None:
    """The native int8 kernel (one row; more rows stay with XLA) reproduces llama.linear's W8A8
    arithmetic exactly, on every build (the AVX2 and the scalar dot alike)."""
    from tl.model import llama

    rng = np.random.default_rng(rows)
    w = rng.standard_normal((shape[0], int(np.prod(shape[1:]))), dtype=np.float32)  # [in, out]
    from tl.model.encodings.int8 import quantize_int8
    from tl.model.weights import Int8

    q, scale = quantize_int8(w.T)
    wq = Int8(jnp.asarray(q.reshape(*shape[1:], shape[0])), jnp.asarray(scale.reshape(shape[1:])))
    x = jnp.asarray(rng.standard_normal((rows, shape[0]), dtype=np.float32)) * 3
    if rows > 1:
        assert lib.matmul(x, wq) is None
        return
    got = np.asarray(jax.jit(lib.matmul)(x, wq))
    want = np.asarray(jax.jit(llama.linear)(x, wq))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_matmul_choice(lib: cpu_native.NativeLib) -> None:
    mesh = _mesh()
    auto = select.select_matmul("auto", lib, "", mesh)
    assert auto.name == "cpu_native" and auto.measured and auto.fn == lib.matmul
    forced = select.select_matmul("cpu_native", lib, "", mesh)
    assert forced.name == "cpu_native" and not forced.measured
    assert select.select_matmul("xla", lib, "", mesh).fn is None


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (7, 1000), (3, 37), (2, 16), (4, 5)])
def test_argmax_lse_matches_float64(lib: cpu_native.NativeLib, rows: int, vocab: int) -> None:
    """First index of the max (ties placed across vector lanes and the scalar tail), and the
    logsumexp within its float32 bound: the sum of V exps (each within the exp's error) to
    gamma_V, its log, and the max added back."""
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((rows, vocab)).astype(np.float32) * 8
    top = x.max(axis=1)
    x[0, vocab - 1] = top[0]  # a tie with a later index: the first one wins
    if rows > 1:
        x[1, :] = x[1, 0]  # all equal: index 0
    tok, lse = jax.jit(lib.argmax_lse)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(tok), np.argmax(x, axis=1))
    want = np.log(np.exp(x.astype(np.float64) - top[:, None]).sum(axis=1)) + top
    bound = gamma(vocab) + 4 * U + 2 * U * np.abs(want)  # relative error of the sum is an absolute one of its log
    _within(np.asarray(lse), want, bound)


def test_sample_with_the_native_argmax_lse_is_the_jnp_sample(lib: cpu_native.NativeLib) -> None:
    """tl.runtime.sampler.sample with the native one-pass argmax/logsumexp: same tokens and acceptances
    as with jnp's, logprobs within both logsumexps' bounds, greedy and sampled rows, drafts,
    penalties on and off."""
    from tl.core.request import SamplingParams
    from tl.runtime.sampler import pack_penalties, pack_rows, sample

    rng = np.random.default_rng(3)
    R, V = 6, 300
    logits = jnp.asarray(rng.standard_normal((R, V)).astype(np.float32) * 3)
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9)
    penal = SamplingParams(temperature=0.0, frequency_penalty=1.5)
    for params in ([greedy] * R, [greedy, hot] * 3, [penal, greedy] * 3):
        drafts = [int(np.argmax(np.asarray(logits[0]))), 5, -1, -1, 7, -1]
        sb = pack_rows(params, list(range(R)), [0] * R, drafts, R)
        pen = pack_penalties(params, [[1, 2, 2]] * R, list(range(R)), [[]] * R, R, R, 1, V)
        want = jax.jit(sample)(logits, sb, pen)
        got = jax.jit(lambda lg, s, p: sample(lg, s, p, lib.argmax_lse))(logits, sb, pen)
        np.testing.assert_array_equal(np.asarray(got.token), np.asarray(want.token))
        np.testing.assert_array_equal(np.asarray(got.accepted), np.asarray(want.accepted))
        lp = np.abs(np.asarray(want.logprob))
        assert (np.abs(np.asarray(got.logprob) - np.asarray(want.logprob)) <= 2 * (gamma(V) + 4 * U) + 4 * U * lp).all()
