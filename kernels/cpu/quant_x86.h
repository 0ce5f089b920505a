// AVX2 helpers both x86 kernel families share (quant_avx2.h; quant_avx512.h, whose AVX-512 VNNI
// kernels read blocks and K-quant scales 256 bits at a time too): a block's weights in a vector,
// eight rows' (d, m) halves, x's block sums, the K-quants' scale bytes, the prefetch into L2 and
// the thread's aligned scratch.
//
// Owns: those helpers. Must not: hold a kernel of its own. Included by the family headers (and
// through them quant_gemm.cc and bench/qlayout.cc); empty where TL_QAVX2 is not defined (quant.h).
#pragma once

#include "quant.h"

#if defined(TL_QAVX2)
namespace tl {
namespace {

// The few-row kernels' software prefetch of the weight rows they read next, into L2, not L1
// (prefetcht2; L2 is what AMD's and Intel's cores fill for it): the lines of 8-32 rows ahead
// are many outstanding misses, which L2 takes where L1's miss buffers stall. Gemma 3 270M's
// 178 MB q8_0 head, one row on Zen 4 (x86-64-v4-vnni, 2 threads): 13.9 GB/s prefetching into L1
// (prefetcht0), 26 into L2 by prefetcht1, 29-31 by prefetcht2; its one-row decode step 19 ->
// 12-13 ms; SmolLM2 Q4_1's 1.3x (bench runner, alternated).
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T2); }

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
#if defined(TL_QAVX512BW)
      const __m256i set = _mm256_movm_epi8(qh);  // 0xff where the 5th bit is set
#else
      // ggml's bytes_from_bits_32: byte i of qh to bytes 8i..8i+7, each testing its own bit.
      const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
      const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(qh)), shuf);
      const __m256i set =
          _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
#endif
      if constexpr (KIND == kQ5_1) return _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(16)));
      // value - 16: nibble - 16 (nibble | 0xf0) where the bit is clear, the nibble where set.
      return _mm256_or_si256(w, _mm256_andnot_si256(set, _mm256_set1_epi8(static_cast<char>(0xf0))));
    }
  }
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

}  // namespace
}  // namespace tl
#endif
