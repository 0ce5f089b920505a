// Float32 matmuls at "high" precision on AMX as an XLA FFI custom call (matmul_precision = "high").
//
// Owns: TlGemmBf16x3 and TlAmxAvailable. Built only for targets with AMX-BF16 (-march=
// sapphirerapids); elsewhere the call answers Unimplemented and TlAmxAvailable 0. Must not:
// write anything but y. Tested by tests/kernels/test_matmul_high.py (where AMX is).
//
// y [N, O] = x [N, K] @ w^T with each float32 operand split into two bf16, a = a_hi + a_lo (a_hi
// = bf16(a), a_lo = bf16(a - a_hi)), and three bf16 products summed in float32 by AMX's
// TDPBF16PS: x_hi w_hi + x_hi w_lo + x_lo w_hi (JAX's bfloat16_3x, PyTorch's "high"). Only
// x_lo w_lo (~2^-16 of the product) is dropped; the relative error of a product is ~1e-5.
// w is packed once at load (kernels/cpu_native.py pack_bf16x3) into AMX B tiles,
// [OB][KB][hi, lo][16 k pairs][16 outputs][2]: a column block's tiles lie together in k order.
// x is split per call into A tiles laid out the same way, [NB][KB][hi, lo][16 rows][32 k], so
// every tile load reads 1 KB in a row. Each thread owns a contiguous range of column-block
// pairs and computes 2 x 2 output tiles (rows r, r+16 x columns c, c+16) over the whole of K:
// 10 tile loads for 12 TDPBF16PS per 32 k, the next k's weight tiles prefetched. Rows go in
// super-blocks whose A tiles stay within 1 MB of L2 while the weight pair's are reused across
// them.
// Measured in a standalone harness against the 4 SmolLM2 layer matrices (weights streamed from
// memory, both threads): 530-550 GFLOP/s of float32 work at 64 and 512 rows, where this file's
// float32 broadcast gemm ran the layers at ~250 within a decode step (`python -m bench kernels`
// compares them in the runner's own program).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace tl {
namespace {

struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out AMX's tile state only to processes that ask (ARCH_REQ_XCOMP_PERM for
// XTILEDATA); the answer is process-wide, asked once.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

void configure_tiles() {  // every tile 16 rows x 64 bytes
  TileConfig c{};
  c.palette = 1;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

// Rows [n0, n1) of x [N, K] into A tiles, k from K to the end of the last k block zeroed: the
// buffer is reused between calls, and stale values there (a NaN from an earlier call's input)
// would meet the weights' zero padding. Rows past N are left as they are: their outputs are
// dropped (TL_STORE_TILE).
void split_rows(const float* X, int64_t K, int64_t KB, uint16_t* A, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    uint16_t* row = A + (n / 16) * KB * 1024 + (n % 16) * 32;
    for (int64_t k = K; k < KB * 32; ++k) {
      uint16_t* t = row + (k / 32) * 1024 + (k % 32);
      t[0] = 0;
      t[512] = 0;
    }
    const float* x = X + n * K;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + k);
      const __m256i hi = (__m256i)_mm512_cvtneps_pbh(v);
      const __m512 hi_f =
          _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, hi), 16));
      const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hi_f));
      uint16_t* t = row + (k / 32) * 1024 + (k % 32);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t), hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t + 512), lo);
    }
    if (k < K) {  // the last K % 16, through a zero-padded copy
      alignas(64) float tail[16] = {};
      const int64_t m = K - k;
      std::memcpy(tail, x + k, m * sizeof(float));
      const __m512 v = _mm512_load_ps(tail);
      alignas(32) uint16_t hi[16], lo[16];
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(hi), h);
      const __m512 hi_f =
          _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, h), 16));
      _mm256_store_si256(reinterpret_cast<__m256i*>(lo), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hi_f)));
      for (int64_t j = 0; j < m; ++j) {
        uint16_t* t = row + ((k + j) / 32) * 1024 + ((k + j) % 32);
        t[0] = hi[j];
        t[512] = lo[j];
      }
    }
  }
}

// Output tile (r, c) from tile register T: straight into y where the whole tile lies inside it,
// else through a copy. (A macro: GCC's tile intrinsics take the register as a literal.)
// C tiles 0-3 (rows of A tiles 6-7 x columns of B tiles 4-5) += A x B: the 2x2 block's 4 products.
#define TL_DP_2X2()          \
  do {                       \
    _tile_dpbf16ps(0, 6, 4); \
    _tile_dpbf16ps(1, 6, 5); \
    _tile_dpbf16ps(2, 7, 4); \
    _tile_dpbf16ps(3, 7, 5); \
  } while (0)

#define TL_STORE_TILE(T, Y, N, O, r, c)                                                                    \
  do {                                                                                                     \
    if ((r) + 16 <= (N) && (c) + 16 <= (O)) {                                                              \
      _tile_stored(T, (Y) + (r) * (O) + (c), (O) * sizeof(float));                                         \
    } else {                                                                                               \
      alignas(64) float t_[256];                                                                           \
      _tile_stored(T, t_, 64);                                                                             \
      for (int64_t i = 0; i < 16 && (r) + i < (N); ++i)                                                    \
        for (int64_t j = 0; j < 16 && (c) + j < (O); ++j) (Y)[((r) + i) * (O) + (c) + j] = t_[i * 16 + j]; \
    }                                                                                                      \
  } while (0)

// Column-block pairs [p0, p1) against every row.
void bf16x3_pairs(const uint16_t* A, int64_t N, int64_t NB, const uint16_t* Wp, int64_t KB, float* Y, int64_t O,
                  int64_t p0, int64_t p1) {
  configure_tiles();
  const int64_t rows_l2 = std::max<int64_t>(2, (int64_t{1} << 20) / (KB * 2048) / 2 * 2);  // row blocks a super-block
  for (int64_t s0 = 0; s0 < NB; s0 += rows_l2) {
    const int64_t s1 = std::min(NB, s0 + rows_l2);
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* B0 = Wp + 2 * p * KB * 1024;
      const uint16_t* B1 = B0 + KB * 1024;
      for (int64_t rb = s0; rb < s1; rb += 2) {
        const uint16_t* A0 = A + rb * KB * 1024;
        const uint16_t* A1 = A0 + KB * 1024;  // NB is even: the pair's second block exists
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < KB; ++kb) {
          const uint16_t* b0 = B0 + kb * 1024;
          const uint16_t* b1 = B1 + kb * 1024;
          if (kb + 1 < KB) {
            const char* n0 = reinterpret_cast<const char*>(b0 + 1024);
            const char* n1 = reinterpret_cast<const char*>(b1 + 1024);
            for (int q = 0; q < 2048; q += 64) {
              _mm_prefetch(n0 + q, _MM_HINT_T0);
              _mm_prefetch(n1 + q, _MM_HINT_T0);
            }
          }
          const uint16_t* a0 = A0 + kb * 1024;
          const uint16_t* a1 = A1 + kb * 1024;
          _tile_loadd(4, b0, 64);  // w_hi
          _tile_loadd(5, b1, 64);
          _tile_loadd(6, a0, 64);  // x_hi
          _tile_loadd(7, a1, 64);
          TL_DP_2X2();
          _tile_loadd(6, a0 + 512, 64);  // x_lo
          _tile_loadd(7, a1 + 512, 64);
          TL_DP_2X2();
          _tile_loadd(4, b0 + 512, 64);  // w_lo
          _tile_loadd(5, b1 + 512, 64);
          _tile_loadd(6, a0, 64);  // x_hi
          _tile_loadd(7, a1, 64);
          TL_DP_2X2();
        }
        const int64_t r = rb * 16, c = 2 * p * 16;
        const int64_t c1 = c + 16, r1 = r + 16;
        TL_STORE_TILE(0, Y, N, O, r, c);
        TL_STORE_TILE(1, Y, N, O, r, c1);
        TL_STORE_TILE(2, Y, N, O, r1, c);
        TL_STORE_TILE(3, Y, N, O, r1, c1);
      }
    }
  }
  _tile_release();
}

ffi::Error GemmBf16x3(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  if (!amx_permitted()) return ffi::Error::Internal("the kernel refused AMX tile state (arch_prctl)");
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 5 || wd[2] != 2 || wd[3] != 16 || wd[4] != 32 || yd.size() < 1 || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("expected x [N,K], w [OB,KB,2,16,32] (pack_bf16x3) and y [N,...]");
  const int64_t N = xd[0], K = xd[1], OB = wd[0], KB = wd[1];
  const int64_t O = N > 0 ? static_cast<int64_t>(y->element_count()) / N : 0;
  if (OB % 2 != 0 || OB * 16 < O || KB * 32 < K || KB * 32 >= K + 32)
    return ffi::Error::InvalidArgument("packed weights do not match x's K or y's outputs");
  if (N == 0 || O == 0) return ffi::Error::Success();
  const int64_t NB = (N + 31) / 32 * 2;  // row blocks of 16, an even number
  static thread_local std::vector<uint16_t> a_tiles;
  a_tiles.resize(NB * KB * 1024);  // not cleared: split_rows writes what the real rows read
  uint16_t* A = a_tiles.data();
  const float* X = x.typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (N * K < 65536) {
    split_rows(X, K, KB, A, 0, N);
  } else {
    parallel_for(pool, threads, [&](int64_t t) { split_rows(X, K, KB, A, N * t / threads, N * (t + 1) / threads); });
  }
  const int64_t pairs = OB / 2;
  const int64_t tasks = std::min(threads, pairs);
  const uint16_t* Wp = w.typed_data();
  float* Y = y->typed_data();
  parallel_for(pool, tasks,
               [&](int64_t t) { bf16x3_pairs(A, N, NB, Wp, KB, Y, O, pairs * t / tasks, pairs * (t + 1) / tasks); });
  return ffi::Error::Success();
}

bool amx_available() { return amx_permitted(); }

}  // namespace
}  // namespace tl
#else
namespace tl {
namespace {

ffi::Error GemmBf16x3(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::U16>, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "this build of native.cc has no AMX-BF16 (cpu_native.amx_available())");
}

bool amx_available() { return false; }

}  // namespace
}  // namespace tl
#endif

extern "C" int64_t TlAmxAvailable() { return tl::amx_available() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemmBf16x3, tl::GemmBf16x3,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [N, K]
                                  .Arg<ffi::Buffer<ffi::U16>>()    // w packed [OB, KB, 2, 16, 32]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [N, ...]
