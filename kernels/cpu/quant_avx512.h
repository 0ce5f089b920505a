// The AVX-512 VNNI kernels (x86-64-v4-vnni, sapphirerapids): TL_QDOT_512 (quant.h).
//
// Owns: the 32-input kinds on the stored rows (exact_row for one row, exact_tile for a few, the
// panels of 32 outputs unpacked a call for kPanelMinRows rows or more: qgemm_blocks), on weights
// repacked at load into panels of 16 (panels_range, qgemm_panels: TlQGemmPanels), and the
// K-quants' dot_rows_k (vpmaddubsw then vpdpwssd with the pairs' scales, 64 inputs a vector),
// which quant_tiles.h runs. Must not: be compiled for another family (empty elsewhere). Included
// by quant_gemm.cc and bench/qlayout.cc (which times exact_row against panels_range); tested by
// tests/kernels/test_cpu_native_quant.py and tests/model/test_panels.py on the builds that run it.
#pragma once

#include "quant_x86.h"

#if defined(TL_QDOT_512)
namespace tl {
namespace {

constexpr int kTileRows = 8;

// The 32-input kinds run the exact kernels below (qgemm_blocks), the K-quants dot_rows_k;
// quant_tiles.h's reference to dot_rows is never instantiated here.
template <int KIND, int R>
void dot_rows(const uint8_t* w, const XQ& x, int64_t n0, float out[R]);

// Inputs 64 j .. 64 j + 63 of a super-block as unsigned codes, in input order.
template <int KIND>
inline __m512i k_codes512(const uint8_t* b, int j) {
  const __m512i m4 = _mm512_set1_epi8(15);
  if constexpr (KIND == kQ6_K) {  // quarters 2 (j % 2), 2 (j % 2) + 1 of half j / 2
    const int h = j / 2, sh = 4 * (j % 2);
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(b + 64 * h), sh), m4);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m512i hb =
        __builtin_shufflevector(_mm256_srli_epi16(qh, sh), _mm256_srli_epi16(qh, sh + 2), 0, 1, 2, 3, 4, 5, 6, 7);
    return _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(hb, _mm512_set1_epi8(3)), 4));
  } else {  // sub-blocks 2 j (low nibbles), 2 j + 1 (high) of the same 32 bytes
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (KIND == kQ4_K ? 16 : 48) + 32 * j));
    __m512i u = _mm512_and_si512(__builtin_shufflevector(t, _mm256_srli_epi16(t, 4), 0, 1, 2, 3, 4, 5, 6, 7), m4);
    if constexpr (KIND == kQ5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m512i hb = __builtin_shufflevector(_mm256_srli_epi16(qh, 2 * j), _mm256_srli_epi16(qh, 2 * j + 1), 0, 1,
                                                 2, 3, 4, 5, 6, 7);
      u = _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(hb, _mm512_set1_epi8(1)), 4));
    }
    return u;
  }
}

// The int16 scale of each pair of inputs 64 j .. 64 j + 63 (groups 4 j .. 4 j + 3), picked from
// the 16 scale bytes widened once a super-block (s16).
template <int KIND>
inline __m512i k_scales512(__m512i s16, int j) {
  const int g = KIND == kQ6_K ? 4 * j : 2 * j;
  const int g1 = KIND == kQ6_K ? g + 1 : g, g2 = KIND == kQ6_K ? g + 2 : g + 1, g3 = KIND == kQ6_K ? g + 3 : g + 1;
  const __m512i idx = _mm512_set_epi16(g3, g3, g3, g3, g3, g3, g3, g3, g2, g2, g2, g2, g2, g2, g2, g2, g1, g1, g1, g1,
                                       g1, g1, g1, g1, g, g, g, g, g, g, g, g);
  return _mm512_permutexvar_epi16(idx, s16);
}

// AVX-512 VNNI: 64 inputs a vector, vpmaddubsw (u x q pairs, |.| <= 2 * 63 * 127: no int16
// saturation) then vpdpwssd with the pairs' scales into int32 lanes, exact over the super-block.
template <int KIND, int R>
inline void dot_rows_k(const uint8_t* w, const XQ& x, int64_t n0, float out[R]) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.ns; ++b) {
    const uint8_t* blk = w + b * BB;
    float d, dmin;
    const __m128i sb = k_scale_bytes<KIND>(blk, d, dmin);
    const __m512i s16 =
        __builtin_shufflevector(_mm256_cvtepi8_epi16(sb), _mm256_setzero_si256(), 0, 1, 2, 3, 4, 5, 6, 7);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i u = k_codes512<KIND>(blk, j), sc = k_scales512<KIND>(s16, j);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(x.q + (n0 + r) * x.K + b * kQKK + 64 * j);
        isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(u, xv), sc);
      }
    }
    const __m256i mn = k_mins16<KIND>(sb);
    const __m512 dw = _mm512_set1_ps(d), dmw = _mm512_set1_ps(dmin);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (n0 + r) * x.ns + b;
      const __m256i m8 = _mm256_madd_epi16(mn, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bs + at * 16)));
      const __m512i msum = __builtin_shufflevector(m8, _mm256_setzero_si256(), 0, 1, 2, 3, 4, 5, 6, 7);
      __m512 f;  // the super-block's lanes times d_w (and less dmin msum), then times d_x
      if constexpr (KIND == kQ6_K) {
        f = _mm512_mul_ps(__builtin_convertvector(i16(_mm512_sub_epi32(isum[r], msum)), v16), dw);
      } else {
        f = _mm512_fmsub_ps(__builtin_convertvector(i16(isum[r]), v16), dw,
                            _mm512_mul_ps(__builtin_convertvector(i16(msum), v16), dmw));
      }
      acc[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(x.dk[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(v16(acc[r]));
}

// The VNNI path (x86-64-v4-vnni, sapphirerapids): every format as unsigned bytes u with a
// per-block offset (q8_0: u = w + 128, q4_0: the nibble, w = u - 8; q5_0: u - 16; q4_1 / q5_1:
// u as stored, the offset being m), so that vpdpbusd takes the weights as they unpack, with no
// sign juggling per row of x. The offset's share of a block's sum, off * sum(q_x), depends on x
// alone: it is computed once a call, negated, and is the accumulator vpdpbusd starts from, so
// each block's int32 sum comes out exact. x is laid out once a call as the weights unpack: a
// pair of blocks a 512-bit vector, for the nibble formats [b0 low 16, b1 low 16, b0 high 16, b1
// high 16] (the order the two 16-byte qs arrays split into), for q8_0 [b0, b1], each int32
// lane's offset term beside it.
//
// One arithmetic for every row count, so that a row's result is the same bit for bit whatever
// else its step holds (a request alone or among other decodes, a prompt after a prefix-cache
// hit; tests/kernels/test_cpu_native_quant.py): each block's exact int32 sum is converted once and added
// as acc = fma(sum, d_w * d_x, acc), then acc = fma(m_w, s_x, acc), block by block in order.
// Steps of up to kPanelMinRows - 1 rows run exact_row / exact_tile (the weights streamed as
// stored, a vector a pair of blocks, the lanes reduced to block sums); more run the panels,
// whose lanes are outputs. (The tiles before these scaled each 4-product int32 lane and summed
// the lanes at the end: the same integers, other roundings, so the panels could take only prompt
// chunks. Panels from 8 rows serve 16 decode streams' matmuls about 1.8x faster than those
// tiles did, at SmolLM2's shapes.)

struct XL {          // x in the VNNI layout, `np` pairs a row
  const int8_t* q;   // [N][np][64]
  const int32_t* c;  // [N][np][16]: -(offset * the lane's x sum)
  int64_t np;
};

template <int KIND>
constexpr bool kNibbles = KIND != kQ8_0;
template <int KIND>
constexpr int kOffset = KIND == kQ8_0   ? 128
                        : KIND == kQ4_0 ? 8
                        : KIND == kQ5_0 ? 16
                                        : 0;

// x in that layout, a vector a pair: the bytes by 128-bit moves (the second block zero past a
// row's last), each lane's offset term from one vpdpbusd of ones.
template <int KIND>
void layout_x(const XQ& x, int64_t N, int8_t* q, int32_t* c, int64_t np) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t p = 0; p < np; ++p) {
      const int64_t b0 = 2 * p;
      const bool pair = b0 + 1 < x.nb;
      const int8_t* src = x.q + n * x.K + b0 * kQK;
      const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
      const __m128i z = _mm_setzero_si128();
      const __m128i c0 = pair ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32)) : z;
      const __m128i c1 = pair ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48)) : z;
      const __m256i lo = kNibbles<KIND> ? _mm256_set_m128i(c0, a0) : _mm256_set_m128i(a1, a0);
      const __m256i hi = kNibbles<KIND> ? _mm256_set_m128i(c1, a1) : _mm256_set_m128i(c1, c0);
      const __m512i v = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7);
      const int64_t at = n * np + p;
      _mm512_storeu_si512(q + at * 64, v);
      const __m512i sum4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, v);
      _mm512_storeu_si512(c + at * 16, _mm512_mullo_epi32(sum4, _mm512_set1_epi32(-kOffset<KIND>)));
    }
}

// A pair of blocks' weights as unsigned bytes in the layout above (the second block zero when
// `pair` is false: a row's odd last block, never read past).
template <int KIND>
inline __m512i unpack_pair(const uint8_t* blk, bool pair) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  if constexpr (KIND == kQ8_0) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    const __m256i b =
        pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + BB + 2)) : _mm256_set1_epi8(-128);
    const __m512i w = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7);
    return _mm512_xor_si512(w, _mm512_set1_epi8(-128));
  } else {
    constexpr int64_t qs_at = KIND == kQ4_0 ? 2 : KIND == kQ4_1 ? 4 : KIND == kQ5_0 ? 6 : 8;
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qs_at));
    const __m128i q1 = pair ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + BB + qs_at)) : _mm_setzero_si128();
    const __m256i t = __builtin_shufflevector(q0, q1, 0, 1, 2, 3);
    __m512i w = __builtin_shufflevector(t, _mm256_srli_epi16(t, 4), 0, 1, 2, 3, 4, 5, 6, 7);
    w = _mm512_and_si512(w, _mm512_set1_epi8(15));
    if constexpr (KIND == kQ5_0 || KIND == kQ5_1) {
      const uint64_t h0 = load_u32(blk + (KIND == kQ5_0 ? 2 : 4));
      const uint64_t h1 = pair ? load_u32(blk + BB + (KIND == kQ5_0 ? 2 : 4)) : 0;
      const __mmask64 hi = (h0 & 0xffff) | (h1 & 0xffff) << 16 | (h0 >> 16) << 32 | (h1 >> 16) << 48;
      w = _mm512_mask_add_epi8(w, hi, w, _mm512_set1_epi8(16));
    }
    return w;
  }
}

// Steps of fewer than kPanelMinRows rows (decodes) with the panels' arithmetic (below). The
// weights stream as stored (unpack_pair: a pair of blocks a vector, MO output rows at once), and
// the 16 lanes of the accumulator are 16 (row of x, output) pairs, c = r * MO + j: each pair's
// vpdpbusd vector (16 int32 lanes, four products each) is reduced with 15 others to its two
// blocks' sums by a transpose-and-add network (reduce_blocks: 44 shuffles and adds per 16
// vpdpbusd); the pairs' d_w (and m_w) come by scalar loads inserted into a vector (scales8;
// exact_row's q8_0: one gather a block).
template <int KIND>
inline void reduce_blocks(const __m512i v[16], __m512i& s0, __m512i& s1) {
  __m512i t[8], u[4], w[2];
  // Zero-masked forms throughout: GCC 12's plain ones warn of an undefined operand.
  for (int k = 0; k < 8; ++k)  // each 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    t[k] = _mm512_add_epi32(_mm512_maskz_unpacklo_epi32(0xffff, v[2 * k], v[2 * k + 1]),
                            _mm512_maskz_unpackhi_epi32(0xffff, v[2 * k], v[2 * k + 1]));
  for (int j = 0; j < 4; ++j)  // each 128-bit lane: v[4j..4j+3]'s sums over that lane
    u[j] = _mm512_add_epi32(_mm512_maskz_unpacklo_epi64(0xff, t[2 * j], t[2 * j + 1]),
                            _mm512_maskz_unpackhi_epi64(0xff, t[2 * j], t[2 * j + 1]));
  // A block's 128-bit lanes: 0 and 2 (the first block of the pair) and 1 and 3 for the nibble
  // formats' layout, 0-1 and 2-3 for q8_0's.
  constexpr int a = kNibbles<KIND> ? _MM_SHUFFLE(1, 0, 1, 0) : _MM_SHUFFLE(2, 0, 2, 0);
  constexpr int b = kNibbles<KIND> ? _MM_SHUFFLE(3, 2, 3, 2) : _MM_SHUFFLE(3, 1, 3, 1);
  for (int i = 0; i < 2; ++i)  // [u(2i) block 0, u(2i) block 1, u(2i+1) block 0, u(2i+1) block 1]
    w[i] = _mm512_add_epi32(_mm512_maskz_shuffle_i32x4(0xffff, u[2 * i], u[2 * i + 1], a),
                            _mm512_maskz_shuffle_i32x4(0xffff, u[2 * i], u[2 * i + 1], b));
  s0 = _mm512_maskz_shuffle_i32x4(0xffff, w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0));
  s1 = _mm512_maskz_shuffle_i32x4(0xffff, w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1));
}

constexpr int kExactAhead = 32;  // weight rows prefetched (into L2: prefetch_l2) ahead of the first row of x

// Outputs [o0, o0 + mo) (mo <= MO <= 8) against rows [n0, n0 + R) of x; MO * R <= 16.
template <int KIND, int MO, int R>
inline void exact_tile(const uint8_t* W, int64_t row_bytes, const XL& x, const XQ& xq, int64_t O, float* Y, int64_t o0,
                       int mo, int64_t n0, bool prefetch) {
  static_assert(MO * R <= 16 && MO <= 8 && 8 % MO == 0, "16 lanes, each 8 a whole number of output rows");
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  const int64_t nb = xq.nb;
  const uint8_t* rows[MO];
  for (int j = 0; j < MO; ++j) rows[j] = W + (o0 + std::min(j, mo - 1)) * row_bytes;  // past mo: computed, not stored
  const __m512 z = _mm512_setzero_ps();
  __m512 acc = z;
  for (int64_t p = 0; p < x.np; ++p) {
    const int64_t b0 = 2 * p;
    const bool pair = b0 + 1 < nb;
    if (prefetch)  // the lines of this pair, kExactAhead rows on
      for (int j = 0; j < MO; ++j)
        for (int64_t l = 0; l < 2 * BB; l += 64) prefetch_l2(rows[j] + kExactAhead * row_bytes + b0 * BB + l);
    __m512i u[MO], v[16];
    for (int j = 0; j < MO; ++j) u[j] = unpack_pair<KIND>(rows[j] + b0 * BB, pair);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (n0 + r) * x.np + p;
      const __m512i xv = _mm512_loadu_si512(x.q + i * 64);
      const __m512i c0 = kOffset<KIND> ? _mm512_loadu_si512(x.c + i * 16) : _mm512_setzero_si512();
      for (int j = 0; j < MO; ++j) v[r * MO + j] = _mm512_dpbusd_epi32(c0, u[j], xv);
    }
    for (int c = MO * R; c < 16; ++c) v[c] = _mm512_setzero_si512();
    __m512i s[2];
    reduce_blocks<KIND>(v, s[0], s[1]);
    for (int h = 0; h < (pair ? 2 : 1); ++h) {
      const int64_t b = b0 + h;
      // Each lane's (d, m) halves of its output's block, and its row's d_x and s_x.
      const __m512i g = _mm512_maskz_broadcast_i64x4(0xff, scales8<MO>(rows, b * BB));  // lane c: output c % MO
      const __m512 dw = _mm512_maskz_cvtph_ps(0xffff, _mm512_maskz_cvtepi32_epi16(0xffff, g));
      __m512 dx = _mm512_set1_ps(xq.d8[(n0 * nb + b) * 8]);
      for (int r = 1; r < R; ++r)
        dx = _mm512_mask_blend_ps(static_cast<__mmask16>(((1u << MO) - 1) << (r * MO)), dx,
                                  _mm512_set1_ps(xq.d8[((n0 + r) * nb + b) * 8]));
      acc = _mm512_fmadd_ps(_mm512_mask_cvtepi32_ps(z, 0xffff, s[h]), _mm512_mul_ps(dw, dx), acc);
      if constexpr (Fmt<KIND>::kHasM) {
        const __m512 mw =
            _mm512_maskz_cvtph_ps(0xffff, _mm512_maskz_cvtepi32_epi16(0xffff, _mm512_maskz_srli_epi32(0xffff, g, 16)));
        __m512 sx = _mm512_set1_ps(xq.s[n0 * nb + b]);
        for (int r = 1; r < R; ++r)
          sx = _mm512_mask_blend_ps(static_cast<__mmask16>(((1u << MO) - 1) << (r * MO)), sx,
                                    _mm512_set1_ps(xq.s[(n0 + r) * nb + b]));
        acc = _mm512_fmadd_ps(mw, sx, acc);
      }
    }
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, acc);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < mo; ++j) Y[(n0 + r) * O + o0 + j] = out[r * MO + j];
}

// One row of x against outputs [o0, o0 + mo) (mo <= 8), two pairs of blocks at a time: lanes
// 0-7 the 8 outputs' pair p, 8-15 their pair p + 1, so all 16 lanes of the reduction carry
// sums; the accumulator is 8 floats, the four blocks added in their order.
template <int KIND>
inline void exact_row(const uint8_t* W, int64_t row_bytes, const XL& x, const XQ& xq, int64_t O, float* Y, int64_t o0,
                      int mo, int64_t n, bool prefetch) {
  constexpr int MO = 8;
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  const int64_t nb = xq.nb;
  const uint8_t* rows[MO];
  alignas(64) int32_t at[16];
  for (int j = 0; j < MO; ++j) rows[j] = W + (o0 + std::min(j, mo - 1)) * row_bytes;
  for (int c = 0; c < 16; ++c)
    at[c] = static_cast<int32_t>(std::min(c % MO, mo - 1) * row_bytes + (c < MO ? 0 : 2 * BB));
  const __m512i gat = _mm512_load_si512(at);
  const float* dx = xq.d8 + n * nb * 8;  // block b's d_x at dx[8 b]
  const float* sx = xq.s + n * nb;
  const __m512 z = _mm512_setzero_ps();
  __m256 acc = _mm256_setzero_ps();
  // Block b's share: lanes [8 half, 8 half + 8) of f (its sums), d (d_w) and m (m_w).
  auto add = [&](__m512 f, __m512 d, __m512 m, int half, int64_t b) {
    const __m512 prod = _mm512_mul_ps(d, _mm512_set1_ps(dx[8 * b]));
    const __m256 fh = half ? __builtin_shufflevector(f, f, 8, 9, 10, 11, 12, 13, 14, 15)
                           : __builtin_shufflevector(f, f, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 ph = half ? __builtin_shufflevector(prod, prod, 8, 9, 10, 11, 12, 13, 14, 15)
                           : __builtin_shufflevector(prod, prod, 0, 1, 2, 3, 4, 5, 6, 7);
    acc = _mm256_fmadd_ps(fh, ph, acc);
    if constexpr (Fmt<KIND>::kHasM) {
      const __m256 mh = half ? __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15)
                             : __builtin_shufflevector(m, m, 0, 1, 2, 3, 4, 5, 6, 7);
      acc = _mm256_fmadd_ps(mh, _mm256_set1_ps(sx[b]), acc);
    }
  };
  for (int64_t p = 0; p < x.np;) {
    const int64_t b0 = 2 * p;
    const bool two = b0 + 3 < nb;  // pairs p and p + 1 both whole
    const bool pair = b0 + 1 < nb;
    if (prefetch)  // the lines of the next four blocks, kExactAhead rows on
      for (int j = 0; j < MO; ++j)
        for (int64_t l = 0; l < 4 * BB; l += 64) prefetch_l2(rows[j] + kExactAhead * row_bytes + b0 * BB + l);
    __m512i v[16];
    const __m512i xv = _mm512_loadu_si512(x.q + (n * x.np + p) * 64);
    const __m512i c0 = kOffset<KIND> ? _mm512_loadu_si512(x.c + (n * x.np + p) * 16) : _mm512_setzero_si512();
    for (int j = 0; j < MO; ++j) v[j] = _mm512_dpbusd_epi32(c0, unpack_pair<KIND>(rows[j] + b0 * BB, two || pair), xv);
    if (two) {
      const __m512i xv1 = _mm512_loadu_si512(x.q + (n * x.np + p + 1) * 64);
      const __m512i c1 = kOffset<KIND> ? _mm512_loadu_si512(x.c + (n * x.np + p + 1) * 16) : _mm512_setzero_si512();
      for (int j = 0; j < MO; ++j)
        v[MO + j] = _mm512_dpbusd_epi32(c1, unpack_pair<KIND>(rows[j] + (b0 + 2) * BB, true), xv1);
    } else {
      for (int j = 0; j < MO; ++j) v[MO + j] = _mm512_setzero_si512();
    }
    __m512i s[2];
    reduce_blocks<KIND>(v, s[0], s[1]);
    const __mmask16 k = two ? __mmask16{0xffff} : __mmask16{0x00ff};  // no gather past a row's blocks
    __m512 f[2], d[2], m[2] = {z, z};
    for (int h = 0; h < (pair ? 2 : 1); ++h) {
      // Each lane's (d, m) halves: the nibble formats by scales8 (9-10% faster for q4_0 / q4_1,
      // 2% q5_1), q8_0 by one gather (5% slower with the loads: bound by its bytes).
      __m512i g;
      const int64_t b = b0 + h;
      if constexpr (kNibbles<KIND>) {
        const __m256i lo = scales8<MO>(rows, b * BB),
                      hi = two ? scales8<MO>(rows, (b + 2) * BB) : _mm256_setzero_si256();
        g = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7);
      } else {
        g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, gat, rows[0] + b * BB, 1);
      }
      f[h] = _mm512_mask_cvtepi32_ps(z, 0xffff, s[h]);
      d[h] = _mm512_maskz_cvtph_ps(0xffff, _mm512_maskz_cvtepi32_epi16(0xffff, g));
      if constexpr (Fmt<KIND>::kHasM)
        m[h] =
            _mm512_maskz_cvtph_ps(0xffff, _mm512_maskz_cvtepi32_epi16(0xffff, _mm512_maskz_srli_epi32(0xffff, g, 16)));
    }
    add(f[0], d[0], m[0], 0, b0);
    if (pair) add(f[1], d[1], m[1], 0, b0 + 1);
    if (two) {
      add(f[0], d[0], m[0], 1, b0 + 2);
      add(f[1], d[1], m[1], 1, b0 + 3);
    }
    p += two ? 2 : 1;
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, acc);
  for (int j = 0; j < mo; ++j) Y[n * O + o0 + j] = out[j];
}

// Outputs [o0, o1) in tiles of MO against every row of x, R rows a tile (the rest in one).
template <int KIND, int MO, int R>
void exact_outputs(const uint8_t* W, int64_t row_bytes, const XL& x, const XQ& xq, int64_t N, int64_t O, float* Y,
                   int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; o += MO) {
    const int mo = static_cast<int>(std::min<int64_t>(MO, o1 - o));
    int64_t n = 0;
    for (; n + R <= N; n += R)
      exact_tile<KIND, MO, R>(W, row_bytes, x, xq, O, Y, o, mo, n, n == 0 && o + MO + kExactAhead <= o1);
    with_rows<R - 1>(
        N - n, [&](auto r) { exact_tile<KIND, MO, decltype(r)::value>(W, row_bytes, x, xq, O, Y, o, mo, n, false); });
  }
}

// Steps of kPanelMinRows rows or more: the lanes of a vector are 16 outputs, not 16 groups of
// one output's inputs. Each thread takes panels of kPanel (32) outputs; a panel's weights are
// unpacked once per run of rows into a thread-local buffer as unsigned bytes u (as above)
// interleaved [block][group of 4 inputs][output] (the 16 x 8 int32 transpose of 16 outputs'
// unpacked blocks), with d_w (and m_w) [block][output]. A row of x then meets a block as eight
// vpdpbusd of the panel's group vectors with its own 4 bytes broadcast, summed in int32 (one
// block: exact), starting from -offset * sum(q_x) (q_x's block sum, once per row and block, in
// place of the weights' offset), then converted and scaled once per block: 8 vpdpbusd and 3
// float operations per 16 x 32 products. Rows go R at a time (2 x R int32 and 2 x R float
// accumulators in registers).
constexpr int kPanel = 32;
// The panels from this many rows of x; fewer run exact_row / exact_tile, the same arithmetic.
// The chain of SmolLM2's decode matmuls (q8_0, 30 layers and the head, from memory, Zen 5) at 4
// rows: panels 1.16x the exact tiles' time; at 8 rows 0.69x, at 16 0.46x.
constexpr int64_t kPanelMinRows = 8;
constexpr int64_t kRun = 256;  // rows of x a panel's unpacked weights serve before the next run

struct PanelBuf {
  __m512i* w;  // [nb][8 groups][2 halves of 16 outputs]
  __m512* d;   // [nb][2 halves]: d_w of each output
  __m512* m;   // [nb][2 halves]: m_w
  __m256i* u;  // [kPanel][nb]: each output's blocks unpacked, in row order (the staging)
};

// 8 x 8 int32 transposes in both 256-bit halves: in[i] = [row i (8 int32), row i + 8], out[g] =
// [row 0..7's int32 g, row 8..15's int32 g].
inline void transpose_8x8x2(const __m512i in[8], __m512i out[8]) {
  __m512i t[8], u[8];  // zero-masked unpacks: GCC 12's plain ones warn of an undefined operand
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_maskz_unpacklo_epi32(0xffff, in[2 * i], in[2 * i + 1]);      // r0g0 r1g0 r0g1 r1g1 | g4 g5
    t[2 * i + 1] = _mm512_maskz_unpackhi_epi32(0xffff, in[2 * i], in[2 * i + 1]);  // g2 g3 | g6 g7
  }
  for (int i = 0; i < 2; ++i) {
    for (int h = 0; h < 2; ++h) {
      u[4 * i + 2 * h] = _mm512_maskz_unpacklo_epi64(0xff, t[4 * i + h], t[4 * i + 2 + h]);  // r0..3 g(2h)   | g(2h+4)
      u[4 * i + 2 * h + 1] =
          _mm512_maskz_unpackhi_epi64(0xff, t[4 * i + h], t[4 * i + 2 + h]);  // r0..3 g(2h+1) | g(2h+5)
    }
  }
  // u[0..3]: rows 0-3 (and 8-11), u[4..7]: rows 4-7 (12-15); within each, 128-bit lane k of
  // u[j] holds group j (k even: j's low, k odd: j + 4) for the half k / 2.
  const __m512i lo = _mm512_set_epi32(27, 26, 25, 24, 11, 10, 9, 8, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 23, 22, 21, 20, 7, 6, 5, 4);
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm512_permutex2var_epi32(u[j], lo, u[4 + j]);
    out[j + 4] = _mm512_permutex2var_epi32(u[j], hi, u[4 + j]);
  }
}

// Outputs [o0, o0 + mo) (mo <= kPanel) of W into `buf`; outputs past mo get zero weights. The
// rows are read front to back (one contiguous range: the hardware prefetcher's pattern; block by
// block across the 32 rows ran a 49152 x 576 q8_0 call at 4-8 rows 2-3x slower), unpacked into
// the staging, then transposed from there (L1 / L2).
template <int KIND>
void unpack_panel(const uint8_t* W, int64_t row_bytes, int64_t o0, int mo, int64_t nb, const PanelBuf& buf) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  float* dv = reinterpret_cast<float*>(buf.d);
  float* mv = reinterpret_cast<float*>(buf.m);
  const __m256i off = _mm256_set1_epi8(static_cast<char>(kOffset<KIND>));
  for (int o = 0; o < kPanel; ++o) {
    __m256i* u = buf.u + o * nb;
    if (o >= mo) {
      for (int64_t b = 0; b < nb; ++b)
        u[b] = _mm256_setzero_si256(), dv[b * kPanel + o] = 0.0f, mv[b * kPanel + o] = 0.0f;
      continue;
    }
    const uint8_t* row = W + (o0 + o) * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * BB;
      u[b] = _mm256_add_epi8(unpack256<KIND>(blk), off);
      dv[b * kPanel + o] = half(blk);
      if constexpr (Fmt<KIND>::kHasM) mv[b * kPanel + o] = half(blk + 2);
    }
  }
  for (int64_t b = 0; b < nb; ++b)
    for (int h = 0; h < 2; ++h) {
      __m512i in[8], out[8];
      for (int i = 0; i < 8; ++i)
        in[i] = __builtin_shufflevector(buf.u[static_cast<size_t>((16 * h + i) * nb + b)],
                                        buf.u[static_cast<size_t>((16 * h + i + 8) * nb + b)], 0, 1, 2, 3, 4, 5, 6, 7);
      transpose_8x8x2(in, out);
      for (int g = 0; g < 8; ++g) buf.w[static_cast<size_t>((b * 8 + g) * 2 + h)] = out[g];
    }
}

template <int KIND, int R>
inline void panel_tile(const PanelBuf& buf, const XQ& x, const int32_t* xsum, int64_t O, float* Y, int64_t o0, int mo,
                       int64_t n0) {
  const int64_t nb = x.nb;
  __m512 acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm512_setzero_ps();
  const __m512i* w = buf.w;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ia[2][R];
    for (int r = 0; r < R; ++r) {
      const __m512i init =
          kOffset<KIND> ? _mm512_set1_epi32(-kOffset<KIND> * xsum[(n0 + r) * nb + b]) : _mm512_setzero_si512();
      ia[0][r] = init, ia[1][r] = init;
    }
    const int8_t* xq = x.q + n0 * x.K + b * kQK;
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i w0 = w[(b * 8 + g) * 2], w1 = w[(b * 8 + g) * 2 + 1];
      for (int r = 0; r < R; ++r) {
        const __m512i xb =
            _mm512_set1_epi32(static_cast<int32_t>(load_u32(reinterpret_cast<const uint8_t*>(xq + r * x.K + 4 * g))));
        ia[0][r] = _mm512_dpbusd_epi32(ia[0][r], w0, xb);
        ia[1][r] = _mm512_dpbusd_epi32(ia[1][r], w1, xb);
      }
    }
    const __m512 d0 = buf.d[static_cast<size_t>(2 * b)], d1 = buf.d[static_cast<size_t>(2 * b + 1)];
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.d8[((n0 + r) * nb + b) * 8]);
      // The masked conversion: GCC 12's plain one warns of its undefined pass-through operand.
      const __m512 f0 = _mm512_mask_cvtepi32_ps(_mm512_setzero_ps(), 0xffff, ia[0][r]);
      const __m512 f1 = _mm512_mask_cvtepi32_ps(_mm512_setzero_ps(), 0xffff, ia[1][r]);
      acc[0][r] = _mm512_fmadd_ps(f0, _mm512_mul_ps(d0, dx), acc[0][r]);
      acc[1][r] = _mm512_fmadd_ps(f1, _mm512_mul_ps(d1, dx), acc[1][r]);
    }
    if constexpr (Fmt<KIND>::kHasM) {
      const __m512 m0 = buf.m[static_cast<size_t>(2 * b)], m1 = buf.m[static_cast<size_t>(2 * b + 1)];
      for (int r = 0; r < R; ++r) {
        const __m512 sx = _mm512_set1_ps(x.s[(n0 + r) * nb + b]);
        acc[0][r] = _mm512_fmadd_ps(m0, sx, acc[0][r]);
        acc[1][r] = _mm512_fmadd_ps(m1, sx, acc[1][r]);
      }
    }
  }
  const __mmask16 k0 = mo >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << mo) - 1);
  const __mmask16 k1 = mo >= 32   ? __mmask16{0xffff}
                       : mo <= 16 ? __mmask16{0}
                                  : static_cast<__mmask16>((1u << (mo - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(Y + (n0 + r) * O + o0, k0, acc[0][r]);
    _mm512_mask_storeu_ps(Y + (n0 + r) * O + o0 + 16, k1, acc[1][r]);
  }
}

constexpr int kPanelRows = 6;  // R

// Panels [p0, p1) of W against rows [n0, n1) of x.
template <int KIND>
void panel_outputs(const uint8_t* W, int64_t row_bytes, const XQ& x, const int32_t* xsum, int64_t O, float* Y,
                   int64_t p0, int64_t p1, int64_t n0, int64_t n1) {
  thread_local Scratch w, d, m, u;
  const size_t nb = static_cast<size_t>(x.nb);
  const PanelBuf buf{w.get<__m512i>(nb * 16), d.get<__m512>(nb * 2), m.get<__m512>(nb * 2),
                     u.get<__m256i>(kPanel * nb)};
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t o = p * kPanel;
    const int mo = static_cast<int>(std::min<int64_t>(kPanel, O - o));
    if (p + 1 < p1) {  // the next panel's rows (one contiguous range) on their way while this one computes
      const char* next = reinterpret_cast<const char*>(W + (o + kPanel) * row_bytes);
      const int64_t bytes = std::min<int64_t>(kPanel, O - o - kPanel) * row_bytes;
      for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(next + i, _MM_HINT_T1);
    }
    unpack_panel<KIND>(W, row_bytes, o, mo, x.nb, buf);
    int64_t n = n0;
    for (; n + kPanelRows <= n1; n += kPanelRows) panel_tile<KIND, kPanelRows>(buf, x, xsum, O, Y, o, mo, n);
    with_rows<kPanelRows - 1>(n1 - n,
                              [&](auto r) { panel_tile<KIND, decltype(r)::value>(buf, x, xsum, O, Y, o, mo, n); });
  }
}

template <int KIND>
void qgemm_blocks(ffi::ThreadPool& pool, const uint8_t* W, const XQ& xq, int64_t N, int64_t O, float* Y) {
  const int64_t nb = xq.nb, np = (nb + 1) / 2, row_bytes = nb * Fmt<KIND>::kBytes;
  if (N >= kPanelMinRows) {
    // Runs of kRun rows; within one, tasks of whole panels (more tasks than threads: the
    // threads take them as they finish, so an uneven split of cores costs one task, not half).
    thread_local std::vector<int32_t> xsum;
    xsum.resize(static_cast<size_t>(N * nb));
    block_sums(xq.q, N * nb, xsum.data());
    const int32_t* sums = xsum.data();  // not xsum in the tasks: a thread_local names each thread's own
    const int64_t panels = (O + kPanel - 1) / kPanel;
    const int64_t per_run = std::max<int64_t>(1, std::min<int64_t>(panels, 8 * pool.num_threads()));
    for (int64_t n0 = 0; n0 < N; n0 += kRun) {
      const int64_t n1 = std::min(N, n0 + kRun);
      parallel_for(pool, per_run, [&](int64_t task) {
        panel_outputs<KIND>(W, row_bytes, xq, sums, O, Y, panels * task / per_run, panels * (task + 1) / per_run, n0,
                            n1);
      });
    }
    return;
  }
  thread_local std::vector<int8_t> q;
  thread_local std::vector<int32_t> c;
  q.resize(static_cast<size_t>(N * np * 64));
  c.resize(static_cast<size_t>(N * np * 16));
  layout_x<KIND>(xq, N, q.data(), c.data(), np);
  const XL x{q.data(), c.data(), np};
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), O / 16));
  parallel_for(
      pool, tasks,
      [&](int64_t task) {
        // Ranges of whole tiles of 16 outputs (the last range takes the rest).
        const int64_t tiles = O / 16;
        const int64_t a = 16 * (tiles * task / tasks), b = task + 1 == tasks ? O : 16 * (tiles * (task + 1) / tasks);
        if (N == 1)
          for (int64_t o = a; o < b; o += 8)
            exact_row<KIND>(W, row_bytes, x, xq, O, Y, o, static_cast<int>(std::min<int64_t>(8, b - o)), 0,
                            o + 8 + kExactAhead <= b);
        else if (N == 2)
          exact_outputs<KIND, 8, 2>(W, row_bytes, x, xq, N, O, Y, a, b);
        else
          exact_outputs<KIND, 4, 4>(W, row_bytes, x, xq, N, O, Y, a, b);
      },
      /*linger_after=*/N == 1);
}

// Weights repacked at load into panels (TlQGemmPanels; tl/model/encodings/panels.py packs them):
// q8_0, q4_0 and q4_1 rows regrouped 16 outputs a panel, each block of 32 inputs of a panel as
// its 16 stored blocks' quant bytes transposed, [G][16 outputs][4 bytes] (G = 8 for q8_0's 32
// bytes, 4 for the nibble formats' 16), then the 16 d and (q4_1) the 16 m as halves: as many
// bytes as the 16 stored blocks. A vector of 64 bytes is then 16 outputs' 4 bytes each, so a
// vpdpbusd against x's matching 4 bytes broadcast adds one output's 4 products to each int32
// lane (a nibble format's vector twice: its low nibbles are inputs 4v..4v+3, its high ones
// 16+4v..16+4v+3): no reduction across lanes and no scalar loads of scales, which is where
// exact_row spends most of its instructions (bench/qlayout.cc: one matrix in L2 3.7x faster; its
// chain of SmolLM2's layers from memory 1.2x on this 2-core Zen 4). The arithmetic is
// exact_row's and the panels': each block's int32 sum exact (from -offset * the x block's sum),
// then acc = fma(sum, d_w d_x, acc) and (q4_1) acc = fma(m_w, s_x, acc), block by block, so the
// outputs are theirs bit for bit whatever the row count.

template <int KIND>
constexpr int64_t kPanelGroups = KIND == kQ8_0 ? 8 : 4;  // G: vectors of quant bytes a block

template <int KIND>
constexpr int64_t panel_block_bytes() {
  return kPanelOut * Fmt<KIND>::kBytes;
}

// Panels [p0, p0 + PN) against rows [n0, n0 + R) of x into Y [N, OP].
template <int KIND, int PN, int R>
inline void panels_tile(const uint8_t* P, const XQ& x, const int32_t* xsum, int64_t OP, float* Y, int64_t p0,
                        int64_t n0, bool prefetch) {
  constexpr int64_t G = kPanelGroups<KIND>, PB = panel_block_bytes<KIND>();
  const int64_t nb = x.nb;
  const __m512i lo4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(-128);
  __m512 acc[PN][R];
  for (int k = 0; k < PN; ++k)
    for (int r = 0; r < R; ++r) acc[k][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ia[PN][R];
    for (int r = 0; r < R; ++r) {
      const __m512i init =
          kOffset<KIND> ? _mm512_set1_epi32(-kOffset<KIND> * xsum[(n0 + r) * nb + b]) : _mm512_setzero_si512();
      for (int k = 0; k < PN; ++k) ia[k][r] = init;
    }
    const uint8_t* xb = reinterpret_cast<const uint8_t*>(x.q + n0 * x.K + b * kQK);
#pragma GCC unroll 8
    for (int64_t g = 0; g < G; ++g) {
      __m512i wl[PN], wh[PN];
      for (int k = 0; k < PN; ++k) {
        const uint8_t* blk = P + ((p0 + k) * nb + b) * PB;
        if (prefetch && g == 0)
          for (int64_t l = 0; l < PB; l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * PN * nb * PB + l), _MM_HINT_T1);
        const __m512i w = _mm512_loadu_si512(blk + 64 * g);
        if constexpr (kNibbles<KIND>) {
          wl[k] = _mm512_and_si512(w, lo4);
          wh[k] = _mm512_and_si512(_mm512_srli_epi16(w, 4), lo4);
        } else {
          wl[k] = _mm512_xor_si512(w, flip);  // int8 -> the unsigned code + 128 (the offset)
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xl = _mm512_set1_epi32(static_cast<int32_t>(load_u32(xb + r * x.K + 4 * g)));
        for (int k = 0; k < PN; ++k) ia[k][r] = _mm512_dpbusd_epi32(ia[k][r], wl[k], xl);
        if constexpr (kNibbles<KIND>) {
          const __m512i xh = _mm512_set1_epi32(static_cast<int32_t>(load_u32(xb + r * x.K + 16 + 4 * g)));
          for (int k = 0; k < PN; ++k) ia[k][r] = _mm512_dpbusd_epi32(ia[k][r], wh[k], xh);
        }
      }
    }
    for (int k = 0; k < PN; ++k) {
      const uint8_t* heads = P + ((p0 + k) * nb + b) * PB + 64 * G;
      const __m512 d = _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(heads)));
      for (int r = 0; r < R; ++r) {
        const __m512 dx = _mm512_set1_ps(x.d8[((n0 + r) * nb + b) * 8]);
        // The masked conversion: GCC 12's plain one warns of its undefined pass-through operand.
        const __m512 f = _mm512_mask_cvtepi32_ps(_mm512_setzero_ps(), 0xffff, ia[k][r]);
        acc[k][r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, dx), acc[k][r]);
      }
      if constexpr (Fmt<KIND>::kHasM) {
        const __m512 m =
            _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(heads + 32)));
        for (int r = 0; r < R; ++r) acc[k][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[(n0 + r) * nb + b]), acc[k][r]);
      }
    }
  }
  for (int k = 0; k < PN; ++k)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(Y + (n0 + r) * OP + (p0 + k) * kPanelOut, acc[k][r]);
}

// Panels [p0, p1) against every row of x: one row four panels at a time (four independent
// chains of vpdpbusd), their lines eight panels on prefetched into L2 (into L1 four panels on,
// SmolLM2's one-row decode ran 0.96x the stored kernels on Q8_0 and 1.00x on Q4_1; this way
// 1.07x and 1.15x, alternated in one process on the 2-core Zen 4); more rows two panels by up
// to 4 rows.
template <int KIND>
void panels_range(const uint8_t* P, const XQ& x, const int32_t* xsum, int64_t N, int64_t OP, float* Y, int64_t p0,
                  int64_t p1) {
  if (N == 1) {
    int64_t p = p0;
    for (; p + 4 <= p1; p += 4) panels_tile<KIND, 4, 1>(P, x, xsum, OP, Y, p, 0, p + 12 <= p1);
    for (; p < p1; ++p) panels_tile<KIND, 1, 1>(P, x, xsum, OP, Y, p, 0, false);
    return;
  }
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two = p + 2 <= p1;
    int64_t n = 0;
    for (; n + 4 <= N; n += 4)
      two ? panels_tile<KIND, 2, 4>(P, x, xsum, OP, Y, p, n, false)
          : panels_tile<KIND, 1, 4>(P, x, xsum, OP, Y, p, n, false);
    with_rows<3>(N - n, [&](auto r) {
      constexpr int R = decltype(r)::value;
      two ? panels_tile<KIND, 2, R>(P, x, xsum, OP, Y, p, n, false)
          : panels_tile<KIND, 1, R>(P, x, xsum, OP, Y, p, n, false);
    });
  }
}

template <int KIND>
void qgemm_panels(ffi::ThreadPool& pool, const uint8_t* P, const XQ& x, int64_t N, int64_t panels, float* Y) {
  thread_local std::vector<int32_t> xsum;
  xsum.resize(static_cast<size_t>(N * x.nb));
  block_sums(x.q, N * x.nb, xsum.data());
  const int32_t* sums = xsum.data();  // not xsum in the tasks: a thread_local names each thread's own
  // One row: one contiguous range of panels a thread (a stream of weights each; finer tasks ran
  // SmolLM2's one-stream decode 0.8-0.95x), the helper lingering for the next call. More rows:
  // runs of rows of x of half an L2 (a pair of panels' weights stays in L1 while the run's rows
  // pass), tasks of panels that the threads take as they finish.
  if (N == 1) {
    const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), panels / 4));
    parallel_for(
        pool, tasks,
        [&](int64_t task) {
          panels_range<KIND>(P, x, sums, 1, panels * kPanelOut, Y, 4 * (panels / 4 * task / tasks),
                             task + 1 == tasks ? panels : 4 * (panels / 4 * (task + 1) / tasks));
        },
        /*linger_after=*/true);
    return;
  }
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>((panels + 1) / 2, 8 * pool.num_threads()));
  const int64_t run = std::max<int64_t>(4, 524288 / x.K / 4 * 4);  // x's int8 in half an L2
  for (int64_t n0 = 0; n0 < N; n0 += run) {
    const int64_t rows = std::min(run, N - n0);
    const XQ xr{x.q + n0 * x.K, x.d8 + n0 * x.nb * 8, x.s + n0 * x.nb, x.K, x.nb};
    parallel_for(pool, tasks, [&](int64_t task) {
      panels_range<KIND>(P, xr, sums + n0 * x.nb, rows, panels * kPanelOut, Y + n0 * panels * kPanelOut,
                         2 * ((panels + 1) / 2 * task / tasks),
                         std::min(panels, 2 * ((panels + 1) / 2 * (task + 1) / tasks)));
    });
  }
}

}  // namespace
}  // namespace tl

#include "quant_tiles.h"
#endif
