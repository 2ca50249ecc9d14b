// Per-thread scratch memory, kept between forward calls.
//
// A forward pass needs large temporary buffers (projected keys/values, queries, per-head
// outputs) and every worker thread small tiles. Allocating them per call costs page faults on
// every call (glibc hands large blocks straight back to the kernel), so each thread keeps its
// buffers in an arena that only grows: after the first call of a given size, forward allocates
// nothing. Buffers belong to the thread that runs the code, so concurrent forward calls from
// several threads never share scratch. release_scratch() frees the calling thread's arena.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

#include "moh/tensor.hpp"

namespace moh {
namespace detail {

/// Named slots of the arena. A slot is requested at most once per scope that uses it. The
/// attention kernel's own small tiles live in thread_local structs next to the drivers
/// (detail/attend.hpp).
enum class ScratchSlot : std::size_t {
  KeysValues,     // [B*S, 2 H_kv d] projected keys/values
  Queries,        // [B*T, H d]
  Context,        // [B*T, H d] per-head outputs
  RoutedQueries,  // [pairs, d] queries of the picked (token, head) pairs
  RoutedOutputs,  // [pairs, d]
  GatherRows,     // per task: gathered input rows [tile, D]
  PartialOutput,  // per task: [tile, D]
  GemmPackA,      // per GEMM: the last, partial panel of A (detail/gemm.hpp)
  GemmPackB,      // per GEMM: packed panels of B
  Count
};

class ScratchArena {
 public:
  /// At least `bytes` bytes for `slot`, 64-byte aligned; contents unspecified. The pointer stays
  /// valid until the same slot is requested again with more bytes or release() is called.
  void* get(ScratchSlot slot, std::size_t bytes) {
    Buffer& b = buffers_[static_cast<std::size_t>(slot)];
    if (b.size < bytes) {
      const std::size_t size = (bytes + 63) / 64 * 64;
      void* p = std::aligned_alloc(64, size);
      if (p == nullptr) throw std::bad_alloc();
      b.data.reset(p);
      b.size = size;
    }
    return b.data.get();
  }
  std::size_t bytes() const {
    std::size_t total = 0;
    for (const Buffer& b : buffers_) total += b.size;
    return total;
  }
  void release() {
    for (Buffer& b : buffers_) {
      b.data.reset();
      b.size = 0;
    }
  }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  struct Buffer {
    std::unique_ptr<void, Free> data;
    std::size_t size = 0;
  };
  Buffer buffers_[static_cast<std::size_t>(ScratchSlot::Count)];
};

inline ScratchArena& thread_arena() {
  thread_local ScratchArena arena;
  return arena;
}

/// A [rows, cols] row-major matrix in the calling thread's slot (contents unspecified).
template <class T>
MatrixMap<T> scratch_matrix(ScratchSlot slot, Index rows, Index cols) {
  const std::size_t bytes = static_cast<std::size_t>(rows * cols) * sizeof(T);
  return MatrixMap<T>(static_cast<T*>(thread_arena().get(slot, bytes)), rows, cols);
}

}  // namespace detail

/// Bytes of scratch the calling thread holds between forward calls.
inline std::size_t scratch_bytes() { return detail::thread_arena().bytes(); }
/// Frees the calling thread's scratch (the next forward allocates it again).
inline void release_scratch() { detail::thread_arena().release(); }

}  // namespace moh
