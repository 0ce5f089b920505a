// Native CPU kernels as XLA FFI custom calls: the cached part of paged attention, and matmuls
// of a few rows.
//
// Owns: (1) TlPagedAttentionCached: folding each token's keys at positions [0, start_pos of its
// sequence) into a softmax state (m, l, acc), reading the blocks of the stored cache layout
// (kernels/paged_attention.py: K [L, NB, Hk, hd, bs], V [L, NB, Hk, bs, hd]) in place, token
// ranges on the threads of XLA's intra-op pool. (2) TlGemv: y [N, O] = x [N, K] @ w [K, O] for
// N <= 16, w's rows split into contiguous ranges over the threads. (3) TlGemvInt8: the same for
// int8 weights stored [O, K] with a scale per output row (W8A8, XLA's arithmetic exactly).
// Must not: write anything but its outputs. Built and loaded by kernels/cpu_native.py; tested
// by tests/test_cpu_native.py against the jnp reference and XLA's dot.
//
// Why: XLA:CPU gathers cached blocks element by element (~3 GB/s a thread) and then runs tiny
// batched dots over the copy; here every block is read once, where it lies. And XLA:CPU runs a
// matrix-vector product on one thread (~19 GB/s of weights in a chain of dependent products);
// split by rows over both threads it streams ~21 GB/s at 1 row, 1.4-1.5x XLA at 2-4 rows.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;           // [T, Hk, G, hd], already scaled by 1/sqrt(hd)
  const float* k;           // [L, NB, Hk, hd, bs]
  const float* v;           // [L, NB, Hk, bs, hd]
  const int32_t* seq_idx;   // [T], -1 for padding
  const int32_t* start_pos; // [S]
  const int32_t* tables;    // [S, MB]
  float* m;                 // [T, Hk, G]
  float* l;                 // [T, Hk, G]
  float* acc;               // [T, Hk, G, hd]
  int64_t T, Hk, G, hd, NB, bs, S, MB, layer;
};

constexpr int64_t kMaxBlock = 64;   // block_size limit of the score buffer
constexpr int64_t kMaxHeadDim = 256;

// One block of one KV head folded into the softmax state of its G query heads. BS and HD are
// compile-time block size and head dim for the common shapes (0: runtime bs, hd), so that a
// block's scores of one query head and its output row stay in registers.
template <int64_t BS, int64_t HD>
inline void fold_block(const float* q, const float* K, const float* V, int64_t n, int64_t G, int64_t bs_rt,
                       int64_t hd_rt, float* m, float* l, float* acc) {
  const int64_t bs = BS ? BS : bs_rt;
  const int64_t hd = HD ? HD : hd_rt;
  float s[kMaxBlock];
  float a[kMaxHeadDim];
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * hd;
    // K is [hd, bs]: one row of keys per dimension; four partial sums break the FMA chain.
    float s1[kMaxBlock], s2[kMaxBlock], s3[kMaxBlock];
    for (int64_t j = 0; j < bs; ++j) s[j] = s1[j] = s2[j] = s3[j] = 0.0f;
    int64_t d = 0;
    for (; d + 4 <= hd; d += 4) {
      const float* kd = K + d * bs;
      const float q0 = qg[d], q1 = qg[d + 1], q2 = qg[d + 2], q3 = qg[d + 3];
      for (int64_t j = 0; j < bs; ++j) {
        s[j] += q0 * kd[j];
        s1[j] += q1 * kd[bs + j];
        s2[j] += q2 * kd[2 * bs + j];
        s3[j] += q3 * kd[3 * bs + j];
      }
    }
    for (; d < hd; ++d)
      for (int64_t j = 0; j < bs; ++j) s[j] += qg[d] * K[d * bs + j];
    for (int64_t j = 0; j < bs; ++j) s[j] += (s1[j] + s2[j]) + s3[j];
    float bm = s[0];
    for (int64_t j = 1; j < n; ++j) bm = std::max(bm, s[j]);
    const float mn = std::max(m[g], bm);
    const float corr = std::exp(m[g] - mn);  // 0 on the first block (m = -inf)
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - mn);
      sum += s[j];
    }
    l[g] = l[g] * corr + sum;
    m[g] = mn;
    float* ag = acc + g * hd;
    for (int64_t x = 0; x < hd; ++x) a[x] = ag[x] * corr;
    for (int64_t j = 0; j < n; ++j) {  // V is [bs, hd]
      const float w = s[j];
      const float* vj = V + j * hd;
      for (int64_t x = 0; x < hd; ++x) a[x] += w * vj[x];
    }
    for (int64_t x = 0; x < hd; ++x) ag[x] = a[x];
  }
}

// One token: every KV head over the cached blocks of its sequence, block by block (a block's
// heads lie together: one contiguous run of K and one of V), the next block prefetched.
template <int64_t BS, int64_t HD>
void fold_token(const Problem& p, int64_t t) {
  const int64_t G = p.G, Hk = p.Hk;
  const int64_t bs = BS ? BS : p.bs;
  const int64_t hd = HD ? HD : p.hd;
  float* m = p.m + t * Hk * G;
  float* l = p.l + t * Hk * G;
  float* acc = p.acc + t * Hk * G * hd;
  std::fill(m, m + Hk * G, -std::numeric_limits<float>::infinity());
  std::fill(l, l + Hk * G, 0.0f);
  std::fill(acc, acc + Hk * G * hd, 0.0f);
  const int32_t seq = p.seq_idx[t];
  if (seq < 0) return;
  const int64_t ctx = p.start_pos[seq];
  const int64_t block_floats = Hk * hd * bs;
  const float* q = p.q + t * Hk * G * hd;
  const int32_t* table = p.tables + seq * p.MB;
  const int64_t nblocks = (ctx + bs - 1) / bs;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t base = (p.layer * p.NB + table[b]) * block_floats;
    if (b + 1 < nblocks) {
      const int64_t next = (p.layer * p.NB + table[b + 1]) * block_floats;
      for (int64_t x = 0; x < block_floats; x += 16) {
        __builtin_prefetch(p.k + next + x);
        __builtin_prefetch(p.v + next + x);
      }
    }
    const int64_t n = std::min(bs, ctx - b * bs);
    for (int64_t h = 0; h < Hk; ++h) {
      fold_block<BS, HD>(q + h * G * hd, p.k + base + h * hd * bs, p.v + base + h * bs * hd, n, G, bs, hd,
                         m + h * G, l + h * G, acc + h * G * hd);
    }
  }
}

using FoldFn = void (*)(const Problem&, int64_t);

FoldFn pick(const Problem& p) {
  if (p.bs == 16 && p.hd == 64) return fold_token<16, 64>;
  if (p.bs == 16 && p.hd == 128) return fold_token<16, 128>;
  if (p.bs == 32 && p.hd == 64) return fold_token<32, 64>;
  if (p.bs == 32 && p.hd == 128) return fold_token<32, 128>;
  return fold_token<0, 0>;
}

// Runs fn(i) for i in [0, n) over the pool's threads, this thread taking part; returns when
// all are done (every helper has left: the work items live on this thread's stack). The
// waiting is a spin (the other pool thread is usually idle).
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F&& fn) {
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  std::atomic<int64_t> helpers_out{std::max<int64_t>(helpers, 0)};
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([&] {
      work();
      helpers_out.fetch_sub(1, std::memory_order_release);
    });
  }
  work();
  while (helpers_out.load(std::memory_order_acquire) > 0) std::this_thread::yield();
}

// Every table entry a token will read must name a block of the cache: a bad table is an
// error, never an out-of-bounds read.
ffi::Error check(const Problem& p) {
  if (p.bs > kMaxBlock) return ffi::Error::InvalidArgument("block_size above 64");
  if (p.hd > kMaxHeadDim) return ffi::Error::InvalidArgument("head_dim above 256");
  if (p.layer < 0) return ffi::Error::InvalidArgument("negative layer");
  for (int64_t t = 0; t < p.T; ++t) {
    const int32_t seq = p.seq_idx[t];
    if (seq < 0) continue;
    if (seq >= p.S) return ffi::Error::InvalidArgument("seq_idx out of range");
    const int64_t ctx = p.start_pos[seq];
    if (ctx < 0 || ctx > p.MB * p.bs) return ffi::Error::InvalidArgument("start_pos beyond the block table");
    for (int64_t b = 0; b * p.bs < ctx; ++b) {
      const int32_t blk = p.tables[seq * p.MB + b];
      if (blk < 0 || blk >= p.NB) return ffi::Error::InvalidArgument("block id out of range");
    }
  }
  return ffi::Error::Success();
}

ffi::Error Cached(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                  ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> seq_idx,
                  ffi::Buffer<ffi::S32> start_pos, ffi::Buffer<ffi::S32> tables,
                  ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l,
                  ffi::ResultBuffer<ffi::F32> acc) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("expected q [T,Hk,G,hd], k_cache [L,NB,Hk,hd,bs], tables [S,MB]");
  Problem p{q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), seq_idx.typed_data(),
            start_pos.typed_data(), tables.typed_data(), m->typed_data(), l->typed_data(),
            acc->typed_data(), qd[0], qd[1], qd[2], qd[3], kd[1], kd[4], td[0], td[1],
            static_cast<int64_t>(layer.typed_data()[0])};
  if (kd[2] != p.Hk || kd[3] != p.hd) return ffi::Error::InvalidArgument("cache heads or head_dim differ from q");
  const auto vd = v_cache.dimensions();
  if (vd.size() != 5 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[4] || vd[4] != kd[3])
    return ffi::Error::InvalidArgument("v_cache is not [L,NB,Hk,bs,hd] of k_cache's sizes");
  if (seq_idx.dimensions().size() != 1 || seq_idx.dimensions()[0] != p.T)
    return ffi::Error::InvalidArgument("seq_idx is not [T]");
  if (start_pos.dimensions().size() != 1 || start_pos.dimensions()[0] != p.S)
    return ffi::Error::InvalidArgument("start_pos is not [S] of the block tables' S");
  if (p.layer >= kd[0]) return ffi::Error::InvalidArgument("layer out of range");
  if (ffi::Error err = check(p); err.failure()) return err;

  // Token ranges over the pool's threads (a few per thread: padding tokens cost nothing).
  const FoldFn fold = pick(p);
  constexpr int64_t kTokens = 8;
  parallel_for(pool, (p.T + kTokens - 1) / kTokens, [&](int64_t i) {
    for (int64_t t = i * kTokens; t < std::min(p.T, (i + 1) * kTokens); ++t) fold(p, t);
  });
  return ffi::Error::Success();
}


// y [N, O] = x [N, K] @ w [K, O] for a few rows N: w's rows split into contiguous ranges over
// the threads (each streams its part of w once, front to back), partial sums added at the end.
ffi::Error Gemv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() < 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("expected x [N,K] and w [K,...]");
  const int64_t N = xd[0], K = xd[1];
  int64_t O = 1;
  for (size_t i = 1; i < wd.size(); ++i) O *= wd[i];
  if (N > 16) return ffi::Error::InvalidArgument("gemv takes at most 16 rows");
  const float* X = x.typed_data();
  const float* W = w.typed_data();
  float* Y = y->typed_data();
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), K / 16));
  std::vector<float> partial(static_cast<size_t>((tasks - 1) * N * O));
  parallel_for(pool, tasks, [&](int64_t task) {
    const int64_t k0 = K * task / tasks, k1 = K * (task + 1) / tasks;
    float* out = task == 0 ? Y : partial.data() + (task - 1) * N * O;
    std::fill(out, out + N * O, 0.0f);
    int64_t k = k0;
    for (; k + 8 <= k1; k += 8) {
      const float* w0 = W + k * O;
      for (int64_t n = 0; n < N; ++n) {
        const float* xk = X + n * K + k;
        const float x0 = xk[0], x1 = xk[1], x2 = xk[2], x3 = xk[3], x4 = xk[4], x5 = xk[5], x6 = xk[6], x7 = xk[7];
        float* a = out + n * O;
        for (int64_t o = 0; o < O; ++o)
          a[o] += (x0 * w0[o] + x1 * w0[O + o]) + (x2 * w0[2 * O + o] + x3 * w0[3 * O + o]) +
                  (x4 * w0[4 * O + o] + x5 * w0[5 * O + o]) + (x6 * w0[6 * O + o] + x7 * w0[7 * O + o]);
      }
    }
    for (; k < k1; ++k) {
      const float* w0 = W + k * O;
      for (int64_t n = 0; n < N; ++n) {
        const float x0 = X[n * K + k];
        float* a = out + n * O;
        for (int64_t o = 0; o < O; ++o) a[o] += x0 * w0[o];
      }
    }
  });
  for (int64_t t = 1; t < tasks; ++t) {
    const float* part = partial.data() + (t - 1) * N * O;
    for (int64_t i = 0; i < N * O; ++i) Y[i] += part[i];
  }
  return ffi::Error::Success();
}

// y [N, O] = x [N, K] @ (q [O, K] * scale [O])^T for a few rows N, int8 weights stored one row
// per output (tl/model/llama.py's int8 linears), with exactly the arithmetic of llama.linear's
// W8A8 path: each x row quantized to int8 by its max |x| / 127 (round half to even), an exact
// int32 dot per output, then float(acc) * x_scale * scale. Compiled without fast-math, so that
// division and the two products round as XLA's do: the result is bit for bit XLA's.
#define TL_STRICT_MATH __attribute__((optimize("no-fast-math")))

// Exact int32 dot of two int8 vectors (AVX2: widened to int16, multiply-added in pairs).
inline int32_t dot_i8(const int8_t* a, const int8_t* b, int64_t K) {
  int64_t k = 0;
  int32_t r = 0;
#if defined(__AVX2__)
  __m256i acc = _mm256_setzero_si256();
  for (; k + 16 <= K; k += 16) {
    const __m256i va = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + k)));
    const __m256i vb = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + k)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(va, vb));
  }
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  h = _mm_hadd_epi32(h, h);
  h = _mm_hadd_epi32(h, h);
  r = _mm_cvtsi128_si32(h);
#endif
  for (; k < K; ++k) r += static_cast<int32_t>(a[k]) * static_cast<int32_t>(b[k]);
  return r;
}

TL_STRICT_MATH void quantize_rows(const float* X, int64_t N, int64_t K, int8_t* xq, float* x_scale) {
  for (int64_t n = 0; n < N; ++n) {
    float mx = 0.0f;
    for (int64_t k = 0; k < K; ++k) mx = std::max(mx, std::fabs(X[n * K + k]));
    const float sc = std::max(mx, 1e-12f) / 127.0f;
    x_scale[n] = sc;
    for (int64_t k = 0; k < K; ++k) xq[n * K + k] = static_cast<int8_t>(std::nearbyint(X[n * K + k] / sc));
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
  const int64_t O = static_cast<int64_t>(q.element_count()) / K;
  if (static_cast<int64_t>(scale.element_count()) != O) return ffi::Error::InvalidArgument("scale is not [...] of q's rows");
  if (N > 16) return ffi::Error::InvalidArgument("gemv takes at most 16 rows");
  std::vector<int8_t> xq(static_cast<size_t>(N * K));
  float x_scale[16];
  quantize_rows(x.typed_data(), N, K, xq.data(), x_scale);
  const int8_t* Q = q.typed_data();
  const float* S = scale.typed_data();
  float* Y = y->typed_data();
  constexpr int64_t kRows = 256;  // output rows per task
  const int64_t tasks = (O + kRows - 1) / kRows;
  parallel_for(pool, tasks, [&](int64_t task) {
    const int64_t o0 = task * kRows, o1 = std::min(O, o0 + kRows);
    for (int64_t o = o0; o < o1; ++o) {
      const int8_t* row = Q + o * K;
      for (int64_t n = 0; n < N; ++n) {
        Y[n * O + o] = rescale(dot_i8(xq.data() + n * K, row, K), x_scale[n], S[o]);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlPagedAttentionCached, Cached,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_idx
                                  .Arg<ffi::Buffer<ffi::S32>>()   // start_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m
                                  .Ret<ffi::Buffer<ffi::F32>>()   // l
                                  .Ret<ffi::Buffer<ffi::F32>>()); // acc

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemv, Gemv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [K, ...]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [N, ...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemvInt8, GemvInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()    // q [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [...]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [N, ...]
