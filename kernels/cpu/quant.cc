// Matmuls of a few rows over llama.cpp's quantized block formats, read as a GGUF stores them.
//
// Owns: TlQGemm, y [N, O] = x [N, K] @ W^T for W [O, row_bytes] whose rows are the raw ggml
// blocks (32 weights each) of q8_0, q4_0, q4_1, q5_0 or q5_1, or super-blocks (256 weights) of
// q4_k, q5_k or q6_k (the `kind` attribute, Kind below), N <= max_rows(kind); TlQGemmMaxRows. Must not: write anything but y. Built by
// kernels/cpu_build.py, called by kernels/cpu_native.py (`qgemm`), tested by
// tests/kernels/test_cpu_native_quant.py against float64 products of gguf's dequantized weights and a
// numpy emulation of the integer arithmetic below.
//
// Arithmetic, as llama.cpp's CPU backend: each row of x is quantized once a call, per block of
// 32, by ggml's quantize_row_q8_0_ref rule (d = amax / 127, id = d ? 1 / d : 0, q = roundf(x *
// id)), keeping d as a float (ggml rounds it to half) and s = d * sum(q) (ggml's Q8_1, for the
// m term of q4_1 / q5_1). A block's dot is an exact int32 sum of int8 products, the weights
// taken signed (q4_0: nibble - 8, q5_0: value - 16, q8_0 as stored; q4_1 / q5_1: 0..31 as they
// are), then scaled by d_w * d_x in float32 (plus m_w * s_x) and summed over the blocks.
//
// Kernels by target (simd.h's families): AVX-512 VNNI (x86-64-v4-vnni, sapphirerapids) two
// blocks a 512-bit vector, vpdpbusd on unsigned codes against x; AVX2 (x86-64-v3, x86-64-v4) one
// block a 256-bit vector, vpmaddubsw then vpmaddwd with ones (q8_0 by the sign trick, |w| *
// sign(x, w) < 2 * 128 * 127 per pair: no int16 saturation); aarch64 with dotprod vdotq_s32 on
// the signed values; elsewhere (SSE2, plain armv8-a) scalar code the compiler vectorizes. On
// AVX-512 VNNI and AVX2, one arithmetic whatever the row count (a row's result does not depend
// on its step's other rows): exact block sums scaled once a block, by exact_row / exact_tile
// (VNNI) or exact8 (AVX2) for the fewest rows and by panel kernels with outputs in the vector
// lanes for more (panel_tile, panel8_tile), any row count. Elsewhere each weight block is
// unpacked once per tile of up to kTileRows rows of x and dotted against all of them. A row's
// blocks stream front to back, each thread one contiguous range of outputs, its helper
// lingering after one-row calls as TlGemv's does (threads.h).
//
// The K-quants as llama.cpp's ggml_vec_dot_q{4,5,6}_K_q8_K: x quantized per super-block of 256
// (Q8_K's geometry: one float d, and bsums, each 16 values' sum; the rounding rule above), the
// weights taken as unsigned codes u (q4_k 0..15, q5_k 0..31, q6_k 0..63) with an int scale sc
// per 16 inputs (q4_k / q5_k: per sub-block of 32, 6 bits, with a 6-bit min mn) and a min per 16
// (q6_k: mn = 32 sc, its codes' offset). A super-block's isum = sum sc u q and msum = sum mn bsum
// are exact int32 sums (|isum| < 2^28); it adds (d_w isum - dmin msum) d_x in float32 (q6_k:
// d_w (isum - msum) d_x; on x86 lane by lane, d_x last as a broadcast operand of the fma). u <= 63 is a valid u8 operand against s8 x everywhere: AVX-512 VNNI
// vpmaddubsw then vpdpwssd with the pairs' scales, 64 inputs a vector; AVX2 (and AVX-512 without
// VNNI) vpmaddubsw then vpmaddwd, 32 a vector; aarch64 dotprod vdotq_s32 a group of 16 scaled by
// vmlaq; scalar elsewhere.

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

namespace ffi = xla::ffi;

namespace tl {
namespace {

constexpr int64_t kQFewRows = 64;                 // the most rows the tiles take (the VNNI build's 32-input kinds: more)
constexpr int64_t kQManyRows = int64_t{1} << 16;  // the most rows a kind with a panel kernel takes
constexpr int64_t kQK = 32;        // weights a block

constexpr int64_t kQKK = 256;     // weights a K-quant super-block

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

int64_t block_bytes(int32_t kind) {
  switch (kind) {
    case kQ8_0: return Fmt<kQ8_0>::kBytes;
    case kQ4_0: return Fmt<kQ4_0>::kBytes;
    case kQ4_1: return Fmt<kQ4_1>::kBytes;
    case kQ5_0: return Fmt<kQ5_0>::kBytes;
    case kQ5_1: return Fmt<kQ5_1>::kBytes;
    case kQ4_K: return Fmt<kQ4_K>::kBytes;
    case kQ5_K: return Fmt<kQ5_K>::kBytes;
    case kQ6_K: return Fmt<kQ6_K>::kBytes;
    default: return 0;
  }
}

int64_t block_inputs(int32_t kind) { return kind >= kQ4_K ? kQKK : kQK; }

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

#if defined(__x86_64__)
// The few-row kernels' software prefetch of the weight rows they read next, into L2, not L1
// (prefetcht2; L2 is what AMD's and Intel's cores fill for it): the lines of 8-32 rows ahead
// are many outstanding misses, which L2 takes where L1's miss buffers stall. Gemma 3 270M's
// 178 MB q8_0 head, one row on Zen 4 (x86-64-v4-vnni, 2 threads): 13.9 GB/s prefetching into L1
// (prefetcht0), 26 into L2 by prefetcht1, 29-31 by prefetcht2; its one-row decode step 19 ->
// 12-13 ms; SmolLM2 Q4_1's 1.3x (bench runner, alternated).
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T2); }
#endif

#if defined(__AVX2__)
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
TL_STRICT_MATH void quantize_x(const float* X, int64_t N, int64_t K, int8_t* q, float* d8, float* s) {
  const int64_t nb = K / kQK;
#if defined(__AVX2__)
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
TL_STRICT_MATH void quantize_x_k(const float* X, int64_t N, int64_t K, int8_t* q, float* dk, int16_t* bs) {
  const int64_t ns = K / kQKK;
#if defined(__AVX2__)
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
inline void unpack_k_scalar(const uint8_t* b, uint8_t u[kQKK], int32_t sc[16], int32_t mn[16], float& d,
                            float& dmin) {
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

#if defined(__AVX2__)
// A block's 32 signed weights in a 256-bit vector (element i in byte i).
template <int KIND>
inline __m256i unpack256(const uint8_t* b) {
  if constexpr (KIND == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else {
    constexpr int64_t qs_at = KIND == kQ4_0 ? 2 : KIND == kQ4_1 ? 4 : KIND == kQ5_0 ? 6 : 8;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qs_at));
    __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
    if constexpr (KIND == kQ4_0) return _mm256_sub_epi8(w, _mm256_set1_epi8(8));
    if constexpr (KIND == kQ4_1) return w;
    if constexpr (KIND == kQ5_0 || KIND == kQ5_1) {
      const uint32_t qh = load_u32(b + (KIND == kQ5_0 ? 2 : 4));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
      const __m256i set = _mm256_movm_epi8(qh);  // 0xff where the 5th bit is set
#else
      // ggml's bytes_from_bits_32: byte i of qh to bytes 8i..8i+7, each testing its own bit.
      const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
      const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(qh)), shuf);
      const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                            _mm256_set1_epi64x(-1));
#endif
      if constexpr (KIND == kQ5_1) return _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(16)));
      // value - 16: nibble - 16 (nibble | 0xf0) where the bit is clear, the nibble where set.
      return _mm256_or_si256(w, _mm256_andnot_si256(set, _mm256_set1_epi8(static_cast<char>(0xf0))));
    }
  }
}

// Sum of u8 a times s8 b in 8 int32 lanes. Without VNNI the pairs pass through saturating int16:
// exact for a <= 128 (|w|, or a q4_1 / q5_1 value <= 31) and |b| <= 127 (2 * 128 * 127 < 2^15).
inline __m256i dot_u8s8_256(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

// Eight lanes' (d, m) halves, lane j's from rows[j % MO] at byte `at`: scalar loads inserted into
// a vector. vpgatherdd ran the 2-4 row tiles 1.4-1.7x slower and held a sixth of exact_row's
// q4_1 time (perf); eight stores and a vector load of them stall on store forwarding.
template <int MO>
inline __m256i scales8(const uint8_t* const* rows, int64_t at) {
  return _mm256_setr_epi32(
      static_cast<int32_t>(load_u32(rows[0 % MO] + at)), static_cast<int32_t>(load_u32(rows[1 % MO] + at)),
      static_cast<int32_t>(load_u32(rows[2 % MO] + at)), static_cast<int32_t>(load_u32(rows[3 % MO] + at)),
      static_cast<int32_t>(load_u32(rows[4 % MO] + at)), static_cast<int32_t>(load_u32(rows[5 % MO] + at)),
      static_cast<int32_t>(load_u32(rows[6 % MO] + at)), static_cast<int32_t>(load_u32(rows[7 % MO] + at)));
}

// Each of `blocks` blocks of 32 int8 at q: its exact sum.
inline void block_sums(const int8_t* q, int64_t blocks, int32_t* out) {
  for (int64_t i = 0; i < blocks; ++i) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * kQK));
    const __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), v);
    const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    out[i] = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
  }
}

inline float hsum256(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#endif

// A thread's 64-byte aligned scratch, grown as needed (std::vector<__m512i> and any template over
// a vector type drop its alignment attribute, with a warning).
struct Scratch {
  void* p = nullptr;
  size_t bytes = 0;
  template <typename T>
  T* get(size_t count) {
    const size_t want = (count * sizeof(T) + 63) / 64 * 64;
    if (want > bytes) {
      std::free(p);
      p = std::aligned_alloc(64, want);
      bytes = want;
    }
    return static_cast<T*>(p);
  }
  ~Scratch() { std::free(p); }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TL_QDOT_512 1
constexpr int kTileRows = 8;

// Weight row `w` (nb blocks) against rows n0..n0+R of x: two blocks a 512-bit vector, the last
// odd block in the low half of one (the high half's weights zero, x and d loads masked).
template <int KIND, int R>
inline void dot_rows(const uint8_t* w, const XQ& x, int64_t n0, float out[R]) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  __m512 acc[R];
  float accm[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), accm[r] = 0.0f;
  const int8_t* xq = x.q + n0 * x.K;
  const float* xd = x.d8 + n0 * x.nb * 8;
  const float* xs = x.s + n0 * x.nb;
  for (int64_t b = 0; b < x.nb; b += 2) {
    const bool pair = b + 1 < x.nb;
    const uint8_t* blk = w + b * BB;
    const __m256i w0 = unpack256<KIND>(blk);
    const __m256i w1 = pair ? unpack256<KIND>(blk + BB) : _mm256_setzero_si256();
    // Joined by vector-extension shuffles: GCC 12's insert intrinsics warn of their undefined operands.
    const __m512i wv = __builtin_shufflevector(w0, w1, 0, 1, 2, 3, 4, 5, 6, 7);
    const float d0 = half(blk), d1 = pair ? half(blk + BB) : 0.0f;
    const __m512 dw = __builtin_shufflevector(_mm256_set1_ps(d0), _mm256_set1_ps(d1), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                              10, 11, 12, 13, 14, 15);
    const __m512i aw = Fmt<KIND>::kSigned ? _mm512_abs_epi8(wv) : wv;
    const __mmask64 neg = Fmt<KIND>::kSigned ? _mm512_movepi8_mask(wv) : 0;
    const __mmask64 xm = pair ? ~__mmask64{0} : __mmask64{0xffffffff};
    const __mmask16 dm = pair ? __mmask16{0xffff} : __mmask16{0xff};
    for (int r = 0; r < R; ++r) {
      __m512i xv = _mm512_maskz_loadu_epi8(xm, xq + r * x.K + b * kQK);
      if (Fmt<KIND>::kSigned) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, xv);
      const __m512 dx = _mm512_maskz_loadu_ps(dm, xd + (r * x.nb + b) * 8);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(__builtin_convertvector(i16(p), v16), dx), dw, acc[r]);
    }
    if constexpr (Fmt<KIND>::kHasM) {
      const float m0 = half(blk + 2), m1 = pair ? half(blk + BB + 2) : 0.0f;
      for (int r = 0; r < R; ++r) accm[r] += m0 * xs[r * x.nb + b] + (pair ? m1 * xs[r * x.nb + b + 1] : 0.0f);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(v16(acc[r])) + accm[r];  // simd.h's (GCC 12's _mm512_reduce_add_ps warns)
}

#elif defined(__AVX2__)
#define TL_QDOT_256 1
constexpr int kTileRows = kRegs >= 32 ? 8 : 4;

// The 32-input kinds run the exact family below, the K-quants their own dot_rows_k; tile's
// reference to dot_rows is never instantiated here.
template <int KIND, int R>
void dot_rows(const uint8_t* w, const XQ& x, int64_t n0, float out[R]);

// The exact family (AVX2 without VNNI: x86-64-v3, x86-64-v4), the 32-input kinds: one arithmetic
// for every row count, as the VNNI path's below, so a row's result does not depend on its
// step's other rows: each block's int32 sum is exact and is added as acc = fma(sum, d_w * d_x,
// acc), then acc = fma(m_w, s_x, acc), block by block, in 8 lanes that are 8 outputs. The
// weights are codes u: the nibble formats unsigned (q4_0: the nibble, w = u - 8; q5_0: w = u -
// 16; q4_1 / q5_1 as stored), their offset's share -off * sum(q_x) added once per block and row
// (exact: |sum| < 2^20); q8_0 signed, by the sign trick (|w| * sign(x, w)). vpmaddubsw's int16
// pairs cannot saturate: u <= 31 (2 * 31 * 128), |w| <= 128 against |x| <= 127. One row: exact8
// (8 outputs' blocks unpacked as stored, the row's 8 dot vectors reduced to 8 block sums by
// vphaddd); more: panels of 8 outputs, unpacked once a call into [block][group of 4
// inputs][output] (the 8 x 8 int32 transpose), which a row meets as 8 vpmaddubsw against its 4
// bytes broadcast, the lanes already outputs. SmolLM2 Q4_1 decode steps on Zen 3 (bench runner,
// noisy machine): 1 row 7.0-9.9 ms, 2 rows 12.9-13.8, 4 rows 17.5-18.3, 16 rows 44-48, where the
// tiles before (4 rows a tile per output, 8 float lanes a block summed at the end) took 9.9-10.3,
// -, 17.4 and 81; exact8 for 2 rows (8 dot vectors and a reduction a row) took 13.8 ms, the
// panels 12.9, so the panels start at 2.
template <int KIND>
constexpr int kOff256 = KIND == kQ4_0 ? 8 : KIND == kQ5_0 ? 16 : 0;

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

// Lane j: the sum of p[j]'s 8 lanes.
inline __m256i reduce8(const __m256i p[8]) {
  const __m256i t0 = _mm256_hadd_epi32(p[0], p[1]), t1 = _mm256_hadd_epi32(p[2], p[3]);
  const __m256i t2 = _mm256_hadd_epi32(p[4], p[5]), t3 = _mm256_hadd_epi32(p[6], p[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);  // [p0..p3 low | high], p4..p7
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// The 8 rows' (d, m) of block b as floats: lanes j of d and m.
template <int KIND>
inline void scales_8(const uint8_t* const rows[8], int64_t at, __m256& d, __m256& m) {
  const __m256i heads = scales8<8>(rows, at);
  // Bytes 0-1 (d) of each 32-bit lane to the low 128 bits, bytes 2-3 (m) to the high.
  const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12,
                                         13, 2, 3, 6, 7, 10, 11, 14, 15);
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
      for (int64_t l = 0; l < share; l += 64)
        prefetch_l2(rows[0] + 2 * span + b * share + l);
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
          ia[r] = _mm256_add_epi32(ia[r], dot_codes<KIND>(w, _mm256_set1_epi32(static_cast<int32_t>(
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
            i16[r] = _mm256_add_epi16(i16[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(static_cast<int32_t>(
                                                                         load_u32(reinterpret_cast<const uint8_t*>(xq + r * x.K + 4 * g))))));
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
#define TL_QDOT_EXACT_256 1

#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define TL_QDOT_NEON 1
constexpr int kTileRows = 8;

template <int KIND, int R>
inline void dot_rows(const uint8_t* w, const XQ& x, int64_t n0, float out[R]) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  float32x4_t acc[R];
  float accm[R];
  for (int r = 0; r < R; ++r) acc[r] = vdupq_n_f32(0.0f), accm[r] = 0.0f;
  const int8_t* xq = x.q + n0 * x.K;
  const float* xd = x.d8 + n0 * x.nb * 8;
  const float* xs = x.s + n0 * x.nb;
  for (int64_t b = 0; b < x.nb; ++b) {
    int8_t wb[kQK];
    float d, m;
    unpack_scalar<KIND>(w + b * BB, wb, d, m);
    const int8x16_t w0 = vld1q_s8(wb), w1 = vld1q_s8(wb + 16);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = xq + r * x.K + b * kQK;
      const int32x4_t p = vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, vld1q_s8(q)), w1, vld1q_s8(q + 16));
      acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(p), d * xd[(r * x.nb + b) * 8]);
      if (Fmt<KIND>::kHasM) accm[r] += m * xs[r * x.nb + b];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = vaddvq_f32(acc[r]) + accm[r];
}

#else
constexpr int kTileRows = 4;

// SSE2, armv8-a without dotprod: scalar blocks (the compiler vectorizes the int8 products).
// Without fast-math: under it, the m term's and the blocks' float adds were reassociated
// differently per tile size R, and a row's result depended on its call's other rows.
template <int KIND, int R>
TL_STRICT_MATH inline void dot_rows(const uint8_t* w, const XQ& x, int64_t n0, float out[R]) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int64_t b = 0; b < x.nb; ++b) {
    int8_t wb[kQK];
    float d, m;
    unpack_scalar<KIND>(w + b * BB, wb, d, m);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = x.q + (n0 + r) * x.K + b * kQK;
      int32_t isum = 0;
      for (int i = 0; i < kQK; ++i) isum += static_cast<int32_t>(wb[i]) * static_cast<int32_t>(q[i]);
      acc[r] += d * x.d8[((n0 + r) * x.nb + b) * 8] * static_cast<float>(isum);
      if (Fmt<KIND>::kHasM) acc[r] += m * x.s[(n0 + r) * x.nb + b];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}
#endif

// The K-quants, each target's way: a weight super-block is unpacked once per tile of up to
// kTileRows rows of x and dotted against all of them (codes u <= 63 unsigned, x signed: u8 x s8
// products with no sign juggling, the q6_k offset and the q4_k / q5_k mins by bsums).
#if defined(__AVX2__)
// The 16 scale bytes (q4_k / q5_k: the 8 scales, then the 8 mins; q6_k: its 16 int8 scales).
template <int KIND>
inline __m128i k_scale_bytes(const uint8_t* b, float& d, float& dmin) {
  if constexpr (KIND == kQ6_K) {
    d = half(b + 208), dmin = 0.0f;
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  } else {  // scales_mins_k4 in 32-bit lanes (no store and reload): a = the 12 bytes (and 4 of qs)
    d = half(b), dmin = half(b + 2);
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i p = _mm_shuffle_epi32(a, 0x98), q = _mm_shuffle_epi32(a, 0x50);  // a0 a2 a1 a2, a0 a0 a1 a1
    const __m128i lo = _mm_and_si128(p, _mm_set1_epi8(0x3f));
    const __m128i top = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(q, 6), _mm_set1_epi8(3)), 4);
    const __m128i nib = _mm_and_si128(_mm_srlv_epi32(p, _mm_set_epi32(4, 0, 0, 0)), _mm_set1_epi8(15));
    return _mm_blend_epi32(lo, _mm_or_si128(nib, top), 0xa);
  }
}

// The min of each group of 16 inputs as int16 (q6_k: 32 sc, its codes' offset).
template <int KIND>
inline __m256i k_mins16(__m128i sb) {
  if constexpr (KIND == kQ6_K) return _mm256_slli_epi16(_mm256_cvtepi8_epi16(sb), 5);
  const __m128i pick = _mm_set_epi8(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sb, pick));
}

// Byte i of the result: byte idx(i / 8) of sb (int16 lanes of 8 a group of 16 inputs, after
// vpmaddubsw's pairing): the scale bytes of four groups, g0..g3.
inline __m256i k_pick4(__m128i sb, int64_t g0, int64_t g1, int64_t g2, int64_t g3) {
  constexpr int64_t k8 = 0x0101010101010101;
  const __m256i idx = _mm256_set_epi64x(g3 * k8, g2 * k8, g1 * k8, g0 * k8);
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(sb), idx);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Inputs 64 j .. 64 j + 63 of a super-block as unsigned codes, in input order.
template <int KIND>
inline __m512i k_codes512(const uint8_t* b, int j) {
  const __m512i m4 = _mm512_set1_epi8(15);
  if constexpr (KIND == kQ6_K) {  // quarters 2 (j % 2), 2 (j % 2) + 1 of half j / 2
    const int h = j / 2, sh = 4 * (j % 2);
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(b + 64 * h), sh), m4);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m512i hb = __builtin_shufflevector(_mm256_srli_epi16(qh, sh), _mm256_srli_epi16(qh, sh + 2), 0, 1, 2, 3, 4, 5, 6, 7);
    return _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(hb, _mm512_set1_epi8(3)), 4));
  } else {  // sub-blocks 2 j (low nibbles), 2 j + 1 (high) of the same 32 bytes
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (KIND == kQ4_K ? 16 : 48) + 32 * j));
    __m512i u = _mm512_and_si512(__builtin_shufflevector(t, _mm256_srli_epi16(t, 4), 0, 1, 2, 3, 4, 5, 6, 7), m4);
    if constexpr (KIND == kQ5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m512i hb = __builtin_shufflevector(_mm256_srli_epi16(qh, 2 * j), _mm256_srli_epi16(qh, 2 * j + 1), 0, 1, 2, 3, 4, 5, 6, 7);
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
    const __m512i s16 = __builtin_shufflevector(_mm256_cvtepi8_epi16(sb), _mm256_setzero_si256(), 0, 1, 2, 3, 4, 5, 6, 7);
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

#elif defined(__AVX2__)
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
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (KIND == kQ4_K ? 16 : 48) + 32 * (s / 2)));
    __m256i u = _mm256_and_si256(_mm256_srli_epi16(t, 4 * (s & 1)), m4);
    if constexpr (KIND == kQ5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, s), _mm256_set1_epi8(1)), 4));
    }
    return u;
  }
}

// AVX2 (and AVX-512 without VNNI): 32 inputs a vector, vpmaddubsw then vpmaddwd with the pairs'
// int16 scales (lanes 0-7 group 2 s, 8-15 group 2 s + 1).
template <int KIND, int R>
inline void dot_rows_k(const uint8_t* w, const XQ& x, int64_t n0, float out[R]) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.ns; ++b) {
    const uint8_t* blk = w + b * BB;
    float d, dmin;
    const __m128i sb = k_scale_bytes<KIND>(blk, d, dmin);
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      const __m256i u = k_codes256<KIND>(blk, s);
      const __m256i sc = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(
          KIND == kQ6_K ? k_pick4(sb, 2 * s, 2 * s + 1, 0, 0) : k_pick4(sb, s, s, 0, 0)));
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (n0 + r) * x.K + b * kQKK + 32 * s));
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), sc));
      }
    }
    const __m256i mn = k_mins16<KIND>(sb);
    const __m256 dw = _mm256_set1_ps(d), dmw = _mm256_set1_ps(dmin);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (n0 + r) * x.ns + b;
      const __m256i msum = _mm256_madd_epi16(mn, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bs + at * 16)));
      __m256 f;  // as the AVX-512 path's
      if constexpr (KIND == kQ6_K) {
        f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], msum)), dw);
      } else {
        f = _mm256_fmsub_ps(_mm256_cvtepi32_ps(isum[r]), dw, _mm256_mul_ps(_mm256_cvtepi32_ps(msum), dmw));
      }
      acc[r] = _mm256_fmadd_ps(f, _mm256_broadcast_ss(x.dk + at), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum256(acc[r]);
}

#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
// aarch64 with dotprod: the super-block unpacked the scalar way (codes <= 63: valid int8), one
// vdotq_s32 a group of 16, its four lanes scaled by the group's scale into int32 lanes.
template <int KIND, int R>
inline void dot_rows_k(const uint8_t* w, const XQ& x, int64_t n0, float out[R]) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int64_t b = 0; b < x.ns; ++b) {
    alignas(16) uint8_t u[kQKK];
    int32_t sc[16], mn[16];
    float d, dmin;
    unpack_k_scalar<KIND>(w + b * BB, u, sc, mn, d, dmin);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (n0 + r) * x.ns + b;
      const int8_t* q = x.q + (n0 + r) * x.K + b * kQKK;
      int32x4_t ai = vdupq_n_s32(0);
      for (int g = 0; g < 16; ++g) {
        const int32x4_t p = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(vld1q_u8(u + 16 * g)), vld1q_s8(q + 16 * g));
        ai = vmlaq_n_s32(ai, p, sc[g]);
      }
      int32_t msum = 0;
      for (int g = 0; g < 16; ++g) msum += mn[g] * x.bs[at * 16 + g];
      acc[r] += k_share<KIND>(d, dmin, x.dk[at], vaddvq_s32(ai), msum);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#else
// SSE2, armv8-a without dotprod: scalar super-blocks (the compiler vectorizes the products);
// without fast-math, as dot_rows above.
template <int KIND, int R>
TL_STRICT_MATH inline void dot_rows_k(const uint8_t* w, const XQ& x, int64_t n0, float out[R]) {
  constexpr int64_t BB = Fmt<KIND>::kBytes;
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int64_t b = 0; b < x.ns; ++b) {
    uint8_t u[kQKK];
    int32_t sc[16], mn[16];
    float d, dmin;
    unpack_k_scalar<KIND>(w + b * BB, u, sc, mn, d, dmin);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (n0 + r) * x.ns + b;
      const int8_t* q = x.q + (n0 + r) * x.K + b * kQKK;
      int32_t isum = 0, msum = 0;
      for (int g = 0; g < 16; ++g) {
        int32_t gs = 0;
        for (int i = 16 * g; i < 16 * g + 16; ++i) gs += static_cast<int32_t>(u[i]) * static_cast<int32_t>(q[i]);
        isum += sc[g] * gs;
        msum += mn[g] * x.bs[at * 16 + g];
      }
      acc[r] += k_share<KIND>(d, dmin, x.dk[at], isum, msum);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}
#endif

#if defined(TL_QDOT_512)
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

struct XL {  // x in the VNNI layout, `np` pairs a row
  const int8_t* q;    // [N][np][64]
  const int32_t* c;   // [N][np][16]: -(offset * the lane's x sum)
  int64_t np;
};

template <int KIND>
constexpr bool kNibbles = KIND != kQ8_0;
template <int KIND>
constexpr int kOffset = KIND == kQ8_0 ? 128 : KIND == kQ4_0 ? 8 : KIND == kQ5_0 ? 16 : 0;

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
    const __m256i b = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + BB + 2)) : _mm256_set1_epi8(-128);
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
inline void exact_tile(const uint8_t* W, int64_t row_bytes, const XL& x, const XQ& xq, int64_t O, float* Y,
                       int64_t o0, int mo, int64_t n0, bool prefetch) {
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
        for (int64_t l = 0; l < 2 * BB; l += 64)
          prefetch_l2(rows[j] + kExactAhead * row_bytes + b0 * BB + l);
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
        const __m512 mw = _mm512_maskz_cvtph_ps(0xffff, _mm512_maskz_cvtepi32_epi16(0xffff, _mm512_maskz_srli_epi32(0xffff, g, 16)));
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
  for (int c = 0; c < 16; ++c) at[c] = static_cast<int32_t>(std::min(c % MO, mo - 1) * row_bytes + (c < MO ? 0 : 2 * BB));
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
        for (int64_t l = 0; l < 4 * BB; l += 64)
          prefetch_l2(rows[j] + kExactAhead * row_bytes + b0 * BB + l);
    __m512i v[16];
    const __m512i xv = _mm512_loadu_si512(x.q + (n * x.np + p) * 64);
    const __m512i c0 = kOffset<KIND> ? _mm512_loadu_si512(x.c + (n * x.np + p) * 16) : _mm512_setzero_si512();
    for (int j = 0; j < MO; ++j) v[j] = _mm512_dpbusd_epi32(c0, unpack_pair<KIND>(rows[j] + b0 * BB, two || pair), xv);
    if (two) {
      const __m512i xv1 = _mm512_loadu_si512(x.q + (n * x.np + p + 1) * 64);
      const __m512i c1 = kOffset<KIND> ? _mm512_loadu_si512(x.c + (n * x.np + p + 1) * 16) : _mm512_setzero_si512();
      for (int j = 0; j < MO; ++j) v[MO + j] = _mm512_dpbusd_epi32(c1, unpack_pair<KIND>(rows[j] + (b0 + 2) * BB, true), xv1);
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
        const __m256i lo = scales8<MO>(rows, b * BB), hi = two ? scales8<MO>(rows, (b + 2) * BB) : _mm256_setzero_si256();
        g = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7);
      } else {
        g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, gat, rows[0] + b * BB, 1);
      }
      f[h] = _mm512_mask_cvtepi32_ps(z, 0xffff, s[h]);
      d[h] = _mm512_maskz_cvtph_ps(0xffff, _mm512_maskz_cvtepi32_epi16(0xffff, g));
      if constexpr (Fmt<KIND>::kHasM)
        m[h] = _mm512_maskz_cvtph_ps(0xffff, _mm512_maskz_cvtepi32_epi16(0xffff, _mm512_maskz_srli_epi32(0xffff, g, 16)));
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
    with_rows<R - 1>(N - n, [&](auto r) { exact_tile<KIND, MO, decltype(r)::value>(W, row_bytes, x, xq, O, Y, o, mo, n, false); });
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
constexpr int64_t kRun = 256;          // rows of x a panel's unpacked weights serve before the next run

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
      u[4 * i + 2 * h] = _mm512_maskz_unpacklo_epi64(0xff, t[4 * i + h], t[4 * i + 2 + h]);      // r0..3 g(2h)   | g(2h+4)
      u[4 * i + 2 * h + 1] = _mm512_maskz_unpackhi_epi64(0xff, t[4 * i + h], t[4 * i + 2 + h]);  // r0..3 g(2h+1) | g(2h+5)
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
      for (int64_t b = 0; b < nb; ++b) u[b] = _mm256_setzero_si256(), dv[b * kPanel + o] = 0.0f, mv[b * kPanel + o] = 0.0f;
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
        const __m512i xb = _mm512_set1_epi32(static_cast<int32_t>(load_u32(reinterpret_cast<const uint8_t*>(xq + r * x.K + 4 * g))));
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
  const __mmask16 k1 = mo >= 32 ? __mmask16{0xffff} : mo <= 16 ? __mmask16{0} : static_cast<__mmask16>((1u << (mo - 16)) - 1);
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
  const PanelBuf buf{w.get<__m512i>(nb * 16), d.get<__m512>(nb * 2), m.get<__m512>(nb * 2), u.get<__m256i>(kPanel * nb)};
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
    with_rows<kPanelRows - 1>(n1 - n, [&](auto r) { panel_tile<KIND, decltype(r)::value>(buf, x, xsum, O, Y, o, mo, n); });
  }
}

template <int KIND>
void qgemm_vnni(ffi::ThreadPool& pool, const uint8_t* W, const XQ& xq, int64_t N, int64_t O, float* Y) {
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
        panel_outputs<KIND>(W, row_bytes, xq, sums, O, Y, panels * task / per_run, panels * (task + 1) / per_run,
                            n0, n1);
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
  parallel_for(pool, tasks, [&](int64_t task) {
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
  }, /*linger_after=*/N == 1);
}
#endif

// Output o against rows [n0, n0 + R) of x, into Y [N, O].
template <int KIND, int R>
inline void tile(const uint8_t* W, int64_t row_bytes, const XQ& x, int64_t O, float* Y, int64_t o, int64_t n0) {
  float out[R];
  if constexpr (kSuper<KIND>)
    dot_rows_k<KIND, R>(W + o * row_bytes, x, n0, out);
  else
    dot_rows<KIND, R>(W + o * row_bytes, x, n0, out);
  for (int r = 0; r < R; ++r) Y[(n0 + r) * O + o] = out[r];
}

// Outputs [o0, o1) against every row of x: each weight row once per tile of kTileRows rows
// (from L1 after the first), each block unpacked once per tile. The K-quants take the rows of x
// in runs of at most 32 KB of int8 (an L1's worth), the outputs' weights streamed again for each
// run (from L2): a whole 64-row x (128 KB at K = 2048) read from L2 for every output ran a
// 640 x 1024 q4_k call 3.3x slower at 64 rows than at 32.
template <int KIND>
void outputs(const uint8_t* W, int64_t row_bytes, const XQ& x, int64_t N, int64_t O, float* Y, int64_t o0,
             int64_t o1) {
  const int64_t run = kSuper<KIND> ? std::max<int64_t>(kTileRows, 32768 / x.K / kTileRows * kTileRows) : N;
  for (int64_t n0 = 0; n0 < N; n0 += run) {
    const int64_t n1 = std::min(N, n0 + run);
    for (int64_t o = o0; o < o1; ++o) {
      int64_t n = n0;
      for (; n + kTileRows <= n1; n += kTileRows) tile<KIND, kTileRows>(W, row_bytes, x, O, Y, o, n);
      with_rows<kTileRows - 1>(n1 - n, [&](auto r) { tile<KIND, decltype(r)::value>(W, row_bytes, x, O, Y, o, n); });
    }
  }
}

template <int KIND>
void qgemm(ffi::ThreadPool& pool, const uint8_t* W, const XQ& x, int64_t N, int64_t O, float* Y) {
  const int64_t row_bytes = (kSuper<KIND> ? x.ns : x.nb) * Fmt<KIND>::kBytes;
  // One contiguous range of outputs a thread (one stream of weights each); after a one-row
  // call the helper lingers for the next (threads.h).
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), O / 16));
#if defined(TL_QDOT_EXACT_256)
  if constexpr (!kSuper<KIND>) {
    // Each row's block sums of q_x (the offset kinds' share), then ranges of whole groups of 8.
    thread_local std::vector<int32_t> xsum;
    const int32_t* sums = nullptr;  // not xsum in the tasks: a thread_local names each thread's own
    if constexpr (kOff256<KIND> != 0) {
      xsum.resize(static_cast<size_t>(N * x.nb));
      block_sums(x.q, N * x.nb, xsum.data());
      sums = xsum.data();
    }
    const int64_t groups = (O + 7) / 8;
    parallel_for(pool, tasks, [&](int64_t task) {
      exact_outputs8<KIND>(W, row_bytes, x, sums, N, O, Y, std::min(O, 8 * (groups * task / tasks)),
                           std::min(O, 8 * (groups * (task + 1) / tasks)));
    }, /*linger_after=*/N == 1);
  } else
#endif
  {
    parallel_for(pool, tasks, [&](int64_t task) {
      outputs<KIND>(W, row_bytes, x, N, O, Y, O * task / tasks, O * (task + 1) / tasks);
    }, /*linger_after=*/N == 1);
  }
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
constexpr int64_t kPanelOut = 16;

template <int KIND>
constexpr int64_t kPanelGroups = KIND == kQ8_0 ? 8 : 4;  // G: vectors of quant bytes a block

template <int KIND>
constexpr int64_t panel_block_bytes() {
  return kPanelOut * Fmt<KIND>::kBytes;
}

#if defined(TL_QDOT_512)
#define TL_QPANELS 1
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
          for (int64_t l = 0; l < PB; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * PN * nb * PB + l), _MM_HINT_T1);
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
        const __m512 m = _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(heads + 32)));
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
      two ? panels_tile<KIND, 2, 4>(P, x, xsum, OP, Y, p, n, false) : panels_tile<KIND, 1, 4>(P, x, xsum, OP, Y, p, n, false);
    with_rows<3>(N - n, [&](auto r) {
      constexpr int R = decltype(r)::value;
      two ? panels_tile<KIND, 2, R>(P, x, xsum, OP, Y, p, n, false) : panels_tile<KIND, 1, R>(P, x, xsum, OP, Y, p, n, false);
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
    parallel_for(pool, tasks, [&](int64_t task) {
      panels_range<KIND>(P, x, sums, 1, panels * kPanelOut, Y, 4 * (panels / 4 * task / tasks),
                         task + 1 == tasks ? panels : 4 * (panels / 4 * (task + 1) / tasks));
    }, /*linger_after=*/true);
    return;
  }
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>((panels + 1) / 2, 8 * pool.num_threads()));
  const int64_t run = std::max<int64_t>(4, 524288 / x.K / 4 * 4);  // x's int8 in half an L2
  for (int64_t n0 = 0; n0 < N; n0 += run) {
    const int64_t rows = std::min(run, N - n0);
    const XQ xr{x.q + n0 * x.K, x.d8 + n0 * x.nb * 8, x.s + n0 * x.nb, x.K, x.nb};
    parallel_for(pool, tasks, [&](int64_t task) {
      panels_range<KIND>(P, xr, sums + n0 * x.nb, rows, panels * kPanelOut, Y + n0 * panels * kPanelOut,
                         2 * ((panels + 1) / 2 * task / tasks), std::min(panels, 2 * ((panels + 1) / 2 * (task + 1) / tasks)));
    });
  }
}
#endif

// Whether this build has the panel kernels (AVX-512 VNNI): where it has not, the engine keeps
// the stored rows (TlQGemmPanels then refuses every call).
bool panels_built() {
#if defined(TL_QPANELS)
  return true;
#else
  return false;
#endif
}

// The rows a call of `kind` takes: any count where a panel kernel runs it (AVX-512 VNNI, and
// AVX2's exact family: the formats of 32-input blocks), and the K-quants' any count on the SIMD
// builds (their tiles take x in runs of an L1's worth, so a row count costs only the weights
// streamed again a run: Gemma 3 270M's q6_k ffn_down at 512 rows ran 1.9x XLA's dequantizing
// dot on Zen 4, its q4_k attn_output 1.24x, at 128-256 rows 0.77-1.0x: the verdicts weigh the
// whole layer chain at 64 rows and at the largest token bucket, not each matrix); else the
// tiles' 64 (the scalar builds: past that their x streams from L2 for every output, and a 512-row call would take seconds to measure at start-up). The AVX2 panels ran
// SmolLM2 Q4_1's 512-token prefill at 736-770 tok/s on Zen 3 where 64 rows a call and XLA's dot
// past them gave 510.
int64_t max_rows(int32_t kind) {
#if defined(TL_QDOT_512) || defined(TL_QDOT_EXACT_256)
  if (kind >= kQ8_0 && kind <= kQ5_1) return kQManyRows;
#endif
#if defined(TL_QDOT_512) || defined(TL_QDOT_256) || defined(TL_QDOT_NEON)
  if (kind >= kQ4_K && kind <= kQ6_K) return kQManyRows;
#endif
  (void)kind;
  return kQFewRows;
}

ffi::Error QGemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, int32_t kind,
                 ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const int64_t bb = block_bytes(kind), bi = block_inputs(kind);
  if (bb == 0) return ffi::Error::InvalidArgument("unknown block kind");
  if (xd.size() != 2 || wd.size() < 2) return ffi::Error::InvalidArgument("expected x [N,K] and w [...,row_bytes]");
  const int64_t N = xd[0], K = xd[1], row_bytes = wd[wd.size() - 1];
  if (K % bi != 0 || row_bytes != K / bi * bb)
    return ffi::Error::InvalidArgument("w's rows are not K / 32 blocks (K / 256 for the K-quants) of this kind");
  if (N > max_rows(kind)) return ffi::Error::InvalidArgument("qgemm takes at most qgemm_max_rows(kind) rows");
  const int64_t O = row_bytes > 0 ? static_cast<int64_t>(w.element_count()) / row_bytes : 0;
  float* Y = y->typed_data();
  if (N == 0 || O == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(Y, Y + N * O, 0.0f);
    return ffi::Error::Success();
  }
  const uint8_t* W = w.typed_data();
  thread_local std::vector<int8_t> q;
  q.resize(static_cast<size_t>(N * K + kQK));
  if (bi == kQKK) {
    const int64_t ns = K / kQKK;
    thread_local std::vector<float> dk;
    thread_local std::vector<int16_t> bs;
    dk.resize(static_cast<size_t>(N * ns));
    bs.resize(static_cast<size_t>(N * ns * 16));
    quantize_x_k(x.typed_data(), N, K, q.data(), dk.data(), bs.data());
    const XQ xk{q.data(), nullptr, nullptr, K, 0, dk.data(), bs.data(), ns};
    switch (kind) {
      case kQ4_K: qgemm<kQ4_K>(pool, W, xk, N, O, Y); break;
      case kQ5_K: qgemm<kQ5_K>(pool, W, xk, N, O, Y); break;
      case kQ6_K: qgemm<kQ6_K>(pool, W, xk, N, O, Y); break;
      default: break;
    }
    return ffi::Error::Success();
  }
  const int64_t nb = K / kQK;
  thread_local std::vector<float> d8, s;
  d8.resize(static_cast<size_t>(N * nb * 8 + 8));
  s.resize(static_cast<size_t>(N * nb));
  quantize_x(x.typed_data(), N, K, q.data(), d8.data(), s.data());
  const XQ xq{q.data(), d8.data(), s.data(), K, nb};
#if defined(TL_QDOT_512)
  switch (kind) {
    case kQ8_0: qgemm_vnni<kQ8_0>(pool, W, xq, N, O, Y); break;
    case kQ4_0: qgemm_vnni<kQ4_0>(pool, W, xq, N, O, Y); break;
    case kQ4_1: qgemm_vnni<kQ4_1>(pool, W, xq, N, O, Y); break;
    case kQ5_0: qgemm_vnni<kQ5_0>(pool, W, xq, N, O, Y); break;
    case kQ5_1: qgemm_vnni<kQ5_1>(pool, W, xq, N, O, Y); break;
    default: break;
  }
  return ffi::Error::Success();
#endif
  switch (kind) {
    case kQ8_0: qgemm<kQ8_0>(pool, W, xq, N, O, Y); break;
    case kQ4_0: qgemm<kQ4_0>(pool, W, xq, N, O, Y); break;
    case kQ4_1: qgemm<kQ4_1>(pool, W, xq, N, O, Y); break;
    case kQ5_0: qgemm<kQ5_0>(pool, W, xq, N, O, Y); break;
    case kQ5_1: qgemm<kQ5_1>(pool, W, xq, N, O, Y); break;
    default: break;
  }
  return ffi::Error::Success();
}

ffi::Error QGemmPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, int32_t kind,
                       ffi::ResultBuffer<ffi::F32> y) {
  if (!panels_built()) return ffi::Error::InvalidArgument("this build has no panel kernels (AVX-512 VNNI)");
  if (kind != kQ8_0 && kind != kQ4_0 && kind != kQ4_1) return ffi::Error::InvalidArgument("panels are q8_0, q4_0 or q4_1");
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3) return ffi::Error::InvalidArgument("expected x [N,K] and w [panels, blocks, bytes]");
  const int64_t N = xd[0], K = xd[1], panels = wd[0], nb = wd[1];
  if (K != nb * kQK || wd[2] != kPanelOut * block_bytes(kind))
    return ffi::Error::InvalidArgument("w is not panels of 16 outputs' blocks of x's K inputs");
  float* Y = y->typed_data();
  if (N == 0 || panels == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(Y, Y + N * panels * kPanelOut, 0.0f);
    return ffi::Error::Success();
  }
#if defined(TL_QPANELS)
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d8, s;
  q.resize(static_cast<size_t>(N * K + kQK));
  d8.resize(static_cast<size_t>(N * nb * 8 + 8));
  s.resize(static_cast<size_t>(N * nb));
  quantize_x(x.typed_data(), N, K, q.data(), d8.data(), s.data());
  const XQ xq{q.data(), d8.data(), s.data(), K, nb};
  const uint8_t* P = w.typed_data();
  switch (kind) {
    case kQ8_0: qgemm_panels<kQ8_0>(pool, P, xq, N, panels, Y); break;
    case kQ4_0: qgemm_panels<kQ4_0>(pool, P, xq, N, panels, Y); break;
    default: qgemm_panels<kQ4_1>(pool, P, xq, N, panels, Y); break;
  }
#else
  (void)pool;
#endif
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tl

extern "C" int64_t TlQGemmMaxRows(int32_t kind) { return tl::max_rows(kind); }
extern "C" int64_t TlQGemmPanelsBuilt() { return tl::panels_built() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlQGemmPanels, tl::QGemmPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // w [panels, K / 32, 16 block bytes]: repacked
                                  .Attr<int32_t>("kind")          // Kind: 0 q8_0, 1 q4_0, 2 q4_1
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [N, 16 panels]

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlQGemm, tl::QGemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // w [..., row_bytes]: raw ggml blocks
                                  .Attr<int32_t>("kind")          // Kind: 0 q8_0, 1 q4_0, 2 q4_1, 3 q5_0, 4 q5_1, 5 q4_k, 6 q5_k, 7 q6_k
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [N, ...]
