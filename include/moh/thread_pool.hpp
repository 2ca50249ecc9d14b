// ThreadPool: the caller's choice of threads for a forward pass.
//
// A pool of N threads is N-1 workers plus the calling thread. Layers split their work into
// fixed-size tasks whose boundaries never depend on the thread count, so results are bitwise
// identical whatever N is; the pool only decides which thread runs which task.
//
//   moh::ThreadPool pool(2);
//   moh::ForwardOptions opts;  opts.pool = &pool;  // not owned
//   layer.forward(x, y, opts);
//
// One pool may be shared by several layers and by several threads calling forward at once:
// calls are serialised on the pool. A task that calls back into the pool runs its inner work on
// its own thread, so nesting never deadlocks.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "moh/error.hpp"

namespace moh {

class ThreadPool {
 public:
  /// `num_threads` >= 1 counts the calling thread.
  explicit ThreadPool(int num_threads) : size_(num_threads) {
    detail::require(num_threads >= 1, "ThreadPool: num_threads must be >= 1: expected >= 1, got ",
                    num_threads);
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  /// Number of threads that run tasks, the caller included.
  int size() const { return size_; }

  /// Runs fn(task, thread) for every task in [0, n) and returns when all are done. `thread` is in
  /// [0, size()) and no two tasks run at once with the same `thread`, so it can index per-thread
  /// scratch. The first exception a task throws is rethrown here.
  void run(std::int64_t n, const std::function<void(std::int64_t, int)>& fn) {
    if (n <= 0) return;
    if (size_ == 1 || n == 1 || inside_pool()) {
      for (std::int64_t i = 0; i < n; ++i) fn(i, 0);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      tasks_ = n;
      next_.store(0);
      busy_ = static_cast<int>(workers_.size());
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    inside_pool() = true;
    drain(0);
    inside_pool() = false;
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return busy_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static bool& inside_pool() {
    thread_local bool inside = false;
    return inside;
  }

  void drain(int thread) {
    for (std::int64_t i = next_.fetch_add(1); i < tasks_; i = next_.fetch_add(1)) {
      try {
        (*job_)(i, thread);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  void work(int thread) {
    inside_pool() = true;
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      drain(thread);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (--busy_ == 0) done_.notify_one();
      }
    }
  }

  int size_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one run at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(std::int64_t, int)>* job_ = nullptr;
  std::int64_t tasks_ = 0;
  std::atomic<std::int64_t> next_{0};
  int busy_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

/// Runs fn(task, thread) for task in [0, n) on `pool`, or inline on this thread when pool is null.
template <class F>
void parallel_for(ThreadPool* pool, std::int64_t n, F&& fn) {
  if (pool == nullptr || pool->size() == 1 || n <= 1) {
    for (std::int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  pool->run(n, std::function<void(std::int64_t, int)>(std::forward<F>(fn)));
}

/// Number of per-thread scratch slots a parallel_for on `pool` needs.
inline int thread_slots(const ThreadPool* pool) { return pool ? pool->size() : 1; }

}  // namespace moh
