// What the panel layout (weight_layout "panels": tl/model/encodings/panels.py) buys one-row Q4_1
// matmuls over the rows as a GGUF stores them, kernel against kernel without XLA around them.
// Built and run by bench/qlayout_bench.py (`python -m bench qlayout`) for the x86-64-v4-vnni
// target; not part of the library.
//
// Includes the quantized matmuls' headers (kernels/cpu/quant.h, quant_avx512.h), so that both
// one-row kernels run here as the engine runs them: exact_row on the stored rows (its lanes
// reduced to block sums, the scales loaded output by output) and panels_range on the panels (16
// outputs in the lanes: 4 loads, 8 vpdpbusd, one conversion and two fmas a block and 16 outputs).
// repack() below writes the layout panels.py packs (the quant bytes of a block transposed to
// [4][16 outputs][4], then the 16 d and 16 m); the two must give the same outputs bit for bit
// (checked).
//
// Prints: one matrix resident in L2, one thread (the kernels' compute), then SmolLM2-135M's 30
// layers of one-row matmuls (wqkv 960 x 576, wo 576 x 576, gate_up 3072 x 576, down 576 x 1536;
// 66 MB of distinct weights, from memory) on one thread and on two (each half of each matrix's
// outputs, a spin barrier between matrices, as a decode step's chain), the layouts alternated.

#include "../kernels/cpu/quant.h"
#include "../kernels/cpu/quant_avx512.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>

namespace {
using tl::XL;
using tl::XQ;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Stored Q4_1 rows [O][nb][20] -> panels [O / 16][nb][320] (O a multiple of 16), as panels.py's pack.
void repack(const uint8_t* W, int64_t O, int64_t nb, uint8_t* P) {
  for (int64_t p = 0; p < O / 16; ++p)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* out = P + (p * nb + b) * 320;
      for (int l = 0; l < 16; ++l) {
        const uint8_t* blk = W + ((p * 16 + l) * nb + b) * 20;
        uint8_t u[32];
        for (int i = 0; i < 16; ++i) u[i] = blk[4 + i] & 15, u[i + 16] = blk[4 + i] >> 4;
        for (int v = 0; v < 4; ++v)
          for (int j = 0; j < 4; ++j)
            out[v * 64 + l * 4 + j] = static_cast<uint8_t>(u[4 * v + j] | (u[4 * (v + 4) + j] << 4));
        std::memcpy(out + 256 + 2 * l, blk, 2);      // d
        std::memcpy(out + 288 + 2 * l, blk + 2, 2);  // m
      }
    }
}

struct Mat {
  int64_t O, K;
  std::vector<uint8_t> W, P;
};

Mat random_q4_1(int64_t O, int64_t K, std::mt19937& rng) {
  std::uniform_int_distribution<int> byte(0, 255), scale(0, 6);
  Mat m{O, K, std::vector<uint8_t>(static_cast<size_t>(O * K / 32 * 20)), {}};
  const int64_t nb = K / 32;
  for (int64_t i = 0; i < O * nb; ++i) {
    uint8_t* blk = m.W.data() + i * 20;
    const uint16_t d = _cvtss_sh(0.01f + 0.001f * static_cast<float>(scale(rng)), 0), mn = _cvtss_sh(-0.08f, 0);
    std::memcpy(blk, &d, 2), std::memcpy(blk + 2, &mn, 2);
    for (int j = 4; j < 20; ++j) blk[j] = static_cast<uint8_t>(byte(rng));
  }
  m.P.resize(m.W.size());
  repack(m.W.data(), O, nb, m.P.data());
  return m;
}

// x quantized as the engine does, in both kernels' forms.
struct XForms {
  std::vector<int8_t> q, lq;
  std::vector<float> d8, s;
  std::vector<int32_t> lc, sums;  // sums: each block's sum of q_x (q4_1 has no offset to weigh it)
  XQ xq{};
  XL xl{};
  void set(const float* X, int64_t K) {
    const int64_t nb = K / 32, np = (nb + 1) / 2;
    q.assign(static_cast<size_t>(K + 64), 0), d8.assign(static_cast<size_t>(nb * 8 + 8), 0),
        s.assign(static_cast<size_t>(nb), 0);
    lq.assign(static_cast<size_t>(np * 64), 0), lc.assign(static_cast<size_t>(np * 16), 0);
    tl::quantize_x(X, 1, K, q.data(), d8.data(), s.data());
    xq = XQ{q.data(), d8.data(), s.data(), K, nb};
    tl::layout_x<tl::kQ4_1>(xq, 1, lq.data(), lc.data(), np);
    xl = XL{lq.data(), lc.data(), np};
    sums.assign(static_cast<size_t>(nb), 0);
    tl::block_sums(xq.q, nb, sums.data());
  }
};

// Outputs [o0, o1) of m: exact_row on the stored rows or the panel kernel on the panels.
void part(const Mat& m, const XForms& x, bool packed, int64_t o0, int64_t o1, float* Y) {
  if (packed) return tl::panels_range<tl::kQ4_1>(m.P.data(), x.xq, x.sums.data(), 1, m.O, Y, o0 / 16, o1 / 16);
  for (int64_t o = o0; o < o1; o += 8)
    tl::exact_row<tl::kQ4_1>(m.W.data(), m.K / 32 * 20, x.xl, x.xq, m.O, Y, o, 8, 0, o + 8 + tl::kExactAhead <= o1);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main() {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> X(1536);
  for (auto& v : X) v = nd(rng);

  {  // One matrix in L2, one thread.
    const Mat m = random_q4_1(960, 576, rng);
    XForms x;
    x.set(X.data(), 576);
    std::vector<float> ya(960), yb(960);
    part(m, x, false, 0, 960, ya.data());
    part(m, x, true, 0, 960, yb.data());
    int differ = 0;
    for (int i = 0; i < 960; ++i) differ += ya[i] != yb[i];
    std::vector<double> t[2];
    for (int round = 0; round < 30; ++round)
      for (int packed = 0; packed < 2; ++packed) {
        const double t0 = now();
        for (int r = 0; r < 100; ++r) part(m, x, packed, 0, 960, packed ? yb.data() : ya.data());
        t[packed].push_back((now() - t0) / 100);
      }
    const double bytes = static_cast<double>(m.W.size());
    std::printf(
        "case one-960x576-in-L2-1-thread stored_us %.2f packed_us %.2f stored_GBs %.1f packed_GBs %.1f differ %d\n",
        median(t[0]) * 1e6, median(t[1]) * 1e6, bytes / median(t[0]) / 1e9, bytes / median(t[1]) / 1e9, differ);
  }

  // SmolLM2's layers from memory.
  std::vector<Mat> ms;
  const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  double total = 0;
  for (int l = 0; l < 30; ++l)
    for (const auto& sh : shapes) {
      ms.push_back(random_q4_1(sh[0], sh[1], rng));
      total += static_cast<double>(ms.back().W.size());
    }
  std::vector<XForms> xs(ms.size());
  for (size_t i = 0; i < ms.size(); ++i) xs[i].set(X.data(), ms[i].K);
  std::vector<float> Y0(3072), Y1(3072);
  std::atomic<int> arrived{0}, go{-1}, finished{0};
  std::atomic<bool> stop{false};
  auto chain_half = [&](int h, bool packed, bool two) {
    for (size_t i = 0; i < ms.size(); ++i) {
      const Mat& m = ms[i];
      const int64_t cut = two ? m.O / 128 * 64 : m.O;  // a multiple of 64 outputs: whole groups of 4 panels
      part(m, xs[i], packed, h ? cut : 0, h ? m.O : cut, h ? Y1.data() : Y0.data());
      if (two) {  // the barrier between a step's dependent matmuls
        arrived.fetch_add(1);
        while (arrived.load() < 2 * static_cast<int>(i + 1)) _mm_pause();
      }
    }
  };
  std::thread helper([&] {
    for (int seen = -1; !stop.load();) {
      const int g = go.load();
      if (g == seen || g < 0) {
        _mm_pause();
        continue;
      }
      seen = g;
      chain_half(1, g & 1, true);
      finished.fetch_add(1);
    }
  });
  std::vector<double> t[2][2];  // [threads - 1][packed]
  for (int round = 0; round < 16; ++round) {
    const bool packed = round & 1;
    const double t0 = now();
    chain_half(0, packed, false);
    t[0][packed].push_back(now() - t0);
    arrived.store(0);
    const int before = finished.load();
    const double t1 = now();
    go.store(round);
    chain_half(0, packed, true);
    while (finished.load() == before) _mm_pause();
    t[1][packed].push_back(now() - t1);
  }
  stop.store(true);
  helper.join();
  for (int th = 0; th < 2; ++th)
    std::printf(
        "case smollm2-layers-%d-thread(s) MB %.1f stored_ms %.2f packed_ms %.2f stored_GBs %.1f packed_GBs %.1f\n",
        th + 1, total / 1e6, median(t[th][0]) * 1e3, median(t[th][1]) * 1e3, total / median(t[th][0]) / 1e9,
        total / median(t[th][1]) / 1e9);
  return 0;
}
