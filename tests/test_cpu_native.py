"""kernels/cpu_native.py: the C++ cached part against the naive and the jnp reference attention.

The small cases of tests/test_paged_attention.py (block size 4, head dim 8: the kernel's generic
path) against the naive dense attention; SmolLM2's shapes (block size 16, head dim 64, 3 query
heads per KV head: a specialised path) against the reference over long cached contexts; bad
block tables refused with an error; the fallbacks when the kernel cannot be built or used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from test_paged_attention import MIXED, build_case, inputs, naive

from kernels import cpu_native, select
from kernels.paged_attention import AttnMetadata, local_state, paged_attention, to_stored


# Steps of <= SMALL_MAX_TOKENS tokens take one fused call, larger ones two parts; each case runs
# through both, whatever its size.
BOTH_PATHS = pytest.mark.parametrize("attend", [cpu_native.small_path, cpu_native.two_part_attention],
                                     ids=["one_call", "two_parts"])


def _native(c: dict, attend=cpu_native.paged_attention) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.asarray(jax.jit(attend)(*inputs(c)))


@BOTH_PATHS
@pytest.mark.parametrize("seqs", [MIXED, [(0, 9), (0, 2)], [(3, 1), (17, 1), (0, 1), (30, 1)], MIXED[:4] + [(0, 2)]],
                         ids=["mixed", "fresh_prefill", "decodes", "with_padding_seq"])
def test_matches_naive(seqs: list[tuple[int, int]], attend) -> None:  # type: ignore[no-untyped-def]
    c = build_case(np.random.default_rng(len(seqs)), seqs, pad=3)
    got = _native(c, attend)
    real = c["seq_idx"] >= 0
    assert np.abs(got - naive(c))[real].max() < 1e-5
    assert np.isfinite(got).all()  # padding rows too


def _smol_case(rng: np.random.Generator, contexts: list[int], new: int, HK: int = 3, G: int = 3, HD: int = 64) -> tuple:
    """SmolLM2 attention shapes (Hk 3, G 3, hd 64, block 16) unless given; each sequence decodes `new` tokens."""
    L, NB, BS = 2, 96, 16
    k = rng.standard_normal((L, NB, BS, HK, HD)).astype(np.float32)
    v = rng.standard_normal((L, NB, BS, HK, HD)).astype(np.float32)
    free = rng.permutation(NB - 1)
    mb = max(-(-(c + new) // BS) for c in contexts)
    tables = np.full((len(contexts), mb), NB - 1, np.int32)
    used, seq_idx, positions = 0, [], []
    for s, ctx in enumerate(contexts):
        n = -(-(ctx + new) // BS)
        tables[s, :n] = free[used:used + n]
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
    meta = AttnMetadata(seq_idx=jnp.asarray(seq_idx, jnp.int32), positions=jnp.asarray(positions, jnp.int32),
                        start_pos=jnp.asarray(contexts, jnp.int32), block_tables=jnp.asarray(tables), chunk_blocks=8)
    return (jnp.asarray(q), jnp.asarray(kn), jnp.asarray(vn), to_stored("k", jnp.asarray(k)),
            to_stored("v", jnp.asarray(v)), jnp.int32(layer), meta)


# (contexts, new tokens a sequence, (Hk, G, hd)): the vector fold's shapes (block 16; hd 64 with
# G 1-4, hd 128 with G 1-2), which read float32 and bf16 caches alike.
VECTOR_FOLD_CASES = [pytest.param([300, 5, 16, 0, 129], 1, (3, 3, 64), id="decodes"),
                     pytest.param([47, 200], 4, (3, 3, 64), id="drafts"),
                     pytest.param([100, 17, 0], 2, (2, 2, 128), id="hd128_g2"),
                     pytest.param([33, 64], 1, (4, 1, 64), id="mha"),
                     pytest.param([40, 2], 1, (2, 4, 64), id="g4")]


@pytest.mark.parametrize("contexts,new,shape", [*VECTOR_FOLD_CASES, pytest.param([70, 3], 3, (2, 5, 64), id="g5_generic")])
@BOTH_PATHS
def test_smollm2_shapes_match_reference(contexts: list[int], new: int, shape: tuple[int, int, int],
                                        attend) -> None:  # type: ignore[no-untyped-def]
    """The vectorised cached part (block 16, G x hd/16 accumulators in registers) and the generic one."""
    args = _smol_case(np.random.default_rng(7), contexts, new, *shape)
    got = np.asarray(jax.jit(attend)(*args))
    want = np.asarray(jax.jit(paged_attention)(*args))
    assert np.abs(got - want).max() < 1e-5


def _bf16_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


@pytest.mark.parametrize("contexts,new,shape", VECTOR_FOLD_CASES)
@BOTH_PATHS
def test_bf16_cache_matches_reference(contexts: list[int], new: int, shape: tuple[int, int, int],
                                      attend) -> None:  # type: ignore[no-untyped-def]
    """A cache of bf16 bits (kv_cache_dtype "bfloat16"): the native fold widens each key and value
    as the reference decodes them, so the two agree as closely as on float32 caches; against
    the float32 cache it differs by bf16 rounding only."""
    q, kn, vn, kc, vc, layer, meta = _smol_case(np.random.default_rng(7), contexts, new, *shape)
    args = (q, kn, vn, _bf16_bits(kc), _bf16_bits(vc), layer, meta)
    got = np.asarray(jax.jit(attend)(*args))
    want = np.asarray(jax.jit(paged_attention)(*args))
    assert np.abs(got - want).max() < 1e-5
    exact = np.asarray(jax.jit(paged_attention)(q, kn, vn, kc, vc, layer, meta))
    assert 1e-4 < np.abs(got - exact).max() < 0.05  # rounded, and only by bf16's precision


@BOTH_PATHS
def test_bad_block_table_is_an_error_not_a_read(attend) -> None:  # type: ignore[no-untyped-def]
    q, kn, vn, kc, vc, layer, meta = _smol_case(np.random.default_rng(1), [40, 3], 1)
    bad = meta.block_tables.at[0, 1].set(10_000)
    meta = AttnMetadata(seq_idx=meta.seq_idx, positions=meta.positions, start_pos=meta.start_pos, block_tables=bad)
    with pytest.raises(Exception, match="block id out of range"):
        jax.block_until_ready(jax.jit(attend)(q, kn, vn, kc, vc, layer, meta))


def test_mismatched_cache_shapes_are_an_error() -> None:
    q, _, _, kc, vc, layer, meta = _smol_case(np.random.default_rng(1), [40, 3], 1)
    qg = q.reshape(q.shape[0], 3, 3, 64) * 0.125
    with pytest.raises(Exception, match="v_cache is not"):
        jax.block_until_ready(cpu_native.cached_state(qg, kc, vc[:, :-1], layer, meta))
    with pytest.raises(Exception, match="start_pos is not"):
        short = AttnMetadata(seq_idx=meta.seq_idx, positions=meta.positions, start_pos=meta.start_pos[:1],
                             block_tables=meta.block_tables)
        jax.block_until_ready(cpu_native.cached_state(qg, kc, vc, layer, short))


def _local_case(runs: list[tuple[int, int]], pad: int, hk: int, g: int, hd: int) -> tuple:
    """This step's tokens only: runs of (first position, tokens) per sequence, then padding."""
    rng = np.random.default_rng(hk * 100 + g * 10 + hd + pad)
    seq_idx = [s for s, (_, n) in enumerate(runs) for _ in range(n)] + [-1] * pad
    positions = [p for start, n in runs for p in range(start, start + n)] + [0] * pad
    T = len(seq_idx)
    qg = jnp.asarray(rng.standard_normal((T, hk, g, hd), dtype=np.float32) * hd ** -0.25)
    k = jnp.asarray(rng.standard_normal((T, hk, hd), dtype=np.float32) * hd ** -0.25)
    v = jnp.asarray(rng.standard_normal((T, hk, hd), dtype=np.float32))
    meta = AttnMetadata(seq_idx=jnp.asarray(seq_idx, jnp.int32), positions=jnp.asarray(positions, jnp.int32),
                        start_pos=jnp.asarray([s for s, _ in runs], jnp.int32),
                        block_tables=jnp.zeros((len(runs), 1), jnp.int32))
    return qg, k, v, meta


@pytest.mark.parametrize("runs,pad,hk,g,hd", [
    ([(0, 150)], 0, 3, 3, 64),  # a fresh prompt: causal tiles, a partial last key chunk
    ([(5, 70), (0, 1), (30, 90), (0, 17)], 22, 3, 3, 64),  # chunks and a decode mixed, padding
    ([(9, 1)] * 20, 0, 3, 3, 64),  # decodes only: every token sees itself
    ([(0, 40)], 3, 2, 7, 128),  # 7 query heads per KV head: tiles of 9 tokens
    ([(3, 33), (0, 4)], 1, 4, 1, 32),
], ids=["prompt", "mixed", "decodes", "hd128_g7", "hd32_mha"])
def test_local_part_matches_jnp(runs: list[tuple[int, int]], pad: int, hk: int, g: int, hd: int) -> None:
    """The native local part (this step's own keys) against local_state's dense masked softmax."""
    qg, k, v, meta = _local_case(runs, pad, hk, g, hd)
    m1, l1, a1 = jax.jit(local_state)(qg, k, v, meta)
    m2, l2, a2 = jax.jit(cpu_native.local_state_native)(qg, k, v, meta)
    real = np.asarray(meta.seq_idx) >= 0
    want, got = np.asarray(a1 / l1[..., None]), np.asarray(a2 / l2[..., None])
    assert np.abs(got - want)[real].max() < 1e-5
    assert np.abs(np.asarray(m2) - np.asarray(m1))[real].max() < 1e-5  # the same running max: merges agree
    assert np.isfinite(got).all() and (got[~real] == 0).all()


@pytest.mark.parametrize("seq_idx,positions,msg", [
    ([0, 1, 0], [0, 0, 1], "not contiguous"),
    ([0, 0, 0], [0, 2, 1], "not increasing"),
    ([0, 0, 1 << 30], [0, 1, 0], "seq_idx out of range"),  # not a huge allocation
])
def test_local_part_refuses_a_layout_it_would_misread(seq_idx: list[int], positions: list[int], msg: str) -> None:
    """The kernel relies on each sequence being one run in position order; anything else is an error."""
    qg, k, v, meta = _local_case([(0, 3)], 0, 3, 3, 64)
    meta = AttnMetadata(seq_idx=jnp.asarray(seq_idx, jnp.int32), positions=jnp.asarray(positions, jnp.int32),
                        start_pos=jnp.zeros(2, jnp.int32), block_tables=jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(Exception, match=msg):
        jax.block_until_ready(cpu_native.local_state_native(qg, k, v, meta))
    kc = jnp.zeros((1, 2, 3, 64, 16), jnp.float32)  # the one-call path checks the same layout
    vc = jnp.zeros((1, 2, 3, 16, 64), jnp.float32)
    with pytest.raises(Exception, match=msg):
        jax.block_until_ready(cpu_native.small_attention(qg, k, v, kc, vc, jnp.int32(0), meta))


def test_small_steps_take_one_call_and_larger_ones_two_parts() -> None:
    for new, calls in ((cpu_native.SMALL_MAX_TOKENS, {cpu_native.SMALL_TARGET}),
                       (cpu_native.SMALL_MAX_TOKENS + 1, {cpu_native.LOCAL_TARGET, cpu_native.TARGET})):
        args = _smol_case(np.random.default_rng(3), [20], new)
        hlo = jax.jit(cpu_native.paged_attention).lower(*args).as_text()
        used = {t for t in (cpu_native.SMALL_TARGET, cpu_native.LOCAL_TARGET, cpu_native.TARGET) if t in hlo}
        assert used == calls


def _probe(dtype: jnp.dtype) -> tuple:
    q, kn, vn, kc, vc, layer, meta = _smol_case(np.random.default_rng(2), [20], 1)
    return (q, kn, vn, kc.astype(dtype), vc.astype(dtype), layer, meta)


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1), ("data", "model"))


def test_auto_picks_native_on_cpu() -> None:
    choice = select.select("auto", "cpu", _mesh(), True, _probe(jnp.float32))
    assert choice.name == "cpu_native"


def test_falls_back_without_a_compiler(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TL_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(cpu_native, "_registered", False)  # as in a fresh process
    jax.clear_caches()  # the trial trace of an earlier test at these shapes would be reused
    choice = select.select("auto", "cpu", _mesh(), True, _probe(jnp.float32))
    assert choice.name == "reference"
    assert "cpu_native refused" in choice.reason and "native.cc" in choice.reason


def test_bf16_cache_is_native_where_the_vector_fold_covers_it() -> None:
    assert select.select("cpu_native", "cpu", _mesh(), True, _probe(jnp.uint16)).name == "cpu_native"
    assert cpu_native.bf16_supported(16, 64, 3) and cpu_native.bf16_supported(16, 128, 2)
    q, kn, vn, kc, vc, layer, meta = _probe(jnp.uint16)
    one_kv_head = (q, kn[:, :1], vn[:, :1], kc[:, :, :1], vc[:, :, :1], layer, meta)  # 9 query heads a KV head
    choice = select.select("cpu_native", "cpu", _mesh(), True, one_kv_head)
    assert choice.name == "reference" and "bf16 cache needs" in choice.reason
    assert select.select("cpu_native", "cpu", _mesh(), True, _probe(jnp.int8)).name == "reference"


def test_not_offered_off_cpu() -> None:
    choice = select.select("cpu_native", "gpu", _mesh(), True, _probe(jnp.float32))
    assert choice.name == "reference" and "runs on cpu" in choice.reason


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 13, 16, 17, 31, 32, 33, 47, 48, 49, 64])
@pytest.mark.parametrize("shape", [(3, 5, 64, 576), (5, 3, 37), (576, 1536), (2, 3), (23, 40), (6, 33), (13, 2, 48)],
                         ids=["qkv", "odd_3d", "down", "tiny", "odd_k_and_o", "o_multiple_of_4", "o_26_k_48"])
def test_matmul_matches_xla(rows: int, shape: tuple[int, ...]) -> None:
    """Row counts up to the limit: the dot form's 4-row blocks (1-16) and the broadcast form's
    tiles of 32, 48 and 64 rows, full and partial; K not a multiple of the 16-wide vector (nor
    of the 16x16 packing transpose), O not of the 4-, 6-, 8- or 12-output blocks; w with
    several out axes."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, shape[-1]), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))  # [*out, K], as llama.linear takes it
    if rows > cpu_native.max_rows():  # a build without AVX-512 stops at 16 rows: XLA's dot takes these
        assert cpu_native.matmul(x, w) is None
        return
    got = np.asarray(jax.jit(cpu_native.matmul)(x, w))
    want = np.einsum("nk,...k->n...", np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-3 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("linger_us", [0.0, 0.001, 50.0], ids=["off", "expires_at_once", "default"])
def test_one_row_matmul_chain_with_lingering_helpers(linger_us: float) -> None:
    """One-row matmuls in a dependent chain (a decode step's shape), from two Python threads at
    once: every hand-off to a lingering helper (or a fresh pool task when the slot is taken or
    its helper has just left) computes the same numbers as the helper-free path."""
    import threading

    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal(s, dtype=np.float32) / 16) for s in ((256, 128), (128, 128), (512, 128))]

    @jax.jit
    def chain(x: jax.Array) -> jax.Array:
        for _ in range(8):
            for w in ws:
                x = cpu_native.matmul(x, w)
                x = jnp.tanh(x[:, :128])
        return x

    xs = [jnp.asarray(rng.standard_normal((1, 128), dtype=np.float32)) for _ in range(2)]
    try:
        cpu_native.set_linger_us(0)
        want = [np.asarray(chain(x)) for x in xs]
        cpu_native.set_linger_us(linger_us)
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
        cpu_native.set_linger_us(50)
    for i in range(2):
        assert len(got[i]) == 20 and all(np.array_equal(g, want[i]) for g in got[i])


def test_max_rows_follows_the_build() -> None:
    """64 rows where the library is built with AVX-512 (-march=native on an AVX-512 CPU), else
    the dot form's 16: the broadcast form would spill from AVX2's 16 vector registers."""
    flags = cpu_native._cpu_flags().split()
    assert cpu_native.max_rows() == (64 if "avx512f" in flags else 16)


def test_matmul_leaves_many_rows_and_bf16_to_xla() -> None:
    x = jnp.ones((cpu_native.max_rows() + 1, 8), jnp.float32)
    w = jnp.ones((4, 8), jnp.float32)
    assert cpu_native.matmul(x, w) is None
    assert cpu_native.matmul(x[:2].astype(jnp.bfloat16), w.astype(jnp.bfloat16)) is None
    assert "ffi" in str(jax.make_jaxpr(cpu_native.matmul)(x[:2], w))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", [(576, 960), (3, 5, 64), (7, 3), (37, 2)], ids=["qkv", "3d_out", "tiny", "odd_k"])
def test_matmul_int8_is_bitwise_xla_w8a8(rows: int, shape: tuple[int, ...]) -> None:
    """The native int8 kernel (one row; more rows stay with XLA) reproduces llama.linear's W8A8
    arithmetic exactly."""
    from tl.model import llama

    rng = np.random.default_rng(rows)
    w = rng.standard_normal((shape[0], int(np.prod(shape[1:]))), dtype=np.float32)  # [in, out]
    qw = llama.quantize_int8(w.T)
    q = jnp.asarray(qw["q"].reshape(*shape[1:], shape[0]))
    wq = {"q": q, "scale": jnp.asarray(qw["scale"].reshape(shape[1:]))}
    x = jnp.asarray(rng.standard_normal((rows, shape[0]), dtype=np.float32)) * 3
    if rows > 1:
        assert cpu_native.matmul(x, wq) is None
        return
    got = np.asarray(jax.jit(cpu_native.matmul)(x, wq))
    want = np.asarray(jax.jit(llama.linear)(x, wq))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_matmul_choice_follows_attention() -> None:
    mesh = _mesh()
    native = select.select("auto", "cpu", mesh, True, _probe(jnp.float32))
    assert select.select_matmul(native, mesh).name == "cpu_native"
    ref = select.select("reference", "cpu", mesh, True, _probe(jnp.float32))
    assert select.select_matmul(ref, mesh).fn is None


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (7, 1000), (3, 37), (2, 16), (4, 5)])
def test_argmax_lse_matches_jnp(rows: int, vocab: int) -> None:
    """First index of the max (ties placed across vector lanes and the scalar tail) and logsumexp."""
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((rows, vocab)).astype(np.float32) * 8
    top = x.max(axis=1)
    x[0, vocab - 1] = top[0]  # a tie with a later index: the first one wins
    if rows > 1:
        x[1, :] = x[1, 0]  # all equal: index 0
    tok, lse = jax.jit(cpu_native.argmax_lse)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(tok), np.argmax(x, axis=1))
    want = np.log(np.exp(x.astype(np.float64) - top[:, None]).sum(axis=1)) + top
    assert np.abs(np.asarray(lse) - want).max() < 2e-5 * max(1.0, np.abs(want).max())


def test_sample_with_the_native_argmax_lse_is_the_jnp_sample() -> None:
    """tl.sampler.sample with the native one-pass argmax/logsumexp: same tokens, acceptances and
    (to rounding) logprobs as with jnp's, greedy and sampled rows, drafts, penalties on and off."""
    from tl.request import SamplingParams
    from tl.sampler import pack_penalties, pack_rows, sample

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
        got = jax.jit(lambda lg, s, p: sample(lg, s, p, cpu_native.argmax_lse))(logits, sb, pen)
        np.testing.assert_array_equal(np.asarray(got.token), np.asarray(want.token))
        np.testing.assert_array_equal(np.asarray(got.accepted), np.asarray(want.accepted))
        assert np.abs(np.asarray(got.logprob) - np.asarray(want.logprob)).max() < 1e-5
