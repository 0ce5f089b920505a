// The dot form of a few-row matmul, over any weight type (matmul.cc's float32 weights, half.cc's
// 16-bit ones): y [N, O] = x [N, K] @ W^T, W [O, K] one row of weights an output.
//
// Owns: dot_form (output rows split into contiguous ranges over the threads, each streaming its
// part of W front to back, kDotMO outputs at a time (their rows read together, the next kDotMO
// rows prefetched as they go), x rows in blocks of kDotNB against them: NB x MO dot products
// accumulate in registers, reduced across lanes at the end) and its blocks. A weight type is a
// loader `L`: L::T the stored element, L::vec(p) kLanes weights at p as floats, L::one(w) one.
// Must not: know any weight type. Used by matmul.cc and half.cc, tested through both
// (tests/kernels/test_cpu_native.py).
#pragma once

#include <algorithm>
#include <cstdint>

#include "simd.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace tl {

constexpr int kDotNB = kRegs >= 32 ? 4 : 2;  // x rows a dot block
constexpr int kDotMO = 4;                    // outputs a dot block

struct FloatWeights {
  using T = float;
  static vf vec(const float* p) { return loadv(p); }
  static float one(float w) { return w; }
};

template <typename L, int NB, int MO>
inline void dot_block(const float* X, int64_t K, const typename L::T* W, int64_t O, float* Y, int64_t n0, int64_t o0,
                      bool prefetch) {
  constexpr int64_t kLine = 64 / sizeof(typename L::T);  // weights a 64-byte line
  vf acc[NB][MO];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MO; ++j) acc[i][j] = vf{};
  const int64_t KV = K / kLanes * kLanes;
  const typename L::T* w = W + o0 * K;
  const float* x = X + n0 * K;
  for (int64_t k = 0; k < KV; k += kLanes) {
    if (prefetch && (k & (kLine - 1)) == 0)  // one 64-byte line a row
      for (int j = 0; j < MO; ++j) __builtin_prefetch(w + (MO + j) * K + k);
    vf wv[MO];
    for (int j = 0; j < MO; ++j) wv[j] = L::vec(w + j * K + k);
    for (int i = 0; i < NB; ++i) {
      const vf xv = loadv(x + i * K + k);
      for (int j = 0; j < MO; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MO; ++j) {
      float r = hsumv(acc[i][j]);
      for (int64_t k = KV; k < K; ++k) r += x[i * K + k] * L::one(w[j * K + k]);
      Y[(n0 + i) * O + o0 + j] = r;
    }
}

// Outputs [o0, o0 + MO) against every row of x.
template <typename L, int MO>
inline void dot_outputs(const float* X, int64_t N, int64_t K, const typename L::T* W, int64_t O, float* Y, int64_t o0,
                        bool prefetch) {
  int64_t n = 0;
  for (; n + kDotNB <= N; n += kDotNB) {  // the MO rows of w stay in L1 after the first block of x rows
    dot_block<L, kDotNB, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0);
  }
  switch (N - n) {
    case 3: dot_block<L, 3, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0); break;
    case 2: dot_block<L, 2, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0); break;
    case 1: dot_block<L, 1, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0); break;
    default: break;
  }
}

template <typename L>
void dot_form(xla::ffi::ThreadPool& pool, const float* X, int64_t N, int64_t K, const typename L::T* W, int64_t O,
              float* Y, bool linger_after) {
  const int64_t blocks = O / kDotMO;  // the last O % kDotMO outputs one by one
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), blocks));
  parallel_for(
      pool, tasks,
      [&](int64_t task) {
        const int64_t b0 = blocks * task / tasks, b1 = blocks * (task + 1) / tasks;
        for (int64_t b = b0; b < b1; ++b) dot_outputs<L, kDotMO>(X, N, K, W, O, Y, kDotMO * b, b + 1 < b1);
        if (task == tasks - 1)
          for (int64_t o = kDotMO * blocks; o < O; ++o) dot_outputs<L, 1>(X, N, K, W, O, Y, o, false);
      },
      linger_after);
}

}  // namespace tl
