// Float32 and int8 matmuls of a few rows as XLA FFI custom calls.
//
// Owns: TlGemv, y [N, O] = x [N, K] @ w^T for w [O, K] (one row of K weights per output: how
// every float linear is stored, tl/model/llama.py) and N <= gemm_max_rows(); TlGemvInt8, the
// same for one row of int8 weights with a scale per output (W8A8, XLA's arithmetic exactly);
// TlGemvMaxRows. Must not: write anything but y. Built by kernels/cpu_build.py, called by
// kernels/cpu_native.py, tested by tests/kernels/test_cpu_native.py against float64 products and
// XLA's int8 dot; which row counts run here rather than on XLA's dot is measured at start-up
// (kernels/verdicts.py), per CPU.
//
// Why: XLA:CPU runs a matrix-vector product on one thread, and a few-row product far below
// the FMA units' rate (on a 2-core EPYC with AVX2, the 30 SmolLM2 layers' matmuls ran at 16
// GFLOP/s at 4 rows and 101 at 64, against ~150 for a large GEMM).
//
// One arithmetic at every row count (dot.h's dot form: each output's weights against kDotNB
// rows of x at a time, one vector accumulator a (row, output) over k, reduced across lanes at
// the end), so that a row's result is the same whatever else the call holds (issue 48: a
// request's answer must not depend on the step it lands in). A one-row form with four
// accumulators a row (~10% more of the memory's rate) and a broadcast form for 16-64 rows
// (rows in the lanes, one fma chain over k: 1.35-1.39x the dot form at 32-64 rows on AVX-512)
// each summed k in another order, and were removed for it.

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dot.h"
#include "simd.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace tl {
namespace {

constexpr int64_t kGemmRows = 64;  // the most rows TlGemv takes (at 96 and 128 XLA's dot was as fast, AVX-512)

void gemm(ffi::ThreadPool& pool, const float* X, int64_t N, int64_t K, const float* W, int64_t O, float* Y) {
  dot_form<FloatWeights>(pool, X, N, K, W, O, Y, /*linger_after=*/N == 1);
}

ffi::Error Gemv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() < 2 || xd[1] != wd[wd.size() - 1])
    return ffi::Error::InvalidArgument("expected x [N,K] and w [...,K]");
  const int64_t N = xd[0], K = xd[1];
  const int64_t O = K > 0 ? static_cast<int64_t>(w.element_count()) / K : 0;
  if (N > kGemmRows) return ffi::Error::InvalidArgument("gemv takes at most cpu_native max_rows() rows");
  if (N > 0 && O > 0) gemm(pool, x.typed_data(), N, K, w.typed_data(), O, y->typed_data());
  return ffi::Error::Success();
}

// y [N, O] = x [N, K] @ (q [O, K] * scale [O])^T for a few rows N, int8 weights stored one row
// per output (tl/model/llama.py's int8 linears), with exactly the arithmetic of llama.linear's
// W8A8 path: each x row quantized to int8 by its max |x| / 127 (round half to even), an exact
// int32 dot per output, then float(acc) * x_scale * scale. Compiled without fast-math, so that
// division and the two products round as XLA's do: the result is bit for bit XLA's.
#define TL_STRICT_MATH __attribute__((optimize("no-fast-math")))

// Exact int32 dot of an int8 weight row with an activation row widened to int16 once a call
// (AVX2: each 16 weights widened, multiply-added in pairs against the activations: three
// instructions a 16, where widening both sides every row took five).
inline int32_t dot_i8(const int16_t* x, const int8_t* w, int64_t K) {
  int64_t k = 0;
  int32_t r = 0;
#if defined(__AVX2__)
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  for (; k + 32 <= K; k += 32) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16)));
    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k))));
    a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k + 16))));
  }
  for (; k + 16 <= K; k += 16) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k))));
  }
  const __m256i acc = _mm256_add_epi32(a0, a1);
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  h = _mm_hadd_epi32(h, h);
  h = _mm_hadd_epi32(h, h);
  r = _mm_cvtsi128_si32(h);
#endif
  for (; k < K; ++k) r += static_cast<int32_t>(x[k]) * static_cast<int32_t>(w[k]);
  return r;
}

TL_STRICT_MATH void quantize_rows(const float* X, int64_t N, int64_t K, int16_t* xq, float* x_scale) {
  for (int64_t n = 0; n < N; ++n) {
    float mx = 0.0f;
    for (int64_t k = 0; k < K; ++k) mx = std::max(mx, std::fabs(X[n * K + k]));
    const float sc = std::max(mx, 1e-12f) / 127.0f;
    x_scale[n] = sc;
    for (int64_t k = 0; k < K; ++k) xq[n * K + k] = static_cast<int16_t>(std::nearbyint(X[n * K + k] / sc));
  }
}

TL_STRICT_MATH float rescale(int32_t acc, float x_scale, float w_scale) {
  const float t = static_cast<float>(acc) * x_scale;
  return t * w_scale;
}

ffi::Error GemvInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  if (xd.size() != 2 || qd.size() < 2 || xd[1] != qd[qd.size() - 1])
    return ffi::Error::InvalidArgument("expected x [N,K] and q [...,K]");
  const int64_t N = xd[0], K = xd[1];
  if (K < 1) return ffi::Error::InvalidArgument("q has no columns");
  const int64_t O = static_cast<int64_t>(q.element_count()) / K;
  if (static_cast<int64_t>(scale.element_count()) != O)
    return ffi::Error::InvalidArgument("scale is not [...] of q's rows");
  if (N > 16) return ffi::Error::InvalidArgument("gemv takes at most 16 rows");
  std::vector<int16_t> xq(static_cast<size_t>(N * K));  // int8 values, widened once
  float x_scale[16];
  quantize_rows(x.typed_data(), N, K, xq.data(), x_scale);
  const int8_t* Q = q.typed_data();
  const float* S = scale.typed_data();
  float* Y = y->typed_data();
  // One contiguous range of output rows a thread (one stream of weights each, as the float
  // one-row matmul), its helper lingering for the next call.
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), O / 16));
  parallel_for(
      pool, tasks,
      [&](int64_t task) {
        for (int64_t o = O * task / tasks; o < O * (task + 1) / tasks; ++o) {
          const int8_t* row = Q + o * K;
          for (int64_t n = 0; n < N; ++n) Y[n * O + o] = rescale(dot_i8(xq.data() + n * K, row, K), x_scale[n], S[o]);
        }
      },
      /*linger_after=*/N == 1);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tl

extern "C" int64_t TlGemvMaxRows() { return tl::kGemmRows; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemv, tl::Gemv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [N, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // w [..., K]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [N, ...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemvInt8, tl::GemvInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [N, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()     // q [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scale [...]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [N, ...]
