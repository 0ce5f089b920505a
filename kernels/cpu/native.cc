// Native CPU kernels as XLA FFI custom calls: the cached and the local part of paged attention,
// and matmuls of up to 64 rows.
//
// Owns: (1) TlPagedAttentionCached: folding each token's keys at positions [0, start_pos of its
// sequence) into a softmax state (m, l, acc), reading the blocks of the stored cache layout
// (kernels/paged_attention.py: K [L, NB, Hk, hd, bs], V [L, NB, Hk, bs, hd]) in place, token
// ranges on the threads of XLA's intra-op pool; float32 caches, or bf16 bits (the ...Bf16
// targets, vector-fold shapes only). (2) TlGemv: y [N, O] = x [N, K] @ w^T, w [O, K],
// for N <= 64 (dot products up to 16 rows, a broadcast form beyond), w's rows (one per output)
// split into contiguous ranges over the threads.
// (3) TlGemvInt8: the same for int8 weights stored [O, K] with a scale per output row (W8A8,
// XLA's arithmetic exactly). (4) TlLocalAttention: the softmax state of each token over this
// step's own keys (same sequence, causal), tiles of query tokens x KV head on the pool's
// threads. (5) TlArgmaxLse: each logits row's first argmax and log-sum-exp, rows on the threads.
// (6) TlSmallAttention: both parts of attention, merged and normalised, in one call for steps
// of a few tokens, (token, KV head) items on the threads.
// Must not: write anything but its outputs. Built and loaded by kernels/cpu_native.py; tested
// by tests/test_cpu_native.py against the jnp reference, XLA's dot and jnp's argmax/logsumexp.
//
// Why: XLA:CPU gathers cached blocks element by element (~3 GB/s a thread) and then runs tiny
// batched dots over the copy; here every block is read once, where it lies. XLA:CPU runs a
// matrix-vector product on one thread; split by output rows over both threads the 30 SmolLM2
// layers' matmuls run 1.27x XLA at 1 row, 1.5-2.2x at 2-16 rows and 1.27-1.57x at 32-64 rows
// (`python -m bench kernels`).
// And XLA:CPU runs the elementwise passes of a masked softmax, argmax and logsumexp on one
// thread.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNoScore = -1e30f;  // a masked score (finite: built with -ffast-math)

// ---- 16-float vectors (GCC vector extensions: zmm with AVX-512, pairs of ymm with AVX2) -------

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned load/store
typedef int32_t i16v __attribute__((vector_size(64)));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
// 16 bf16 values (a bf16 KV cache's uint16 bits) widened to floats: bf16 is a float's top half.
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
inline v16 load16(const uint16_t* p) {
  return (v16)(__builtin_convertvector(*reinterpret_cast<const u16x16*>(p), u32x16) << 16);
}
inline void store16(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline v16 splat(float x) { return v16{} + x; }

inline float hmax(v16 x) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(x);
#else
  float r = x[0];
  for (int i = 1; i < 16; ++i) r = std::max(r, x[i]);
  return r;
#endif
}
inline float hsum(v16 x) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(x);
#else
  float r = 0.0f;
  for (int i = 0; i < 16; ++i) r += x[i];
  return r;
#endif
}
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

// e^x for x <= 0 (scores minus their running max), relative error ~2e-7; x below -87 gives ~0.
inline v16 vexp(v16 x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const v16 t = x * 1.44269504088896341f;
  v16 n = __builtin_convertvector(__builtin_convertvector(t, i16v), v16);  // trunc toward 0
  n = n > t ? n - 1.0f : n;                                                 // floor
  const v16 r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;  // in [0, ln 2)
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i16v e = (__builtin_convertvector(n, i16v) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// Asks for n floats from each of a and b to be brought into cache, one line at a time.
inline void prefetch_pair(const float* a, const float* b, int64_t n) {
  for (int64_t x = 0; x < n; x += 16) {
    __builtin_prefetch(a + x);
    __builtin_prefetch(b + x);
  }
}

// KV: float, or uint16_t for a cache of bf16 bits (kv_cache_dtype = "bfloat16").
template <typename KV>
struct ProblemT {
  const float* q;           // [T, Hk, G, hd], already scaled by 1/sqrt(hd)
  const KV* k;              // [L, NB, Hk, hd, bs]
  const KV* v;              // [L, NB, Hk, bs, hd]
  const int32_t* seq_idx;   // [T], -1 for padding
  const int32_t* start_pos; // [S]
  const int32_t* tables;    // [S, MB]
  float* m;                 // [T, Hk, G]
  float* l;                 // [T, Hk, G]
  float* acc;               // [T, Hk, G, hd]
  int64_t T, Hk, G, hd, NB, bs, S, MB, layer;
};
using Problem = ProblemT<float>;

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
void fold_token(const Problem& p, int64_t t, int64_t h0, int64_t h1) {
  const int64_t G = p.G, Hk = p.Hk;
  const int64_t bs = BS ? BS : p.bs;
  const int64_t hd = HD ? HD : p.hd;
  float* m = p.m + t * Hk * G;
  float* l = p.l + t * Hk * G;
  float* acc = p.acc + t * Hk * G * hd;
  std::fill(m + h0 * G, m + h1 * G, -std::numeric_limits<float>::infinity());
  std::fill(l + h0 * G, l + h1 * G, 0.0f);
  std::fill(acc + h0 * G * hd, acc + h1 * G * hd, 0.0f);
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
      prefetch_pair(p.k + next, p.v + next, block_floats);
    }
    const int64_t n = std::min(bs, ctx - b * bs);
    for (int64_t h = h0; h < h1; ++h) {
      fold_block<BS, HD>(q + h * G * hd, p.k + base + h * hd * bs, p.v + base + h * bs * hd, n, G, bs, hd,
                         m + h * G, l + h * G, acc + h * G * hd);
    }
  }
}

// fold_token for block size 16 with the G query heads of a KV head together: per block, a row
// of 16 keys per dimension against the G queries (one vector of scores each), one vector exp
// per query head, and the G x HV accumulator vectors kept in registers over all the blocks of
// the head. (The scalar-loop fold_block spent most of a 64-sequence step in exp and reloads.)
template <typename KV, int G, int HV>
void fold_token_vec(const ProblemT<KV>& p, int64_t t, int64_t h0, int64_t h1) {
  constexpr int64_t hd = HV * 16, bs = 16;
  const int64_t Hk = p.Hk;
  float* m_out = p.m + t * Hk * G;
  float* l_out = p.l + t * Hk * G;
  float* acc_out = p.acc + t * Hk * G * hd;
  const int32_t seq = p.seq_idx[t];
  const int64_t ctx = seq < 0 ? 0 : p.start_pos[seq];
  const int64_t nblocks = (ctx + bs - 1) / bs;
  const int32_t* table = seq < 0 ? nullptr : p.tables + seq * p.MB;
  const int64_t block_floats = Hk * hd * bs;
  const i16v iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t h = h0; h < h1; ++h) {
    const float* q = p.q + (t * Hk + h) * G * hd;
    v16 acc[G][HV];
    float m[G], l[G];
    for (int g = 0; g < G; ++g) {
      m[g] = kNoScore;
      l[g] = 0.0f;
      for (int x = 0; x < HV; ++x) acc[g][x] = v16{};
    }
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t base = (p.layer * p.NB + table[b]) * block_floats + h * hd * bs;
      const KV* K = p.k + base;  // [hd, bs]
      const KV* V = p.v + base;  // [bs, hd]
      // The next block of this head (or the first of the next head) is prefetched a line of K
      // and a line of V per key dimension, spread over the score loop: K and V of a head's
      // block are hd lines each, one per dimension (bs = 16 floats a line). A burst of all of
      // them at the block's start ran 1.10-1.14x slower (one thread, 64 sequences x 256
      // random blocks x 30 layers: 73-75 vs 80-85 ms; 2-8 blocks ahead was no better). A bf16
      // block is half the lines: one per two dimensions.
      const KV* Kn = nullptr;
      const KV* Vn = nullptr;
      if (b + 1 < nblocks || (h + 1 < h1 && nblocks > 0)) {
        const int64_t nb = b + 1 < nblocks ? table[b + 1] : table[0];
        const int64_t nh = b + 1 < nblocks ? h : h + 1;
        const int64_t next = (p.layer * p.NB + nb) * block_floats + nh * hd * bs;
        Kn = p.k + next;
        Vn = p.v + next;
      }
      v16 s[G];
      for (int g = 0; g < G; ++g) s[g] = v16{};
      for (int64_t d = 0; d < hd; ++d) {
        if (Kn != nullptr && (sizeof(KV) == 4 || (d & 1) == 0)) {
          __builtin_prefetch(Kn + d * bs);
          __builtin_prefetch(Vn + d * bs);
        }
        const v16 kd = load16(K + d * bs);
        for (int g = 0; g < G; ++g) s[g] += q[g * hd + d] * kd;
      }
      const int32_t n = static_cast<int32_t>(std::min(bs, ctx - b * bs));
      const auto valid = iota < n;
      alignas(64) float pr[G][16];
      for (int g = 0; g < G; ++g) {
        const v16 sc = valid ? s[g] : splat(kNoScore);
        const float mn = std::max(m[g], hmax(sc));
        const float corr = std::exp(m[g] - mn);
        const v16 e = valid ? vexp(sc - mn) : v16{};
        l[g] = l[g] * corr + hsum(e);
        m[g] = mn;
        for (int x = 0; x < HV; ++x) acc[g][x] *= corr;
        store16(pr[g], e);
      }
      for (int32_t j = 0; j < n; ++j) {
        v16 vv[HV];
        for (int x = 0; x < HV; ++x) vv[x] = load16(V + j * hd + 16 * x);
        for (int g = 0; g < G; ++g)
          for (int x = 0; x < HV; ++x) acc[g][x] += pr[g][j] * vv[x];
      }
    }
    for (int g = 0; g < G; ++g) {
      // No cached key: m = -inf, l = 0 (the merge with the local part then ignores this part).
      m_out[h * G + g] = nblocks ? m[g] : -std::numeric_limits<float>::infinity();
      l_out[h * G + g] = l[g];
      for (int x = 0; x < HV; ++x) store16(acc_out + (h * G + g) * hd + 16 * x, acc[g][x]);
    }
  }
}

template <typename KV>
using FoldFnT = void (*)(const ProblemT<KV>&, int64_t, int64_t, int64_t);  // (problem, token, heads [h0, h1))
using FoldFn = FoldFnT<float>;

FoldFn pick_scalar(const Problem& p) {
  if (p.bs == 16 && p.hd == 64) return fold_token<16, 64>;
  if (p.bs == 16 && p.hd == 128) return fold_token<16, 128>;
  if (p.bs == 32 && p.hd == 64) return fold_token<32, 64>;
  if (p.bs == 32 && p.hd == 128) return fold_token<32, 128>;
  return fold_token<0, 0>;
}

// The fold for these shapes; for a bf16 cache only the vector folds exist, and nullptr
// elsewhere (kernels/cpu_native.py: bf16_supported, which keeps such shapes on the reference).
template <typename KV>
FoldFnT<KV> pick(const ProblemT<KV>& p) {
  if (p.bs == 16 && p.hd == 64 && p.G >= 1 && p.G <= 4) {
    switch (p.G) {
      case 1: return fold_token_vec<KV, 1, 4>;
      case 2: return fold_token_vec<KV, 2, 4>;
      case 3: return fold_token_vec<KV, 3, 4>;
      default: return fold_token_vec<KV, 4, 4>;
    }
  }
  if (p.bs == 16 && p.hd == 128 && (p.G == 1 || p.G == 2))
    return p.G == 1 ? fold_token_vec<KV, 1, 8> : fold_token_vec<KV, 2, 8>;
  if constexpr (!std::is_same_v<KV, float>) {
    return nullptr;
  } else {
    return pick_scalar(p);
  }
}

// Runs fn(i) for i in [0, n) over the pool's threads, this thread taking part; returns when
// all are done (every helper has left: the work items live on this thread's stack). The
// waiting is a spin (the other pool thread is usually idle).
//
// Lingering helpers. A one-token decode step is a dependent chain of ~120 small matmuls with
// small serial ops between them; a pool thread that has gone to sleep takes tens of
// microseconds to wake, and the caller's half of the matmul then waits for it (in a chain of
// the 30 layers' matmuls with attention between them, the attention cost 2.3 ms where alone it
// costs 0.9). So a helper that ran a `linger` job stays, spinning on a slot, for up to
// g_linger_ns (50 us) after it, and the next parallel_for hands its work to the spinning helper with one
// atomic store instead of a pool wake-up. Slot states: kFree (no helper), kIdle (a helper
// spins), kClaimed (a caller is posting), kWork (posted). Only a caller that moves kIdle ->
// kClaimed may post; only the slot's helper moves kIdle -> kFree, so no work is lost.
// The cost: a lingering helper holds a thread of XLA's pool, so pool work of XLA's own can wait
// up to g_linger_ns for it (with two programs running at once and a 1 ms linger, a test chain
// ran 50x slower); hence one-row matmuls only, where the ops around them run on one thread, and
// a short linger.
struct Job {
  void (*run)(void*);
  void* ctx;
  std::atomic<int64_t>* out;  // decremented when the helper has finished run(ctx)
};

struct alignas(64) Slot {
  std::atomic<int> state{0};
  Job job{};
};

enum : int { kFree = 0, kIdle = 1, kClaimed = 2, kWork = 3 };
constexpr int64_t kSlots = 64;
std::atomic<int64_t> g_linger_ns{50000};  // TlSetLingerNs: benchmarks compare values, 0 = off
Slot g_slots[kSlots];

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// After a linger job: own `slot` (if no helper does) and run what is posted there until
// g_linger_ns pass with nothing posted.
void linger(Slot& slot) {
  const int64_t linger_ns = g_linger_ns.load(std::memory_order_relaxed);
  int expected = kFree;
  if (linger_ns <= 0 || !slot.state.compare_exchange_strong(expected, kIdle, std::memory_order_acq_rel)) return;
  int64_t deadline = now_ns() + linger_ns;
  for (uint32_t spins = 0;; ++spins) {  // unsigned: wraps, never overflows
    const int s = slot.state.load(std::memory_order_acquire);
    if (s == kWork) {
      const Job job = slot.job;
      job.run(job.ctx);
      job.out->fetch_sub(1, std::memory_order_release);
      slot.state.store(kIdle, std::memory_order_release);
      deadline = now_ns() + linger_ns;
      continue;
    }
    cpu_relax();
    if (s == kIdle && (spins & 63) == 0 && now_ns() > deadline) {
      expected = kIdle;
      if (slot.state.compare_exchange_strong(expected, kFree, std::memory_order_acq_rel)) return;
    }
  }
}

template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F&& fn, bool linger_after = false) {
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  std::atomic<int64_t> helpers_out{std::max<int64_t>(helpers, 0)};
  const Job job{[](void* w) { (*static_cast<decltype(work)*>(w))(); }, &work, &helpers_out};
  for (int64_t h = 0; h < helpers; ++h) {
    Slot* slot = h < kSlots ? &g_slots[h] : nullptr;  // helpers past the slots neither linger nor are posted to
    int expected = kIdle;
    if (slot != nullptr && slot->state.compare_exchange_strong(expected, kClaimed, std::memory_order_acq_rel)) {
      slot->job = job;
      slot->state.store(kWork, std::memory_order_release);
      continue;
    }
    pool.Schedule([job, slot, linger_after] {
      job.run(job.ctx);
      job.out->fetch_sub(1, std::memory_order_release);
      if (linger_after && slot != nullptr) linger(*slot);
    });
  }
  work();
  while (helpers_out.load(std::memory_order_acquire) > 0) std::this_thread::yield();
}

// Every table entry a token will read must name a block of the cache: a bad table is an
// error, never an out-of-bounds read.
template <typename KV>
ffi::Error check(const ProblemT<KV>& p) {
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

// The cached part's Problem over these buffers (m, l, acc: where its state goes), every shape
// and table entry checked: a mismatch is an error, never an out-of-bounds read.
// A bf16 cache (KVT = U16) must have a vector fold for its shapes.
template <ffi::DataType KVT>
ffi::Error cached_problem(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<KVT>& k_cache,
                          const ffi::Buffer<KVT>& v_cache, const ffi::Buffer<ffi::S32>& layer,
                          const ffi::Buffer<ffi::S32>& seq_idx, const ffi::Buffer<ffi::S32>& start_pos,
                          const ffi::Buffer<ffi::S32>& tables, float* m, float* l, float* acc,
                          ProblemT<ffi::NativeType<KVT>>& p) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("expected q [T,Hk,G,hd], k_cache [L,NB,Hk,hd,bs], tables [S,MB]");
  p = {q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), seq_idx.typed_data(),
       start_pos.typed_data(), tables.typed_data(), m, l, acc, qd[0], qd[1], qd[2], qd[3], kd[1], kd[4],
       td[0], td[1], static_cast<int64_t>(layer.typed_data()[0])};
  if (kd[2] != p.Hk || kd[3] != p.hd) return ffi::Error::InvalidArgument("cache heads or head_dim differ from q");
  const auto vd = v_cache.dimensions();
  if (vd.size() != 5 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[4] || vd[4] != kd[3])
    return ffi::Error::InvalidArgument("v_cache is not [L,NB,Hk,bs,hd] of k_cache's sizes");
  if (seq_idx.dimensions().size() != 1 || seq_idx.dimensions()[0] != p.T)
    return ffi::Error::InvalidArgument("seq_idx is not [T]");
  if (start_pos.dimensions().size() != 1 || start_pos.dimensions()[0] != p.S)
    return ffi::Error::InvalidArgument("start_pos is not [S] of the block tables' S");
  if (p.layer >= kd[0]) return ffi::Error::InvalidArgument("layer out of range");
  if (pick(p) == nullptr)
    return ffi::Error::InvalidArgument("a bf16 cache needs block_size 16 with head_dim 64 (1-4 query heads a KV head) "
                                       "or 128 (1-2)");
  return check(p);
}

template <ffi::DataType KVT>
ffi::Error Cached(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<KVT> k_cache,
                  ffi::Buffer<KVT> v_cache, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> seq_idx,
                  ffi::Buffer<ffi::S32> start_pos, ffi::Buffer<ffi::S32> tables,
                  ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l,
                  ffi::ResultBuffer<ffi::F32> acc) {
  ProblemT<ffi::NativeType<KVT>> p;
  if (ffi::Error err = cached_problem(q, k_cache, v_cache, layer, seq_idx, start_pos, tables, m->typed_data(),
                                      l->typed_data(), acc->typed_data(), p);
      err.failure())
    return err;

  // Token ranges over the pool's threads (a few per thread: padding tokens cost nothing).
  const auto fold = pick(p);
  constexpr int64_t kTokens = 8;
  parallel_for(pool, (p.T + kTokens - 1) / kTokens, [&](int64_t i) {
    for (int64_t t = i * kTokens; t < std::min(p.T, (i + 1) * kTokens); ++t) fold(p, t, 0, p.Hk);
  });
  return ffi::Error::Success();
}

// ---- The local part: every token over this step's own keys (same sequence, causal) ----------
//
// A flash-attention forward on the CPU. Tokens of a sequence are one contiguous run of the
// token axis in position order (AttnMetadata's contract, checked here), so token t's keys are
// tokens [lo(t), t] of its run. Work items are (tile of query tokens, KV head): the tile's rows
// (its tokens x the G query heads of the KV head) are scored against 64 keys at a time (4
// vectors of 16), folded into an online softmax, and only key chunks some row can see are visited (a causal 512-token
// prompt does ~half of the dense [T,T] work, a batch of decodes almost none).

struct Local {
  const float* q;       // [T, Hk, G, hd], already scaled by 1/sqrt(hd)
  const float* kt;      // [Hk, hd, Tp]: this step's keys transposed, zero beyond T
  const float* v;       // [T, Hk, hd]
  const int32_t* lo;    // [T]: first token of t's run; -1 for padding
  float* m;             // [T, Hk, G]
  float* l;             // [T, Hk, G]
  float* acc;           // [T, Hk, G, hd]
  int64_t T, Tp, Hk, G, hd, tile;
};

constexpr int64_t kLocalRows = 64;  // rows (tokens x query heads) of a tile, at most
constexpr int64_t kKeys = 64;       // keys per chunk: 4 vectors of 16
constexpr int64_t kLocalSerialPairs = 8192;  // below this many (query row, key) pairs: one thread

// Rows [r0, r0 + 4) of a tile against the KV vectors of 16 keys from key u0: scores (a row of
// transposed keys per dimension, q broadcast), masked to each row's keys, folded into the
// row's online softmax (m, l, acc rescaled); the probabilities go to P [row][kKeys].
template <int KV, int HV>
inline void score_rows(const Local& p, const float* kt, int64_t u0, int64_t r0, const float* const* qrow,
                       const int32_t* row_lo, const int32_t* row_hi, float* m, float* l, float* acc, float* P) {
  constexpr int64_t hd = HV * 16;
  const i16v iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16 s[4][KV] = {};
  const float* kd = kt + u0;
  const float *q0 = qrow[r0], *q1 = qrow[r0 + 1], *q2 = qrow[r0 + 2], *q3 = qrow[r0 + 3];
  for (int64_t d = 0; d < hd; ++d, kd += p.Tp) {
    v16 kv[KV];
    for (int c = 0; c < KV; ++c) kv[c] = load16(kd + 16 * c);
    const float a0 = q0[d], a1 = q1[d], a2 = q2[d], a3 = q3[d];
    for (int c = 0; c < KV; ++c) {
      s[0][c] += a0 * kv[c];
      s[1][c] += a1 * kv[c];
      s[2][c] += a2 * kv[c];
      s[3][c] += a3 * kv[c];
    }
  }
  for (int i = 0; i < 4; ++i) {
    const int64_t r = r0 + i;
    v16 bmv = splat(kNoScore);
    for (int c = 0; c < KV; ++c) {
      const i16v u = iota + static_cast<int32_t>(u0 + 16 * c);
      s[i][c] = (u >= row_lo[r]) & (u <= row_hi[r]) ? s[i][c] : splat(kNoScore);
      bmv = vmax(bmv, s[i][c]);
    }
    const float bm = hmax(bmv);
    float* pr = P + r * kKeys;
    if (bm <= kNoScore) {  // no key of this chunk for this row
      for (int c = 0; c < KV; ++c) store16(pr + 16 * c, v16{});
      continue;
    }
    const float mn = std::max(m[r], bm);
    const float corr = std::exp(m[r] - mn);
    v16 sum{};
    for (int c = 0; c < KV; ++c) {
      const v16 e = s[i][c] > kNoScore ? vexp(s[i][c] - mn) : v16{};
      sum += e;
      store16(pr + 16 * c, e);
    }
    l[r] = l[r] * corr + hsum(sum);
    m[r] = mn;
    if (corr != 1.0f) {
      float* a = acc + r * hd;
      for (int x = 0; x < HV; ++x) store16(a + 16 * x, load16(a + 16 * x) * corr);
    }
  }
}

// One tile of query tokens [t0, t1) and one KV head; HV = hd / 16 (a row of V is HV vectors).
template <int HV>
void local_tile(const Local& p, int64_t t0, int64_t t1, int64_t h) {
  constexpr int64_t hd = HV * 16;
  const int64_t G = p.G, Hk = p.Hk;
  const int64_t R = (t1 - t0) * G;
  const int64_t Rp = (R + 3) / 4 * 4;
  alignas(64) static thread_local float zeros[hd] = {};
  const float* qrow[kLocalRows];
  int32_t row_lo[kLocalRows], row_hi[kLocalRows];
  alignas(64) float acc[kLocalRows * hd];
  alignas(64) float P[kLocalRows * kKeys];
  float m[kLocalRows], l[kLocalRows];
  int64_t key_lo = t1, key_hi = t0 - 1;
  for (int64_t r = 0; r < Rp; ++r) {
    const int64_t t = t0 + r / G, g = r % G;
    if (r < R && p.lo[t] >= 0) {
      qrow[r] = p.q + ((t * Hk + h) * G + g) * hd;
      row_lo[r] = p.lo[t];
      row_hi[r] = static_cast<int32_t>(t);
      key_lo = std::min<int64_t>(key_lo, p.lo[t]);
      key_hi = std::max<int64_t>(key_hi, t);
    } else {  // padding rows see no key
      qrow[r] = zeros;
      row_lo[r] = 1;
      row_hi[r] = 0;
    }
    m[r] = kNoScore;
    l[r] = 0.0f;
  }
  std::fill(acc, acc + Rp * hd, 0.0f);
  const float* kt = p.kt + h * hd * p.Tp;
  for (int64_t u0 = key_lo; u0 <= key_hi; u0 += kKeys) {
    const int64_t n = std::min<int64_t>(kKeys, key_hi + 1 - u0);  // keys of this chunk some row may see
    // Scores and softmax state of every row over this chunk's keys (only the vectors of 16 keys
    // that hold one: a batch of decodes needs 1 of the 4).
    const int nk = static_cast<int>((n + 15) / 16);
    for (int64_t r0 = 0; r0 < Rp; r0 += 4) {
      switch (nk) {
        case 1: score_rows<1, HV>(p, kt, u0, r0, qrow, row_lo, row_hi, m, l, acc, P); break;
        case 2: score_rows<2, HV>(p, kt, u0, r0, qrow, row_lo, row_hi, m, l, acc, P); break;
        case 3: score_rows<3, HV>(p, kt, u0, r0, qrow, row_lo, row_hi, m, l, acc, P); break;
        default: score_rows<4, HV>(p, kt, u0, r0, qrow, row_lo, row_hi, m, l, acc, P); break;
      }
    }
    // acc += P V, 16 / HV rows at a time so that their accumulators stay in registers.
    constexpr int RB = HV >= 16 ? 1 : 16 / HV;
    for (int64_t r0 = 0; r0 < Rp; r0 += RB) {
      const int rb = static_cast<int>(std::min<int64_t>(RB, Rp - r0));
      v16 a[RB][HV];
      for (int i = 0; i < rb; ++i)
        for (int x = 0; x < HV; ++x) a[i][x] = load16(acc + (r0 + i) * hd + 16 * x);
      for (int64_t j = 0; j < n; ++j) {
        const float* vr = p.v + ((u0 + j) * Hk + h) * hd;
        v16 vv[HV];
        for (int x = 0; x < HV; ++x) vv[x] = load16(vr + 16 * x);
        for (int i = 0; i < rb; ++i) {
          const float w = P[(r0 + i) * kKeys + j];
          for (int x = 0; x < HV; ++x) a[i][x] += w * vv[x];
        }
      }
      for (int i = 0; i < rb; ++i)
        for (int x = 0; x < HV; ++x) store16(acc + (r0 + i) * hd + 16 * x, a[i][x]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, g = r % G;
    const int64_t o = (t * Hk + h) * G + g;
    if (p.lo[t] < 0) {  // padding: an all-zero output, finite
      p.m[o] = 0.0f;
      p.l[o] = 1.0f;
      std::fill(p.acc + o * hd, p.acc + (o + 1) * hd, 0.0f);
      continue;
    }
    p.m[o] = m[r];
    p.l[o] = l[r];
    std::copy(acc + r * hd, acc + (r + 1) * hd, p.acc + o * hd);
  }
}

// Runs: each sequence's tokens one contiguous run of the token axis, positions increasing
// within it. lo[t] = the first token of t's run (-1 for padding). A layout that breaks this is
// an error: the local part would read the wrong keys.
ffi::Error token_runs(const int32_t* seq, const int32_t* pos, int64_t T, std::vector<int32_t>& lo) {
  lo.assign(static_cast<size_t>(T), -1);
  std::vector<char> seen;
  for (int64_t t = 0; t < T; ++t) {
    if (seq[t] < 0) continue;
    if (seq[t] >= T) return ffi::Error::InvalidArgument("seq_idx out of range");  // a step has < T sequences
    if (t > 0 && seq[t] == seq[t - 1]) {
      if (pos[t] <= pos[t - 1]) return ffi::Error::InvalidArgument("positions of a sequence are not increasing");
      lo[t] = lo[t - 1];
      continue;
    }
    if (static_cast<size_t>(seq[t]) >= seen.size()) seen.resize(static_cast<size_t>(seq[t]) + 1, 0);
    if (seen[seq[t]]) return ffi::Error::InvalidArgument("tokens of a sequence are not contiguous");
    seen[seq[t]] = 1;
    lo[t] = static_cast<int32_t>(t);
  }
  return ffi::Error::Success();
}

ffi::Error LocalAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seq_idx, ffi::Buffer<ffi::S32> positions,
                          ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l,
                          ffi::ResultBuffer<ffi::F32> acc) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 3 || vd.size() != 3)
    return ffi::Error::InvalidArgument("expected q [T,Hk,G,hd], k and v [T,Hk,hd]");
  const int64_t T = qd[0], Hk = qd[1], G = qd[2], hd = qd[3];
  if (kd[0] != T || kd[1] != Hk || kd[2] != hd || vd[0] != T || vd[1] != Hk || vd[2] != hd)
    return ffi::Error::InvalidArgument("k or v is not [T,Hk,hd] of q's sizes");
  if (seq_idx.dimensions().size() != 1 || seq_idx.dimensions()[0] != T || positions.dimensions().size() != 1 ||
      positions.dimensions()[0] != T)
    return ffi::Error::InvalidArgument("seq_idx or positions is not [T]");
  if (hd != 32 && hd != 64 && hd != 128) return ffi::Error::InvalidArgument("local attention takes head_dim 32, 64 or 128");
  if (G > kLocalRows) return ffi::Error::InvalidArgument("more than 64 query heads per KV head");
  std::vector<int32_t> lo;
  if (ffi::Error err = token_runs(seq_idx.typed_data(), positions.typed_data(), T, lo); err.failure()) return err;
  int64_t pairs = 0;  // (query token, key) pairs of the step
  for (int64_t t = 0; t < T; ++t) pairs += lo[t] >= 0 ? t - lo[t] + 1 : 0;
  // Keys transposed per KV head, [Hk, hd, Tp], zero beyond T (a chunk may read past the end).
  const int64_t Tp = (T + 15) / 16 * 16 + kKeys;
  std::unique_ptr<float[]> kt(new float[static_cast<size_t>(Hk * hd * Tp)]);
  const float* K = k.typed_data();
  for (int64_t h = 0; h < Hk; ++h)
    for (int64_t d = 0; d < hd; ++d) {
      float* row = kt.get() + (h * hd + d) * Tp;
      for (int64_t t = 0; t < T; ++t) row[t] = K[(t * Hk + h) * hd + d];
      std::fill(row + T, row + Tp, 0.0f);
    }
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(16, kLocalRows / G));
  Local p{q.typed_data(), kt.get(), v.typed_data(), lo.data(), m->typed_data(), l->typed_data(),
          acc->typed_data(), T, Tp, Hk, G, hd, tile};
  const int64_t tiles = (T + tile - 1) / tile;
  auto fn = hd == 32 ? local_tile<2> : hd == 64 ? local_tile<4> : local_tile<8>;
  // Later tiles see more keys: hand them out first. A step whose tokens see few keys of this
  // step (decodes, short chunks) runs on this thread: waking a helper costs more than it saves.
  auto item = [&](int64_t i) {
    const int64_t ti = tiles - 1 - i / Hk, h = i % Hk;
    fn(p, ti * tile, std::min(T, (ti + 1) * tile), h);
  };
  if (pairs * G < kLocalSerialPairs) {
    for (int64_t i = 0; i < tiles * Hk; ++i) item(i);
  } else {
    parallel_for(pool, tiles * Hk, item);
  }
  return ffi::Error::Success();
}

// ---- Both parts in one call, for steps of a few tokens (decodes) ----------------------------
//
// out [T, Hk, G, hd]: each token's attention over its cached keys (the fold above) and this
// step's own keys of its sequence (a plain online softmax loop), merged and normalised; padding
// rows 0. Work items are (token, KV head), so one decoding sequence's 3 KV heads split over
// both threads. For a one-row decode step this replaces two calls, a cond and the merge's ops a
// layer. Meant for steps of a few tokens (kernels/cpu_native.py: SMALL_MAX_TOKENS): it is right
// at any size, but its local loop is quadratic in a run's length, where the tile kernel is not.

void local_fold_small(const float* q, const float* k, const float* v, int64_t lo, int64_t t, int64_t Hk,
                      int64_t h, int64_t G, int64_t hd, float* m, float* l, float* acc) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * hd;
    float* ag = acc + g * hd;
    // No cached key: the fold left m = -inf, l = 0, acc = 0; a finite floor keeps exp() finite
    // (this file is built with -ffast-math).
    float mg = l[g] > 0.0f ? m[g] : kNoScore, lg = l[g];
    for (int64_t j = lo; j <= t; ++j) {
      const float* kj = k + (j * Hk + h) * hd;
      const float* vj = v + (j * Hk + h) * hd;
      float sc = 0.0f;
      for (int64_t d = 0; d < hd; ++d) sc += qg[d] * kj[d];
      const float mn = std::max(mg, sc);
      const float corr = std::exp(mg - mn);
      const float w = std::exp(sc - mn);
      lg = lg * corr + w;
      mg = mn;
      for (int64_t d = 0; d < hd; ++d) ag[d] = ag[d] * corr + w * vj[d];
    }
    m[g] = mg;
    l[g] = lg;
  }
}

template <ffi::DataType KVT>
ffi::Error SmallAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                          ffi::Buffer<ffi::F32> v_new, ffi::Buffer<KVT> k_cache, ffi::Buffer<KVT> v_cache,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> seq_idx, ffi::Buffer<ffi::S32> positions,
                          ffi::Buffer<ffi::S32> start_pos, ffi::Buffer<ffi::S32> tables,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  if (qd.size() != 4) return ffi::Error::InvalidArgument("expected q [T,Hk,G,hd]");
  const int64_t T = qd[0], Hk = qd[1], G = qd[2], hd = qd[3];
  const auto nd = k_new.dimensions();
  const auto nvd = v_new.dimensions();
  if (nd.size() != 3 || nd[0] != T || nd[1] != Hk || nd[2] != hd || nvd.size() != 3 || nvd[0] != T ||
      nvd[1] != Hk || nvd[2] != hd)
    return ffi::Error::InvalidArgument("k_new or v_new is not [T,Hk,hd] of q's sizes");
  if (positions.dimensions().size() != 1 || positions.dimensions()[0] != T)
    return ffi::Error::InvalidArgument("positions is not [T]");
  // The cached part's state: m and l in scratch, acc in the output (normalised in place).
  std::vector<float> ml(static_cast<size_t>(2 * T * Hk * G));
  ProblemT<ffi::NativeType<KVT>> p;
  if (ffi::Error err = cached_problem(q, k_cache, v_cache, layer, seq_idx, start_pos, tables, ml.data(),
                                      ml.data() + T * Hk * G, out->typed_data(), p);
      err.failure())
    return err;
  std::vector<int32_t> lo;
  if (ffi::Error err = token_runs(p.seq_idx, positions.typed_data(), T, lo); err.failure()) return err;
  const auto fold = pick(p);
  const float* K = k_new.typed_data();
  const float* V = v_new.typed_data();
  parallel_for(pool, T * Hk, [&](int64_t i) {
    const int64_t t = i / Hk, h = i % Hk;
    float* m = p.m + (t * Hk + h) * G;
    float* l = p.l + (t * Hk + h) * G;
    float* acc = p.acc + (t * Hk + h) * G * hd;
    if (lo[t] < 0) {  // padding
      std::fill(acc, acc + G * hd, 0.0f);
      return;
    }
    fold(p, t, h, h + 1);
    local_fold_small(p.q + (t * Hk + h) * G * hd, K, V, lo[t], t, Hk, h, G, hd, m, l, acc);
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.0f / l[g];
      for (int64_t d = 0; d < hd; ++d) acc[g * hd + d] *= inv;
    }
  });
  return ffi::Error::Success();
}

// y [N, O] = x [N, K] @ w^T for w [O, K] (one row of K weights per output: how every float
// linear is stored, tl/model/llama.py) and a few rows N: output rows split into contiguous
// ranges over the threads, each streaming its part of w front to back, MO = 4 outputs at a time
// (their 4 rows read together, 16 weights per load, the next 4 rows prefetched as they go),
// x rows in blocks of NB <= 4 against them: 16 dot products accumulate in registers, reduced
// across lanes at the end. (Measured on the 30 SmolLM2 layers at one row: prefetching 8-32
// rows ahead, 2 or 8 outputs a block, and chunks handed out dynamically were no faster.)

template <int NB, int MO>
inline void gemv_block(const float* X, int64_t K, const float* W, int64_t O, float* Y, int64_t n0, int64_t o0,
                       bool prefetch) {
  v16 acc[NB][MO];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MO; ++j) acc[i][j] = v16{};
  const int64_t K16 = K / 16 * 16;
  const float* w = W + o0 * K;
  const float* x = X + n0 * K;
  for (int64_t k = 0; k < K16; k += 16) {
    if (prefetch)
      for (int j = 0; j < MO; ++j) __builtin_prefetch(w + (MO + j) * K + k);
    v16 wv[MO];
    for (int j = 0; j < MO; ++j) wv[j] = load16(w + j * K + k);
    for (int i = 0; i < NB; ++i) {
      const v16 xv = load16(x + i * K + k);
      for (int j = 0; j < MO; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MO; ++j) {
      float r = hsum(acc[i][j]);
      for (int64_t k = K16; k < K; ++k) r += x[i * K + k] * w[j * K + k];
      Y[(n0 + i) * O + o0 + j] = r;
    }
}

template <int MO>
inline void gemv_outputs(const float* X, int64_t N, int64_t K, const float* W, int64_t O, float* Y, int64_t o0,
                         bool prefetch) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) {  // the MO rows of w stay in L1 after the first block of x rows
    gemv_block<4, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0);
  }
  switch (N - n) {
    case 3: gemv_block<3, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0); break;
    case 2: gemv_block<2, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0); break;
    case 1: gemv_block<1, MO>(X, K, W, O, Y, n, o0, prefetch && n == 0); break;
    default: break;
  }
}

// Many rows (N > kGemvRows): the dot products above reduce every accumulator across its lanes
// and load both operands a multiply-add; here the roles turn. x's rows are packed once a call,
// 16*J rows side by side per k (XP [N/16J][K][16J], zero-padded), and each weight w[o,k] is
// broadcast against 16*J rows at once: RO outputs x J vectors of rows in registers, so a k
// costs J loads and RO broadcasts for RO*J multiply-adds, no lane reduction. w stays in its
// [O,K] layout (RO rows streamed together, the next RO prefetched). Measured on the 30 SmolLM2
// layers' matmuls on one thread (weights streamed from memory): at 64 rows 6x4 ran 1.39x the
// dot form (106 vs 77 GFLOP/s), 12x2 at 32 rows 1.35x; 8x3, 5x4, 24x1 and a weight panel
// packed per call (scalar transpose) were slower, weights pre-packed into panels only 1.05x.
constexpr int64_t kGemvRows = 16;
constexpr int64_t kGemmRows = 64;  // at 96 and 128 rows XLA's dot is as fast

// The most rows Gemv takes on this build. The broadcast form's 24 accumulators are 24 zmm
// registers; without AVX-512 each v16 is two ymm, of which there are only 16, so it would
// spill, and such a build stops at the dot form's 16 rows (cpu_native.max_rows() asks).
constexpr int64_t gemv_max_rows() {
#if defined(__AVX512F__)
  return kGemmRows;
#else
  return kGemvRows;
#endif
}

template <int RO, int J>
inline void gemm_tile(const float* xp, int64_t K, const float* W, float* Y, int64_t O, int64_t N,
                      int64_t o0, int64_t n0, bool prefetch) {
  constexpr int C = 16 * J;
  v16 acc[RO][J];
  for (int i = 0; i < RO; ++i)
    for (int j = 0; j < J; ++j) acc[i][j] = v16{};
  const float* w = W + o0 * K;
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch && (k & 15) == 0)
      for (int i = 0; i < RO; ++i) __builtin_prefetch(w + (RO + i) * K + k);
    v16 b[J];
    for (int j = 0; j < J; ++j) b[j] = load16(xp + k * C + 16 * j);
    for (int i = 0; i < RO; ++i) {
      const v16 a = splat(w[i * K + k]);
      for (int j = 0; j < J; ++j) acc[i][j] += a * b[j];
    }
  }
  for (int j = 0; j < J; ++j) {
    const int64_t rows = std::min<int64_t>(16, N - n0 - 16 * j);
    for (int64_t l = 0; l < rows; ++l)
      for (int i = 0; i < RO; ++i) Y[(n0 + 16 * j + l) * O + o0 + i] = acc[i][j][l];
  }
}

// Outputs [o0, o0 + RO*blocks) (then `tail` more, fewer than RO, if given) against every row tile.
template <int RO, int J>
void gemm_outputs(const float* XP, int64_t N, int64_t K, const float* W, int64_t O, float* Y, int64_t o0,
                  int64_t blocks, int64_t tail) {
  constexpr int C = 16 * J;
  const int64_t tiles = (N + C - 1) / C;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t t = 0; t < tiles; ++t)
      gemm_tile<RO, J>(XP + t * K * C, K, W, Y, O, N, o0 + RO * b, C * t, t == 0 && b + 1 < blocks);
  const int64_t o = o0 + RO * blocks;
  for (int64_t t = 0; t < tiles; ++t) {
    const float* xp = XP + t * K * C;
    switch (tail) {
      case 5: gemm_tile<5, J>(xp, K, W, Y, O, N, o, C * t, false); break;
      case 4: gemm_tile<4, J>(xp, K, W, Y, O, N, o, C * t, false); break;
      case 3: gemm_tile<3, J>(xp, K, W, Y, O, N, o, C * t, false); break;
      case 2: gemm_tile<2, J>(xp, K, W, Y, O, N, o, C * t, false); break;
      case 1: gemm_tile<1, J>(xp, K, W, Y, O, N, o, C * t, false); break;
      default:
        for (int64_t r = 0; r < tail; ++r) gemm_tile<1, J>(xp, K, W, Y, O, N, o + r, C * t, false);
    }
  }
}

#if defined(__AVX512F__)
// r[i][j] -> r[j][i] for a 16x16 block of floats (unpack, then 128-bit lane shuffles).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}
#endif

// X [N,K] -> XP [tiles][K][C]: row n of tile t in lane n - t*C of each k's C floats, rows past
// N zero. (A scalar transpose was 5% of a 64-row chain of the 30 layers' matmuls.)
void pack_rows(const float* X, int64_t N, int64_t K, int64_t C, float* XP) {
  const int64_t tiles = (N + C - 1) / C;
  int64_t k0 = 0;
#if defined(__AVX512F__)
  for (; k0 + 16 <= K; k0 += 16)
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t c0 = 0; c0 < C; c0 += 16) {
        __m512 r[16];
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t n = t * C + c0 + i;
          r[i] = n < N ? _mm512_loadu_ps(X + n * K + k0) : _mm512_setzero_ps();
        }
        transpose16(r);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(XP + (t * K + k0 + i) * C + c0, r[i]);
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
void gemm(ffi::ThreadPool& pool, const float* X, int64_t N, int64_t K, const float* W, int64_t O, float* Y) {
  constexpr int C = 16 * J;
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

ffi::Error Gemv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() < 2 || xd[1] != wd[wd.size() - 1])
    return ffi::Error::InvalidArgument("expected x [N,K] and w [...,K]");
  const int64_t N = xd[0], K = xd[1];
  const int64_t O = K > 0 ? static_cast<int64_t>(w.element_count()) / K : 0;
  const float* X = x.typed_data();
  const float* W = w.typed_data();
  float* Y = y->typed_data();
  if (N > gemv_max_rows()) return ffi::Error::InvalidArgument("gemv takes at most cpu_native.max_rows() rows");
  if (N > 48) {  // tiles of 64, 48, 32 rows: the smallest that N fills
    gemm<6, 4>(pool, X, N, K, W, O, Y);
    return ffi::Error::Success();
  }
  if (N > 32) {
    gemm<8, 3>(pool, X, N, K, W, O, Y);
    return ffi::Error::Success();
  }
  if (N > kGemvRows) {
    gemm<12, 2>(pool, X, N, K, W, O, Y);
    return ffi::Error::Success();
  }
  const int64_t blocks = O / 4;  // of 4 outputs; the last O % 4 one by one
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), blocks));
  parallel_for(pool, tasks, [&](int64_t task) {
    const int64_t b0 = blocks * task / tasks, b1 = blocks * (task + 1) / tasks;
    for (int64_t b = b0; b < b1; ++b) gemv_outputs<4>(X, N, K, W, O, Y, 4 * b, b + 1 < b1);
    if (task == tasks - 1)
      for (int64_t o = 4 * blocks; o < O; ++o) gemv_outputs<1>(X, N, K, W, O, Y, o, false);
  }, /*linger_after=*/N == 1);
  return ffi::Error::Success();
}

// ---- float32 matmuls at "high" precision on AMX (matmul_precision = "high") -----------------
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

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
void split_rows(const float* X, int64_t N, int64_t K, int64_t KB, uint16_t* A, int64_t n0, int64_t n1) {
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
      const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
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
      const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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
#define TL_DP_2X2()            \
  do {                         \
    _tile_dpbf16ps(0, 6, 4);   \
    _tile_dpbf16ps(1, 6, 5);   \
    _tile_dpbf16ps(2, 7, 4);   \
    _tile_dpbf16ps(3, 7, 5);   \
  } while (0)

#define TL_STORE_TILE(T, Y, N, O, r, c)                                                     \
  do {                                                                                     \
    if ((r) + 16 <= (N) && (c) + 16 <= (O)) {                                              \
      _tile_stored(T, (Y) + (r) * (O) + (c), (O) * sizeof(float));                         \
    } else {                                                                               \
      alignas(64) float t_[256];                                                           \
      _tile_stored(T, t_, 64);                                                             \
      for (int64_t i = 0; i < 16 && (r) + i < (N); ++i)                                    \
        for (int64_t j = 0; j < 16 && (c) + j < (O); ++j) (Y)[((r) + i) * (O) + (c) + j] = t_[i * 16 + j]; \
    }                                                                                      \
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
    split_rows(X, N, K, KB, A, 0, N);
  } else {
    parallel_for(pool, threads, [&](int64_t t) { split_rows(X, N, K, KB, A, N * t / threads, N * (t + 1) / threads); });
  }
  const int64_t pairs = OB / 2;
  const int64_t tasks = std::min(threads, pairs);
  const uint16_t* Wp = w.typed_data();
  float* Y = y->typed_data();
  parallel_for(pool, tasks, [&](int64_t t) {
    bf16x3_pairs(A, N, NB, Wp, KB, Y, O, pairs * t / tasks, pairs * (t + 1) / tasks);
  });
  return ffi::Error::Success();
}

bool amx_available() { return amx_permitted(); }
#else
ffi::Error GemmBf16x3(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::U16>, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Unimplemented("this build of native.cc has no AMX-BF16 (cpu_native.amx_available())");
}

bool amx_available() { return false; }
#endif

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
  if (K < 1) return ffi::Error::InvalidArgument("q has no columns");
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

// token [R] = the first index of each row's max of x [R, V], lse [R] = log(sum(exp(x))): what
// greedy sampling and the logprob of the chosen token need, one row per task, a vector pass
// for max and index and one for the sum. (XLA:CPU ran argmax and logsumexp on one thread:
// 8 ms at 64 rows of a 49152-token vocabulary.)
void argmax_lse_row(const float* x, int64_t V, int32_t* tok, float* lse) {
  const int64_t V16 = V / 16 * 16;
  const i16v iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  float best = x[0];
  int64_t arg = 0;
  if (V16 > 0) {
    v16 mv = load16(x);
    i16v iv = iota;
    for (int64_t i = 16; i < V16; i += 16) {
      const v16 xv = load16(x + i);
      const auto gt = xv > mv;
      mv = gt ? xv : mv;
      iv = gt ? iota + static_cast<int32_t>(i) : iv;
    }
    best = hmax(mv);
    arg = V;
    for (int j = 0; j < 16; ++j)
      if (mv[j] == best) arg = std::min<int64_t>(arg, iv[j]);
  }
  for (int64_t i = std::max<int64_t>(V16, 1); i < V; ++i)
    if (x[i] > best) {
      best = x[i];
      arg = i;
    }
  v16 sum{};
  for (int64_t i = 0; i < V16; i += 16) sum += vexp(load16(x + i) - best);
  float total = hsum(sum);
  for (int64_t i = V16; i < V; ++i) total += std::exp(x[i] - best);
  *tok = static_cast<int32_t>(arg);
  *lse = best + std::log(total);
}

ffi::Error ArgmaxLse(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> tok,
                     ffi::ResultBuffer<ffi::F32> lse) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] < 1) return ffi::Error::InvalidArgument("expected x [R,V] with V >= 1");
  const int64_t R = xd[0], V = xd[1];
  const float* X = x.typed_data();
  int32_t* T = tok->typed_data();
  float* L = lse->typed_data();
  parallel_for(pool, R, [&](int64_t r) { argmax_lse_row(X + r * V, V, T + r, L + r); });
  return ffi::Error::Success();
}

// The bindings of the two attention handlers, over a float32 (F32) or a bf16-bits (U16) cache.
template <ffi::DataType KVT>
auto small_attention_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()               // q [T,Hk,G,hd], scaled
      .Arg<ffi::Buffer<ffi::F32>>()               // k_new
      .Arg<ffi::Buffer<ffi::F32>>()               // v_new
      .Arg<ffi::Buffer<KVT>>()                    // k_cache
      .template Arg<ffi::Buffer<KVT>>()           // v_cache
      .template Arg<ffi::Buffer<ffi::S32>>()      // layer
      .template Arg<ffi::Buffer<ffi::S32>>()      // seq_idx
      .template Arg<ffi::Buffer<ffi::S32>>()      // positions
      .template Arg<ffi::Buffer<ffi::S32>>()      // start_pos
      .template Arg<ffi::Buffer<ffi::S32>>()      // block_tables
      .template Ret<ffi::Buffer<ffi::F32>>();     // out [T,Hk,G,hd]
}

template <ffi::DataType KVT>
auto cached_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()               // q
      .Arg<ffi::Buffer<KVT>>()                    // k_cache
      .template Arg<ffi::Buffer<KVT>>()           // v_cache
      .template Arg<ffi::Buffer<ffi::S32>>()      // layer
      .template Arg<ffi::Buffer<ffi::S32>>()      // seq_idx
      .template Arg<ffi::Buffer<ffi::S32>>()      // start_pos
      .template Arg<ffi::Buffer<ffi::S32>>()      // block_tables
      .template Ret<ffi::Buffer<ffi::F32>>()      // m
      .template Ret<ffi::Buffer<ffi::F32>>()      // l
      .template Ret<ffi::Buffer<ffi::F32>>();     // acc
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlSmallAttention, SmallAttention<ffi::F32>, small_attention_binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TlSmallAttentionBf16, SmallAttention<ffi::U16>, small_attention_binding<ffi::U16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TlPagedAttentionCached, Cached<ffi::F32>, cached_binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TlPagedAttentionCachedBf16, Cached<ffi::U16>, cached_binding<ffi::U16>());

extern "C" void TlSetLingerNs(int64_t ns) { g_linger_ns.store(ns, std::memory_order_relaxed); }
extern "C" int64_t TlGemvMaxRows() { return gemv_max_rows(); }
extern "C" int64_t TlAmxAvailable() { return amx_available() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemmBf16x3, GemmBf16x3,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, K]
                                  .Arg<ffi::Buffer<ffi::U16>>()   // w packed [OB, KB, 2, 16, 32]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [N, ...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemv, Gemv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [..., K]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [N, ...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlGemvInt8, GemvInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()    // q [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [...]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [N, ...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlLocalAttention, LocalAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, Hk, G, hd], scaled
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k [T, Hk, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v [T, Hk, hd]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_idx [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions [T]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m
                                  .Ret<ffi::Buffer<ffi::F32>>()   // l
                                  .Ret<ffi::Buffer<ffi::F32>>()); // acc

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlArgmaxLse, ArgmaxLse,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [R, V]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // token [R]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // lse [R]
