// Tests for moh/runtime/thread_pool.hpp: every task runs exactly once, thread ids are in [0, size)
// and never shared by two running tasks, exceptions reach the caller, nested runs keep their
// task's thread index and do not deadlock, concurrent callers do not deadlock, current_index()
// says which pool thread runs, and a pool of 0 threads is refused. run() takes a non-owning
// reference to the callable, so the tasks are named lambdas that outlive the call.
#include "moh/runtime/thread_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "test_helpers.hpp"

namespace {

using moh_test::error_of;
using moh_test::Mentions;

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
      auto count = [&](std::int64_t task, int) { hits[static_cast<std::size_t>(task)]++; };
      pool.run(n, count);
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_EQ(hits[static_cast<std::size_t>(i)].load(), 1)
            << "threads " << threads << " n " << n << " task " << i;
    }
    bool ran = false;
    auto mark = [&](std::int64_t, int) { ran = true; };
    pool.run(0, mark);
    pool.run(-3, mark);
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
    auto task_fn = [&](std::int64_t task, int thread) {
      if (thread < 0 || thread >= threads) {
        ++out_of_range;
        return;
      }
      if (busy[static_cast<std::size_t>(thread)].exchange(1) != 0) ++shared;
      if (task % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      busy[static_cast<std::size_t>(thread)] = 0;
    };
    pool.run(400, task_fn);
    EXPECT_EQ(out_of_range.load(), 0) << threads;
    EXPECT_EQ(shared.load(), 0) << threads;
  }
}

TEST(ThreadPool, ExceptionsPropagateAndPoolStaysUsable) {
  moh::ThreadPool pool(3);
  std::atomic<int> count{0};
  auto boom = [&](std::int64_t task, int) {
    ++count;
    if (task == 37) throw std::runtime_error("boom 37");
  };
  try {
    pool.run(100, boom);
    FAIL() << "expected the task's exception";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "boom 37");
  }
  EXPECT_GE(count.load(), 1);
  // A moh::Error keeps its type.
  auto fails = [](std::int64_t task, int) {
    if (task == 9) moh::detail::fail("task ", task);
  };
  EXPECT_TRUE(Mentions(error_of([&] { pool.run(10, fails); }), {"moh: task 9"}));
  // The pool still works afterwards, and a run without errors does not rethrow an old one.
  std::vector<std::atomic<int>> hits(50);
  for (auto& h : hits) h = 0;
  auto hit = [&](std::int64_t t, int) { hits[static_cast<std::size_t>(t)]++; };
  EXPECT_NO_THROW(pool.run(50, hit));
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  // Single-threaded pools and parallel_for propagate as well.
  moh::ThreadPool one(1);
  auto logic = [](std::int64_t, int) { throw std::logic_error("x"); };
  EXPECT_THROW(one.run(3, logic), std::logic_error);
  EXPECT_THROW(moh::parallel_for(&pool, 8, [](std::int64_t t, int) {
                 if (t == 5) throw std::out_of_range("y");
               }),
               std::out_of_range);
}

TEST(ThreadPool, NestedRunFromInsideATaskDoesNotDeadlock) {
  auto* pool = new moh::ThreadPool(3);  // leaked on deadlock, deleted otherwise
  std::atomic<int> inner{0};
  std::atomic<int> bad_thread{0};
  std::atomic<int> other_index{0};  // an inner task that ran under another index than its task
  const bool finished = finishes_within(
      [&] {
        auto outer = [&](std::int64_t, int outer_thread) {
          auto inner_run = [&](std::int64_t, int thread) {
            if (thread < 0 || thread >= 3) ++bad_thread;
            if (thread != outer_thread || moh::ThreadPool::current_index() != outer_thread)
              ++other_index;
            ++inner;
          };
          pool->run(10, inner_run);
          moh::parallel_for(pool, 5, [&](std::int64_t, int thread) {
            if (thread != outer_thread) ++other_index;
            ++inner;
          });
          // Without a pool, a task's inline loop also keeps the task's index.
          moh::parallel_for(nullptr, 2, [&](std::int64_t, int thread) {
            if (thread != outer_thread) ++other_index;
          });
          // Per-thread scratch for a nested region: room for this thread's index.
          if (moh::thread_slots(nullptr) < outer_thread + 1) ++other_index;
        };
        pool->run(12, outer);
      },
      20.0);
  ASSERT_TRUE(finished) << "nested ThreadPool::run deadlocked";
  EXPECT_EQ(inner.load(), 12 * 15);
  EXPECT_EQ(bad_thread.load(), 0);
  EXPECT_EQ(other_index.load(), 0);
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
              auto task = [&](std::int64_t t, int thread) {
                if (thread < 0 || thread >= 3) ++failures;
                hits[static_cast<std::size_t>(t)] += 1;
                total += c + 1;
              };
              pool->run(kTasks, task);
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
  EXPECT_TRUE(Mentions(error_of([] { moh::ThreadPool pool(0); }), {"got 0", ">= 1"}));
  EXPECT_TRUE(Mentions(error_of([] { moh::ThreadPool pool(-2); }), {"got -2", ">= 1"}));
}

TEST(ThreadPool, CurrentIndexNamesThePoolThreadRunningATask) {
  EXPECT_EQ(moh::ThreadPool::current_index(), -1);  // outside any task
  for (int threads : {2, 3}) {
    moh::ThreadPool pool(threads);
    std::atomic<int> mismatches{0};
    const auto caller = std::this_thread::get_id();
    auto check = [&](std::int64_t, int thread) {
      if (moh::ThreadPool::current_index() != thread) ++mismatches;
      if (std::this_thread::get_id() == caller && thread != 0) ++mismatches;  // the caller is 0
      if (moh::thread_slots(&pool) != threads) ++mismatches;
    };
    pool.run(200, check);
    EXPECT_EQ(mismatches.load(), 0) << threads;
    EXPECT_EQ(moh::ThreadPool::current_index(), -1) << threads;  // reset after the run
  }
  // A thread that runs a task of one pool keeps its index when it starts a run on another.
  moh::ThreadPool outer(3), other(4);
  std::atomic<int> wrong{0};
  auto outer_task = [&](std::int64_t, int thread) {
    auto inner_task = [&](std::int64_t, int inner_thread) {
      if (inner_thread != thread || moh::ThreadPool::current_index() != thread) ++wrong;
    };
    other.run(6, inner_task);
    if (moh::ThreadPool::current_index() != thread) ++wrong;  // unchanged after the inner run
    if (moh::thread_slots(&other) != std::max(4, thread + 1)) ++wrong;
  };
  outer.run(30, outer_task);
  EXPECT_EQ(wrong.load(), 0);
}

// run() runs the tasks inline on the caller for a one-thread pool or a single task; the caller is
// thread 0 there too, and current_index() must say so (as documented), so that code inside the
// task that asks for its index gets the one it was handed.
TEST(ThreadPool, InlineRunsReportIndexZero) {
  moh::ThreadPool one(1), three(3);
  int wrong = 0, ran = 0;
  auto check = [&](std::int64_t, int thread) {
    ++ran;
    if (thread != 0) ++wrong;
    if (moh::ThreadPool::current_index() != 0) ++wrong;
  };
  one.run(5, check);    // a one-thread pool
  three.run(1, check);  // a single task
  EXPECT_EQ(ran, 6);
  EXPECT_EQ(wrong, 0) << "current_index() inside an inline run";
  EXPECT_EQ(moh::ThreadPool::current_index(), -1);
}

TEST(ThreadPool, RunTakesAnyCallableByReference) {
  // A callable with a lot of state (more than a std::function stores inline) runs as is, and
  // the state it changes is the caller's object, not a copy.
  moh::ThreadPool pool(2);
  struct Summer {
    std::atomic<std::int64_t> sum{0};
    std::int64_t pad[8] = {};
    void operator()(std::int64_t task, int) { sum += task + pad[0]; }
  } summer;
  pool.run(100, summer);
  EXPECT_EQ(summer.sum.load(), 99 * 100 / 2);
  const moh::detail::TaskRef ref(summer);
  ref(1000, 0);
  EXPECT_EQ(summer.sum.load(), 99 * 100 / 2 + 1000);
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
  // parallel_for takes temporaries (it keeps the callable alive for the run).
  std::atomic<int> n{0};
  moh::parallel_for(&pool, 9, [&](std::int64_t, int) { ++n; });
  EXPECT_EQ(n.load(), 9);
}

}  // namespace
