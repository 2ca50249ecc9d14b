// moh::Workspace: the scratch memory of forward calls, owned by the caller.
//
// A forward pass needs temporary buffers: projected keys/values, queries, routing records, the
// attention kernel's tiles and the GEMM's packed panels on every thread that runs a task. They
// come from a Workspace the caller passes in ForwardOptions (or to linear() and attention()):
// one arena for the call itself and one per thread of the pool (the calling thread is 0). An
// arena hands out memory by bumping a pointer and takes it all back at the end of the scope
// that asked for it, so a call of a given shape needs the same bytes every time, whichever
// thread runs which task: after the first (warm-up) call, calls of that shape or a smaller one
// take no memory from the system. The bytes held are the most a single call has needed
// (bounded by the shapes seen); bytes() reports them and release() frees them. (A routing
// record the caller passes is the caller's: its matrices are resized when the shape changes.)
//
//   moh::Workspace ws;             // empty; grows on the first call
//   moh::ForwardOptions opts;
//   opts.workspace = &ws;          // not owned
//   layer.forward(x, y, opts);     // warm calls of this shape allocate nothing
//
// A workspace serves one call at a time (a second call that uses it while the first runs is a
// moh::Error, not a data race); give each thread that calls forward its own. Without a
// workspace, a call makes a temporary one and frees it on return, so it allocates every time.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "moh/error.hpp"
#include "moh/runtime/thread_pool.hpp"
#include "moh/tensor.hpp"

namespace moh {
namespace detail {

/// Grow-only bump allocator. allocate() returns 64-byte aligned, uninitialised memory that stays
/// valid until the arena is rewound past it; Scope rewinds on destruction. When one call needs
/// more than the first block holds, the arena spills into further blocks; once it is rewound to
/// empty it merges them into one block of the high-water size, so the next call of the same
/// shape runs in one block and allocates nothing.
class Arena {
 public:
  static constexpr std::size_t kAlign = 64;
  static constexpr std::size_t kPageBytes = 4096;

  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Arena(Arena&&) noexcept = default;
  Arena& operator=(Arena&&) noexcept = default;

  /// Room for `count` values of T (trivially destructible types only), aligned to `align` bytes
  /// (64, or a larger power of two such as kPageBytes).
  template <class T>
  T* allocate(Index count, std::size_t align = kAlign) {
    static_assert(std::is_trivially_destructible<T>::value, "Arena holds plain data only");
    require(count >= 0, "Arena: count must be >= 0: expected >= 0, got ", count);
    eigen_assert(align >= kAlign && (align & (align - 1)) == 0);
    if (align == kAlign)
      return static_cast<T*>(allocate_bytes(static_cast<std::size_t>(count) * sizeof(T)));
    const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(
        allocate_bytes(static_cast<std::size_t>(count) * sizeof(T) + align - kAlign));
    return reinterpret_cast<T*>((p + align - 1) / align * align);
  }

  /// A [rows, cols] row-major matrix view in the arena (contents unspecified).
  template <class T>
  MatrixMap<T> matrix(Index rows, Index cols) {
    return MatrixMap<T>(allocate<T>(rows * cols), rows, cols);
  }

  /// Everything allocated after a Scope was made is taken back when it ends.
  class Scope {
   public:
    explicit Scope(Arena& arena) : arena_(arena), block_(arena.block_), used_(arena.used_) {}
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope() { arena_.rewind(block_, used_); }

   private:
    Arena& arena_;
    std::size_t block_, used_;
  };

  /// Bytes the arena holds (its blocks' capacity).
  std::size_t bytes() const {
    std::size_t total = 0;
    for (const Block& b : blocks_) total += b.size;
    return total;
  }
  /// Bytes in use by live scopes.
  std::size_t in_use() const {
    std::size_t total = used_;
    for (std::size_t i = 0; i < block_ && i < blocks_.size(); ++i) total += blocks_[i].size;
    return total;
  }
  /// The most bytes in use at once so far.
  std::size_t peak() const { return peak_; }
  /// Makes the arena one block of at least `bytes` (nothing may be in use), so that a later use
  /// of up to that many bytes allocates nothing.
  /// Never throws: when the memory is not there, the arena stays as it was.
  void reserve(std::size_t bytes) noexcept {
    eigen_assert(in_use() == 0);
    bytes = (bytes + kAlign - 1) / kAlign * kAlign;
    if (bytes == 0 || (blocks_.size() == 1 && blocks_[0].size >= bytes)) return;
    replace_with_one_block(bytes);
  }
  /// Frees every block (nothing may be in use).
  void release() {
    eigen_assert(in_use() == 0);
    blocks_.clear();
    block_ = used_ = peak_ = 0;
  }

 private:
  struct Free {
    void operator()(void* p) const { ::operator delete(p, std::align_val_t(kAlign)); }
  };
  struct Block {
    std::unique_ptr<void, Free> data;
    std::size_t size = 0;
  };

  void* allocate_bytes(std::size_t bytes) {
    bytes = (bytes + kAlign - 1) / kAlign * kAlign;
    for (;;) {
      if (block_ < blocks_.size() && blocks_[block_].size - used_ >= bytes) {
        void* p = static_cast<char*>(blocks_[block_].data.get()) + used_;
        used_ += bytes;
        peak_ = std::max(peak_, in_use());
        return p;
      }
      if (block_ + 1 < blocks_.size()) {  // a later block from an earlier spill
        ++block_;
        used_ = 0;
        continue;
      }
      // A new block: at least what is asked, and room to grow (the first call of a shape).
      const std::size_t last = blocks_.empty() ? 0 : blocks_.back().size;
      const std::size_t size = std::max<std::size_t>({bytes, 2 * last, std::size_t(1) << 16});
      Block b;
      b.data.reset(::operator new(size, std::align_val_t(kAlign)));
      b.size = size;
      blocks_.push_back(std::move(b));
      block_ = blocks_.size() - 1;
      used_ = 0;
    }
  }

  void rewind(std::size_t block, std::size_t used) {
    block_ = block;
    used_ = used;
    // The call spilled: next time, one block of the most it needed.
    if (block == 0 && used == 0 && blocks_.size() > 1)
      replace_with_one_block((peak_ + kAlign - 1) / kAlign * kAlign);
  }

  /// Frees every block for one of `bytes` (nothing in use); keeps them if the memory is not
  /// there, so that a scope's destructor and settling a workspace never throw.
  void replace_with_one_block(std::size_t bytes) noexcept {
    void* p = ::operator new(bytes, std::align_val_t(kAlign), std::nothrow);
    if (p == nullptr) return;
    Block b;
    b.data.reset(p);
    b.size = bytes;
    try {
      if (blocks_.capacity() == 0) blocks_.reserve(1);  // the only allocation that may fail
    } catch (...) {
      return;  // b frees p
    }
    blocks_.clear();  // keeps the capacity
    blocks_.push_back(std::move(b));
    block_ = used_ = 0;
    peak_ = std::max(peak_, bytes);
  }

  std::vector<Block> blocks_;
  std::size_t block_ = 0;  // the block allocations come from
  std::size_t used_ = 0;   // bytes used in that block
  std::size_t peak_ = 0;   // most bytes in use at once
};

}  // namespace detail

namespace detail {
struct WorkspaceAccess;
}

class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  /// Bytes held between calls: the call's arena and every thread's.
  std::size_t bytes() const {
    std::size_t total = call_.bytes();
    for (const auto& t : threads_) total += t->bytes();
    return total;
  }
  /// Frees all scratch (the next call allocates it again). Not while a call uses the workspace.
  void release() {
    detail::require(!busy_.load(), "Workspace::release: the workspace is in use by a forward "
                    "call: expected no call running, got one");
    call_.release();
    threads_.clear();
  }

 private:
  friend struct detail::WorkspaceAccess;

  detail::Arena call_;                                    // the call's, between parallel regions
  std::vector<std::unique_ptr<detail::Arena>> threads_;  // one per pool thread (0 = the caller)
  std::atomic<bool> busy_{false};
};

namespace detail {

/// What only the library does with a workspace, during a call it leased it for.
struct WorkspaceAccess {
  static bool try_acquire(Workspace& w) {
    bool expected = false;
    return w.busy_.compare_exchange_strong(expected, true);
  }
  static void finish(Workspace& w) { w.busy_.store(false); }
  static Arena& call(Workspace& w) { return w.call_; }
  static Arena& thread(Workspace& w, int t) {
    eigen_assert(t >= 0 && static_cast<std::size_t>(t) < w.threads_.size());
    return *w.threads_[static_cast<std::size_t>(t)];
  }
  /// Makes sure `threads` per-thread arenas exist (allocates only when the pool grew).
  static void prepare(Workspace& w, int threads) {
    while (w.threads_.size() < static_cast<std::size_t>(threads))
      w.threads_.push_back(std::make_unique<Arena>());
  }
  /// After a call: grows every thread's arena to the most any of them needed. Which thread runs
  /// which task varies from call to call, so without this a warm call could hand a thread a
  /// task larger than any it ran before. Never throws (a failed growth is retried next time).
  static void settle(Workspace& w) noexcept {
    std::size_t most = 0;
    for (const auto& t : w.threads_) most = std::max(most, t->peak());
    for (const auto& t : w.threads_) t->reserve(most);
  }
};

/// What a call runs on: its threads (null: the calling thread only) and its workspace.
struct Exec {
  ThreadPool* pool = nullptr;
  Workspace* ws = nullptr;
  /// Set for a decode-style call of few tokens per sequence (new tokens against a cache, the
  /// queries or the memory of cross-attention; AttentionLayer::decode_exec): the products take
  /// every row the same way whatever their row count, so that each sequence of a batch gets the
  /// bits it gets alone, for any batch size (the route itself is the ops' business: multiply()).
  bool dot_rows = false;
  /// The threads the call's work is split across (1 without a pool).
  int threads() const { return pool != nullptr ? pool->size() : 1; }
  /// Whether the call's work is split across more than one thread.
  bool threaded() const { return threads() > 1; }
  Arena& call() const { return WorkspaceAccess::call(*ws); }
  Arena& thread(int t) const { return WorkspaceAccess::thread(*ws, t); }
};

/// The workspace of one call: the caller's (marked busy for the call) or a temporary one.
class WorkspaceLease {
 public:
  /// Leases `given` (or a temporary) with arenas for every thread a parallel_for on `pool` uses.
  WorkspaceLease(Workspace* given, ThreadPool* pool, const char* who) : pool_(pool) {
    if (given == nullptr) {
      own_ = std::make_unique<Workspace>();
      ws_ = own_.get();
    } else {
      require(WorkspaceAccess::try_acquire(*given), who,
              ": workspace is in use by another call: expected a workspace that no call is "
              "using (one per calling thread), got a busy one");
      ws_ = given;
      held_.ws = given;  // from here on, released even if the rest of construction throws
    }
    WorkspaceAccess::prepare(*ws_, thread_slots(pool));
  }
  WorkspaceLease(const WorkspaceLease&) = delete;
  WorkspaceLease& operator=(const WorkspaceLease&) = delete;

  Workspace& get() const { return *ws_; }
  Exec exec() const { return Exec{pool_, ws_}; }

 private:
  /// Settles and releases the caller's workspace when the lease ends (or fails to start).
  struct Held {
    Workspace* ws = nullptr;
    ~Held() {
      if (ws == nullptr) return;
      WorkspaceAccess::settle(*ws);
      WorkspaceAccess::finish(*ws);
    }
  };

  ThreadPool* pool_ = nullptr;
  Held held_;
  std::unique_ptr<Workspace> own_;
  Workspace* ws_ = nullptr;
};

}  // namespace detail
}  // namespace moh
