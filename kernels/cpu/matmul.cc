// Float32 and int8 matmuls of a few rows as XLA FFI custom calls.
//
// Owns: TlGemv, y [N, O] = x [N, K] @ w^T for w [O, K] (one row of K weights per output: how
// every float linear is stored, tl/model/llama.py) and N <= gemm_max_rows(); TlGemvInt8, the
// same for one row of int8 weights with a scale per output (W8A8, XLA's arithmetic exactly);
// TlGemvMaxRows. Must not: write anything but y. Built by kernels/cpu_build.py, called by
// kernels/cpu_native.py, tested by tests/test_cpu_native.py against float64 products and
// XLA's int8 dot; which row counts run here rather than on XLA's dot is measured at start-up
// (kernels/verdicts.py), per CPU.
//
// Why: XLA:CPU runs a matrix-vector product on one thread, and a few-row product far below
// the FMA units' rate (on a 2-core EPYC with AVX2, the 30 SmolLM2 layers' matmuls ran at 16
// GFLOP/s at 4 rows and 101 at 64, against ~150 for a large GEMM).
//
// Two forms, blocked for the target's registers (simd.h):
// - dot form (N <= kDotMaxRows): output rows split into contiguous ranges over the threads,
//   each streaming its part of w front to back, MO outputs at a time (their rows read
//   together, the next MO rows prefetched as they go), x rows in blocks of NB against them:
//   NB x MO dot products accumulate in registers, reduced across lanes at the end.
// - broadcast form (more rows): x's rows are packed once a call, C = kLanes * J rows side by
//   side per k (XP [tiles][K][C], zero-padded), and each weight w[o,k] is broadcast against C
//   rows at once: RO outputs x J vectors of rows in registers, so a k costs J loads and RO
//   broadcasts for RO * J multiply-adds, no lane reduction. w stays in its [O, K] layout (RO
//   rows streamed together, the next RO prefetched), its RO rows reused from L1 across the
//   row tiles.
// On AVX-512 (32 registers of 16 floats) the dot form is 4 x 4 and the broadcast form 6 x 4
// (64 rows), 8 x 3 (48) or 12 x 2 (32), measured on the 30 SmolLM2 layers' matmuls on one
// thread: at 64 rows 6x4 ran 1.39x the dot form (106 vs 77 GFLOP/s), 12x2 at 32 rows 1.35x;
// 8x3, 5x4, 24x1 and a weight panel packed per call were slower. With 16 registers (AVX2,
// SSE2) the dot form is 2 x 4 and the broadcast form 6 x 2 (15 registers).

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

constexpr int64_t kGemmRows = 64;            // the most rows TlGemv takes (at 96 and 128 XLA's dot was as fast, AVX-512)
#if TL_LANES == 16
constexpr int64_t kDotMaxRows = 16;
#else
constexpr int64_t kDotMaxRows = 4;
#endif

// One row of x: each output's weights read front to back (4 accumulators break the FMA chain),
// so a thread's range of w is one linear stream. (Reading 4 rows of w at once, as the dot
// form does, streamed 17-19 GB/s where this read 19-22, the memory's rate, on a 2-core EPYC
// with AVX2: a standalone harness over 425 MB of [3072, 576] and [576, 576] matrices.)
void row_outputs(const float* x, int64_t K, const float* W, float* y, int64_t o0, int64_t o1) {
  constexpr int64_t U = 4 * kLanes;
  const int64_t KU = K / U * U, KV = K / kLanes * kLanes;
  for (int64_t o = o0; o < o1; ++o) {
    const float* w = W + o * K;
    vf a0{}, a1{}, a2{}, a3{};
    for (int64_t k = 0; k < KU; k += U) {
      a0 += loadv(x + k) * loadv(w + k);
      a1 += loadv(x + k + kLanes) * loadv(w + k + kLanes);
      a2 += loadv(x + k + 2 * kLanes) * loadv(w + k + 2 * kLanes);
      a3 += loadv(x + k + 3 * kLanes) * loadv(w + k + 3 * kLanes);
    }
    for (int64_t k = KU; k < KV; k += kLanes) a0 += loadv(x + k) * loadv(w + k);
    float r = hsumv((a0 + a1) + (a2 + a3));
    for (int64_t k = KV; k < K; ++k) r += x[k] * w[k];
    y[o] = r;
  }
}

void dot_rows(ffi::ThreadPool& pool, const float* X, int64_t N, int64_t K, const float* W, int64_t O, float* Y) {
  if (N == 1) {
    const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), O / 16));
    parallel_for(pool, tasks, [&](int64_t task) { row_outputs(X, K, W, Y, O * task / tasks, O * (task + 1) / tasks); },
                 /*linger_after=*/true);
    return;
  }
  dot_form<FloatWeights>(pool, X, N, K, W, O, Y, /*linger_after=*/false);
}

template <int RO, int J>
inline void gemm_tile(const float* xp, int64_t K, const float* W, float* Y, int64_t O, int64_t N,
                      int64_t o0, int64_t n0, bool prefetch) {
  constexpr int C = kLanes * J;
  vf acc[RO][J];
  for (int i = 0; i < RO; ++i)
    for (int j = 0; j < J; ++j) acc[i][j] = vf{};
  const float* w = W + o0 * K;
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch && (k & 15) == 0)
      for (int i = 0; i < RO; ++i) __builtin_prefetch(w + (RO + i) * K + k);
    vf b[J];
    for (int j = 0; j < J; ++j) b[j] = loadv(xp + k * C + kLanes * j);
    for (int i = 0; i < RO; ++i) {
      const vf a = splatv(w[i * K + k]);
      for (int j = 0; j < J; ++j) acc[i][j] += a * b[j];
    }
  }
  for (int j = 0; j < J; ++j) {
    const int64_t rows = std::min<int64_t>(kLanes, N - n0 - kLanes * j);
    for (int64_t l = 0; l < rows; ++l)
      for (int i = 0; i < RO; ++i) Y[(n0 + kLanes * j + l) * O + o0 + i] = acc[i][j][l];
  }
}

// Outputs [o0, o0 + RO*blocks) (then `tail` more, fewer than RO, if given) against every row tile.
template <int RO, int J>
void gemm_outputs(const float* XP, int64_t N, int64_t K, const float* W, int64_t O, float* Y, int64_t o0,
                  int64_t blocks, int64_t tail) {
  constexpr int C = kLanes * J;
  const int64_t tiles = (N + C - 1) / C;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t t = 0; t < tiles; ++t)
      gemm_tile<RO, J>(XP + t * K * C, K, W, Y, O, N, o0 + RO * b, C * t, t == 0 && b + 1 < blocks);
  const int64_t o = o0 + RO * blocks;
  for (int64_t t = 0; t < tiles; ++t) {
    const float* xp = XP + t * K * C;
    for (int64_t r = 0; r < tail; ++r) gemm_tile<1, J>(xp, K, W, Y, O, N, o + r, C * t, false);
  }
}

#if defined(__AVX512F__)
// r[i][j] -> r[j][i] for a 16x16 block of floats: unpack pairs of floats, then of float pairs,
// then two rounds of 128-bit lane shuffles (as vector-extension shuffles: GCC 12's masked
// AVX-512 unpack intrinsics warn of their own undefined operands).
inline void transpose16(v16 r[16]) {
  v16 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
    t[2 * i + 1] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30,
                                           15, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const v16 a = t[4 * i], b = t[4 * i + 1], c = t[4 * i + 2], d = t[4 * i + 3];
    r[4 * i] = __builtin_shufflevector(a, c, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    r[4 * i + 1] = __builtin_shufflevector(a, c, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    r[4 * i + 2] = __builtin_shufflevector(b, d, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    r[4 * i + 3] = __builtin_shufflevector(b, d, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  // Lanes (a0, a2, b0, b2) and (a1, a3, b1, b3) of two vectors (vshuff32x4 0x88 and 0xdd).
  auto even = [](v16 a, v16 b) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  };
  auto odd = [](v16 a, v16 b) {
    return __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  };
  for (int i = 0; i < 4; ++i) {
    t[i] = even(r[i], r[4 + i]);
    t[4 + i] = odd(r[i], r[4 + i]);
    t[8 + i] = even(r[8 + i], r[12 + i]);
    t[12 + i] = odd(r[8 + i], r[12 + i]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = even(t[i], t[8 + i]);
    r[8 + i] = odd(t[i], t[8 + i]);
    r[4 + i] = even(t[4 + i], t[12 + i]);
    r[12 + i] = odd(t[4 + i], t[12 + i]);
  }
}
#elif defined(__AVX2__)
// r[i][j] -> r[j][i] for an 8x8 block of floats.
inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}
#endif

// The transposable square of the target: W x W floats in W vectors (AVX-512: 16 x 16, AVX2:
// 8 x 8); none elsewhere (pack_rows' scalar loop then does it all).
#if defined(__AVX512F__)
#define TL_HAVE_SQUARE 1
struct Square {
  static constexpr int64_t W = 16;
  using V = v16;
  static V load(const float* p) { return load16(p); }
  static V zero() { return v16{}; }
  static void store(float* p, V v) { store16(p, v); }
  static void transpose(V* r) { transpose16(r); }
};
#elif defined(__AVX2__)
#define TL_HAVE_SQUARE 1
struct Square {
  static constexpr int64_t W = 8;
  using V = __m256;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V zero() { return _mm256_setzero_ps(); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void transpose(V* r) { transpose8(r); }
};
#endif

// X [N,K] -> XP [tiles][K][C]: row n of tile t in lane n - t*C of each k's C floats, rows past
// N zero. (A scalar transpose was 5% of a 64-row chain of the 30 layers' matmuls, AVX-512.)
void pack_rows(const float* X, int64_t N, int64_t K, int64_t C, float* XP) {
  const int64_t tiles = (N + C - 1) / C;
  int64_t k0 = 0;
#if defined(TL_HAVE_SQUARE)
  constexpr int64_t W = Square::W;
  for (; k0 + W <= K; k0 += W)
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t c0 = 0; c0 < C; c0 += W) {
        Square::V r[W];
        for (int64_t i = 0; i < W; ++i) {
          const int64_t n = t * C + c0 + i;
          r[i] = n < N ? Square::load(X + n * K + k0) : Square::zero();
        }
        Square::transpose(r);
        for (int64_t i = 0; i < W; ++i) Square::store(XP + (t * K + k0 + i) * C + c0, r[i]);
      }
#endif
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t k = k0; k < K; ++k)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t n = t * C + c;
        XP[(t * K + k) * C + c] = n < N ? X[n * K + k] : 0.0f;
      }
}

template <int RO, int J>
void broadcast_form(ffi::ThreadPool& pool, const float* X, int64_t N, int64_t K, const float* W, int64_t O,
                    float* Y) {
  constexpr int C = kLanes * J;
  std::vector<float> xp(static_cast<size_t>((N + C - 1) / C * K * C));
  pack_rows(X, N, K, C, xp.data());
  const int64_t blocks = O / RO;  // of RO outputs; the last O % RO go with the last task
  // One contiguous range a thread: 8 ranges a thread, taken as they come, ran the 30 layers'
  // matmuls 1.14-1.17x XLA at 64 rows against 1.24-1.29x (1.25-1.30 against 1.44-1.46 at 32).
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), blocks));
  parallel_for(pool, tasks, [&](int64_t task) {
    const int64_t b0 = blocks * task / tasks, b1 = blocks * (task + 1) / tasks;
    gemm_outputs<RO, J>(xp.data(), N, K, W, O, Y, RO * b0, b1 - b0, task == tasks - 1 ? O - RO * blocks : 0);
  });
}

void gemm(ffi::ThreadPool& pool, const float* X, int64_t N, int64_t K, const float* W, int64_t O, float* Y) {
  if (N <= kDotMaxRows) return dot_rows(pool, X, N, K, W, O, Y);
#if TL_LANES == 16
  if (N > 48) return broadcast_form<6, 4>(pool, X, N, K, W, O, Y);  // tiles of 64, 48, 32 rows: the smallest N fills
  if (N > 32) return broadcast_form<8, 3>(pool, X, N, K, W, O, Y);
  return broadcast_form<12, 2>(pool, X, N, K, W, O, Y);
#elif defined(__aarch64__)
  return broadcast_form<6, 4>(pool, X, N, K, W, O, Y);  // 32 registers of 4 floats: tiles of 16 rows
#else
  return broadcast_form<6, 2>(pool, X, N, K, W, O, Y);  // 16 registers: 12 accumulators, tiles of 2 vectors
#endif
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

ffi::Error GemvInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  if (xd.size() != 2 || qd.size() < 2 || xd[1] != qd[qd.size() - 1])
    return ffi::Error::InvalidArgument("expected x [N,K] and q [...,K]");
  const int64_t N = xd[0], K = xd[1];
  if (K < 1) return ffi::Error::InvalidArgument("q has no columns");
  const int64_t O = static_cast<int64_t>(q.element_count()) / K;
  if (static_cast<int64_t>(scale.element_count()) != O) return ffi::Error::InvalidArgument("scale is not [...] of q's rows");
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
  parallel_for(pool, tasks, [&](int64_t task) {
    for (int64_t o = O * task / tasks; o < O * (task + 1) / tasks; ++o) {
      const int8_t* row = Q + o * K;
      for (int64_t n = 0; n < N; ++n) Y[n * O + o] = rescale(dot_i8(xq.data() + n * K, row, K), x_scale[n], S[o]);
    }
  }, /*linger_after=*/N == 1);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace tl

extern "C" int64_t TlGemvMaxRows() { return tl::kGemmRows; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemv, tl::Gemv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [..., K]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [N, ...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemvInt8, tl::GemvInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()    // q [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [...]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [N, ...]
