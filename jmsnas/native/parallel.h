// A parallel loop on XLA's intra-op thread pool, shared by the native CPU kernels.
#ifndef JMSNAS_NATIVE_PARALLEL_H_
#define JMSNAS_NATIVE_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jmsnas {

// A loop over [0, n).
// Chunks are taken from a shared counter by the calling thread and by helper tasks; the caller only waits for
// chunks another thread has already started, so the loop cannot deadlock when every pool thread is busy (a
// helper that starts after the work is gone returns at once). fn(begin, end) runs each chunk once.

struct LoopState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t n = 0, grain = 1;
  std::function<void(int64_t, int64_t)> fn;
};

inline void RunChunks(LoopState& st) {
  for (;;) {
    int64_t begin = st.next.fetch_add(st.grain);
    if (begin >= st.n) return;
    int64_t end = std::min(begin + st.grain, st.n);
    st.fn(begin, end);
    if (st.done.fetch_add(end - begin) + (end - begin) == st.n) {
      std::lock_guard<std::mutex> lock(st.mu);
      st.cv.notify_all();
    }
  }
}

inline int NumWorkers(xla::ffi::ThreadPool& pool, int64_t n) {
  int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  return static_cast<int>(std::max<int64_t>(std::min<int64_t>(threads, n), 1));
}

inline void ParallelFor(xla::ffi::ThreadPool& pool, int workers, int64_t n,
                        std::function<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  auto st = std::make_shared<LoopState>();
  st->n = n;
  st->grain = std::max<int64_t>(1, n / (8 * workers));
  st->fn = std::move(fn);
  for (int t = 1; t < workers; ++t) {
    pool.Schedule([st] { RunChunks(*st); });
  }
  RunChunks(*st);
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == st->n; });
}

// [0, n) cut into `blocks` contiguous blocks whose bounds depend only on n and blocks, each run once as
// fn(block, begin, end) on some thread. Reductions that keep one partial result per block and add the blocks in
// order give the same bits whatever the thread count and scheduling (a partial per thread would not).
inline void ParallelBlocks(xla::ffi::ThreadPool& pool, int64_t n, int64_t blocks,
                           const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  ParallelFor(pool, NumWorkers(pool, blocks), blocks, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) fn(k, k * n / blocks, (k + 1) * n / blocks);
  });
}

// out[0, size) = the sum of the `blocks` partial results partial[b * size, (b + 1) * size), added in block order
// (the second half of a ParallelBlocks reduction; the order makes the result independent of scheduling).
inline void AddBlocksInOrder(const float* partial, int64_t blocks, int64_t size, float* out) {
  std::copy(partial, partial + size, out);
  for (int64_t b = 1; b < blocks; ++b) {
    const float* p = partial + b * size;
    for (int64_t i = 0; i < size; ++i) out[i] += p[i];
  }
}

}  // namespace jmsnas

#endif  // JMSNAS_NATIVE_PARALLEL_H_
