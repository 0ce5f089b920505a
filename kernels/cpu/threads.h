// Work over the threads of XLA's intra-op pool, with lingering helpers for chains of small calls.
//
// Owns: parallel_for (fn(i) for i in [0, n) on the pool's threads and this one, returning when
// every helper has left) and the helper slots it posts to. Must not: know any kernel.
//
// Lingering helpers. A one-token decode step is a dependent chain of ~120 small matmuls with
// small serial ops between them; a pool thread that has gone to sleep takes tens of
// microseconds to wake, and the caller's half of the matmul then waits for it (in a chain of
// the 30 layers' matmuls with attention between them, the attention cost 2.3 ms where alone it
// costs 0.9). So a helper that ran a `linger` job stays, spinning on a slot, for up to
// linger_ns (50 us) after it, and the next parallel_for hands its work to the spinning helper
// with one atomic store instead of a pool wake-up. Slot states: kFree (no helper), kIdle (a
// helper spins), kClaimed (a caller is posting), kWork (posted). Only a caller that moves
// kIdle -> kClaimed may post; only the slot's helper moves kIdle -> kFree, so no work is lost.
// The cost: a lingering helper holds a thread of XLA's pool, so pool work of XLA's own can wait
// up to linger_ns for it (with two programs running at once and a 1 ms linger, a test chain
// ran 50x slower); hence one-row matmuls only, where the ops around them run on one thread, and
// a short linger.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace tl {

// One parallel_for's shared state, on the heap: a helper task may start after the call has
// returned (both pool threads busy in calls of their own when XLA runs independent custom calls
// at once), so it must find the state still there, see the call closed and leave without
// touching the caller's work. `gate` counts helpers inside the work, plus kClosed once the
// caller has finished its own share; a helper enters only while it is not closed, and the caller
// waits only for helpers that entered. (Waiting for every scheduled helper, as this once did,
// deadlocked two concurrent calls on a 2-thread pool: each waited for a helper queued behind
// the other.)
struct Shared {
  static constexpr int64_t kClosed = int64_t{1} << 40;
  std::atomic<int64_t> gate{0};
  void (*run)(void*) = nullptr;  // runs items until none is left
  void* ctx = nullptr;           // the caller's work (valid while gate has no kClosed, or a helper is inside)

  // A helper's turn: run the work unless the caller has closed the call.
  void help() {
    if (gate.fetch_add(1, std::memory_order_acq_rel) & kClosed) {
      gate.fetch_sub(1, std::memory_order_acq_rel);
      return;
    }
    run(ctx);
    gate.fetch_sub(1, std::memory_order_acq_rel);
  }
};

struct Job {
  std::shared_ptr<Shared> shared;
};

struct alignas(64) Slot {
  std::atomic<int> state{0};
  Job job{};
};

enum : int { kFree = 0, kIdle = 1, kClaimed = 2, kWork = 3 };
constexpr int64_t kSlots = 64;
extern Slot g_slots[kSlots];

// After a linger job: own `slot` (if no helper does) and run what is posted there until the
// linger time passes with nothing posted (threads.cc).
void linger(Slot& slot);

template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, F&& fn, bool linger_after = false) {
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) {
    work();
    return;
  }
  auto shared = std::make_shared<Shared>();
  shared->run = [](void* w) { (*static_cast<decltype(work)*>(w))(); };
  shared->ctx = &work;
  for (int64_t h = 0; h < helpers; ++h) {
    Slot* slot = h < kSlots ? &g_slots[h] : nullptr;  // helpers past the slots neither linger nor are posted to
    int expected = kIdle;
    if (slot != nullptr && slot->state.compare_exchange_strong(expected, kClaimed, std::memory_order_acq_rel)) {
      slot->job = Job{shared};
      slot->state.store(kWork, std::memory_order_release);
      continue;
    }
    pool.Schedule([shared, slot, linger_after] {
      shared->help();
      if (linger_after && slot != nullptr) linger(*slot);
    });
  }
  work();
  int64_t inside = shared->gate.fetch_add(Shared::kClosed, std::memory_order_acq_rel);
  while (inside != 0) {  // helpers that entered finish the items they took
    std::this_thread::yield();
    inside = shared->gate.load(std::memory_order_acquire) - Shared::kClosed;
  }
}

}  // namespace tl
