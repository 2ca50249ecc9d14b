// moh::LargeBuffer: storage for the big arrays a decode step streams (weights, KV caches).
//
// A decode step reads every weight and every cached key and value once, so its speed is the
// rate at which one core streams memory. On Linux with 4 KiB pages that rate is capped by the
// page walks and by the hardware prefetcher, which stops at each page boundary, so huge pages
// stream faster. An allocation of at least 2 MiB is aligned to 2 MiB and advised for transparent
// huge pages (madvise), which kernels configured with THP "madvise" (Debian's default) honour.
// Elsewhere, or when the advice is refused, it is plain aligned memory; nothing else changes.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "moh/error.hpp"

namespace moh {
namespace detail {

constexpr std::size_t kHugePage = std::size_t(2) << 20;

/// Zeroed memory for n values of T: 2 MiB aligned and advised for huge pages when it is at least
/// that large, else 64-byte aligned. Free with release_large().
template <class T>
T* allocate_large(std::size_t n) {
  if (n == 0) return nullptr;
  require(n <= static_cast<std::size_t>(-1) / sizeof(T) - kHugePage, "LargeBuffer: ", n,
          " values do not fit in memory: expected fewer");
  const std::size_t bytes = n * sizeof(T);
  const std::size_t align = bytes >= kHugePage ? kHugePage : 64;
  const std::size_t rounded = (bytes + align - 1) / align * align;  // aligned_alloc's rule
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr) fail("LargeBuffer: out of memory: expected ", rounded, " bytes, got none");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (align == kHugePage) (void)madvise(p, rounded, MADV_HUGEPAGE);  // advice: may be refused
#endif
  std::memset(p, 0, bytes);
  return static_cast<T*>(p);
}

inline void release_large(void* p) { std::free(p); }

}  // namespace detail

/// A fixed-size, zero-initialised array of trivially copyable T in large-buffer memory (see the
/// file comment).
template <class T>
class LargeBuffer {
  static_assert(std::is_trivially_copyable<T>::value, "LargeBuffer holds plain values");

 public:
  LargeBuffer() = default;
  explicit LargeBuffer(std::size_t n) : data_(detail::allocate_large<T>(n)), size_(n) {}
  ~LargeBuffer() { detail::release_large(data_); }
  LargeBuffer(LargeBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
    o.data_ = nullptr;
    o.size_ = 0;
  }
  LargeBuffer& operator=(LargeBuffer&& o) noexcept {
    if (this != &o) {
      detail::release_large(data_);
      data_ = o.data_;
      size_ = o.size_;
      o.data_ = nullptr;
      o.size_ = 0;
    }
    return *this;
  }
  /// Copies are deep, like std::vector's.
  LargeBuffer(const LargeBuffer& o) : LargeBuffer(o.size_) {
    if (size_) std::memcpy(data_, o.data_, size_ * sizeof(T));
  }
  LargeBuffer& operator=(const LargeBuffer& o) {
    if (this != &o) *this = LargeBuffer(o);
    return *this;
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace moh
