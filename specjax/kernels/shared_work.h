// specjax CPU kernels: work items shared out between the calling thread and XLA's own intra-op
// thread pool (the FFI ThreadPool context); no thread of our own is made. Items are taken from a
// shared counter as threads come free; the caller waits only for items that were taken, so a pool
// task that starts late finds nothing to do and cannot deadlock the call.
#ifndef SPECJAX_KERNELS_SHARED_WORK_H_
#define SPECJAX_KERNELS_SHARED_WORK_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace specjax_kernels {

struct SharedWork {
  std::function<void(int64_t)> run;   // does item i
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

inline void TakeItems(SharedWork& w) {
  for (;;) {
    const int64_t i = w.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= w.items) return;
    w.run(i);
    w.done.fetch_add(1, std::memory_order_release);
  }
}

// Runs run(i) for every i in [0, items) on the caller and up to pool.num_threads() - 1 helpers.
inline void ShareOut(xla::ffi::ThreadPool& pool, int64_t items, std::function<void(int64_t)> run) {
  if (items <= 0) return;
  auto work = std::make_shared<SharedWork>();
  work->run = std::move(run);
  work->items = items;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min<int64_t>(threads - 1, items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { TakeItems(*work); });
  TakeItems(*work);
  for (int spins = 0; work->done.load(std::memory_order_acquire) < items; ++spins) {
#if defined(__x86_64__) || defined(_M_X64)
    if (spins < 4096) { _mm_pause(); continue; }
#endif
    std::this_thread::yield();
  }
}

}  // namespace specjax_kernels

#endif  // SPECJAX_KERNELS_SHARED_WORK_H_
