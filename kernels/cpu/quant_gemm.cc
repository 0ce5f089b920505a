// The quantized matmuls' one translation unit of kernels: x quantized once a call, then the
// build's kernel family (quant.h's TL_QDOT_*) for the call's kind.
//
// Owns: qgemm_run and qgemm_panels_run (quant.h), the thread's buffers of x quantized. Must not:
// check shapes (quant_ffi.cc does) or hold a kernel (the family headers do). Built by
// kernels/cpu_build.py with every other kernels/cpu/*.cc; tested by
// tests/kernels/test_cpu_native_quant.py and tests/model/test_panels.py.
//
// Kernels by target: AVX-512 VNNI (quant_avx512.h: x86-64-v4-vnni, sapphirerapids) two blocks a
// 512-bit vector, vpdpbusd on unsigned codes against x; AVX2 (quant_avx2.h: x86-64-v3,
// x86-64-v4) one block a 256-bit vector, vpmaddubsw then vpmaddwd with ones (q8_0 by the sign
// trick, |w| * sign(x, w) < 2 * 128 * 127 per pair: no int16 saturation); aarch64 with dotprod
// (quant_neon.h) vdotq_s32 on the signed values; elsewhere (quant_scalar.h: SSE2, plain
// armv8-a) scalar code the compiler vectorizes. On AVX-512 VNNI and AVX2, one arithmetic
// whatever the row count (a row's result does not depend on its step's other rows): exact block
// sums scaled once a block, by exact_row / exact_tile (VNNI) or exact8 (AVX2) for the fewest
// rows and by panel kernels with outputs in the vector lanes for more (panel_tile, panel8_tile),
// any row count; on AVX2 the K-quants too (exact super-block sums: k_rows8 for up to 7 rows,
// k_panel_tile for more). Elsewhere (the VNNI build's K-quants, NEON, scalar) each weight block
// is unpacked once per tile of up to kTileRows rows of x and dotted against all of them
// (quant_tiles.h). A row's blocks stream front to back, each
// thread one contiguous range of outputs, its helper lingering after one-row calls as TlGemv's
// does (threads.h).

#include "quant.h"
#include "quant_avx2.h"
#include "quant_avx512.h"
#include "quant_neon.h"
#include "quant_scalar.h"

namespace tl {

void qgemm_run(ffi::ThreadPool& pool, int32_t kind, const float* X, int64_t N, int64_t K, const uint8_t* W, int64_t O,
               float* Y) {
  thread_local std::vector<int8_t> q;
  q.resize(static_cast<size_t>(N * K + kQK));
  if (kind >= kQ4_K) {
    const int64_t ns = K / kQKK;
    thread_local std::vector<float> dk;
    thread_local std::vector<int16_t> bs;
    dk.resize(static_cast<size_t>(N * ns));
    bs.resize(static_cast<size_t>(N * ns * 16));
    quantize_x_k(X, N, K, q.data(), dk.data(), bs.data());
    const XQ xk{q.data(), nullptr, nullptr, K, 0, dk.data(), bs.data(), ns};
    with_kind<kQ4_K, kQ6_K>(kind, [&](auto k) { qgemm<decltype(k)::value>(pool, W, xk, N, O, Y); });
    return;
  }
  const int64_t nb = K / kQK;
  thread_local std::vector<float> d8, s;
  d8.resize(static_cast<size_t>(N * nb * 8 + 8));
  s.resize(static_cast<size_t>(N * nb));
  quantize_x(X, N, K, q.data(), d8.data(), s.data());
  const XQ xq{q.data(), d8.data(), s.data(), K, nb};
  with_kind<kQ8_0, kQ5_1>(kind, [&](auto k) { qgemm_blocks<decltype(k)::value>(pool, W, xq, N, O, Y); });
}

void qgemm_panels_run(ffi::ThreadPool& pool, int32_t kind, const float* X, int64_t N, int64_t K, const uint8_t* P,
                      int64_t panels, float* Y) {
#if defined(TL_QPANELS)
  const int64_t nb = K / kQK;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d8, s;
  q.resize(static_cast<size_t>(N * K + kQK));
  d8.resize(static_cast<size_t>(N * nb * 8 + 8));
  s.resize(static_cast<size_t>(N * nb));
  quantize_x(X, N, K, q.data(), d8.data(), s.data());
  const XQ xq{q.data(), d8.data(), s.data(), K, nb};
  with_kind<kQ8_0, kQ4_1>(kind, [&](auto k) { qgemm_panels<decltype(k)::value>(pool, P, xq, N, panels, Y); });
#else
  (void)pool, (void)kind, (void)X, (void)N, (void)K, (void)P, (void)panels, (void)Y;
#endif
}

}  // namespace tl
