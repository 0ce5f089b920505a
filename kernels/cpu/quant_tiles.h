// The tiles of rows the AVX-512 VNNI, NEON and scalar families run their K-quants by (and the
// NEON and scalar families their blocks of 32; AVX2 has its own, quant_avx2.h): the family's dot_rows_k / dot_rows over
// output o and up to kTileRows rows of x, each weight row read once a tile, the outputs split over the threads.
//
// Owns: tile, outputs, qgemm (the K-quants' call on those builds; the blocks of 32 on NEON and
// scalar builds). Must not: know a family's vectors (dot_rows, dot_rows_k and kTileRows are the
// including family header's). Included at the end of those family headers (quant_avx512.h,
// quant_neon.h, quant_scalar.h); tested by tests/kernels/test_cpu_native_quant.py.
//
// The K-quants, each target's way: a weight super-block is unpacked once per tile of up to
// kTileRows rows of x and dotted against all of them (codes u <= 63 unsigned, x signed: u8 x s8
// products with no sign juggling, the q6_k offset and the q4_k / q5_k mins by bsums).
#pragma once

#include "quant.h"

namespace tl {
namespace {

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
void outputs(const uint8_t* W, int64_t row_bytes, const XQ& x, int64_t N, int64_t O, float* Y, int64_t o0, int64_t o1) {
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
  parallel_for(
      pool, tasks,
      [&](int64_t task) { outputs<KIND>(W, row_bytes, x, N, O, Y, O * task / tasks, O * (task + 1) / tasks); },
      /*linger_after=*/N == 1);
}

}  // namespace
}  // namespace tl
