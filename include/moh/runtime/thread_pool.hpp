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
// its own thread, under its own thread index, so nesting never deadlocks and never hands one
// index to two threads at once. Running a parallel region allocates nothing.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "moh/error.hpp"

namespace moh {
namespace detail {

/// A non-owning reference to a callable void(std::int64_t task, int thread): what
/// ThreadPool::run() takes, so that starting a parallel region never allocates (a std::function
/// holding a lambda with more than two captures would).
class TaskRef {
 public:
  template <class F>
  TaskRef(F& f)  // NOLINT: implicit, like a reference
      : object_(static_cast<void*>(&f)),
        call_([](void* o, std::int64_t task, int thread) { (*static_cast<F*>(o))(task, thread); }) {}
  void operator()(std::int64_t task, int thread) const { call_(object_, task, thread); }

 private:
  void* object_;
  void (*call_)(void*, std::int64_t, int);
};

}  // namespace detail

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

  /// The index of the pool thread running on this OS thread while it runs a task of some pool
  /// (0 for the thread that called run()), or -1 outside any task.
  static int current_index() { return current_thread(); }

  /// Runs fn(task, thread) for every task in [0, n) and returns when all are done. `thread` is in
  /// [0, size()) (for a run started inside a task, that task's own index) and no two tasks run
  /// at once with the same `thread`, so it can index per-thread scratch. The first exception a
  /// task throws is rethrown here.
  void run(std::int64_t n, detail::TaskRef fn) {
    if (n <= 0) return;
    if (current_thread() >= 0) {  // inside a task of some pool: stay on this thread and index
      for (std::int64_t i = 0; i < n; ++i) fn(i, current_thread());
      return;
    }
    if (size_ == 1 || n == 1) {
      const AsThread zero(0);  // reset even if a task throws
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
    {
      const AsThread zero(0);
      drain(0);
    }
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return busy_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  /// Marks this OS thread as pool thread `index` for the guard's lifetime.
  struct AsThread {
    explicit AsThread(int index) { current_thread() = index; }
    ~AsThread() { current_thread() = -1; }
    AsThread(const AsThread&) = delete;
    AsThread& operator=(const AsThread&) = delete;
  };

  /// The index of the pool thread running on this OS thread while it runs tasks, else -1.
  static int& current_thread() {
    thread_local int index = -1;
    return index;
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
    current_thread() = thread;
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
  const detail::TaskRef* job_ = nullptr;
  std::int64_t tasks_ = 0;
  std::atomic<std::int64_t> next_{0};
  int busy_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

/// Runs fn(task, thread) for task in [0, n) on `pool`, or inline on this thread (index 0) when
/// pool is null.
template <class F>
void parallel_for(ThreadPool* pool, std::int64_t n, F&& fn) {
  if (pool == nullptr) {
    const int thread = std::max(0, ThreadPool::current_index());
    for (std::int64_t i = 0; i < n; ++i) fn(i, thread);
    return;
  }
  pool->run(n, detail::TaskRef(fn));
}

/// Number of per-thread scratch arenas a parallel_for on `pool` needs from this thread: one per
/// pool thread, and room for this thread's index when it already runs inside a pool's task.
inline int thread_slots(const ThreadPool* pool) {
  return std::max(pool ? pool->size() : 1, ThreadPool::current_index() + 1);
}

}  // namespace moh
