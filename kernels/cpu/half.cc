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
// Form: dot.h's dot form, as matmul.cc's few rows: output rows in contiguous ranges over the
// threads, 4 rows of W streamed together (the next 4 prefetched), each weight vector widened
// once and dotted with up to 4 rows of x; the helper lingers after one-row calls.
// The widening: AVX-512 vcvtph2ps / vpmovzxwd + vpslld of 16 values, AVX2 with F16C the same
// of 8, elsewhere scalar conversions (simd.h) into a vector.

#include <algorithm>
#include <cstdint>
#include <cstring>

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

constexpr int64_t kHalfMaxRows = 64;  // as TlGemv: more rows run XLA's dot of the widened weights

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

// The loader of dot.h for 16-bit weights of KIND.
template <int KIND>
struct HalfWeights {
  using T = uint16_t;
  static vf vec(const uint16_t* p) { return widen<KIND>(p); }
  static float one(uint16_t h) { return KIND == 0 ? half_to_float(h) : bf16_to_float(h); }
};

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
    dot_form<HalfWeights<0>>(pool, x.typed_data(), N, K, W, O, Y, /*linger_after=*/N == 1);
  else
    dot_form<HalfWeights<1>>(pool, x.typed_data(), N, K, W, O, Y, /*linger_after=*/N == 1);
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
