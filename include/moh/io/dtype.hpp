// Element types of safetensors files and the exact conversions between them and C++ values,
// shared by the reader (io/safetensors.hpp) and the writer (io/safetensors_writer.hpp):
// little-endian loads and stores, float narrowing without undefined behaviour, range-checked
// integer conversions, and rounding to odd so that double -> half rounds once.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "moh/error.hpp"
#include "moh/float16.hpp"

namespace moh {

/// Element types of a safetensors file that moh can read.
enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

/// Bytes per element of `dtype`.
inline std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F16:
    case DType::BF16:
    case DType::I16:
      return 2;
    case DType::I8:
    case DType::U8:
    case DType::BOOL:
      return 1;
  }
  return 0;  // unreachable for valid enumerators
}

/// The safetensors spelling of `dtype`, e.g. "F32".
inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F64: return "F64";
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

namespace detail {

/// Reads an unsigned integer stored little-endian at `p` (any alignment, any host byte order).
template <class U>
U load_le(const std::uint8_t* p) {
  static_assert(std::is_unsigned<U>::value, "load_le reads unsigned integers");
  U value = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) value = static_cast<U>(value | (U(p[i]) << (8 * i)));
  return value;
}

inline bool parse_dtype(const std::string& name, DType& out) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F64", DType::F64}, {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16},
      {"I64", DType::I64}, {"I32", DType::I32}, {"I16", DType::I16}, {"I8", DType::I8},
      {"U8", DType::U8},   {"BOOL", DType::BOOL}};
  for (const auto& entry : kNames) {
    if (name == entry.first) {
      out = entry.second;
      return true;
    }
  }
  return false;
}

/// a * b into `out`; false if the product exceeds `limit`.
inline bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t limit, std::uint64_t& out) {
  if (a != 0 && b > limit / a) return false;
  out = a * b;
  return true;
}

/// Name of a requested element type, for conversion messages.
template <class T>
const char* type_name() {
  if (std::is_same<T, bool>::value) return "bool (0 or 1)";
  if (std::is_same<T, float>::value) return "float";
  if (std::is_same<T, double>::value) return "double";
  if (std::is_same<T, long double>::value) return "long double";
  if (std::is_integral<T>::value) {
    static const std::string name =
        concat(std::is_signed<T>::value ? "int" : "uint", 8 * sizeof(T));
    return name.c_str();
  }
  return "the requested type";
}

/// double -> float with IEEE round-to-nearest semantics, without the undefined behaviour of
/// static_cast for values beyond float's range (they become +-max or +-infinity).
inline float narrow_to_float(double v) {
  constexpr double kMax = static_cast<double>(std::numeric_limits<float>::max());
  // Halfway between FLT_MAX (2^128 - 2^104) and 2^128; ties round to even, i.e. to infinity.
  const double overflow = std::ldexp(1.0, 128) - std::ldexp(1.0, 103);
  if (std::isnan(v)) return std::numeric_limits<float>::quiet_NaN();
  if (v >= overflow) return std::numeric_limits<float>::infinity();
  if (v <= -overflow) return -std::numeric_limits<float>::infinity();
  if (v > kMax) return std::numeric_limits<float>::max();
  if (v < -kMax) return -std::numeric_limits<float>::max();
  return static_cast<float>(v);
}

/// Converts one element to T. Floating targets round; integer targets need the exact value to be
/// representable; bool needs exactly 0 or 1. Returns false (leaving `out`) when impossible.
template <class T, class S>
bool convert_value(S v, T& out) {
  static_assert(std::is_arithmetic<T>::value, "moh::SafeTensors converts to arithmetic types");
  if constexpr (std::is_same<T, bool>::value) {
    if (v == S(0) || v == S(1)) {
      out = (v == S(1));
      return true;
    }
    return false;
  } else if constexpr (std::is_floating_point<T>::value) {
    if constexpr (std::is_same<T, float>::value && std::is_same<S, double>::value) {
      out = narrow_to_float(v);
    } else {
      out = static_cast<T>(v);  // widening, or integer -> floating (always defined)
    }
    return true;
  } else if constexpr (std::is_floating_point<S>::value) {
    // Floating -> integer: finite, integral and inside [min, 2^digits).
    if (!std::isfinite(v) || std::trunc(v) != v) return false;
    const long double x = v;
    const long double lowest = static_cast<long double>(std::numeric_limits<T>::min());
    const long double above = std::ldexp(1.0L, std::numeric_limits<T>::digits);
    if (x < lowest || x >= above) return false;
    out = static_cast<T>(v);
    return true;
  } else {
    // Integer -> integer: range-checked, so nothing wraps.
    if constexpr (std::is_signed<S>::value) {
      if (v < 0) {
        if constexpr (!std::is_signed<T>::value) {
          return false;
        } else {
          if (static_cast<std::intmax_t>(v) <
              static_cast<std::intmax_t>(std::numeric_limits<T>::min())) {
            return false;
          }
          out = static_cast<T>(v);
          return true;
        }
      }
    }
    if (static_cast<std::uintmax_t>(v) >
        static_cast<std::uintmax_t>(std::numeric_limits<T>::max())) {
      return false;
    }
    out = static_cast<T>(v);
    return true;
  }
}

/// Promotes small integer types so that streams print numbers, not characters.
template <class S>
auto printable(S v) {
  return +v;
}

}  // namespace detail

/// The dtype that holds T without conversion: float -> F32, double -> F64, int64_t -> I64,
/// int32_t -> I32, int16_t -> I16, int8_t -> I8, uint8_t -> U8, bool -> BOOL.
template <class T>
constexpr DType dtype_for() {
  static_assert(std::is_same<T, bool>::value || std::is_same<T, float>::value ||
                    std::is_same<T, double>::value ||
                    (std::is_integral<T>::value && std::is_signed<T>::value) ||
                    (std::is_integral<T>::value && sizeof(T) == 1),
                "moh::dtype_for: no safetensors dtype holds this type exactly");
  if constexpr (std::is_same<T, bool>::value) {
    return DType::BOOL;
  } else if constexpr (std::is_same<T, float>::value) {
    return DType::F32;
  } else if constexpr (std::is_same<T, double>::value) {
    return DType::F64;
  } else if constexpr (!std::is_signed<T>::value) {
    return DType::U8;
  } else if constexpr (sizeof(T) == 8) {
    return DType::I64;
  } else if constexpr (sizeof(T) == 4) {
    return DType::I32;
  } else if constexpr (sizeof(T) == 2) {
    return DType::I16;
  } else {
    return DType::I8;
  }
}

namespace detail {

/// Stores the low sizeof(U) bytes of `value` at `p`, little-endian (any host byte order).
template <class U>
void store_le(std::uint8_t* p, U value) {
  static_assert(std::is_unsigned<U>::value, "store_le writes unsigned integers");
  for (std::size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<std::uint8_t>(value >> (8 * i));
}

/// double -> float rounding to odd: an inexact result keeps the truncated value with its last
/// bit set. Rounding that to a narrower format (half, bfloat16: >= 2 bits fewer) then gives the
/// same result as rounding the double directly, which double -> float -> half would not.
inline float round_to_odd_float(double v) {
  if (std::isnan(v)) return static_cast<float>(v);
  constexpr double kMax = static_cast<double>(std::numeric_limits<float>::max());
  if (std::isinf(v)) return static_cast<float>(v);
  constexpr float kOddMax = std::numeric_limits<float>::max();  // mantissa all ones: odd
  if (v > kMax) return kOddMax;
  if (v < -kMax) return -kOddMax;
  const float nearest = static_cast<float>(v);
  if (static_cast<double>(nearest) == v) return nearest;
  std::uint32_t bits = bit_cast_value<std::uint32_t>(nearest);
  if (std::fabs(static_cast<double>(nearest)) > std::fabs(v)) --bits;  // truncate toward zero
  return bit_cast_value<float>(bits | 1u);
}

/// Integer -> double rounding to odd (exact below 2^53): the dropped low bits become a sticky
/// last bit, so a later rounding to a narrower format rounds only once.
template <class I>
double round_to_odd_double(I v) {
  static_assert(std::is_integral<I>::value && sizeof(I) <= 8, "round_to_odd_double takes integers");
  bool negative = false;
  if constexpr (std::is_signed<I>::value) negative = v < 0;
  // Two's complement negation in uint64 is exact even for the most negative value.
  std::uint64_t magnitude = negative ? std::uint64_t(0) - static_cast<std::uint64_t>(v)
                                     : static_cast<std::uint64_t>(v);
  int shift = 0;
  while ((magnitude >> shift) >= (std::uint64_t(1) << 53)) ++shift;
  const bool sticky = shift > 0 && (magnitude & ((std::uint64_t(1) << shift) - 1)) != 0;
  magnitude = (magnitude >> shift) | (sticky ? 1u : 0u);
  const double out = std::ldexp(static_cast<double>(magnitude), shift);
  return negative ? -out : out;
}

/// `v` as a float rounded to odd, for the half-precision encoders.
template <class S>
float to_float_for_narrowing(S v) {
  if constexpr (std::is_same<S, float>::value) {
    return v;
  } else if constexpr (std::is_same<S, bool>::value) {
    return v ? 1.0f : 0.0f;
  } else if constexpr (std::is_same<S, double>::value) {
    return round_to_odd_float(v);
  } else {
    return round_to_odd_float(round_to_odd_double(v));
  }
}

}  // namespace detail

}  // namespace moh
