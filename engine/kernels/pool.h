// A small spinning thread pool for the matmul kernels (header-only, one pool per process).
//
// Decode calls ~50 matmuls per token, each 10-300 us, so waking threads through a condition
// variable (tens of us) would cost as much as the work: workers spin for a while after their
// last job (AOTLM_KERNEL_SPIN_US, default 2000) and only then sleep. The caller works on its own
// job too, and concurrent callers (one per device under forced-device tensor parallelism) each
// push a job that all idle workers help with. Size: AOTLM_KERNEL_THREADS, default all cores.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace aotlm {

struct Job {
  const std::function<void(int)>* fn;
  int n;
  std::atomic<int> next{0}, done{0}, refs{0};
};

class Pool {
 public:
  explicit Pool(int n) : size_(std::max(1, n)) {
    const char* s = std::getenv("AOTLM_KERNEL_SPIN_US");
    spin_us_ = s ? std::atoi(s) : 2000;
    for (int i = 1; i < size_; ++i) threads_.emplace_back([this] { loop(); });
  }
  int size() const { return size_; }

  void run(int n, const std::function<void(int)>& fn) {
    Job job;
    job.fn = &fn;
    job.n = n;
    if (size_ > 1 && n > 1) {
      {
        std::lock_guard<std::mutex> g(mu_);
        jobs_.push_back(&job);
        pending_.fetch_add(1);
      }
      cv_.notify_all();
    }
    work(job);
    if (size_ > 1 && n > 1) {
      {
        std::lock_guard<std::mutex> g(mu_);
        auto it = std::find(jobs_.begin(), jobs_.end(), &job);
        if (it != jobs_.end()) {
          jobs_.erase(it);
          pending_.fetch_sub(1);
        }
      }
      // a worker holding a chunk may be descheduled on a busy machine: yield, don't just spin
      for (int spins = 0;
           job.done.load(std::memory_order_acquire) < n || job.refs.load(std::memory_order_acquire) > 0;
           ++spins) {
        if (spins < 256)
          _mm_pause();
        else
          std::this_thread::yield();
      }
    }
  }

 private:
  static void work(Job& j) {
    int i;
    while ((i = j.next.fetch_add(1)) < j.n) {
      (*j.fn)(i);
      j.done.fetch_add(1, std::memory_order_release);
    }
  }

  Job* take() {  // under mu_: a job with work left, pinned by refs
    for (Job* j : jobs_)
      if (j->next.load() < j->n) {
        j->refs.fetch_add(1);
        return j;
      }
    return nullptr;
  }

  void loop() {
    using clock = std::chrono::steady_clock;
    auto last = clock::now();
    for (;;) {
      Job* j = nullptr;
      if (pending_.load(std::memory_order_acquire) > 0) {
        std::lock_guard<std::mutex> g(mu_);
        j = take();
      }
      if (j) {
        work(*j);
        j->refs.fetch_sub(1, std::memory_order_release);
        last = clock::now();
        continue;
      }
      for (int k = 0; k < 64; ++k) _mm_pause();
      std::this_thread::yield();  // let other runnable threads (XLA's, other processes) have the core
      if (clock::now() - last > std::chrono::microseconds(spin_us_)) {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [this] { return pending_.load() > 0; });
        last = clock::now();
      }
    }
  }

  int size_, spin_us_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job*> jobs_;
  std::atomic<int> pending_{0};
};

inline Pool& pool() {
  static Pool* p = [] {
    const char* s = std::getenv("AOTLM_KERNEL_THREADS");
    int n = s ? std::atoi(s) : int(std::thread::hardware_concurrency());
    return new Pool(n > 0 ? n : 1);  // never destroyed: workers live until the process exits
  }();
  return *p;
}
inline int pool_size() { return pool().size(); }
// Another executor for this thread's parallel_for calls while a ScopedExecutor lives (the prefill
// GEMMs run on XLA's own intra-op threads, wmatmul.cc: gemm_pk).
using Executor = std::function<void(int, const std::function<void(int)>&)>;
inline thread_local const Executor* tl_executor = nullptr;
struct ScopedExecutor {
  const Executor* old;
  explicit ScopedExecutor(const Executor* e) : old(tl_executor) { tl_executor = e; }
  ~ScopedExecutor() { tl_executor = old; }
};

inline void parallel_for(int n, const std::function<void(int)>& fn) {
  if (tl_executor)
    (*tl_executor)(n, fn);
  else
    pool().run(n, fn);
}

}  // namespace aotlm
