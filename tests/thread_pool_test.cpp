// Tests for moh/thread_pool.hpp: every task runs exactly once, thread ids are in [0, size) and
// never shared by two running tasks, exceptions reach the caller, nested runs and concurrent
// callers do not deadlock, and a pool of 0 threads is refused.
#include "moh/thread_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

/// Runs fn on its own thread and waits up to `seconds`; false if it did not finish (a deadlock).
/// On timeout the thread is left detached with its state kept alive, so the test can report
/// instead of hanging.
bool finishes_within(std::function<void()> fn, double seconds) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> f = done->get_future();
  std::thread([fn = std::move(fn), done] {
    try {
      fn();
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  if (f.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) return false;
  f.get();  // rethrows what fn threw
  return true;
}

TEST(ThreadPool, RunsEveryTaskExactlyOnce) {
  for (int threads : {1, 2, 3, 4, 8}) {
    moh::ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (std::int64_t n : {std::int64_t(1), std::int64_t(2), std::int64_t(7), std::int64_t(1000)}) {
      std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
      for (auto& h : hits) h = 0;
      pool.run(n, [&](std::int64_t task, int) { hits[static_cast<std::size_t>(task)]++; });
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_EQ(hits[static_cast<std::size_t>(i)].load(), 1)
            << "threads " << threads << " n " << n << " task " << i;
    }
    bool ran = false;
    pool.run(0, [&](std::int64_t, int) { ran = true; });
    pool.run(-3, [&](std::int64_t, int) { ran = true; });
    EXPECT_FALSE(ran);
  }
}

TEST(ThreadPool, ThreadIdsInRangeAndNeverSharedWhileRunning) {
  // A thread id indexes per-thread scratch: two tasks that run at the same time must have
  // different ids, and every id is in [0, size).
  for (int threads : {2, 3, 5}) {
    moh::ThreadPool pool(threads);
    std::vector<std::atomic<int>> busy(static_cast<std::size_t>(threads));
    for (auto& b : busy) b = 0;
    std::atomic<int> out_of_range{0}, shared{0};
    pool.run(400, [&](std::int64_t task, int thread) {
      if (thread < 0 || thread >= threads) {
        ++out_of_range;
        return;
      }
      if (busy[static_cast<std::size_t>(thread)].exchange(1) != 0) ++shared;
      if (task % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      busy[static_cast<std::size_t>(thread)] = 0;
    });
    EXPECT_EQ(out_of_range.load(), 0) << threads;
    EXPECT_EQ(shared.load(), 0) << threads;
  }
}

TEST(ThreadPool, ExceptionsPropagateAndPoolStaysUsable) {
  moh::ThreadPool pool(3);
  std::atomic<int> count{0};
  try {
    pool.run(100, [&](std::int64_t task, int) {
      ++count;
      if (task == 37) throw std::runtime_error("boom 37");
    });
    FAIL() << "expected the task's exception";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "boom 37");
  }
  EXPECT_GE(count.load(), 1);
  // A moh::Error keeps its type.
  EXPECT_THROW(pool.run(10, [](std::int64_t task, int) {
                 if (task == 9) moh::detail::fail("task ", task);
               }),
               moh::Error);
  // The pool still works afterwards, and a run without errors does not rethrow an old one.
  std::vector<std::atomic<int>> hits(50);
  for (auto& h : hits) h = 0;
  EXPECT_NO_THROW(pool.run(50, [&](std::int64_t t, int) { hits[static_cast<std::size_t>(t)]++; }));
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  // Single-threaded pools and parallel_for propagate as well.
  moh::ThreadPool one(1);
  EXPECT_THROW(one.run(3, [](std::int64_t, int) { throw std::logic_error("x"); }), std::logic_error);
  EXPECT_THROW(moh::parallel_for(&pool, 8, [](std::int64_t t, int) {
                 if (t == 5) throw std::out_of_range("y");
               }),
               std::out_of_range);
}

TEST(ThreadPool, NestedRunFromInsideATaskDoesNotDeadlock) {
  auto* pool = new moh::ThreadPool(3);  // leaked on deadlock, deleted otherwise
  std::atomic<int> inner{0};
  std::atomic<int> bad_thread{0};
  const bool finished = finishes_within(
      [&] {
        pool->run(12, [&](std::int64_t, int) {
          pool->run(10, [&](std::int64_t, int thread) {
            if (thread < 0 || thread >= 3) ++bad_thread;
            ++inner;
          });
          moh::parallel_for(pool, 5, [&](std::int64_t, int) { ++inner; });
        });
      },
      20.0);
  ASSERT_TRUE(finished) << "nested ThreadPool::run deadlocked";
  EXPECT_EQ(inner.load(), 12 * 15);
  EXPECT_EQ(bad_thread.load(), 0);
  delete pool;
}

TEST(ThreadPool, ConcurrentCallersShareOnePool) {
  // Several std::threads call run() on one pool at once; each sees all of its own tasks once.
  auto* pool = new moh::ThreadPool(3);
  constexpr int kCallers = 4, kRounds = 40, kTasks = 97;
  std::atomic<int> failures{0};
  std::atomic<long> total{0};
  const bool finished = finishes_within(
      [&] {
        std::vector<std::thread> callers;
        for (int c = 0; c < kCallers; ++c)
          callers.emplace_back([&, c] {
            for (int round = 0; round < kRounds; ++round) {
              std::vector<std::atomic<int>> hits(kTasks);
              for (auto& h : hits) h = 0;
              pool->run(kTasks, [&](std::int64_t t, int thread) {
                if (thread < 0 || thread >= 3) ++failures;
                hits[static_cast<std::size_t>(t)] += 1;
                total += c + 1;
              });
              for (auto& h : hits)
                if (h.load() != 1) ++failures;
            }
          });
        for (auto& t : callers) t.join();
      },
      60.0);
  ASSERT_TRUE(finished) << "concurrent callers deadlocked";
  EXPECT_EQ(failures.load(), 0);
  // Caller c adds c + 1 per task: (1 + 2 + 3 + 4) * rounds * tasks.
  EXPECT_EQ(total.load(), 10L * kRounds * kTasks);
  delete pool;
}

TEST(ThreadPool, ZeroOrNegativeThreadsIsAnError) {
  try {
    moh::ThreadPool pool(0);
    FAIL() << "expected moh::Error";
  } catch (const moh::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("got 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find(">= 1"), std::string::npos) << msg;
  }
  EXPECT_THROW(moh::ThreadPool(-2), moh::Error);
}

TEST(ThreadPool, ParallelForWithoutPoolRunsInlineInOrder) {
  std::vector<std::int64_t> order;
  std::vector<int> threads;
  moh::parallel_for(nullptr, 6, [&](std::int64_t t, int thread) {
    order.push_back(t);
    threads.push_back(thread);
  });
  EXPECT_EQ(order, (std::vector<std::int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(threads, std::vector<int>(6, 0));
  EXPECT_EQ(moh::thread_slots(nullptr), 1);
  moh::ThreadPool pool(4);
  EXPECT_EQ(moh::thread_slots(&pool), 4);
  // A one-thread pool also runs inline on the caller.
  moh::ThreadPool one(1);
  const auto caller = std::this_thread::get_id();
  bool same = true;
  moh::parallel_for(&one, 5, [&](std::int64_t, int) { same = same && std::this_thread::get_id() == caller; });
  EXPECT_TRUE(same);
}

}  // namespace
