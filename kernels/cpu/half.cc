// Matmuls of a few rows over 16-bit float weights (a GGUF's F16 and BF16 tensors, kept as stored).
//
// Owns: TlGemvHalf, y [N, O] = x [N, K] @ W^T for W [O, 2 K] the little-endian bytes of each
// output's K weights as IEEE half (`kind` 0) or bfloat16 (`kind` 1), N <= kHalfMaxRows;
// TlGemvHalfMaxRows(kind). Must not: write anything but y. Built by kernels/cpu_build.py, called by
// kernels/cpu_native.py (`gemv_half`), tested by tests/kernels/test_cpu_native.py against float64
// products of the widened weights (and, for vdpbf16ps, of x rounded to bfloat16).
//
// Arithmetic: each weight widened to float32 exactly (a half's 11 significant bits and a
// bfloat16's 8 fit a float's 24), multiplied by x in float32 and summed in float32, lane by
// lane, then across lanes: only the products' and the sums' roundings, as the float32 kernel
// (matmul.cc). Up to kHalfMaxRows rows.
//
// bfloat16 weights where the build has AVX512-BF16 (x86-64-v4-vnni, sapphirerapids): llama.cpp's
// arithmetic for a BF16 tensor instead, any row count. x is rounded to bfloat16 once a call
// (vcvtne2ps2bf16: to nearest even, an error of at most 2^-8 relative), and vdpbf16ps adds each
// pair of products (exact in float32: 8 x 8 significant bits) to a float32 lane; 16 (row of x,
// output) lanes are then summed across by one transpose-and-add network whose tree is the same
// for every lane, so a row's result does not depend on its step's other rows. Against widening
// (16 products of 2 x 16 values a vector: 2 vcvt and 2 FMAs where this has 1 vdpbf16ps, and x
// read at 2 bytes a value), it is what makes a prompt chunk of a BF16 model run natively; a
// one-row step streams the weights either way.
//
// Form of the widening kernel: dot.h's dot form, as matmul.cc's few rows: output rows in
// contiguous ranges over the threads, 4 rows of W streamed together (the next 4 prefetched),
// each weight vector widened once and dotted with up to 4 rows of x; the helper lingers after
// one-row calls. The widening: AVX-512 vcvtph2ps / vpmovzxwd + vpslld of 16 values, AVX2 with
// F16C the same of 8, elsewhere scalar conversions (simd.h) into a vector.

#include <algorithm>
#include <cstdint>
#include <cstring>
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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TL_BF16_DOT 1
constexpr int64_t kBf16ManyRows = int64_t{1} << 16;

// x [N, K] rounded to bfloat16, each row padded with zeros to KP (a multiple of 32).
void bf16_rows(const float* X, int64_t N, int64_t K, int64_t KP, uint16_t* out) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < KP; k += 32) {
      const int64_t left = K - k;
      const __mmask16 m0 = left >= 16  ? __mmask16{0xffff}
                           : left <= 0 ? __mmask16{0}
                                       : static_cast<__mmask16>((1u << left) - 1);
      const __mmask16 m1 = left >= 32   ? __mmask16{0xffff}
                           : left <= 16 ? __mmask16{0}
                                        : static_cast<__mmask16>((1u << (left - 16)) - 1);
      const __m512 lo = _mm512_maskz_loadu_ps(m0, X + n * K + k);
      const __m512 hi = _mm512_maskz_loadu_ps(m1, X + n * K + k + 16);
      _mm512_storeu_si512(out + n * KP + k, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
}

// 16 float vectors -> one, lane c the sum of v[c]'s lanes, by the same tree for every c:
// within each 128-bit lane (l0 + l2) + (l1 + l3), then (L0 + L2) + (L1 + L3).
inline __m512 sum16(const __m512 v[16]) {
  __m512 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)
    t[k] = _mm512_add_ps(_mm512_maskz_unpacklo_ps(0xffff, v[2 * k], v[2 * k + 1]),
                         _mm512_maskz_unpackhi_ps(0xffff, v[2 * k], v[2 * k + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_maskz_unpacklo_pd(0xff, a, b)),
                         _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(0xff, a, b)));
  }
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(0xffff, u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_maskz_shuffle_f32x4(0xffff, u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_maskz_shuffle_f32x4(0xffff, w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_maskz_shuffle_f32x4(0xffff, w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Outputs [o0, o0 + mo) (mo <= MO) against rows [n0, n0 + R) of x; MO * R <= 16, lane r MO + j;
// PF: the next MO rows of W prefetched as these stream.
template <int MO, int R, bool PF>
inline void bdot_tile(const uint16_t* xb, int64_t KP, const uint16_t* W, int64_t K, int64_t O, float* Y, int64_t o0,
                      int mo, int64_t n0) {
  static_assert(MO * R <= 16, "16 lanes");
  const uint16_t* rows[MO];
  for (int j = 0; j < MO; ++j) rows[j] = W + (o0 + std::min(j, mo - 1)) * K;  // past mo: computed, not stored
  // Sixteen named accumulators, not an array: GCC kept an array of them in memory through the
  // loop (a store of each a step), which halved the rate.
  const __m512 z = _mm512_setzero_ps();
  __m512 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z, a8 = z, a9 = z, a10 = z, a11 = z, a12 = z,
         a13 = z, a14 = z, a15 = z;
  auto acc = [&](int c) __attribute__((always_inline)) -> __m512& {
    switch (c) {
      case 0: return a0;
      case 1: return a1;
      case 2: return a2;
      case 3: return a3;
      case 4: return a4;
      case 5: return a5;
      case 6: return a6;
      case 7: return a7;
      case 8: return a8;
      case 9: return a9;
      case 10: return a10;
      case 11: return a11;
      case 12: return a12;
      case 13: return a13;
      case 14: return a14;
      default: return a15;
    }
  };
  // One step of 32 inputs (the last one's weights masked; x is zero-padded to KP).
  auto step = [&](int64_t k, __mmask32 m) __attribute__((always_inline)) {
    if constexpr (PF)
      for (int j = 0; j < MO; ++j) _mm_prefetch(reinterpret_cast<const char*>(rows[j] + MO * K + k), _MM_HINT_T0);
    __m512bh w[MO];
#pragma GCC unroll 16
    for (int j = 0; j < MO; ++j) w[j] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, rows[j] + k));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + (n0 + r) * KP + k));
#pragma GCC unroll 16
      for (int j = 0; j < MO; ++j) acc(r * MO + j) = _mm512_dpbf16_ps(acc(r * MO + j), w[j], xv);
    }
  };
  const int64_t KF = K / 32 * 32;
  for (int64_t k = 0; k < KF; k += 32) step(k, ~__mmask32{0});
  if (KF < K) step(KF, static_cast<__mmask32>((1u << (K - KF)) - 1));
  const __m512 all[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};  // past MO R: zero
  alignas(64) float out[16];
  _mm512_store_ps(out, sum16(all));
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < mo; ++j) Y[(n0 + r) * O + o0 + j] = out[r * MO + j];
}

template <int MO, int R>
inline void bdot_rest(const uint16_t* xb, int64_t KP, const uint16_t* W, int64_t K, int64_t O, float* Y, int64_t o0,
                      int mo, int64_t n0, int64_t left) {
  if constexpr (R > 0) {
    if (left == R) return bdot_tile<MO, R, false>(xb, KP, W, K, O, Y, o0, mo, n0);
    bdot_rest<MO, R - 1>(xb, KP, W, K, O, Y, o0, mo, n0, left);
  }
}

// Outputs [o0, o1) in tiles of MO against every row of x, R rows a tile (the rest in one).
template <int MO, int R>
void bdot_outputs(const uint16_t* xb, int64_t KP, int64_t N, const uint16_t* W, int64_t K, int64_t O, float* Y,
                  int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; o += MO) {
    const int mo = static_cast<int>(std::min<int64_t>(MO, o1 - o));
    int64_t n = 0;
    for (; n + R <= N; n += R) {
      if (n == 0 && o + 2 * MO <= o1)
        bdot_tile<MO, R, true>(xb, KP, W, K, O, Y, o, mo, n);
      else
        bdot_tile<MO, R, false>(xb, KP, W, K, O, Y, o, mo, n);
    }
    if (n < N) bdot_rest<MO, R - 1>(xb, KP, W, K, O, Y, o, mo, n, N - n);
  }
}

void bdot(ffi::ThreadPool& pool, const float* X, int64_t N, int64_t K, const uint16_t* W, int64_t O, float* Y) {
  const int64_t KP = (K + 31) / 32 * 32;
  thread_local std::vector<uint16_t> xb;
  xb.resize(static_cast<size_t>(N * KP));
  bf16_rows(X, N, K, KP, xb.data());
  const uint16_t* xp = xb.data();  // not xb in the tasks: a thread_local names each thread's own
  // Ranges of whole tiles of 16 outputs over the threads (more tasks than threads past a few
  // rows: the threads take them as they finish).
  const int64_t tiles = (O + 15) / 16;
  const int64_t tasks =
      std::max<int64_t>(1, std::min<int64_t>(tiles, N == 1 ? pool.num_threads() : 8 * pool.num_threads()));
  parallel_for(
      pool, tasks,
      [&](int64_t task) {
        const int64_t a = std::min(O, 16 * (tiles * task / tasks)), b = std::min(O, 16 * (tiles * (task + 1) / tasks));
        if (N == 1)
          bdot_outputs<16, 1>(xp, KP, N, W, K, O, Y, a, b);
        else if (N <= 3)
          bdot_outputs<8, 2>(xp, KP, N, W, K, O, Y, a, b);
        else
          bdot_outputs<4, 4>(xp, KP, N, W, K, O, Y, a, b);
      },
      /*linger_after=*/N == 1);
}
#endif

// The rows a call of `kind` takes: any count for bfloat16 where vdpbf16ps runs it.
int64_t max_rows(int32_t kind) {
#if defined(TL_BF16_DOT)
  if (kind == 1) return kBf16ManyRows;
#endif
  (void)kind;
  return kHalfMaxRows;
}

ffi::Error GemvHalf(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, int32_t kind,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (kind != 0 && kind != 1) return ffi::Error::InvalidArgument("kind is 0 (f16) or 1 (bf16)");
  if (xd.size() != 2 || wd.size() < 2) return ffi::Error::InvalidArgument("expected x [N,K] and w [...,2K]");
  const int64_t N = xd[0], K = xd[1];
  if (wd[wd.size() - 1] != 2 * K) return ffi::Error::InvalidArgument("w's rows are not K 16-bit weights");
  if (N > max_rows(kind)) return ffi::Error::InvalidArgument("gemv_half takes at most max_rows(kind) rows");
  const int64_t O = K > 0 ? static_cast<int64_t>(w.element_count()) / (2 * K) : 0;
  float* Y = y->typed_data();
  if (N == 0 || O == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(Y, Y + N * O, 0.0f);
    return ffi::Error::Success();
  }
  // XLA's buffers are 64-byte aligned, so the uint8 rows are 2-byte aligned uint16 rows.
  const uint16_t* W = reinterpret_cast<const uint16_t*>(w.typed_data());
#if defined(TL_BF16_DOT)
  if (kind == 1) {
    bdot(pool, x.typed_data(), N, K, W, O, Y);
    return ffi::Error::Success();
  }
#endif
  if (kind == 0)
    dot_form<HalfWeights<0>>(pool, x.typed_data(), N, K, W, O, Y, /*linger_after=*/N == 1);
  else
    dot_form<HalfWeights<1>>(pool, x.typed_data(), N, K, W, O, Y, /*linger_after=*/N == 1);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tl

extern "C" int64_t TlGemvHalfMaxRows(int32_t kind) { return tl::max_rows(kind); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemvHalf, tl::GemvHalf,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [N, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // w [..., 2 K]: the weights' bytes
                                  .Attr<int32_t>("kind")           // 0 f16, 1 bf16
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [N, ...]
