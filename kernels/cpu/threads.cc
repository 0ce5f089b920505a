// The helper slots of threads.h and how long a helper lingers (TlSetLingerNs).
#include "threads.h"

#include <chrono>

#include "simd.h"

namespace tl {

Slot g_slots[kSlots];

namespace {

std::atomic<int64_t> g_linger_ns{50000};  // TlSetLingerNs: benchmarks compare values, 0 = off

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void linger(Slot& slot) {
  const int64_t linger_ns = g_linger_ns.load(std::memory_order_relaxed);
  int expected = kFree;
  if (linger_ns <= 0 || !slot.state.compare_exchange_strong(expected, kIdle, std::memory_order_acq_rel)) return;
  int64_t deadline = now_ns() + linger_ns;
  for (uint32_t spins = 0;; ++spins) {  // unsigned: wraps, never overflows
    const int s = slot.state.load(std::memory_order_acquire);
    if (s == kWork) {
      Job job = std::move(slot.job);
      job.shared->help();
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

}  // namespace tl

extern "C" void TlSetLingerNs(int64_t ns) { tl::g_linger_ns.store(ns, std::memory_order_relaxed); }
