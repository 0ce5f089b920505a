// The aarch64 dotprod kernels (aarch64-dotprod): TL_QDOT_NEON (quant.h).
//
// Owns: dot_rows (a block unpacked the scalar way, two vdotq_s32 a block and row) and
// dot_rows_k (a K-quant super-block unpacked the scalar way, codes <= 63 valid int8, one
// vdotq_s32 a group of 16 scaled by vmlaq), both run by quant_tiles.h's tiles (up to 64 rows a
// call for the blocks of 32). Must not: be compiled for another family (empty elsewhere).
// Included by quant_gemm.cc; compiled by tests/kernels/test_cpu_build.py (an aarch64 machine runs
// tests/kernels/test_cpu_native_quant.py on it).
#pragma once

#include "quant.h"

#if defined(TL_QDOT_NEON)
namespace tl {
namespace {

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

}  // namespace
}  // namespace tl

#include "quant_tiles.h"

namespace tl {
namespace {

// The 32-input kinds by the tiles too (quant_tiles.h).
template <int KIND>
void qgemm_blocks(ffi::ThreadPool& pool, const uint8_t* W, const XQ& x, int64_t N, int64_t O, float* Y) {
  qgemm<KIND>(pool, W, x, N, O, Y);
}

}  // namespace
}  // namespace tl
#endif
