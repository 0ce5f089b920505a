// The int8 ceiling of this CPU: multiply-adds a second of its widest integer dot instruction, from
// registers, on every core. Built and run by bench/int8_peak.py; not part of the library.
//
// One thread a core runs kChains independent accumulators (enough to cover the instruction's
// latency), each its own pair of operands (two opaque vectors against four constants, so no
// product is computed once for two chains), for `iters` rounds: AVX-512 VNNI vpdpbusd (64 u8 x s8 products into 16
// int32 lanes a 512-bit instruction), else AVX2 vpmaddubsw then vpaddw (32 products a 256-bit instruction, the add
// being what the kernels pay to accumulate them: quant_avx2.h). Prints one line: the multiply-adds a second over all
// threads, and the instruction measured.

#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

constexpr int kChains = 8;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr const char* kWhat = "vpdpbusd zmm";
constexpr int64_t kMacs = 64;
int64_t run(int64_t iters, int seed) {
  __m512i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(seed + c);
  const __m512i a0 = _mm512_set1_epi8(static_cast<char>(seed | 1)), b = _mm512_set1_epi8(3);
  __m512i a[2] = {a0, _mm512_add_epi8(a0, b)}, bs[4];
  for (int k = 0; k < 4; ++k) bs[k] = _mm512_add_epi8(b, _mm512_set1_epi8(static_cast<char>(k)));
  for (int64_t i = 0; i < iters; ++i) {
    asm volatile("" : "+v"(a[0]), "+v"(a[1]));  // opaque each round: no product hoisted out of the loop
#pragma GCC unroll 8
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a[c % 2], bs[c / 2]);
  }
  int64_t sum = 0;
  for (int c = 0; c < kChains; ++c) {  // (GCC 12's _mm512_reduce_add_epi32 warns of an uninitialized __Y)
    alignas(64) int32_t lanes[16];
    _mm512_store_si512(lanes, acc[c]);
    for (int32_t v : lanes) sum += v;
  }
  return sum;
}
#else
constexpr const char* kWhat = "vpmaddubsw + vpaddw ymm";
constexpr int64_t kMacs = 32;
int64_t run(int64_t iters, int seed) {
  __m256i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi16(static_cast<int16_t>(seed + c));
  __m256i a[2] = {_mm256_set1_epi8(static_cast<char>(seed | 1)), _mm256_set1_epi8(static_cast<char>(seed | 5))};
  __m256i bs[4];
  for (int k = 0; k < 4; ++k) bs[k] = _mm256_set1_epi8(static_cast<char>(3 + k));
  for (int64_t i = 0; i < iters; ++i) {
    asm volatile("" : "+x"(a[0]), "+x"(a[1]));  // opaque each round: no product hoisted out of the loop
#pragma GCC unroll 8
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(a[c % 2], bs[c / 2]));
  }
  int64_t sum = 0;
  for (int c = 0; c < kChains; ++c) sum += _mm256_extract_epi16(acc[c], 0);
  return sum;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  const int64_t iters = argc > 2 ? std::atoll(argv[2]) : 100000000;
  std::vector<std::thread> pool;
  std::vector<int64_t> sums(static_cast<size_t>(threads));
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { sums[static_cast<size_t>(t)] = run(iters, t + argc); });
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t check = 0;
  for (int64_t v : sums) check += v;
  std::printf("%.6e %s %lld\n", static_cast<double>(threads) * iters * kChains * kMacs / s, kWhat,
              static_cast<long long>(check & 1));
  return 0;
}
