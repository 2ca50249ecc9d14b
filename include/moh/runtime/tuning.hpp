// moh::KernelTuning: how the decode kernels order their reads from memory on this machine.
//
// A decode step is bound by how fast one core streams weights and cache from memory, and the
// fastest read pattern depends on the microarchitecture, so the pattern is a process-wide setting.
// No setting changes a bit of any result: a dot product's element sums the same partial sums in
// the same order whatever rows it is read beside, and a prefetch only asks for bytes early.
// kernel_tuning() is chosen for the CPU it first runs on; set_kernel_tuning() replaces it.
#pragma once

#include <atomic>

#include "moh/error.hpp"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#endif

namespace moh {

enum class CpuVendor { Other, AMD, Intel };

/// The CPU as CPUID names it: vendor and display family and model (base plus extended fields).
struct CpuId {
  CpuVendor vendor = CpuVendor::Other;
  unsigned family = 0;
  unsigned model = 0;

  /// The CPU this runs on; vendor Other, family and model 0 where CPUID cannot be read.
  static CpuId this_cpu();
};

namespace detail {

/// Decodes CPUID leaf 0's ebx, edx, ecx (the vendor string) and leaf 1's eax (family, model).
inline CpuId cpu_id_from_words(unsigned ebx0, unsigned edx0, unsigned ecx0, unsigned eax1) {
  CpuId c;
  if (ebx0 == 0x68747541u && edx0 == 0x69746e65u && ecx0 == 0x444d4163u)  // "AuthenticAMD"
    c.vendor = CpuVendor::AMD;
  else if (ebx0 == 0x756e6547u && edx0 == 0x49656e69u && ecx0 == 0x6c65746eu)  // "GenuineIntel"
    c.vendor = CpuVendor::Intel;
  const unsigned base = (eax1 >> 8) & 0xFu, extended = (eax1 >> 20) & 0xFFu;
  c.family = base == 0xFu ? base + extended : base;
  const unsigned model = (eax1 >> 4) & 0xFu, extended_model = (eax1 >> 16) & 0xFu;
  c.model = base == 0xFu || base == 0x6u ? (extended_model << 4) + model : model;
  return c;
}

}  // namespace detail

inline CpuId CpuId::this_cpu() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0, eax1 = 0, ebx1 = 0, ecx1 = 0, edx1 = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) != 0 &&
      __get_cpuid(1, &eax1, &ebx1, &ecx1, &edx1) != 0)
    return detail::cpu_id_from_words(ebx, edx, ecx, eax1);
#endif
  return CpuId{};
}

/// Read patterns of the decode kernels (plain data; see the header comment).
struct KernelTuning {
  /// Most weight rows of a decode product's long rows (more than 256 elements) that one row of
  /// the input reads side by side, in [1, kMaxWeightStreams]: each from its own part of the
  /// rows, and without AVX-512 at most 3 (6 of bfloat16 weights on AVX2). Short rows (a head's
  /// slice of W_o) are read in this many parts side by side, at most 6 (4 with AVX-512).
  int weight_streams = 6;
  /// Whether attention of 3 or more queries per key/value head over a float cache (a GQA group's
  /// decode step) prefetches the keys and values ahead of its reads. A bfloat16 cache always is.
  bool prefetch_float_cache = false;

  static constexpr int kMaxWeightStreams = 6;

  /// Throws moh::Error unless weight_streams is in [1, kMaxWeightStreams].
  void validate() const {
    detail::require(weight_streams >= 1 && weight_streams <= kMaxWeightStreams,
                    "KernelTuning: expected weight_streams in [1, ", kMaxWeightStreams, "], got ",
                    weight_streams);
  }

  /// The tuning for a CPU: float caches prefetched on AMD family 0x1A (Zen 5) and later, the
  /// defaults elsewhere.
  static KernelTuning for_cpu(const CpuId& cpu) {
    KernelTuning t;
    if (cpu.vendor == CpuVendor::AMD && cpu.family >= 0x1Au) t.prefetch_float_cache = true;
    return t;
  }

  /// for_cpu() of the CPU this runs on; the defaults where it cannot be identified.
  static KernelTuning for_this_cpu() { return for_cpu(CpuId::this_cpu()); }
};

namespace detail {

// The process's tuning, read on every decode product: relaxed atomics, so that a change from
// another thread is never a data race; each field takes effect at some later product (the pair
// is not replaced atomically, which no result can tell). One instance per program, or per
// shared library where moh is compiled into several with hidden visibility.
struct TuningState {
  std::atomic<int> weight_streams;
  std::atomic<bool> prefetch_float_cache;
  explicit TuningState(const KernelTuning& t)
      : weight_streams(t.weight_streams), prefetch_float_cache(t.prefetch_float_cache) {}
};

inline TuningState& tuning_state() {
  static TuningState state(KernelTuning::for_this_cpu());
  return state;
}

inline int weight_streams() {
  return tuning_state().weight_streams.load(std::memory_order_relaxed);
}
inline bool prefetch_float_cache() {
  return tuning_state().prefetch_float_cache.load(std::memory_order_relaxed);
}

}  // namespace detail

/// The tuning the decode kernels use now.
inline KernelTuning kernel_tuning() {
  KernelTuning t;
  t.weight_streams = detail::weight_streams();
  t.prefetch_float_cache = detail::prefetch_float_cache();
  return t;
}

/// Replaces the tuning for the whole process (a benchmark comparing patterns, or a CPU that
/// for_this_cpu() misjudges); results do not change. Throws moh::Error if `t` is invalid.
inline void set_kernel_tuning(const KernelTuning& t) {
  t.validate();
  detail::tuning_state().weight_streams.store(t.weight_streams, std::memory_order_relaxed);
  detail::tuning_state().prefetch_float_cache.store(t.prefetch_float_cache,
                                                    std::memory_order_relaxed);
}

}  // namespace moh
