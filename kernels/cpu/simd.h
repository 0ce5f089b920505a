// Vector types and helpers for every target the library is built for (kernels/cpu_build.py:
// x86-64 baseline SSE2, x86-64-v3 AVX2+FMA, x86-64-v4 AVX-512, Sapphire Rapids AMX, aarch64
// NEON), written with GCC vector extensions so that one source compiles everywhere.
//
// Owns: `vf` (one hardware vector of floats: kLanes floats, kRegs architectural registers),
// `v16` (16 floats: a KV block's keys, whatever the hardware width), loads, stores, horizontal
// reductions, a vector exp, prefetches and a spin hint. Must not: hold state.
//
// Why both types: register blocking (how many accumulators a kernel keeps) follows the
// hardware registers, so the matmuls count in `vf`; the attention kernels follow the KV block
// of 16 keys, so they count in v16 and size their blocking by kV16Regs, the v16 values that fit
// in registers. A kernel tuned on AVX-512 (32 x 16 floats) that keeps 20 v16 live spills on
// AVX2 (16 x 8 floats = 8 v16): that is how this library once ran 4x slower than XLA there.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace tl {

#if defined(__AVX512F__)
#define TL_LANES 16
constexpr int kRegs = 32;
#elif defined(__AVX__)
#define TL_LANES 8
constexpr int kRegs = 16;
#elif defined(__aarch64__)
#define TL_LANES 4
constexpr int kRegs = 32;
#else  // SSE2
#define TL_LANES 4
constexpr int kRegs = 16;
#endif
constexpr int kLanes = TL_LANES;
constexpr int kV16Regs = kRegs * kLanes / 16;  // v16 values that fit in registers: 32, 8 (AVX2, NEON), 4 (SSE2)

constexpr float kNoScore = -1e30f;  // a masked score (finite: the library is built with -ffast-math)

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef float vfu __attribute__((vector_size(4 * kLanes), aligned(4)));  // unaligned load/store
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));

typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef float f8 __attribute__((vector_size(32)));
typedef float f4 __attribute__((vector_size(16)));
typedef float f16x __attribute__((vector_size(64)));
typedef float f16xu __attribute__((vector_size(64), aligned(4)));

// IEEE half bits -> float, exactly (F16C or aarch64's conversion where present, else by bits).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#elif defined(__aarch64__)
  __fp16 f;
  std::memcpy(&f, &h, sizeof f);
  return static_cast<float>(f);
#else
  const uint32_t sign = static_cast<uint32_t>(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &v, sizeof bits);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// bfloat16 bits -> float: its top half, exactly.
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline vf loadv(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void storev(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
inline vf splatv(float x) { return vf{} + x; }

// e^x for x <= 0 (scores minus their running max), relative error ~2e-7; x below -87 gives ~0.
template <typename V, typename I>
inline V vexp_t(V x) {
  x = x < -87.0f ? V{} - 87.0f : x;
  const V t = x * 1.44269504088896341f;
  V n = __builtin_convertvector(__builtin_convertvector(t, I), V);           // trunc toward 0
  n = n > t ? n - 1.0f : n;                                                  // floor
  const V r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;  // in [0, ln 2)
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I e = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// ---- v16: 16 floats (m16 its lane masks, i16 16 int32) ----------------------------------------
//
// With AVX-512 a v16 is one register (GCC's vector type). Elsewhere it is a struct of 16 /
// kLanes native vectors with elementwise operators: GCC lowers a 64-byte vector type on AVX2
// through the stack (every multiply-add of the attention fold stored and reloaded its operands:
// 1128 stack accesses in one function, 8 GB/s where the fold should stream), and the struct
// keeps each part in a register.
#if TL_LANES == 16
typedef f16x v16;
typedef int32_t i16 __attribute__((vector_size(64)));
typedef i16 m16;
inline v16 load16(const float* p) { return *reinterpret_cast<const f16xu*>(p); }
inline void store16(float* p, v16 x) { *reinterpret_cast<f16xu*>(p) = x; }
inline v16 select(m16 m, v16 a, v16 b) { return m ? a : b; }
inline i16 select(m16 m, i16 a, i16 b) { return m ? a : b; }
inline v16 vexp(v16 x) { return vexp_t<v16, i16>(x); }
inline float lane(v16 x, int i) { return x[i]; }
inline int32_t lane(i16 x, int i) { return x[i]; }
#else
constexpr int kParts = 16 / kLanes;

struct i16 {
  vi p[kParts];
};
struct m16 {  // lanes all-ones where true
  vi p[kParts];
};
struct v16 {
  vf p[kParts];
  v16& operator+=(v16 b) {
    for (int i = 0; i < kParts; ++i) p[i] += b.p[i];
    return *this;
  }
  v16& operator*=(v16 b) {
    for (int i = 0; i < kParts; ++i) p[i] *= b.p[i];
    return *this;
  }
  v16& operator*=(float b) {
    for (int i = 0; i < kParts; ++i) p[i] *= b;
    return *this;
  }
};

#define TL_V16_BINARY(OP)                                       \
  inline v16 operator OP(v16 a, v16 b) {                        \
    for (int i = 0; i < kParts; ++i) a.p[i] = a.p[i] OP b.p[i]; \
    return a;                                                   \
  }                                                             \
  inline v16 operator OP(v16 a, float b) {                      \
    for (int i = 0; i < kParts; ++i) a.p[i] = a.p[i] OP b;      \
    return a;                                                   \
  }                                                             \
  inline v16 operator OP(float a, v16 b) {                      \
    for (int i = 0; i < kParts; ++i) b.p[i] = a OP b.p[i];      \
    return b;                                                   \
  }
TL_V16_BINARY(+)
TL_V16_BINARY(-)
TL_V16_BINARY(*)
#undef TL_V16_BINARY

#define TL_V16_COMPARE(T, OP)                                   \
  inline m16 operator OP(T a, T b) {                            \
    m16 m;                                                      \
    for (int i = 0; i < kParts; ++i) m.p[i] = a.p[i] OP b.p[i]; \
    return m;                                                   \
  }
TL_V16_COMPARE(v16, <)
TL_V16_COMPARE(v16, >)
TL_V16_COMPARE(i16, <)
TL_V16_COMPARE(i16, <=)
TL_V16_COMPARE(i16, >=)
#undef TL_V16_COMPARE

inline v16 splat(float x);
inline i16 splati(int32_t x) {
  i16 r;
  for (int i = 0; i < kParts; ++i) r.p[i] = vi{} + x;
  return r;
}
inline m16 operator<(v16 a, float b) { return a < splat(b); }
inline m16 operator>(v16 a, float b) { return a > splat(b); }
inline m16 operator<(i16 a, int32_t b) { return a < splati(b); }
inline m16 operator<=(i16 a, int32_t b) { return a <= splati(b); }
inline m16 operator>=(i16 a, int32_t b) { return a >= splati(b); }
inline i16 operator+(i16 a, int32_t b) {
  for (int i = 0; i < kParts; ++i) a.p[i] += b;
  return a;
}
inline m16 operator&(m16 a, m16 b) {
  for (int i = 0; i < kParts; ++i) a.p[i] &= b.p[i];
  return a;
}

inline v16 load16(const float* p) {
  v16 r;
  for (int i = 0; i < kParts; ++i) r.p[i] = loadv(p + kLanes * i);
  return r;
}
inline void store16(float* p, v16 x) {
  for (int i = 0; i < kParts; ++i) storev(p + kLanes * i, x.p[i]);
}
inline v16 select(m16 m, v16 a, v16 b) {
  for (int i = 0; i < kParts; ++i) a.p[i] = m.p[i] ? a.p[i] : b.p[i];
  return a;
}
inline i16 select(m16 m, i16 a, i16 b) {
  for (int i = 0; i < kParts; ++i) a.p[i] = m.p[i] ? a.p[i] : b.p[i];
  return a;
}
inline v16 vexp(v16 x) {
  for (int i = 0; i < kParts; ++i) x.p[i] = vexp_t<vf, vi>(x.p[i]);
  return x;
}
inline float lane(v16 x, int i) { return x.p[i / kLanes][i % kLanes]; }
inline int32_t lane(i16 x, int i) { return x.p[i / kLanes][i % kLanes]; }
#endif

inline v16 splat(float x) {
  v16 r{};
  return r + x;
}
inline v16 vmax(v16 a, v16 b) { return select(a > b, a, b); }
// 16 bf16 values (a bf16 KV cache's uint16 bits) widened to floats: bf16 is a float's top half.
typedef uint16_t u16v __attribute__((vector_size(2 * kLanes), aligned(2)));
typedef uint32_t u32v __attribute__((vector_size(4 * kLanes)));
inline v16 load16(const uint16_t* p) {
#if TL_LANES == 16
  return (v16)(__builtin_convertvector(*reinterpret_cast<const u16x16*>(p), u32x16) << 16);
#else
  v16 r;
  for (int i = 0; i < kParts; ++i)
    r.p[i] = (vf)(__builtin_convertvector(*reinterpret_cast<const u16v*>(p + kLanes * i), u32v) << 16);
  return r;
#endif
}
inline i16 iota16() {
  alignas(64) const int32_t x[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  i16 r;
  std::memcpy(&r, x, sizeof r);
  return r;
}

// Horizontal sum and max of a v16 by halving.
inline float hsum(v16 x) {
#if TL_LANES == 16
  const f8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#elif TL_LANES == 8
  const f8 a = x.p[0] + x.p[1];
#else
  const f4 a4 = (x.p[0] + x.p[1]) + (x.p[2] + x.p[3]);
  return (a4[0] + a4[2]) + (a4[1] + a4[3]);
#endif
#if TL_LANES >= 8
  const f4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#endif
}
inline float hmax(v16 x) {
#if TL_LANES == 16
  const f8 lo = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  const f8 hi = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const f8 a = lo > hi ? lo : hi;
#elif TL_LANES == 8
  const f8 a = x.p[0] > x.p[1] ? x.p[0] : x.p[1];
#else
  const f4 a1 = x.p[0] > x.p[1] ? x.p[0] : x.p[1], a2 = x.p[2] > x.p[3] ? x.p[2] : x.p[3];
  const f4 b = a1 > a2 ? a1 : a2;
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
#endif
#if TL_LANES >= 8
  const f4 l4 = __builtin_shufflevector(a, a, 0, 1, 2, 3), h4 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f4 b = l4 > h4 ? l4 : h4;
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
#endif
}
inline float hsumv(vf x) {
#if TL_LANES == 16
  return hsum(x);
#elif TL_LANES == 8
  const f4 b = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#else
  return (x[0] + x[2]) + (x[1] + x[3]);
#endif
}

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace tl
