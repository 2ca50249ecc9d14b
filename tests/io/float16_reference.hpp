// Independent references for the 16-bit float tests (tests/float16_test.cpp, tests/io/dtype_test.cpp):
// the bits of a float, binary16 decoded by the textbook formula, and the nearest half found by
// search. None of them uses the library's bit manipulation.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace moh_float16_test {

/// Bits of a float.
inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
/// The float with bits `u`.
inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// binary16 decoded by the textbook formula, independent of the library's bit manipulation.
inline double half_reference(std::uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
  double v;
  if (exponent == 0) {
    v = std::ldexp(mantissa, -24);
  } else if (exponent == 31) {
    v = mantissa ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    v = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return sign ? -v : v;
}

/// Nearest half to `v` by search over all finite halves (ties to the even bit pattern); values
/// at or beyond 65520 give infinity. Independent of the library's bit manipulation. (A float
/// argument widens to double exactly.)
inline std::uint16_t nearest_half_reference(double v) {
  const double x = std::fabs(v);
  const std::uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  if (x >= 65520.0) return sign | 0x7C00;
  std::uint16_t lo = 0, hi = 0x7BFF;  // largest half <= x, by binary search on magnitude
  while (lo < hi) {
    const auto mid = static_cast<std::uint16_t>((lo + hi + 1) / 2);
    if (half_reference(mid) <= x) lo = mid; else hi = static_cast<std::uint16_t>(mid - 1);
  }
  const double below = half_reference(lo);
  if (below == x) return sign | lo;
  const double above = lo == 0x7BFF ? 65536.0 : half_reference(static_cast<std::uint16_t>(lo + 1));
  const std::uint16_t up = static_cast<std::uint16_t>(lo + 1);  // 0x7C00 = infinity
  if (x - below < above - x) return sign | lo;
  if (x - below > above - x) return sign | up;
  return sign | ((lo & 1) ? up : lo);
}

}  // namespace moh_float16_test
