// Timing for the examples that report how long a call takes: one call's milliseconds and the
// median of several.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace example_timing {

/// Milliseconds of one call of fn (steady clock).
inline double milliseconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  const std::chrono::duration<double, std::milli> elapsed =
      std::chrono::steady_clock::now() - start;
  return elapsed.count();
}

/// The median of v (the upper one of an even count); v not empty.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace example_timing
