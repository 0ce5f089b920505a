// The AVX2 kernels (x86-64-v3; x86-64-v4, AVX-512 without VNNI): TL_QDOT_256 (quant.h).
//
// Owns: the exact family of the 32-input kinds (exact8 for one row, panels of 8 outputs,
// panel8_tile, for more: any row count, qgemm_blocks) and of the K-quants (k_rows8 for up to 7 rows,
// panels of 8 outputs a super-block at a time, k_panel_tile, for more: qgemm). Must not:
// be compiled for another family (empty elsewhere). Included by quant_gemm.cc; tested by
// tests/kernels/test_cpu_native_quant.py on every build this CPU runs.
#pragma once

#include "quant_x86.h"

#if defined(TL_QDOT_256)
namespace tl {
namespace {

// Keeps v's running sum in order, in a register: GCC otherwise reassociates the K-quant panel's
// chains of int16 adds (k_panel_tile) into a tree that computes every product of a run first
// (32 live vectors for 4 rows of 8 groups, spilled to the stack). Zen 3, one thread, a Llama 3.2
// 1B gate projection in q4_k at 64 rows: 63 GMAC/s so, 73 in order, 78 as two chains in order;
// the same template inlined into another caller had been scheduled either way.
inline void in_order(__m256i& v) { asm("" : "+x"(v)); }

// Sum of u8 a times s8 b in 8 int32 lanes, the pairs through saturating int16 (no VNNI here):
// exact for a <= 128 (|w|, or a q4_1 / q5_1 value <= 31) and |b| <= 127 (2 * 128 * 127 < 2^15).
inline __m256i dot_u8s8_256(__m256i a, __m256i b) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}

// The exact family (AVX2 without VNNI: x86-64-v3, x86-64-v4), the 32-input kinds: one arithmetic
// for every row count, as the VNNI path's (quant_avx512.h), so a row's result does not depend on its
// step's other rows: each block's int32 sum is exact and is added as acc = fma(sum, d_w * d_x,
// acc), then acc = fma(m_w, s_x, acc), block by block, in 8 lanes that are 8 outputs. The
// weights are codes u: the nibble formats unsigned (q4_0: the nibble, w = u - 8; q5_0: w = u -
// 16; q4_1 / q5_1 as stored), their offset's share -off * sum(q_x) added once per block and row
// (exact: |sum| < 2^20); q8_0 signed, by the sign trick (|w| * sign(x, w)). vpmaddubsw's int16
// pairs cannot saturate: u <= 31 (2 * 31 * 128), |w| <= 128 against |x| <= 127. One row: exact8
// (8 outputs' blocks unpacked as stored, the row's 8 dot vectors reduced to 8 block sums by
// reduce8); more: panels of 8 outputs, unpacked once a call into [block][group of 4
// inputs][output] (the 8 x 8 int32 transpose), which a row meets as 8 vpmaddubsw against its 4
// bytes broadcast, the lanes already outputs. SmolLM2 Q4_1 decode steps on Zen 3 (bench runner,
// noisy machine): 1 row 7.0-9.9 ms, 2 rows 12.9-13.8, 4 rows 17.5-18.3, 16 rows 44-48, where the
// tiles before (4 rows a tile per output, 8 float lanes a block summed at the end) took 9.9-10.3,
// -, 17.4 and 81; exact8 for 2 rows (8 dot vectors and a reduction a row) took 13.8 ms, the
// panels 12.9, so the panels start at 2.
template <int KIND>
constexpr int kOff256 = KIND == kQ4_0   ? 8
                        : KIND == kQ5_0 ? 16
                                        : 0;

// A block's 32 codes: q4_0 / q5_0 their signed values plus the offset, q4_1 / q5_1 as stored,
// q8_0 signed.
template <int KIND>
inline __m256i codes256(const uint8_t* b) {
  if constexpr (kOff256<KIND> != 0) return _mm256_add_epi8(unpack256<KIND>(b), _mm256_set1_epi8(kOff256<KIND>));
  return unpack256<KIND>(b);
}

// 8 int32 lanes of u8 codes (q8_0: signed w) against s8 x.
template <int KIND>
inline __m256i dot_codes(__m256i u, __m256i x) {
  if constexpr (KIND == kQ8_0) return dot_u8s8_256(_mm256_sign_epi8(u, u), _mm256_sign_epi8(x, u));
  return dot_u8s8_256(u, x);
}

// Lane j: the sum of p[j]'s 8 lanes (exact int32 sums, so any order gives the same; an add tree
// of unpacks, single-uop shuffles where vphaddd is three).
inline __m256i reduce8(const __m256i p[8]) {
  __m256i a[4], b[2];
  for (int i = 0; i < 4; ++i)  // lanes (p[2i] a0+a1 | b0+b1 | a2+a3 | b2+b3, then the high half's)
    a[i] =
        _mm256_add_epi32(_mm256_unpacklo_epi32(p[2 * i], p[2 * i + 1]), _mm256_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // lanes (p[4i] | p[4i+1] | p[4i+2] | p[4i+3]) of each 128-bit half
    b[i] =
        _mm256_add_epi32(_mm256_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(b[0], b[1], 0x20), _mm256_permute2x128_si256(b[0], b[1], 0x31));
}

// The 8 rows' (d, m) of block b as floats: lanes j of d and m.
template <int KIND>
inline void scales_8(const uint8_t* const rows[8], int64_t at, __m256& d, __m256& m) {
  const __m256i heads = scales8<8>(rows, at);
  // Bytes 0-1 (d) of each 32-bit lane to the low 128 bits, bytes 2-3 (m) to the high.
  const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13,
                                         2, 3, 6, 7, 10, 11, 14, 15);
  const __m256i dm = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(heads, split), 0xd8);
  d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
  m = Fmt<KIND>::kHasM ? _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1)) : _mm256_setzero_ps();
}

// Row n's share of block b: acc = fma(sum, d_w * d_x, acc) (+ fma(m_w, s_x, acc)).
template <int KIND>
inline __m256 scale_block(__m256i sum, __m256 dw, __m256 mw, const XQ& x, const int32_t* xsum, int64_t n, int64_t b,
                          __m256 acc) {
  const int64_t at = n * x.nb + b;
  if constexpr (kOff256<KIND> != 0) sum = _mm256_add_epi32(sum, _mm256_set1_epi32(-kOff256<KIND> * xsum[at]));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(x.d8[at * 8])), acc);
  if constexpr (Fmt<KIND>::kHasM) acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[at]), acc);
  return acc;
}

// Outputs [o0, o0 + mo) (mo <= 8; past mo computed, not stored) against the one row of x.
// `ahead`: rows 16 to 23 from o0 exist, prefetched a block's share a block (8 rows read side by
// side are 8 streams row_bytes apart, which the hardware prefetcher follows badly: without it
// one-row calls of a q4_1 1536 x 576 chain on Zen 3 ran at 9-10 GB/s, with it 21), into L2
// (prefetch_l2: this build's SmolLM2 Q4_1 one-row decode steps on Zen 4 1.17x those prefetching
// into L1).
template <int KIND>
inline void exact8(const uint8_t* W, int64_t row_bytes, const XQ& x, const int32_t* xsum, float* Y, int64_t o0, int mo,
                   bool ahead) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  const uint8_t* rows[8];
  for (int j = 0; j < 8; ++j) rows[j] = W + (o0 + std::min(j, mo - 1)) * row_bytes;
  __m256 acc = _mm256_setzero_ps();
  const int64_t span = 8 * row_bytes, share = (span + x.nb - 1) / x.nb;
  for (int64_t b = 0; b < x.nb; ++b) {
    if (ahead)
      for (int64_t l = 0; l < share; l += 64) prefetch_l2(rows[0] + 2 * span + b * share + l);
    __m256 dw, mw;
    scales_8<KIND>(rows, b * BB, dw, mw);
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * kQK));
    __m256i p[8];
    for (int j = 0; j < 8; ++j) p[j] = dot_codes<KIND>(codes256<KIND>(rows[j] + b * BB), xv);
    acc = scale_block<KIND>(reduce8(p), dw, mw, x, xsum, 0, b, acc);
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, acc);
  for (int j = 0; j < mo; ++j) Y[o0 + j] = out[j];
}

// A panel of 8 outputs unpacked: w [nb][8 groups] (lane j: output j's 4 codes of the group),
// d and m [nb] (lane j: output j's d_w, m_w).
struct Panel8 {
  __m256i* w;
  __m256* d;
  __m256* m;
};

// 8 x 8 int32 transpose: out[g] lane j = in[j] lane g.
inline void transpose8(const __m256i in[8], __m256i out[8]) {
  __m256i t[8], v[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(in[2 * i], in[2 * i + 1]);      // a0 b0 a1 b1 | a4 b4 a5 b5
    t[2 * i + 1] = _mm256_unpackhi_epi32(in[2 * i], in[2 * i + 1]);  // a2 b2 a3 b3 | a6 b6 a7 b7
  }
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h) {
      v[4 * i + 2 * h] = _mm256_unpacklo_epi64(t[4 * i + h], t[4 * i + 2 + h]);      // rows 4i..4i+3, g 2h | 2h+4
      v[4 * i + 2 * h + 1] = _mm256_unpackhi_epi64(t[4 * i + h], t[4 * i + 2 + h]);  // g 2h+1 | 2h+5
    }
  for (int g = 0; g < 4; ++g) {
    out[g] = _mm256_permute2x128_si256(v[g], v[4 + g], 0x20);
    out[g + 4] = _mm256_permute2x128_si256(v[g], v[4 + g], 0x31);
  }
}

template <int KIND>
void unpack_panel8(const uint8_t* W, int64_t row_bytes, int64_t o0, int mo, int64_t nb, const Panel8& p) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  const uint8_t* rows[8];
  for (int j = 0; j < 8; ++j) rows[j] = W + (o0 + std::min(j, mo - 1)) * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i in[8];
    for (int j = 0; j < 8; ++j) in[j] = codes256<KIND>(rows[j] + b * BB);
    transpose8(in, p.w + b * 8);
    scales_8<KIND>(rows, b * BB, p.d[b], p.m[b]);
  }
}

template <int KIND, int R>
inline void panel8_tile(const Panel8& p, const XQ& x, const int32_t* xsum, int64_t O, float* Y, int64_t o0, int mo,
                        int64_t n0) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m256i ia[R];
    for (int r = 0; r < R; ++r) ia[r] = _mm256_setzero_si256();
    const int8_t* xq = x.q + n0 * x.K + b * kQK;
    if constexpr (KIND == kQ8_0) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m256i w = p.w[b * 8 + g];
        for (int r = 0; r < R; ++r)
          ia[r] = _mm256_add_epi32(
              ia[r], dot_codes<KIND>(w, _mm256_set1_epi32(static_cast<int32_t>(
                                            load_u32(reinterpret_cast<const uint8_t*>(xq + r * x.K + 4 * g))))));
      }
    } else {
      // vpmaddubsw's int16 pairs summed in int16 over a run of groups before vpmaddwd: a pair is
      // at most 2 * 15 * 127 (4-bit codes: 8 groups, 30480) or 2 * 31 * 127 (5-bit: 4, 31496).
      constexpr int kRunG = KIND == kQ4_0 || KIND == kQ4_1 ? 8 : 4;
      for (int g0 = 0; g0 < 8; g0 += kRunG) {
        __m256i i16[R];
        for (int r = 0; r < R; ++r) i16[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = g0; g < g0 + kRunG; ++g) {
          const __m256i w = p.w[b * 8 + g];
          for (int r = 0; r < R; ++r)
            i16[r] = _mm256_add_epi16(
                i16[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(static_cast<int32_t>(load_u32(
                                                    reinterpret_cast<const uint8_t*>(xq + r * x.K + 4 * g))))));
        }
        for (int r = 0; r < R; ++r) ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(i16[r], _mm256_set1_epi16(1)));
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = scale_block<KIND>(ia[r], p.d[b], p.m[b], x, xsum, n0 + r, b, acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[r]);
    for (int j = 0; j < mo; ++j) Y[(n0 + r) * O + o0 + j] = out[j];
  }
}

constexpr int64_t kRun256 = 256;  // rows of x a panel's unpacked weights serve before the next run

// Outputs [o0, o1) against every row of x, 8 outputs at a time.
template <int KIND>
void exact_outputs8(const uint8_t* W, int64_t row_bytes, const XQ& x, const int32_t* xsum, int64_t N, int64_t O,
                    float* Y, int64_t o0, int64_t o1) {
  if (N == 1) {
    for (int64_t o = o0; o < o1; o += 8)
      exact8<KIND>(W, row_bytes, x, xsum, Y, o, static_cast<int>(std::min<int64_t>(8, o1 - o)), o + 24 <= o1);
    return;
  }
  thread_local Scratch scratch;  // the panel: w, then d, then m
  __m256i* w = scratch.get<__m256i>(static_cast<size_t>(x.nb * 10));
  const Panel8 p{w, reinterpret_cast<__m256*>(w + x.nb * 8), reinterpret_cast<__m256*>(w + x.nb * 9)};
  // Runs of kRun rows (their x stays in L2 across the panels), each panel unpacked once a run.
  for (int64_t n0 = 0; n0 < N; n0 += kRun256) {
    const int64_t n1 = std::min(N, n0 + kRun256);
    for (int64_t o = o0; o < o1; o += 8) {
      const int mo = static_cast<int>(std::min<int64_t>(8, o1 - o));
      unpack_panel8<KIND>(W, row_bytes, o, mo, x.nb, p);
      int64_t n = n0;
      for (; n + 4 <= n1; n += 4) panel8_tile<KIND, 4>(p, x, xsum, O, Y, o, mo, n);
      with_rows<3>(n1 - n, [&](auto r) { panel8_tile<KIND, decltype(r)::value>(p, x, xsum, O, Y, o, mo, n); });
    }
  }
}

// fn(o0, o1) over one contiguous range of whole groups of 8 outputs a thread (one stream of
// weights each); after a one-row call the helper lingers for the next (threads.h).
template <typename F>
void for_output_groups8(ffi::ThreadPool& pool, int64_t N, int64_t O, F&& fn) {
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), O / 16));
  const int64_t groups = (O + 7) / 8;
  parallel_for(
      pool, tasks,
      [&](int64_t task) {
        fn(std::min(O, 8 * (groups * task / tasks)), std::min(O, 8 * (groups * (task + 1) / tasks)));
      },
      /*linger_after=*/N == 1);
}

// The 32-input kinds: each row's block sums of q_x (the offset kinds' share), then the outputs
// in groups of 8 over the threads.
template <int KIND>
void qgemm_blocks(ffi::ThreadPool& pool, const uint8_t* W, const XQ& x, int64_t N, int64_t O, float* Y) {
  const int64_t row_bytes = x.nb * Fmt<KIND>::kBytes;
  thread_local std::vector<int32_t> xsum;
  const int32_t* sums = nullptr;  // not xsum in the tasks: a thread_local names each thread's own
  if constexpr (kOff256<KIND> != 0) {
    xsum.resize(static_cast<size_t>(N * x.nb));
    block_sums(x.q, N * x.nb, xsum.data());
    sums = xsum.data();
  }
  for_output_groups8(pool, N, O,
                     [&](int64_t o0, int64_t o1) { exact_outputs8<KIND>(W, row_bytes, x, sums, N, O, Y, o0, o1); });
}

// Sub-block s (inputs 32 s .. 32 s + 31) as unsigned codes, in input order.
template <int KIND>
inline __m256i k_codes256(const uint8_t* b, int s) {
  const __m256i m4 = _mm256_set1_epi8(15);
  if constexpr (KIND == kQ6_K) {
    const int h = s / 4, c = s % 4;
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (c & 1)));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(l, 4 * (c >> 1)), m4);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
  } else {
    const __m256i t =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (KIND == kQ4_K ? 16 : 48) + 32 * (s / 2)));
    __m256i u = _mm256_and_si256(_mm256_srli_epi16(t, 4 * (s & 1)), m4);
    if constexpr (KIND == kQ5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, s), _mm256_set1_epi8(1)), 4));
    }
    return u;
  }
}

// The K-quants, one arithmetic for every row count (as the 32-input kinds'): for each output
// and super-block, isum = sum sc u q and msum = sum mn bsum as exact int32 sums, then in float32
// f = isum d_w - msum dmin (q6_k: (isum - msum) d_w) and acc = fma(f, d_x, acc), super-block by
// super-block in order, in 8 lanes that are 8 outputs. Up to 7 rows: k_rows8 (each output's
// super-block as stored, 32 inputs a vector against its scales, the 8 outputs' lanes reduced
// to 8 sums by reduce8); more: panels of 8 outputs unpacked a super-block at a time into [group
// of 4 inputs][output] (k_unpack8), which each row meets as vpmaddubsw against its 4 bytes
// broadcast, the int16 pairs summed over a run of groups (q4_k 8: 8 * 2 * 15 * 127 = 30480;
// q5_k 4: 31496; q6_k 2: 32004, below 2^15) before vpmaddwd with the run's scales. (The tiles
// before these, 4 rows an output, each sub-block unpacked once a tile and the lanes summed as
// floats at the end, ran a 16-row Llama 3.2 1B q4_k layer 4.7x its one-row time on Zen 3.)
template <int KIND>
constexpr int kKRun = KIND == kQ4_K   ? 8
                      : KIND == kQ5_K ? 4
                                      : 2;

// vpshufb's index that puts int16 element a of each 128-bit half in all 8 lanes of the low half,
// element b in the high half's.
inline __m256i k_pick16(int a, int b) {
  const int64_t lo = (2 * a) | (2 * a + 1) << 8, hi = (2 * b) | (2 * b + 1) << 8;
  const int64_t qa = lo | lo << 16 | lo << 32 | lo << 48, qb = hi | hi << 16 | hi << 32 | hi << 48;
  return _mm256_set_epi64x(qb, qb, qa, qa);
}

// A super-block of 8 outputs unpacked: w [64 groups of 4 inputs] (lane j: output j's 4 codes),
// sc [16] (lane j: output j's int16 scale of group g of 16 inputs, twice: the pair's), mn [8]
// (lane j: the int16 pair of output j's mins of inputs 32 t .. 32 t + 31, per 16: q4_k / q5_k
// the sub-block's min twice, q6_k its two scales, 32 times each later), d and dmin (lane j).
struct KPanel8 {
  __m256i w[64];
  __m256i sc[16];
  __m256i mn[8];
  __m256 d, dmin;
};

template <int KIND>
inline void k_unpack8(const uint8_t* const rows[8], int64_t b, KPanel8& p) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  for (int s = 0; s < 8; ++s) {
    __m256i in[8];
    for (int j = 0; j < 8; ++j) in[j] = k_codes256<KIND>(rows[j] + b * BB, s);
    transpose8(in, p.w + 8 * s);
  }
  alignas(32) float d[8], dmin[8];
  __m256i s16[8], lo[8], hi[8];
  for (int j = 0; j < 8; ++j) {
    // the 16 scale bytes widened: q4_k / q5_k the 8 scales then the 8 mins, q6_k the 16 scales
    s16[j] = _mm256_cvtepi8_epi16(k_scale_bytes<KIND>(rows[j] + b * BB, d[j], dmin[j]));
    lo[j] = _mm256_unpacklo_epi16(s16[j], s16[j]);  // groups 0-3 | 8-11, each twice
    hi[j] = _mm256_unpackhi_epi16(s16[j], s16[j]);  // groups 4-7 | 12-15
  }
  __m256i t[8], u[8];
  transpose8(lo, t);
  transpose8(hi, u);
  for (int g = 0; g < 4; ++g) p.sc[g] = t[g], p.sc[8 + g] = t[4 + g], p.sc[4 + g] = u[g], p.sc[12 + g] = u[4 + g];
  if constexpr (KIND == kQ6_K) {
    transpose8(s16, p.mn);  // lane j of mn[t]: output j's scales of groups 2 t, 2 t + 1
  } else {
    for (int s = 0; s < 8; ++s) p.mn[s] = p.sc[8 + s];  // the sub-block's min, twice
  }
  p.d = _mm256_load_ps(d);
  p.dmin = _mm256_load_ps(dmin);
}

// Row n's share of super-block b from its exact sums: acc = fma(f, d_x, acc).
template <int KIND>
inline __m256 k_scale(__m256i isum, __m256i msum, __m256 dw, __m256 dmw, const XQ& x, int64_t n, int64_t b,
                      __m256 acc) {
  const int64_t at = n * x.ns + b;
  __m256 f;
  if constexpr (KIND == kQ6_K) {
    f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum, msum)), dw);
  } else {
    f = _mm256_fmsub_ps(_mm256_cvtepi32_ps(isum), dw, _mm256_mul_ps(_mm256_cvtepi32_ps(msum), dmw));
  }
  return _mm256_fmadd_ps(f, _mm256_broadcast_ss(x.dk + at), acc);
}

// Rows [n0, n0 + R) against the panel's super-block b, into acc (their 8 outputs' lanes).
template <int KIND, int R>
inline void k_panel_tile(const KPanel8& p, const XQ& x, int64_t n0, int64_t b, __m256* acc) {
  constexpr int kRun = kKRun<KIND>;
  static_assert(kRun % 2 == 0, "a run is two chains of groups");
  constexpr int kGroup = KIND == kQ6_K ? 4 : 8;  // groups of 4 inputs a scale covers
  __m256i isum[R], msum[R];
  const uint8_t* xr[R];  // each row's next 4 bytes: a constant offset from its own pointer
  for (int r = 0; r < R; ++r) {
    isum[r] = _mm256_setzero_si256(), msum[r] = _mm256_setzero_si256();
    xr[r] = reinterpret_cast<const uint8_t*>(x.q + (n0 + r) * x.K + b * kQKK);
  }
  const __m256i* w = p.w;
  for (int g0 = 0; g0 < 64; g0 += kRun, w += kRun) {
    __m256i i16[2][R];  // a row's even and odd groups: two chains in order (78 GMAC/s against one's 73)
#pragma GCC unroll 8
    for (int j = 0; j < kRun; ++j) {
      const __m256i wj = _mm256_load_si256(w + j);
      for (int r = 0; r < R; ++r) {
        const __m256i prod = _mm256_maddubs_epi16(wj, _mm256_set1_epi32(static_cast<int32_t>(load_u32(xr[r] + 4 * j))));
        __m256i& sum = i16[j % 2][r];
        sum = j < 2 ? prod : _mm256_add_epi16(sum, prod);
        if constexpr (kRun > 2) in_order(sum);  // q6_k's runs of 2 schedule better free
      }
    }
    const __m256i sc = p.sc[g0 / kGroup];
    for (int r = 0; r < R; ++r) {
      isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_add_epi16(i16[0][r], i16[1][r]), sc));
      xr[r] += 4 * kRun;
    }
  }
  for (int t = 0; t < 8; ++t)
    for (int r = 0; r < R; ++r) {
      const int16_t* bs = x.bs + ((n0 + r) * x.ns + b) * 16 + 2 * t;
      const __m256i pair = _mm256_set1_epi32(static_cast<int32_t>(load_u32(reinterpret_cast<const uint8_t*>(bs))));
      msum[r] = _mm256_add_epi32(msum[r], _mm256_madd_epi16(p.mn[t], pair));
    }
  for (int r = 0; r < R; ++r) {
    if constexpr (KIND == kQ6_K) msum[r] = _mm256_slli_epi32(msum[r], 5);
    acc[r] = k_scale<KIND>(isum[r], msum[r], p.d, p.dmin, x, n0 + r, b, acc[r]);
  }
}

// Outputs [o0, o0 + mo) (mo <= 8; past mo computed, not stored) against rows [n0, n0 + R) of x:
// each output's row streamed front to back as stored (one sequential stream of weights, as the
// hardware prefetcher likes: 8 rows read side by side ran a one-row Llama 3.2 1B q4_k layer 6%
// slower on Zen 3), each sub-block unpacked once for the R rows, each super-block's sums kept
// in 8 lanes in `sums` ([R][ns][8 outputs] isum, then as many msum), then the 8 outputs' lanes
// reduced to exact sums by reduce8 and scaled in order. `ahead`: the rows 16 outputs on are this
// thread's, each super-block's share of them prefetched into L2 as this one is read (the stream
// alone reached 75-80% of the rate from cache: a one-row q4_k layer 1.11-1.20x with it, Zen 3).
template <int KIND, int R>
inline void k_rows8(const uint8_t* W, int64_t row_bytes, const XQ& x, int64_t O, float* Y, int64_t o0, int mo,
                    int64_t n0, __m256i* sums, float* scales, bool ahead) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  const int64_t ns = x.ns, span = 16 * row_bytes;
  __m256i* ms = sums + R * ns * 8;
  float* dmins = scales + ns * 8;
  for (int j = 0; j < 8; ++j) {
    const uint8_t* row = W + (o0 + std::min(j, mo - 1)) * row_bytes;
    for (int64_t b = 0; b < ns; ++b) {
      const uint8_t* blk = row + b * BB;
      if (ahead)
        for (int64_t l = 0; l < BB; l += 64) prefetch_l2(blk + span + l);
      const __m128i sb = k_scale_bytes<KIND>(blk, scales[b * 8 + j], dmins[b * 8 + j]);
      const __m256i s16 = _mm256_cvtepi8_epi16(sb);
      const __m256i lo = _mm256_permute4x64_epi64(s16, 0x44), hi = _mm256_permute4x64_epi64(s16, 0xee);
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m256i u = k_codes256<KIND>(blk, s);
        // The sub-block's scale in every int16 lane (q6_k: lanes 0-7 group 2 s's, 8-15 2 s + 1's).
        const int g0 = KIND == kQ6_K ? 2 * s : s, g1 = KIND == kQ6_K ? 2 * s + 1 : s;
        const __m256i sc = _mm256_shuffle_epi8(g0 < 8 ? lo : hi, k_pick16(g0 % 8, g1 % 8));
        for (int r = 0; r < R; ++r) {
          const __m256i xv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (n0 + r) * x.K + b * kQKK + 32 * s));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), sc));
        }
      }
      const __m256i mn = k_mins16<KIND>(sb);
      for (int r = 0; r < R; ++r) {
        sums[(r * ns + b) * 8 + j] = isum[r];
        ms[(r * ns + b) * 8 + j] = _mm256_madd_epi16(
            mn, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bs + ((n0 + r) * ns + b) * 16)));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < ns; ++b)
      acc = k_scale<KIND>(reduce8(sums + (r * ns + b) * 8), reduce8(ms + (r * ns + b) * 8),
                          _mm256_loadu_ps(scales + b * 8), _mm256_loadu_ps(dmins + b * 8), x, n0 + r, b, acc);
    alignas(32) float out[8];
    _mm256_store_ps(out, acc);
    for (int j = 0; j < mo; ++j) Y[(n0 + r) * O + o0 + j] = out[j];
  }
}

constexpr int64_t kKPanelMinRows = 8;  // fewer rows than this run k_rows8 (see k_outputs8)

// Outputs [o0, o1) against every row of x, 8 outputs at a time: up to 7 rows by k_rows8 (tiles
// of 4); more by panels, in runs of rows whose x fits L2 (the panel's super-blocks unpacked again a run),
// each super-block unpacked once a run and met by every row of it while in L1, the rows'
// accumulators in the thread's scratch.
template <int KIND>
void k_outputs8(const uint8_t* W, int64_t row_bytes, const XQ& x, int64_t N, int64_t O, float* Y, int64_t o0,
                int64_t o1) {
  if (N < kKPanelMinRows) {
    thread_local Scratch sums, scales;
    __m256i* is = sums.get<__m256i>(static_cast<size_t>(2 * 4 * x.ns * 8));
    float* sc = scales.get<float>(static_cast<size_t>(2 * x.ns * 8));
    for (int64_t o = o0; o < o1; o += 8) {
      const int mo = static_cast<int>(std::min<int64_t>(8, o1 - o));
      int64_t n = 0;
      // The rows 16 outputs on are this thread's: the first pass over these outputs reads them into L2.
      const bool ahead = o + 24 <= o1;
      for (; n + 4 <= N; n += 4) k_rows8<KIND, 4>(W, row_bytes, x, O, Y, o, mo, n, is, sc, ahead && n == 0);
      with_rows<3>(N - n, [&](auto r) {
        k_rows8<KIND, decltype(r)::value>(W, row_bytes, x, O, Y, o, mo, n, is, sc, ahead && n == 0);
      });
    }
    return;
  }
  constexpr int R = 4;
  thread_local Scratch scratch;  // the panel, then the run's accumulators
  const int64_t run = std::max<int64_t>(R, (int64_t{256} << 10) / x.K / R * R);
  KPanel8* p =
      scratch.get<KPanel8>(1 + (static_cast<size_t>(run) * sizeof(__m256) + sizeof(KPanel8) - 1) / sizeof(KPanel8));
  __m256* acc = reinterpret_cast<__m256*>(p + 1);
  for (int64_t n0 = 0; n0 < N; n0 += run) {
    const int64_t n1 = std::min(N, n0 + run);
    for (int64_t o = o0; o < o1; o += 8) {
      const int mo = static_cast<int>(std::min<int64_t>(8, o1 - o));
      const uint8_t* rows[8];
      for (int j = 0; j < 8; ++j) rows[j] = W + (o + std::min(j, mo - 1)) * row_bytes;
      for (int64_t n = n0; n < n1; ++n) acc[n - n0] = _mm256_setzero_ps();
      for (int64_t b = 0; b < x.ns; ++b) {
        k_unpack8<KIND>(rows, b, *p);
        int64_t n = n0;
        for (; n + R <= n1; n += R) k_panel_tile<KIND, R>(*p, x, n, b, acc + (n - n0));
        with_rows<R - 1>(n1 - n, [&](auto r) { k_panel_tile<KIND, decltype(r)::value>(*p, x, n, b, acc + (n - n0)); });
      }
      for (int64_t n = n0; n < n1; ++n) {
        alignas(32) float out[8];
        _mm256_store_ps(out, acc[n - n0]);
        for (int j = 0; j < mo; ++j) Y[n * O + o + j] = out[j];
      }
    }
  }
}

// The K-quants: the outputs in groups of 8 over the threads.
template <int KIND>
void qgemm(ffi::ThreadPool& pool, const uint8_t* W, const XQ& x, int64_t N, int64_t O, float* Y) {
  const int64_t row_bytes = x.ns * Fmt<KIND>::kBytes;
  for_output_groups8(pool, N, O, [&](int64_t o0, int64_t o1) { k_outputs8<KIND>(W, row_bytes, x, N, O, Y, o0, o1); });
}

}  // namespace
}  // namespace tl
#endif
