// The quantized matmuls' shared concepts: llama.cpp's block formats as a GGUF stores them, x's
// quantization, the build's kernel family, and the two calls the FFI glue makes.
//
// Owns: Kind and Fmt (bytes a block of each format; q8_0, q4_0, q4_1, q5_0, q5_1: blocks of 32
// weights; q4_k, q5_k, q6_k: super-blocks of 256), the scalar unpacking of both (the NEON and
// scalar kernels' way, the tests' reference reading), with_kind and with_rows (a run-time kind or
// row count to a template's), XQ (x quantized) and its quantizers, and the feature macros that
// pick a build's kernels (TL_QDOT_*: tested here and nowhere else but in the kernel headers'
// guards). Must not: hold a kernel. Included by quant_gemm.cc (the kernels' translation unit),
// quant_ffi.cc (the glue) and bench/qlayout.cc; tested through them by
// tests/kernels/test_cpu_native_quant.py and tests/model/test_panels.py.
//
// The files, as llama.cpp's ggml-cpu splits them: this header; quant_x86.h (AVX2 helpers both
// x86 families share); one header of kernels per family, each compiled only where its macro is
// set: quant_avx512.h (AVX-512 VNNI: x86-64-v4-vnni, sapphirerapids), quant_avx2.h (AVX2 without
// VNNI: x86-64-v3, x86-64-v4), quant_neon.h (aarch64 with dotprod), quant_scalar.h (SSE2, plain
// armv8-a); quant_tiles.h (the tiles of rows the VNNI, NEON and scalar families run their K-quants
// by, and the NEON and scalar builds their blocks of 32; AVX2's K-quants are its own); quant_gemm.cc (x quantized, the
// build's kernel for a kind); quant_ffi.cc (TlQGemm, TlQGemmPanels: shapes checked, then quant_gemm.cc).
//
// Arithmetic, as llama.cpp's CPU backend: each row of x is quantized once a call, per block of
// 32, by ggml's quantize_row_q8_0_ref rule (d = amax / 127, id = d ? 1 / d : 0, q = roundf(x *
// id)), keeping d as a float (ggml rounds it to half) and s = d * sum(q) (ggml's Q8_1, for the
// m term of q4_1 / q5_1). A block's dot is an exact int32 sum of int8 products, the weights
// taken signed (q4_0: nibble - 8, q5_0: value - 16, q8_0 as stored; q4_1 / q5_1: 0..31 as they
// are), then scaled by d_w * d_x in float32 (plus m_w * s_x) and summed over the blocks.
//
// The K-quants as llama.cpp's ggml_vec_dot_q{4,5,6}_K_q8_K: x quantized per super-block of 256
// (Q8_K's geometry: one float d, and bsums, each 16 values' sum; the rounding rule above), the
// weights taken as unsigned codes u (q4_k 0..15, q5_k 0..31, q6_k 0..63) with an int scale sc
// per 16 inputs (q4_k / q5_k: per sub-block of 32, 6 bits, with a 6-bit min mn) and a min per 16
// (q6_k: mn = 32 sc, its codes' offset). A super-block's isum = sum sc u q and msum = sum mn bsum
// are exact int32 sums (|isum| < 2^28); it adds (d_w isum - dmin msum) d_x in float32 (q6_k:
// d_w (isum - msum) d_x; on x86 lane by lane, d_x last as a broadcast operand of the fma). u <=
// 63 is a valid u8 operand against s8 x everywhere (each family's header says how it takes it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "simd.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

// The build's kernel family (kernels/cpu_build.py's targets), exactly one of the four.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TL_QDOT_512 1  // quant_avx512.h; and the panel kernels of repacked weights (TlQGemmPanels)
#define TL_QPANELS 1
#elif defined(__AVX2__)
#define TL_QDOT_256 1  // quant_avx2.h
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define TL_QDOT_NEON 1  // quant_neon.h
#else
#define TL_QDOT_SCALAR 1  // quant_scalar.h
#endif
#if defined(__AVX2__)
#define TL_QAVX2 1  // both x86 families: quantize_block's vectors, quant_x86.h
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define TL_QAVX512BW 1  // a 32-bit mask to 32 bytes in one instruction (vpmovm2b: unpack256)
#endif

namespace ffi = xla::ffi;

namespace tl {

// x [N, K] float32 times W's O rows of `kind`'s raw blocks (K / 32 of them, K / 256 for the
// K-quants) into Y [N, O], by the build's kernel (quant_gemm.cc); N <= max_rows(kind), K > 0.
void qgemm_run(ffi::ThreadPool& pool, int32_t kind, const float* X, int64_t N, int64_t K, const uint8_t* W, int64_t O,
               float* Y);
// x [N, K] times P's `panels` panels of 16 outputs (q8_0, q4_0, q4_1 repacked: quant_avx512.h)
// into Y [N, 16 panels]; only where TL_QPANELS is defined.
void qgemm_panels_run(ffi::ThreadPool& pool, int32_t kind, const float* X, int64_t N, int64_t K, const uint8_t* P,
                      int64_t panels, float* Y);

namespace {

constexpr int64_t kQFewRows = 64;  // the most rows the tiles take (the VNNI build's 32-input kinds: more)
constexpr int64_t kQManyRows = int64_t{1} << 16;  // the most rows a kind with a panel kernel takes
constexpr int64_t kQK = 32;                       // weights a block

constexpr int64_t kQKK = 256;  // weights a K-quant super-block

enum Kind : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7 };

template <int KIND>
constexpr bool kSuper = KIND == kQ4_K || KIND == kQ5_K || KIND == kQ6_K;  // super-blocks of 256

template <int KIND>
struct Fmt;
template <>
struct Fmt<kQ8_0> {
  static constexpr int64_t kBytes = 34;  // f16 d, int8 qs[32]
  static constexpr bool kSigned = true, kHasM = false;
};
template <>
struct Fmt<kQ4_0> {
  static constexpr int64_t kBytes = 18;  // f16 d, qs[16]: byte j = element j (low nibble), j + 16 (high)
  static constexpr bool kSigned = true, kHasM = false;
};
template <>
struct Fmt<kQ4_1> {
  static constexpr int64_t kBytes = 20;  // f16 d, f16 m, qs[16]
  static constexpr bool kSigned = false, kHasM = true;
};
template <>
struct Fmt<kQ5_0> {
  static constexpr int64_t kBytes = 22;  // f16 d, uint32 qh (bit j: element j's 5th bit), qs[16]
  static constexpr bool kSigned = true, kHasM = false;
};
template <>
struct Fmt<kQ5_1> {
  static constexpr int64_t kBytes = 24;  // f16 d, f16 m, uint32 qh, qs[16]
  static constexpr bool kSigned = false, kHasM = true;
};

// The K-quants (ggml's block_q4_K / block_q5_K / block_q6_K), a super-block of 256 weights each.
template <>
struct Fmt<kQ4_K> {
  static constexpr int64_t kBytes = 144;  // f16 d, f16 dmin, 12 bytes of 6-bit scales / mins, qs[128]
};
template <>
struct Fmt<kQ5_K> {
  static constexpr int64_t kBytes = 176;  // f16 d, f16 dmin, 12 bytes of scales / mins, qh[32], qs[128]
};
template <>
struct Fmt<kQ6_K> {
  static constexpr int64_t kBytes = 210;  // ql[128], qh[64], int8 scales[16], f16 d
};

// IEEE half at p (unaligned) -> float, exactly.
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// fn(std::integral_constant<int, left>()) for 0 < left <= R: a tile template's row count chosen
// at run time for the rows left after its whole tiles.
template <int R, typename F>
inline void with_rows(int64_t left, F&& fn) {
  if constexpr (R > 0) {
    if (left == R) return fn(std::integral_constant<int, R>());
    with_rows<R - 1>(left, fn);
  }
}

// fn(std::integral_constant<int, kind>()) for the run-time `kind` among FIRST..LAST (Kind's
// order): the one dispatch from a call's kind to a kernel template's. False (fn not called) for
// a kind outside them.
template <int FIRST = kQ8_0, int LAST = kQ6_K, typename F>
inline bool with_kind(int32_t kind, F&& fn) {
  if constexpr (FIRST <= LAST) {
    if (kind == FIRST) {
      fn(std::integral_constant<int, FIRST>());
      return true;
    }
    return with_kind<FIRST + 1, LAST>(kind, fn);
  }
  return false;
}

// A block's scale d, offset m (0 without) and 32 signed weights, the scalar way.
template <int KIND>
inline void unpack_scalar(const uint8_t* b, int8_t w[kQK], float& d, float& m) {
  d = half(b);
  m = Fmt<KIND>::kHasM ? half(b + 2) : 0.0f;
  if constexpr (KIND == kQ8_0) {
    std::memcpy(w, b + 2, kQK);
  } else if constexpr (KIND == kQ4_0 || KIND == kQ4_1) {
    const uint8_t* qs = b + (KIND == kQ4_0 ? 2 : 4);
    const int off = KIND == kQ4_0 ? 8 : 0;
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<int8_t>((qs[j] & 15) - off);
      w[j + 16] = static_cast<int8_t>((qs[j] >> 4) - off);
    }
  } else {
    const uint32_t qh = load_u32(b + (KIND == kQ5_0 ? 2 : 4));
    const uint8_t* qs = b + (KIND == kQ5_0 ? 6 : 8);
    const int off = KIND == kQ5_0 ? 16 : 0;
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<int8_t>(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - off);
      w[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
    }
  }
}

// x quantized once a call: row n's int8 values at q + n * K (then kQK bytes of padding past the
// last row, for the masked tail loads), each block's d eight times (one per int32 lane of a
// block's dot) at d8 + (n * nb + b) * 8, and s = d * sum(q) at s + n * nb + b.
//
// A K-quant call quantizes x per super-block of 256 instead (ggml's Q8_K geometry): q as above,
// each super-block's d at dk + n * ns + b, and the sum of each 16 of its values (ggml's bsums, for
// the mins) at bs + (n * ns + b) * 16; d8, s and nb unused.
struct XQ {
  const int8_t* q;
  const float* d8;
  const float* s;
  int64_t K, nb;
  const float* dk = nullptr;
  const int16_t* bs = nullptr;
  int64_t ns = 0;
};

#define TL_STRICT_MATH __attribute__((optimize("no-fast-math")))

#if defined(TL_QAVX2)
// One block of L (32, 256) values by the rule below, 8 a vector: the same IEEE operations (|x|
// max, d, id, v = x * id, its integer part, its fraction against one half), so the same q and d;
// and each 16 values' sum. (The scalar loops did not vectorize: 1.5 ns a value, 50 us of a 16-row
// 640 x 2048 q4_k call.)
template <int L>
TL_STRICT_MATH void quantize_block(const float* x, int8_t* q, float& d, int16_t* bs) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < L; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  for (int g = 0; g < L / 16; ++g) {
    __m256i t[2];
    for (int k = 0; k < 2; ++k) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + 16 * g + 8 * k), id);
      const __m256i i = _mm256_cvttps_epi32(v);  // toward zero
      const __m256 frac = _mm256_sub_ps(v, _mm256_cvtepi32_ps(i));
      const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ));
      const __m256i down = _mm256_castps_si256(_mm256_cmp_ps(frac, _mm256_set1_ps(-0.5f), _CMP_LE_OQ));
      t[k] = _mm256_add_epi32(_mm256_sub_epi32(i, up), down);  // masks are -1
    }
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(t[0], t[1]), 0xd8);  // 16 int16, in order
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * g),
                     _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
    const __m256i s8 = _mm256_madd_epi16(w, _mm256_set1_epi16(1));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    bs[g] = static_cast<int16_t>(_mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1))));
  }
}
#endif

// ggml's quantize_row_q8_0_ref with a float d: roundf (half away from zero) done exactly in
// integers (v's integer part, then its fraction against one half): quantize_block's vectors on
// AVX2 and up, scalar code elsewhere.
TL_STRICT_MATH inline void quantize_x(const float* X, int64_t N, int64_t K, int8_t* q, float* d8, float* s) {
  const int64_t nb = K / kQK;
#if defined(TL_QAVX2)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      float d;
      int16_t bs[2];
      quantize_block<kQK>(X + n * K + b * kQK, q + n * K + b * kQK, d, bs);
      for (int l = 0; l < 8; ++l) d8[(n * nb + b) * 8 + l] = d;
      s[n * nb + b] = d * static_cast<float>(bs[0] + bs[1]);
    }
#else
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = X + n * K + b * kQK;
      float amax = 0.0f;  // no std::max / std::fabs: under another optimize attribute they are not inlined
      for (int i = 0; i < kQK; ++i) {
        const float a = x[i] < 0.0f ? -x[i] : x[i];
        amax = a > amax ? a : amax;
      }
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* qb = q + n * K + b * kQK;
      int32_t sum = 0;
      for (int i = 0; i < kQK; ++i) {
        const float v = x[i] * id;
        int32_t t = static_cast<int32_t>(v);  // toward zero
        const float frac = v - static_cast<float>(t);
        t += (frac >= 0.5f) - (frac <= -0.5f);
        qb[i] = static_cast<int8_t>(t);
        sum += t;
      }
      for (int l = 0; l < 8; ++l) d8[(n * nb + b) * 8 + l] = d;
      s[n * nb + b] = d * static_cast<float>(sum);
    }
#endif
}

// Q8_K's geometry (a float d a super-block of 256, bsums: each 16 values' sum) with the rule
// above (d = amax / 127, roundf). ggml's quantize_row_q8_K scales by -127 / the signed max and
// rounds half to even: another int8 vector within the same |x - d q| <= d / 2.
TL_STRICT_MATH inline void quantize_x_k(const float* X, int64_t N, int64_t K, int8_t* q, float* dk, int16_t* bs) {
  const int64_t ns = K / kQKK;
#if defined(TL_QAVX2)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < ns; ++b)
      quantize_block<kQKK>(X + n * K + b * kQKK, q + n * K + b * kQKK, dk[n * ns + b], bs + (n * ns + b) * 16);
#else
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < ns; ++b) {
      const float* x = X + n * K + b * kQKK;
      float amax = 0.0f;
      for (int i = 0; i < kQKK; ++i) {
        const float a = x[i] < 0.0f ? -x[i] : x[i];
        amax = a > amax ? a : amax;
      }
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* qb = q + n * K + b * kQKK;
      for (int g = 0; g < 16; ++g) {
        int32_t sum = 0;
        for (int i = 16 * g; i < 16 * g + 16; ++i) {
          const float v = x[i] * id;
          int32_t t = static_cast<int32_t>(v);
          const float frac = v - static_cast<float>(t);
          t += (frac >= 0.5f) - (frac <= -0.5f);
          qb[i] = static_cast<int8_t>(t);
          sum += t;
        }
        bs[(n * ns + b) * 16 + g] = static_cast<int16_t>(sum);
      }
      dk[n * ns + b] = d;
    }
#endif
}

// ggml's get_scale_min_k4 for all eight sub-blocks of 32 at once: the 12 bytes at s -> out[0..7]
// the 6-bit scales, out[8..15] the 6-bit mins. Sub-blocks 0-3 keep their low 6 bits in bytes 0-3
// (scales) and 4-7 (mins); sub-blocks 4-7 their low 4 bits in the nibbles of bytes 8-11 and their
// top 2 in the top bits of bytes 0-3 / 4-7: each 32-bit word moves four sub-blocks' bits at once.
inline void scales_mins_k4(const uint8_t* s, uint8_t out[16]) {
  uint32_t a[3];
  std::memcpy(a, s, sizeof a);
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  const uint32_t o[4] = {a[0] & low6, (a[2] & low4) | (((a[0] >> 6) & top2) << 4), a[1] & low6,
                         ((a[2] >> 4) & low4) | (((a[1] >> 6) & top2) << 4)};
  std::memcpy(out, o, sizeof o);
}

// A super-block's codes u[256] (unsigned, in input order), a scale and a min a group of 16 inputs,
// d and dmin: weight = d sc u - dmin mn. q4_k / q5_k: a sub-block of 32 is 32 bytes' low (even
// sub-block) or high (odd) nibbles, q5_k's 5th bit of input 32 s + l bit s of qh[l]; q6_k (codes
// 0..63, weight = d sc (u - 32): mn = 32 sc, taken out of the integer sum, dmin unused): input
// 128 h + 32 c + l has the low (c < 2) or high nibble of ql[64 h + 32 (c & 1) + l] and bits 2c..2c+1
// of qh[32 h + l] on top, and a signed scale per 16 inputs.
template <int KIND>
inline void unpack_k_scalar(const uint8_t* b, uint8_t u[kQKK], int32_t sc[16], int32_t mn[16], float& d, float& dmin) {
  if constexpr (KIND == kQ6_K) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          const uint8_t lo = (ql[64 * h + 32 * (c & 1) + l] >> (4 * (c >> 1))) & 15;
          u[128 * h + 32 * c + l] = static_cast<uint8_t>(lo | (((qh[32 * h + l] >> (2 * c)) & 3) << 4));
        }
    for (int g = 0; g < 16; ++g) sc[g] = static_cast<int8_t>(b[192 + g]), mn[g] = 32 * sc[g];
    d = half(b + 208), dmin = 0.0f;
  } else {
    const uint8_t* qs = b + (KIND == kQ4_K ? 16 : 48);
    for (int s = 0; s < 8; ++s)
      for (int l = 0; l < 32; ++l) {
        uint8_t v = (qs[32 * (s / 2) + l] >> (4 * (s & 1))) & 15;
        if (KIND == kQ5_K) v = static_cast<uint8_t>(v | (((b[16 + l] >> s) & 1) << 4));
        u[32 * s + l] = v;
      }
    uint8_t sm[16];
    scales_mins_k4(b + 4, sm);
    for (int g = 0; g < 16; ++g) sc[g] = sm[g / 2], mn[g] = sm[8 + g / 2];
    d = half(b), dmin = half(b + 2);
  }
}

// A super-block's share of a row's dot from its exact integer sums isum = sum sc u q and msum =
// sum mn bsum: d_w d_x isum - dmin d_x msum (q6_k: d_w d_x (isum - msum), one integer).
template <int KIND>
inline float k_share(float d, float dmin, float dx, int32_t isum, int32_t msum) {
  if constexpr (KIND == kQ6_K) return d * dx * static_cast<float>(isum - msum);
  return d * dx * static_cast<float>(isum) - dmin * dx * static_cast<float>(msum);
}

constexpr int64_t kPanelOut = 16;  // outputs a panel of repacked weights (quant_avx512.h says how)

}  // namespace
}  // namespace tl
