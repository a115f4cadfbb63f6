// Process-wide thread pool for the CPU kernels (header-only; one instance per loaded library,
// shared by every translation unit that includes this header).
//
// Persistent workers, created lazily on first use and never destroyed. run() publishes a job;
// workers and the caller claim indices with an atomic counter. Any number of callers may run
// jobs at once; each caller also works on its own job, so a job always finishes even when every
// worker is busy elsewhere (and nested use cannot deadlock). Size:
// std::thread::hardware_concurrency(), or JAX_FLASH_CPU_THREADS when that is a positive integer
// (read once, at creation).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace jax_flash {
namespace cpu {

class ThreadPool {
 public:
  using Fn = void (*)(void* ctx, int64_t index);

  static ThreadPool& get() {
    static ThreadPool* pool = new ThreadPool(configured_threads());  // never destroyed
    return *pool;
  }

  // Threads that may work on one job: the workers plus the caller.
  int num_threads() const { return num_workers_ + 1; }

  // Calls fn(ctx, i) for every i in [0, n), in any order and on any threads; returns when all
  // calls have returned. fn must not throw.
  void run(int64_t n, Fn fn, void* ctx) {
    if (n <= 0) return;
    if (num_workers_ == 0 || n == 1) {
      for (int64_t i = 0; i < n; ++i) fn(ctx, i);
      return;
    }
    Job job;
    job.n = n;
    job.fn = fn;
    job.ctx = ctx;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(&job);
    }
    if (n - 1 >= num_workers_)
      work_cv_.notify_all();
    else
      for (int64_t i = 0; i < n - 1; ++i) work_cv_.notify_one();
    work_on(&job);
    std::unique_lock<std::mutex> lock(mu_);
    remove_locked(&job);
    done_cv_.wait(lock, [&] { return job.refs == 0; });
  }

 private:
  struct Job {
    int64_t n = 0;
    std::atomic<int64_t> next{0};
    Fn fn = nullptr;
    void* ctx = nullptr;
    int refs = 0;  // workers inside this job; guarded by mu_
  };

  static int configured_threads() {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("JAX_FLASH_CPU_THREADS")) {
      char* end = nullptr;
      const long v = std::strtol(env, &end, 10);
      if (end != env && v > 0) n = static_cast<int>(std::min<long>(v, 4096));
    }
    return std::max(n, 1);
  }

  explicit ThreadPool(int threads) {
    for (int i = 0; i < threads - 1; ++i) {
      try {
        std::thread(&ThreadPool::worker_loop, this).detach();
        ++num_workers_;
      } catch (...) {
        break;  // fewer workers; callers still make progress
      }
    }
  }

  static void work_on(Job* job) {
    for (int64_t i; (i = job->next.fetch_add(1, std::memory_order_relaxed)) < job->n;)
      job->fn(job->ctx, i);
  }

  void remove_locked(Job* job) {
    auto it = std::find(queue_.begin(), queue_.end(), job);
    if (it != queue_.end()) queue_.erase(it);
  }

  void worker_loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return !queue_.empty(); });
      Job* job = queue_.front();
      ++job->refs;
      lock.unlock();
      work_on(job);
      lock.lock();
      remove_locked(job);  // exhausted: nobody else should pick it up
      if (--job->refs == 0) done_cv_.notify_all();
    }
  }

  int num_workers_ = 0;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Job*> queue_;
};

// Runs f(i) for i in [0, n) on the shared pool. f must not throw.
template <typename F>
void parallel_for(int64_t n, F& f) {
  ThreadPool::get().run(
      n, [](void* ctx, int64_t i) { (*static_cast<F*>(ctx))(i); }, &f);
}

// Per-thread scratch of at least n floats for the kernels' work items, kept for the thread's
// lifetime and grown on demand (no allocation per item or per call once warm); one buffer per
// thread, shared by every kernel that runs on it. nullptr if the allocation fails.
inline float* thread_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) {
    try {
      buf.clear();
      buf.shrink_to_fit();
      buf.resize(static_cast<size_t>(n));
    } catch (...) {
      return nullptr;
    }
  }
  return buf.data();
}

}  // namespace cpu
}  // namespace jax_flash
