// Matmuls of a few rows over 16-bit float weights (a GGUF's F16 and BF16 tensors, kept as stored).
//
// Owns: TlGemvHalf, y [N, O] = x [N, K] @ W^T for W [O, 2 K] the little-endian bytes of each
// output's K weights as IEEE half (`kind` 0) or bfloat16 (`kind` 1), N <= kHalfMaxRows;
// TlGemvHalfMaxRows. Must not: write anything but y. Built by kernels/cpu_build.py, called by
// kernels/cpu_native.py (`gemv_half`), tested by tests/test_cpu_native.py against float64
// products of the widened weights.
//
// Arithmetic: each weight widened to float32 exactly (a half's 11 significant bits and a
// bfloat16's 8 fit a float's 24), multiplied by x in float32 and summed in float32, lane by
// lane, then across lanes: only the products' and the sums' roundings, as the float32 kernel
// (matmul.cc). Not AVX512-BF16's vdpbf16ps: it would round x to bfloat16 too (8 significant
// bits, an error 2^-9 relative per product where this has 2^-24), for no gain where a step
// streams the weights from memory, which is what bounds a one-row step.
//
// Form: matmul.cc's dot form. Output rows in contiguous ranges over the threads, MO = 4 rows
// of W streamed together (the next 4 prefetched), each weight vector widened once and dotted
// with NB rows of x (NB accumulators a weight row); the helper lingers after one-row calls.
// The widening: AVX-512 vcvtph2ps / vpmovzxwd + vpslld of 16 values, AVX2 with F16C the same
// of 8, elsewhere scalar conversions (simd.h) into a vector.

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "simd.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace tl {
namespace {

constexpr int64_t kHalfMaxRows = 64;  // as TlGemv: more rows run XLA's dot of the widened weights
constexpr int kHalfMO = 4;
constexpr int kHalfNB = kRegs >= 32 ? 4 : 2;

// kLanes weights at p widened to float32 (KIND 0: IEEE half, 1: bfloat16).
template <int KIND>
inline vf widen(const uint16_t* p) {
#if TL_LANES == 16
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  // The zero-masked forms: GCC 12's plain ones warn of their undefined pass-through operand.
  if constexpr (KIND == 0) return reinterpret_cast<vf>(_mm512_maskz_cvtph_ps(0xffff, h));
  return reinterpret_cast<vf>(_mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16));
#elif TL_LANES == 8 && defined(__AVX2__) && defined(__F16C__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (KIND == 0) return reinterpret_cast<vf>(_mm256_cvtph_ps(h));
  return reinterpret_cast<vf>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  float f[kLanes];
  for (int i = 0; i < kLanes; ++i) f[i] = KIND == 0 ? half_to_float(p[i]) : bf16_to_float(p[i]);
  return loadv(f);
#endif
}

template <int KIND>
inline float widen1(uint16_t h) {
  return KIND == 0 ? half_to_float(h) : bf16_to_float(h);
}

// Rows [n0, n0 + NB) of x against outputs [o0, o0 + MO).
template <int KIND, int NB, int MO>
inline void half_block(const float* X, int64_t K, const uint16_t* W, int64_t O, float* Y, int64_t n0, int64_t o0,
                       bool prefetch) {
  vf acc[NB][MO];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MO; ++j) acc[i][j] = vf{};
  const int64_t KV = K / kLanes * kLanes;
  const uint16_t* w = W + o0 * K;
  const float* x = X + n0 * K;
  for (int64_t k = 0; k < KV; k += kLanes) {
    if (prefetch && (k & 31) == 0)  // one 64-byte line a row every 32 weights
      for (int j = 0; j < MO; ++j) __builtin_prefetch(w + (MO + j) * K + k);
    vf wv[MO];
    for (int j = 0; j < MO; ++j) wv[j] = widen<KIND>(w + j * K + k);
    for (int i = 0; i < NB; ++i) {
      const vf xv = loadv(x + i * K + k);
      for (int j = 0; j < MO; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MO; ++j) {
      float r = hsumv(acc[i][j]);
      for (int64_t k = KV; k < K; ++k) r += x[i * K + k] * widen1<KIND>(w[j * K + k]);
      Y[(n0 + i) * O + o0 + j] = r;
    }
}

template <int KIND, int MO>
inline void half_outputs(const float* X, int64_t N, int64_t K, const uint16_t* W, int64_t O, float* Y, int64_t o0,
                         bool prefetch) {
  int64_t n = 0;
  for (; n + kHalfNB <= N; n += kHalfNB) half_block<KIND, kHalfNB, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0);
  switch (N - n) {
    case 3: half_block<KIND, 3, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0); break;
    case 2: half_block<KIND, 2, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0); break;
    case 1: half_block<KIND, 1, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0); break;
    default: break;
  }
}

template <int KIND>
void gemv_half(ffi::ThreadPool& pool, const float* X, int64_t N, int64_t K, const uint16_t* W, int64_t O, float* Y) {
  const int64_t blocks = O / kHalfMO;  // the last O % kHalfMO outputs one by one
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), blocks / 4));
  parallel_for(pool, tasks, [&](int64_t task) {
    const int64_t b0 = blocks * task / tasks, b1 = blocks * (task + 1) / tasks;
    for (int64_t b = b0; b < b1; ++b) half_outputs<KIND, kHalfMO>(X, N, K, W, O, Y, kHalfMO * b, b + 1 < b1);
    if (task == tasks - 1)
      for (int64_t o = kHalfMO * blocks; o < O; ++o) half_outputs<KIND, 1>(X, N, K, W, O, Y, o, false);
  }, /*linger_after=*/N == 1);
}

ffi::Error GemvHalf(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, int32_t kind,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (kind != 0 && kind != 1) return ffi::Error::InvalidArgument("kind is 0 (f16) or 1 (bf16)");
  if (xd.size() != 2 || wd.size() < 2) return ffi::Error::InvalidArgument("expected x [N,K] and w [...,2K]");
  const int64_t N = xd[0], K = xd[1];
  if (wd[wd.size() - 1] != 2 * K) return ffi::Error::InvalidArgument("w's rows are not K 16-bit weights");
  if (N > kHalfMaxRows) return ffi::Error::InvalidArgument("gemv_half takes at most 64 rows");
  const int64_t O = K > 0 ? static_cast<int64_t>(w.element_count()) / (2 * K) : 0;
  float* Y = y->typed_data();
  if (N == 0 || O == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(Y, Y + N * O, 0.0f);
    return ffi::Error::Success();
  }
  // XLA's buffers are 64-byte aligned, so the uint8 rows are 2-byte aligned uint16 rows.
  const uint16_t* W = reinterpret_cast<const uint16_t*>(w.typed_data());
  if (kind == 0)
    gemv_half<0>(pool, x.typed_data(), N, K, W, O, Y);
  else
    gemv_half<1>(pool, x.typed_data(), N, K, W, O, Y);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tl

extern "C" int64_t TlGemvHalfMaxRows() { return tl::kHalfMaxRows; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemvHalf, tl::GemvHalf,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // w [..., 2 K]: the weights' bytes
                                  .Attr<int32_t>("kind")          // 0 f16, 1 bf16
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [N, ...]
