// Conversions between float and the 16-bit float formats: IEEE 754 binary16 ("half", F16) and
// bfloat16 (the upper half of a binary32, BF16). Widening is exact; narrowing rounds to nearest,
// ties to even, and keeps NaN a NaN. Used by the safetensors reader and writer and by bfloat16
// weight storage.
#pragma once

#include <cstdint>
#include <cstring>

namespace moh {
namespace detail {

/// Reinterprets the bits of `from` as a `To` of the same size (no aliasing UB).
template <class To, class From>
To bit_cast_value(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast_value needs equal sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

}  // namespace detail

/// Converts an IEEE 754 binary16 value to float exactly (subnormals, infinities and NaN
/// payloads included; every half value is representable as a float).
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1Fu;
  std::uint32_t mantissa = h & 0x3FFu;
  std::uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // infinity or NaN (payload kept)
  } else if (exponent != 0) {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);  // normal
  } else if (mantissa == 0) {
    bits = sign;  // signed zero
  } else {
    // Subnormal half: value = mantissa * 2^-24. Shift the leading 1 up to the implicit bit; each
    // shift lowers the exponent by one, starting from the smallest normal exponent -14.
    int e = -14;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    mantissa &= 0x3FFu;
    bits = sign | (static_cast<std::uint32_t>(e + 127) << 23) | (mantissa << 13);
  }
  return detail::bit_cast_value<float>(bits);
}

/// Converts a bfloat16 value (the upper half of a binary32) to float exactly.
inline float bfloat16_to_float(std::uint16_t b) {
  return detail::bit_cast_value<float>(static_cast<std::uint32_t>(b) << 16);
}

/// Converts a float to IEEE 754 binary16, rounding to nearest (ties to even). Magnitudes from
/// 65520 up become infinity, tiny values become subnormals or a signed zero, and NaN stays NaN
/// (the top 10 payload bits are kept, so half -> float -> half gives back every bit pattern).
inline std::uint16_t float_to_half(float f) {
  const std::uint32_t x = detail::bit_cast_value<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) {  // NaN: keep what fits of the payload, and keep it a NaN
    std::uint32_t payload = (abs >> 13) & 0x3FFu;
    if (payload == 0) payload = 0x200u;
    return static_cast<std::uint16_t>(sign | 0x7C00u | payload);
  }
  if (abs >= 0x38800000u) {  // >= 2^-14: a normal half, or infinity after rounding
    // Rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even;
    // a carry out of the mantissa correctly bumps the exponent, up to infinity.
    const std::uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);
    const std::uint32_t h = (rounded - 0x38000000u) >> 13;
    return static_cast<std::uint16_t>(sign | (h >= 0x7C00u ? 0x7C00u : h));
  }
  if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);  // < 2^-25: rounds to zero
  // A half subnormal counts units of 2^-24. With the implicit bit, the float is m * 2^(e - 150);
  // in units of 2^-24 that is m >> (126 - e), shift 14..24, rounded to nearest even (a carry into
  // 0x400 yields the smallest normal, which is the right bit pattern).
  const std::uint32_t e = abs >> 23;
  const std::uint32_t m = (abs & 0x7FFFFFu) | 0x800000u;
  const std::uint32_t shift = 126u - e;
  std::uint32_t q = m >> shift;
  const std::uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (q & 1u) != 0)) ++q;
  return static_cast<std::uint16_t>(sign | q);
}

/// Converts a float to bfloat16 (the upper half of a binary32), rounding to nearest (ties to
/// even). Values beyond the largest bfloat16 become infinity; NaN stays NaN with its top payload
/// bits, so bfloat16 -> float -> bfloat16 gives back every bit pattern.
inline std::uint16_t float_to_bfloat16(float f) {
  const std::uint32_t x = detail::bit_cast_value<std::uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    std::uint32_t b = x >> 16;
    if ((b & 0x7Fu) == 0) b |= 0x40u;  // the payload lived in the dropped bits: stay a NaN
    return static_cast<std::uint16_t>(b);
  }
  // Round the low 16 bits to nearest even; a carry moves into the exponent (up to infinity).
  return static_cast<std::uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace moh
