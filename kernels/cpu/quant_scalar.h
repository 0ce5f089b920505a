// The scalar kernels (x86-64: SSE2; aarch64: armv8-a without dotprod): TL_QDOT_SCALAR (quant.h).
//
// Owns: dot_rows and dot_rows_k over the blocks unpacked the scalar way (the compiler vectorizes
// the int8 products), without fast-math, both run by quant_tiles.h's tiles (up to 64 rows a
// call). Must not: be compiled for another family (empty elsewhere). Included by quant_gemm.cc;
// tested by tests/kernels/test_cpu_native_quant.py on the x86-64 build.
#pragma once

#include "quant.h"

#if defined(TL_QDOT_SCALAR)
namespace tl {
namespace {

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
