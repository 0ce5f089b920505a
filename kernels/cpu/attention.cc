// Paged attention on the CPU as an XLA FFI custom call.
//
// Owns: TlSmallAttention(Bf16): each token's attention over its sequence's cached keys (positions
// [0, start_pos of its sequence); with a sliding window w > 0 only those > its position - w),
// read in place from the stored cache layout (kernels/paged_attention.py: K [L, NB, Hk, hd, bs],
// V [L, NB, Hk, bs, hd]; float32, or bf16 bits for the vector folds' shapes), and over this
// step's own keys of its sequence up to it, merged and normalised; work items (token, KV head,
// run of its cached blocks) on the threads of XLA's intra-op pool. kernels/cpu_native.py calls
// it with every token a sequence of its own (its earlier keys in the cache), so that a token's
// result is a function of its keys alone (issue 48).
// Must not: write anything but its outputs. Built by kernels/cpu_build.py, called by
// kernels/cpu_native.py, tested by tests/kernels/test_cpu_native.py against the jnp reference and a
// float64 one; whether it or the reference runs the model is measured at start-up
// (tl/runtime/verdicts.py).
//
// Why: XLA:CPU gathers cached blocks element by element (~3 GB/s a thread) and then runs tiny
// batched dots over the copy; here every block is read once, where it lies.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace tl {
namespace {

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
  const float* q;            // [T, Hk, G, hd], already scaled by 1/sqrt(hd)
  const KV* k;               // [L, NB, Hk, hd, bs]
  const KV* v;               // [L, NB, Hk, bs, hd]
  const int32_t* seq_idx;    // [T], -1 for padding
  const int32_t* start_pos;  // [S]
  const int32_t* tables;     // [S, MB]
  float* m;                  // [T, Hk, G]
  float* l;                  // [T, Hk, G]
  float* acc;                // [T, Hk, G, hd]
  int64_t T, Hk, G, hd, NB, bs, S, MB, layer;
  const int32_t* positions = nullptr;  // [T]; read only with a window
  int64_t window = 0;                  // sliding window (0: none): keys at positions > the token's - window
  int64_t part = 0, parts = 1;         // fold only run `part` of `parts` even runs of a token's blocks
};
using Problem = ProblemT<float>;

constexpr int64_t kMaxBlock = 64;  // block_size limit of the score buffer
constexpr int64_t kMaxHeadDim = 256;

// The first cached key token t sees: 0, or with a sliding window the first inside it (the
// folds start at its block; a token whose window starts at or past its context sees none).
template <typename KV>
inline int64_t first_key(const ProblemT<KV>& p, int64_t t) {
  return p.window > 0 ? std::max<int64_t>(0, p.positions[t] - p.window + 1) : 0;
}

// The cached blocks [b0, b1) a fold of token t reads, its context ctx and first key k0: from
// its window's first block to its context's last, and of those only run p.part of p.parts (the
// split of a few tokens' work over the threads, SmallAttention: one part, the whole range,
// elsewhere).
template <typename KV>
inline void block_span(const ProblemT<KV>& p, int64_t ctx, int64_t k0, int64_t& b0, int64_t& b1) {
  const int64_t nblocks = (ctx + p.bs - 1) / p.bs;
  const int64_t first = k0 < ctx ? k0 / p.bs : nblocks;
  b0 = first + (nblocks - first) * p.part / p.parts;
  b1 = first + (nblocks - first) * (p.part + 1) / p.parts;
}

// One block of one KV head (its keys [j0, n)) folded into the softmax state of its G query
// heads. BS and HD are compile-time block size and head dim for the common shapes (0: runtime
// bs, hd), so that a block's scores of one query head and its output row stay in registers.
template <int64_t BS, int64_t HD>
inline void fold_block(const float* q, const float* K, const float* V, int64_t j0, int64_t n, int64_t G, int64_t bs_rt,
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
    float bm = s[j0];
    for (int64_t j = j0 + 1; j < n; ++j) bm = std::max(bm, s[j]);
    const float mn = std::max(m[g], bm);
    const float corr = std::exp(m[g] - mn);  // 0 on the first block (m = -inf)
    float sum = 0.0f;
    for (int64_t j = j0; j < n; ++j) {
      s[j] = std::exp(s[j] - mn);
      sum += s[j];
    }
    l[g] = l[g] * corr + sum;
    m[g] = mn;
    float* ag = acc + g * hd;
    for (int64_t x = 0; x < hd; ++x) a[x] = ag[x] * corr;
    for (int64_t j = j0; j < n; ++j) {  // V is [bs, hd]
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
  const int64_t k0 = first_key(p, t);
  int64_t b0, b1;
  block_span(p, ctx, k0, b0, b1);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = (p.layer * p.NB + table[b]) * block_floats;
    if (b + 1 < b1) {
      const int64_t next = (p.layer * p.NB + table[b + 1]) * block_floats;
      prefetch_pair(p.k + next, p.v + next, block_floats);
    }
    const int64_t n = std::min(bs, ctx - b * bs);
    const int64_t j0 = std::max<int64_t>(0, k0 - b * bs);
    for (int64_t h = h0; h < h1; ++h) {
      fold_block<BS, HD>(q + h * G * hd, p.k + base + h * hd * bs, p.v + base + h * bs * hd, j0, n, G, bs, hd,
                         m + h * G, l + h * G, acc + h * G * hd);
    }
  }
}

// The accumulator chunk of the vector fold: CH of a head's HV vectors of 16 output floats per
// query head, chosen so that G x CH accumulators, CH rows of V and a weight fit in registers
// (simd.h kV16Regs). With CH = HV (AVX-512: all 12 of SmolLM2's G 3 x HV 4) the accumulators
// stay in registers over all the blocks of a head; with fewer (AVX2 and NEON: 1) they live in
// L1 and each block adds to them one chunk at a time. (Keeping all 12 in registers spilled 24
// ymm registers on AVX2: 64 sequences at context 256, 30 layers, ran 186 ms, 0.87x the jnp
// reference.)
constexpr int fold_chunk(int G, int HV) {
  for (int ch = HV; ch > 1; ch /= 2)
    if (G * ch + ch + 2 <= kV16Regs) return ch;
  return 1;
}

// One block's softmax step for G query heads: scores s (16 keys, `valid` of them real) folded
// into the running max m and sum l; corr[g] rescales the head's accumulators, pr[g] holds the
// block's weights.
template <int G>
inline void block_softmax(const v16* s, m16 valid, float* m, float* l, float* corr, float (*pr)[16]) {
  for (int g = 0; g < G; ++g) {
    const v16 sc = select(valid, s[g], splat(kNoScore));
    const float mn = std::max(m[g], hmax(sc));
    corr[g] = std::exp(m[g] - mn);
    const v16 e = select(valid, vexp(sc - mn), v16{});
    l[g] = l[g] * corr[g] + hsum(e);
    m[g] = mn;
    store16(pr[g], e);
  }
}

// fold_token for block size 16 with the G query heads of a KV head together, where a head's G x
// HV accumulator vectors fit in registers (fold_chunk(G, HV) == HV: AVX-512): per block, a row
// of 16 keys per dimension against the G queries (one vector of scores each), one vector exp
// per query head, the accumulators kept in registers over all the blocks of the head. (The
// scalar-loop fold_block spent most of a 64-sequence step in exp and reloads.)
template <typename KV, int G, int HV>
void fold_token_vec(const ProblemT<KV>& p, int64_t t, int64_t h0, int64_t h1) {
  constexpr int64_t hd = HV * 16, bs = 16;
  const int64_t Hk = p.Hk;
  float* m_out = p.m + t * Hk * G;
  float* l_out = p.l + t * Hk * G;
  float* acc_out = p.acc + t * Hk * G * hd;
  const int32_t seq = p.seq_idx[t];
  const int64_t ctx = seq < 0 ? 0 : p.start_pos[seq];
  const int64_t k0 = seq < 0 ? 0 : first_key(p, t);
  int64_t b0, nblocks;  // from the first block of the window (of this part)
  block_span(p, ctx, k0, b0, nblocks);
  const int32_t* table = seq < 0 ? nullptr : p.tables + seq * p.MB;
  const int64_t block_floats = Hk * hd * bs;
  const i16 iota = iota16();
  for (int64_t h = h0; h < h1; ++h) {
    const float* q = p.q + (t * Hk + h) * G * hd;
    v16 acc[G][HV];
    float m[G], l[G];
    for (int g = 0; g < G; ++g) {
      m[g] = kNoScore;
      l[g] = 0.0f;
      for (int x = 0; x < HV; ++x) acc[g][x] = v16{};
    }
    for (int64_t b = b0; b < nblocks; ++b) {
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
      if (b + 1 < nblocks || h + 1 < h1) {
        const int64_t nb = b + 1 < nblocks ? table[b + 1] : table[b0];
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
      const int32_t j0 = static_cast<int32_t>(std::max<int64_t>(0, k0 - b * bs));  // > 0: the window's first block
      alignas(64) float pr[G][16];
      float corr[G];
      block_softmax<G>(s, j0 > 0 ? (iota < n) & (iota >= j0) : iota < n, m, l, corr, pr);
      for (int g = 0; g < G; ++g)
        for (int x = 0; x < HV; ++x) acc[g][x] *= corr[g];
      for (int32_t j = j0; j < n; ++j) {
        v16 vv[HV];
        for (int x = 0; x < HV; ++x) vv[x] = load16(V + j * hd + 16 * x);
        for (int g = 0; g < G; ++g)
          for (int x = 0; x < HV; ++x) acc[g][x] += pr[g][j] * vv[x];
      }
    }
    for (int g = 0; g < G; ++g) {
      // No cached key: m = -inf, l = 0 (the merge with the local part then ignores this part).
      m_out[h * G + g] = b0 < nblocks ? m[g] : -std::numeric_limits<float>::infinity();
      l_out[h * G + g] = l[g];
      for (int x = 0; x < HV; ++x) store16(acc_out + (h * G + g) * hd + 16 * x, acc[g][x]);
    }
  }
}

// fold_token_vec's order turned for targets whose registers do not hold a head's accumulators
// (fold_chunk < HV: AVX2, NEON, SSE2): block by block, every head of the block in turn, the
// accumulators of all heads in L1. A block's heads lie together (K [Hk, hd, bs], V [Hk, bs,
// hd]: two contiguous runs of Hk x 4 KB for SmolLM2), so each block is two streams where the
// head-major order made each head's pass over the blocks its own pair of 4 KB streams. The
// next block is prefetched a line of K and one of V per (head, dimension) over the score loops.
template <typename KV, int G, int HV>
void fold_token_blocks(const ProblemT<KV>& p, int64_t t, int64_t h0, int64_t h1) {
  constexpr int64_t hd = HV * 16, bs = 16;
  constexpr int CH = fold_chunk(G, HV);
  constexpr int64_t kMaxHeads = 16;
  const int64_t Hk = p.Hk;
  const int32_t seq = p.seq_idx[t];
  const int64_t ctx = seq < 0 ? 0 : p.start_pos[seq];
  const int64_t k0 = seq < 0 ? 0 : first_key(p, t);
  int64_t b0, nblocks;  // from the first block of the window (of this part)
  block_span(p, ctx, k0, b0, nblocks);
  const int32_t* table = seq < 0 ? nullptr : p.tables + seq * p.MB;
  const int64_t block_floats = Hk * hd * bs;
  const i16 iota = iota16();
  for (int64_t c0 = h0; c0 < h1; c0 += kMaxHeads) {  // heads in groups whose state fits the buffers
    const int64_t c1 = std::min(h1, c0 + kMaxHeads), nh = c1 - c0;
    alignas(64) float accm[kMaxHeads * G * hd];
    float m[kMaxHeads * G], l[kMaxHeads * G];
    std::fill(accm, accm + nh * G * hd, 0.0f);
    std::fill(m, m + nh * G, kNoScore);
    std::fill(l, l + nh * G, 0.0f);
    for (int64_t b = b0; b < nblocks; ++b) {
      const int64_t base = (p.layer * p.NB + table[b]) * block_floats;
      const KV* Kn = b + 1 < nblocks ? p.k + (p.layer * p.NB + table[b + 1]) * block_floats : nullptr;
      const KV* Vn = b + 1 < nblocks ? p.v + (p.layer * p.NB + table[b + 1]) * block_floats : nullptr;
      const int32_t n = static_cast<int32_t>(std::min(bs, ctx - b * bs));
      const int32_t j0 = static_cast<int32_t>(std::max<int64_t>(0, k0 - b * bs));  // > 0: the window's first block
      const auto valid = j0 > 0 ? (iota < n) & (iota >= j0) : iota < n;
      for (int64_t h = c0; h < c1; ++h) {
        const float* q = p.q + (t * Hk + h) * G * hd;
        const KV* K = p.k + base + h * hd * bs;  // [hd, bs]
        const KV* V = p.v + base + h * bs * hd;  // [bs, hd]
        v16 s[G];
        for (int g = 0; g < G; ++g) s[g] = v16{};
        for (int64_t d = 0; d < hd; ++d) {
          if (Kn != nullptr && (sizeof(KV) == 4 || (d & 1) == 0)) {
            __builtin_prefetch(Kn + (h * hd + d) * bs);
            __builtin_prefetch(Vn + (h * hd + d) * bs);
          }
          const v16 kd = load16(K + d * bs);
          for (int g = 0; g < G; ++g) s[g] += q[g * hd + d] * kd;
        }
        float* ah = accm + (h - c0) * G * hd;
        alignas(64) float pr[G][16];
        float corr[G];
        block_softmax<G>(s, valid, m + (h - c0) * G, l + (h - c0) * G, corr, pr);
        for (int x0 = 0; x0 < HV; x0 += CH) {
          v16 a[G][CH];
          for (int g = 0; g < G; ++g)
            for (int x = 0; x < CH; ++x) a[g][x] = load16(ah + g * hd + 16 * (x0 + x)) * corr[g];
          for (int32_t j = j0; j < n; ++j) {
            v16 vv[CH];
            for (int x = 0; x < CH; ++x) vv[x] = load16(V + j * hd + 16 * (x0 + x));
            for (int g = 0; g < G; ++g)
              for (int x = 0; x < CH; ++x) a[g][x] += pr[g][j] * vv[x];
          }
          for (int g = 0; g < G; ++g)
            for (int x = 0; x < CH; ++x) store16(ah + g * hd + 16 * (x0 + x), a[g][x]);
        }
      }
    }
    for (int64_t h = c0; h < c1; ++h)
      for (int g = 0; g < G; ++g) {
        // No cached key: m = -inf, l = 0 (the merge with the local part then ignores this part).
        const int64_t o = (t * Hk + h) * G + g;
        p.m[o] = b0 < nblocks ? m[(h - c0) * G + g] : -std::numeric_limits<float>::infinity();
        p.l[o] = l[(h - c0) * G + g];
        std::copy(accm + ((h - c0) * G + g) * hd, accm + ((h - c0) * G + g + 1) * hd, p.acc + o * hd);
      }
  }
}

template <typename KV>
using FoldFnT = void (*)(const ProblemT<KV>&, int64_t, int64_t, int64_t);  // (problem, token, heads [h0, h1))
using FoldFn = FoldFnT<float>;

// The vector fold for G query heads a KV head and HV vectors of 16 a head: head-major with the
// accumulators in registers where they fit, else block-major (fold_token_blocks).
template <typename KV, int G, int HV>
FoldFnT<KV> fold_vec() {
  if constexpr (fold_chunk(G, HV) == HV) {
    return fold_token_vec<KV, G, HV>;
  } else {
    return fold_token_blocks<KV, G, HV>;
  }
}

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
      case 1: return fold_vec<KV, 1, 4>();
      case 2: return fold_vec<KV, 2, 4>();
      case 3: return fold_vec<KV, 3, 4>();
      default: return fold_vec<KV, 4, 4>();
    }
  }
  if (p.bs == 16 && p.hd == 128 && (p.G == 1 || p.G == 2))
    return p.G == 1 ? fold_vec<KV, 1, 8>() : fold_vec<KV, 2, 8>();
  if (p.bs == 16 && p.hd == 256 && p.G >= 1 && p.G <= 4) {  // Gemma 3's heads (the blocks' order)
    switch (p.G) {
      case 1: return fold_vec<KV, 1, 16>();
      case 2: return fold_vec<KV, 2, 16>();
      case 3: return fold_vec<KV, 3, 16>();
      default: return fold_vec<KV, 4, 16>();
    }
  }
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

// The cached part's Problem over these buffers (m, l, acc: where its state goes; positions [T]
// and the sliding window), every shape and table entry checked: a mismatch is an error, never
// an out-of-bounds read.
// A bf16 cache (KVT = U16) must have a vector fold for its shapes.
template <ffi::DataType KVT>
ffi::Error cached_problem(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<KVT>& k_cache,
                          const ffi::Buffer<KVT>& v_cache, const ffi::Buffer<ffi::S32>& layer,
                          const ffi::Buffer<ffi::S32>& seq_idx, const ffi::Buffer<ffi::S32>& positions,
                          const ffi::Buffer<ffi::S32>& start_pos, const ffi::Buffer<ffi::S32>& tables, int32_t window,
                          float* m, float* l, float* acc, ProblemT<ffi::NativeType<KVT>>& p) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("expected q [T,Hk,G,hd], k_cache [L,NB,Hk,hd,bs], tables [S,MB]");
  p = {q.typed_data(),
       k_cache.typed_data(),
       v_cache.typed_data(),
       seq_idx.typed_data(),
       start_pos.typed_data(),
       tables.typed_data(),
       m,
       l,
       acc,
       qd[0],
       qd[1],
       qd[2],
       qd[3],
       kd[1],
       kd[4],
       td[0],
       td[1],
       static_cast<int64_t>(layer.typed_data()[0]),
       positions.typed_data(),
       window};
  if (kd[2] != p.Hk || kd[3] != p.hd) return ffi::Error::InvalidArgument("cache heads or head_dim differ from q");
  const auto vd = v_cache.dimensions();
  if (vd.size() != 5 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[4] || vd[4] != kd[3])
    return ffi::Error::InvalidArgument("v_cache is not [L,NB,Hk,bs,hd] of k_cache's sizes");
  if (seq_idx.dimensions().size() != 1 || seq_idx.dimensions()[0] != p.T || positions.dimensions().size() != 1 ||
      positions.dimensions()[0] != p.T)
    return ffi::Error::InvalidArgument("seq_idx or positions is not [T]");
  if (window < 0) return ffi::Error::InvalidArgument("negative window");
  if (start_pos.dimensions().size() != 1 || start_pos.dimensions()[0] != p.S)
    return ffi::Error::InvalidArgument("start_pos is not [S] of the block tables' S");
  if (p.layer >= kd[0]) return ffi::Error::InvalidArgument("layer out of range");
  if (pick(p) == nullptr)
    return ffi::Error::InvalidArgument(
        "a bf16 cache needs block_size 16 with head_dim 64 (1-4 query heads a KV head) "
        "or 128 (1-2)");
  return check(p);
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

// With a sliding window (> 0), lo[t] moves up to the first token of t's run inside t's window
// (position > t's - window), so the local folds start there; a run's window starts only move
// up (positions increase along it), so one pass. The token itself is always inside.
void window_runs(const int32_t* pos, int64_t T, int32_t window, std::vector<int32_t>& lo) {
  if (window <= 0) return;
  int64_t u = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (lo[t] < 0) continue;
    u = std::max<int64_t>(u, lo[t]);  // a new run starts after every earlier start
    while (pos[u] <= pos[t] - window) ++u;
    lo[t] = static_cast<int32_t>(u);
  }
}

// ---- Both parts in one call, for steps of a few tokens (decodes) ----------------------------
//
// out [T, Hk, G, hd]: each token's attention over its cached keys (the fold above) and this
// step's own keys of its sequence (a plain online softmax loop), merged and normalised; padding
// rows 0. Work items are (token, KV head, run of its cached blocks), so one decoding sequence's
// heads split evenly over the threads. For a one-row decode step this replaces two calls, a
// cond and the merge's ops a layer. Meant for steps of a few tokens (kernels/cpu_native.py:
// SMALL_MAX_TOKENS): it is right at any size, but its local loop is quadratic in a run's length,
// where the tile kernel is not.

constexpr int64_t kMinRunBlocks = 2;  // the fewest cached blocks a run of SmallAttention's split reads
constexpr int64_t kMaxParts = 16;

// P runs' softmax states (m, l [P, G], acc [P, G, hd], in the runs' order) merged into one (m,
// l, acc [G, hd]): rescaled to their common max and summed, in the runs' order. A run that saw
// no key (l = 0) adds nothing; none: m = -inf, l = 0, acc = 0, as a fold over no block leaves.
void merge_runs(const float* rm, const float* rl, const float* racc, int64_t P, int64_t G, int64_t hd, float* m,
                float* l, float* acc) {
  for (int64_t g = 0; g < G; ++g) {
    float mx = kNoScore;
    bool any = false;
    for (int64_t c = 0; c < P; ++c)
      if (rl[c * G + g] > 0.0f) {
        mx = any ? std::max(mx, rm[c * G + g]) : rm[c * G + g];
        any = true;
      }
    float* ag = acc + g * hd;
    std::fill(ag, ag + hd, 0.0f);
    float lg = 0.0f;
    for (int64_t c = 0; c < P; ++c) {
      if (!(rl[c * G + g] > 0.0f)) continue;
      const float w = std::exp(rm[c * G + g] - mx);
      lg += rl[c * G + g] * w;
      const float* a = racc + (c * G + g) * hd;
      for (int64_t d = 0; d < hd; ++d) ag[d] += w * a[d];
    }
    m[g] = any ? mx : -std::numeric_limits<float>::infinity();
    l[g] = lg;
  }
}

void local_fold_small(const float* q, const float* k, const float* v, int64_t lo, int64_t t, int64_t Hk, int64_t h,
                      int64_t G, int64_t hd, float* m, float* l, float* acc) {
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
                          ffi::ResultBuffer<ffi::F32> out, int32_t window) {
  const auto qd = q.dimensions();
  if (qd.size() != 4) return ffi::Error::InvalidArgument("expected q [T,Hk,G,hd]");
  const int64_t T = qd[0], Hk = qd[1], G = qd[2], hd = qd[3];
  const auto nd = k_new.dimensions();
  const auto nvd = v_new.dimensions();
  if (nd.size() != 3 || nd[0] != T || nd[1] != Hk || nd[2] != hd || nvd.size() != 3 || nvd[0] != T || nvd[1] != Hk ||
      nvd[2] != hd)
    return ffi::Error::InvalidArgument("k_new or v_new is not [T,Hk,hd] of q's sizes");
  // The cached part's state: m and l in scratch, acc in the output (normalised in place).
  std::vector<float> ml(static_cast<size_t>(2 * T * Hk * G));
  ProblemT<ffi::NativeType<KVT>> p;
  if (ffi::Error err = cached_problem(q, k_cache, v_cache, layer, seq_idx, positions, start_pos, tables, window,
                                      ml.data(), ml.data() + T * Hk * G, out->typed_data(), p);
      err.failure())
    return err;
  std::vector<int32_t> lo;
  if (ffi::Error err = token_runs(p.seq_idx, positions.typed_data(), T, lo); err.failure()) return err;
  window_runs(positions.typed_data(), T, window, lo);
  const auto fold = pick(p);
  const float* K = k_new.typed_data();
  const float* V = v_new.typed_data();
  // Each token's cached blocks in parts_t even runs (by its own span and the model's heads
  // alone: a token's result does not depend on the step's other tokens), a work item each
  // (token, KV head, run); the last of a (token, head)'s runs to finish merges their states, adds
  // the local part and normalises. Before, one sequence's 3 KV heads (SmolLM2) were 3 items on 2
  // threads, one thread folding two while the other waited, and Gemma 3's one KV head ran on one
  // thread. One-stream decode, runner, alternated (2-core Zen 4): SmolLM2 Q4_1 at context 256
  // and 1024 about 1.01-1.05x, Gemma 3 Q4_K_M 1.16x at 256 and 1.21x at 1024; 16 sequences 0.99x.
  // Runs a token: enough for one token's heads to give each thread two items, none under
  // kMinRunBlocks blocks (p itself is one part: block_span gives the whole span).
  const int64_t want = std::max<int64_t>(1, (2 * pool.num_threads() + Hk - 1) / Hk);
  std::vector<int64_t> first(static_cast<size_t>(T + 1), 0);  // the first item of each token
  std::vector<int64_t> parts(static_cast<size_t>(T), 1);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t seq = p.seq_idx[t];
    if (seq >= 0 && lo[t] >= 0) {
      int64_t b0, b1;
      block_span(p, p.start_pos[seq], first_key(p, t), b0, b1);
      parts[t] = std::clamp<int64_t>(std::min(want, (b1 - b0) / kMinRunBlocks), 1, kMaxParts);
    }
    first[t + 1] = first[t] + Hk * parts[t];
  }
  const int64_t items = first[T];
  // Each run's state: m, l [items, G], acc [items, G, hd]; the runs of a (token, head) together.
  thread_local std::vector<float> run_ml, run_acc;  // kept between calls: no allocation a layer
  run_ml.resize(static_cast<size_t>(2 * items * G));
  run_acc.resize(static_cast<size_t>(items * G * hd));
  float* const rml = run_ml.data();  // not run_ml in the items: a thread_local names each thread's own
  float* const racc = run_acc.data();
  std::unique_ptr<std::atomic<int32_t>[]> left(new std::atomic<int32_t>[static_cast<size_t>(T * Hk)]);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hk; ++h) left[t * Hk + h].store(static_cast<int32_t>(parts[t]), std::memory_order_relaxed);
  parallel_for(pool, items, [&](int64_t i) {
    const int64_t t = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
    const int64_t P = parts[t], h = (i - first[t]) / P, c = (i - first[t]) % P;
    float* m = p.m + (t * Hk + h) * G;
    float* l = p.l + (t * Hk + h) * G;
    float* acc = p.acc + (t * Hk + h) * G * hd;
    if (lo[t] < 0) {  // padding
      std::fill(acc, acc + G * hd, 0.0f);
      return;
    }
    if (P == 1) {
      fold(p, t, h, h + 1);
    } else {
      // Run c into its slot: a Problem whose state arrays put (t, h) at this run's slot.
      const int64_t slot = first[t] + h * P + c;
      ProblemT<ffi::NativeType<KVT>> pc = p;
      pc.part = c;
      pc.parts = P;
      pc.m = rml + (slot - (t * Hk + h)) * G;
      pc.l = rml + items * G + (slot - (t * Hk + h)) * G;
      pc.acc = racc + (slot - (t * Hk + h)) * G * hd;
      fold(pc, t, h, h + 1);
      if (left[t * Hk + h].fetch_sub(1, std::memory_order_acq_rel) != 1) return;  // not the last run
      const int64_t r0 = first[t] + h * P;
      merge_runs(rml + r0 * G, rml + items * G + r0 * G, racc + r0 * G * hd, P, G, hd, m, l, acc);
    }
    local_fold_small(p.q + (t * Hk + h) * G * hd, K, V, lo[t], t, Hk, h, G, hd, m, l, acc);
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.0f / l[g];
      for (int64_t d = 0; d < hd; ++d) acc[g * hd + d] *= inv;
    }
  });
  return ffi::Error::Success();
}

// The bindings of the two attention handlers, over a float32 (F32) or a bf16-bits (U16) cache.
template <ffi::DataType KVT>
auto small_attention_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()           // q [T,Hk,G,hd], scaled
      .Arg<ffi::Buffer<ffi::F32>>()           // k_new
      .Arg<ffi::Buffer<ffi::F32>>()           // v_new
      .Arg<ffi::Buffer<KVT>>()                // k_cache
      .template Arg<ffi::Buffer<KVT>>()       // v_cache
      .template Arg<ffi::Buffer<ffi::S32>>()  // layer
      .template Arg<ffi::Buffer<ffi::S32>>()  // seq_idx
      .template Arg<ffi::Buffer<ffi::S32>>()  // positions
      .template Arg<ffi::Buffer<ffi::S32>>()  // start_pos
      .template Arg<ffi::Buffer<ffi::S32>>()  // block_tables
      .template Ret<ffi::Buffer<ffi::F32>>()  // out [T,Hk,G,hd]
      .template Attr<int32_t>("window");      // sliding window, 0: none
}

}  // namespace
}  // namespace tl

XLA_FFI_DEFINE_HANDLER_SYMBOL(TlSmallAttention, tl::SmallAttention<ffi::F32>, tl::small_attention_binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TlSmallAttentionBf16, tl::SmallAttention<ffi::U16>,
                              tl::small_attention_binding<ffi::U16>());
