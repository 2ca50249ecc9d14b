// Tests for moh/float16.hpp: conversions between float and IEEE 754 binary16 ("half") and
// bfloat16. Widening is exact (every bit pattern against the textbook formula, NaN payloads kept
// bit for bit); narrowing rounds to nearest, ties to even (hand-picked ties on both sides, every
// midpoint between neighbouring halves, random and swept bit patterns against an independent
// nearest-value search), over subnormals, the overflow threshold and signed zeros; NaN stays NaN
// with its sign and the payload bits that fit, so half -> float -> half and bfloat16 -> float ->
// bfloat16 give back every bit pattern.
#include "moh/float16.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "io/float16_reference.hpp"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

using moh_float16_test::bits_float;
using moh_float16_test::float_bits;
using moh_float16_test::half_reference;
using moh_float16_test::nearest_half_reference;

/// Of the two bfloat16 values around x (truncated toward zero, and the next one away from zero,
/// whose value is 2^128 when it is the infinity encoding), the nearer one, ties to the one with
/// an even last mantissa bit. Distances in double are exact. x finite.
std::uint16_t nearest_bfloat16(float x) {
  const std::uint32_t bits = float_bits(x);
  const std::uint32_t lo = bits & 0xFFFF0000u, hi = lo + 0x10000u;
  const double sign = (bits >> 31) ? -1.0 : 1.0;
  const double lo_value = bits_float(lo);
  const double hi_value = (hi & 0x7FFFFFFFu) == 0x7F800000u ? sign * std::ldexp(1.0, 128)
                                                             : static_cast<double>(bits_float(hi));
  const double down = std::abs(static_cast<double>(x) - lo_value);
  const double up = std::abs(hi_value - static_cast<double>(x));
  if (down < up || (down == up && ((lo >> 16) & 1u) == 0)) return static_cast<std::uint16_t>(lo >> 16);
  return static_cast<std::uint16_t>(hi >> 16);
}

/// Where a 16-bit format keeps a float NaN's payload: the top payload bits p (below `payloads`)
/// sit at bit `shift` of the float; the `low` bits under them are dropped.
struct NanLayout {
  std::uint32_t payloads;
  int shift;
  std::uint32_t infinity;  // the 16-bit exponent bits
  std::uint32_t quiet;     // the payload given when p is 0
  std::vector<std::uint32_t> low;
};

/// Every float NaN with payload bits p and low bits `low` (either sign) narrows to
/// sign | infinity | (p ? p : quiet), and widening then narrowing gives that pattern back.
template <class Narrow, class Widen>
void check_nan_payloads(Narrow narrow, Widen widen, const NanLayout& layout) {
  for (std::uint32_t sign : {0u, 0x80000000u})
    for (std::uint32_t p = 0; p < layout.payloads; ++p)
      for (std::uint32_t low : layout.low) {
        if (p == 0 && low == 0) continue;  // that is infinity, not a NaN
        const std::uint32_t nan = sign | 0x7F800000u | (p << layout.shift) | low;
        const std::uint16_t h = narrow(bits_float(nan));
        const std::uint16_t want = static_cast<std::uint16_t>((sign >> 16) | layout.infinity | (p ? p : layout.quiet));
        ASSERT_EQ(h, want) << std::hex << nan;
        // 16 bits -> float -> 16 bits is then the identity on it.
        ASSERT_EQ(narrow(widen(h)), h) << std::hex << nan;
      }
}

// ---- half: widening ---------------------------------------------------------------------------

TEST(Half, KnownValues) {
  EXPECT_EQ(moh::half_to_float(0x3C00), 1.0f);
  EXPECT_EQ(moh::half_to_float(0xC000), -2.0f);
  EXPECT_EQ(moh::half_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(moh::half_to_float(0x0001), std::ldexp(1.0f, -24));        // smallest subnormal
  EXPECT_EQ(moh::half_to_float(0x03FF), 1023.0f * std::ldexp(1.0f, -24));  // largest subnormal
  EXPECT_EQ(moh::half_to_float(0x0400), std::ldexp(1.0f, -14));        // smallest normal
  EXPECT_EQ(moh::half_to_float(0x3555), 1365.0f / 4096.0f);            // ~1/3
  EXPECT_EQ(moh::half_to_float(0x0000), 0.0f);
  EXPECT_FALSE(std::signbit(moh::half_to_float(0x0000)));
  EXPECT_TRUE(std::signbit(moh::half_to_float(0x8000)));
  EXPECT_EQ(moh::half_to_float(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(moh::half_to_float(0x7C00), kInf);
  EXPECT_EQ(moh::half_to_float(0xFC00), -kInf);
  EXPECT_TRUE(std::isnan(moh::half_to_float(0x7E00)));
  EXPECT_TRUE(std::isnan(moh::half_to_float(0x7C01)));  // signalling-style payload stays NaN
  EXPECT_TRUE(std::isnan(moh::half_to_float(0xFFFF)));
}

TEST(Half, WideningIsExactForEveryBitPattern) {
  for (std::uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float got = moh::half_to_float(h);
    const double want = half_reference(h);
    if (std::isnan(want)) {
      // A NaN keeps its sign and its whole 10-bit payload, in the payload's top bits.
      ASSERT_TRUE(std::isnan(got)) << "bits 0x" << std::hex << bits;
      const std::uint32_t expected = (static_cast<std::uint32_t>(h & 0x8000u) << 16) | 0x7F800000u |
                                     (static_cast<std::uint32_t>(h & 0x3FFu) << 13);
      ASSERT_EQ(float_bits(got), expected) << "bits 0x" << std::hex << bits;
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << "bits 0x" << std::hex << bits;
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << "bits 0x" << std::hex << bits;
    }
  }
}

// ---- half: narrowing --------------------------------------------------------------------------

TEST(Half, NarrowingRoundTripsEveryBitPattern) {
  // Every half, NaNs and infinities included, comes back bit for bit through float.
  for (std::uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    ASSERT_EQ(moh::float_to_half(moh::half_to_float(h)), h) << "bits 0x" << std::hex << bits;
  }
}

TEST(Half, NarrowingSpecialValues) {
  EXPECT_EQ(moh::float_to_half(0.0f), 0x0000);
  EXPECT_EQ(moh::float_to_half(-0.0f), 0x8000);
  EXPECT_EQ(moh::float_to_half(kInf), 0x7C00);
  EXPECT_EQ(moh::float_to_half(-kInf), 0xFC00);
  EXPECT_EQ(moh::float_to_half(65504.0f), 0x7BFF);                  // largest half
  EXPECT_EQ(moh::float_to_half(1e6f), 0x7C00);                      // overflow -> inf
  EXPECT_EQ(moh::float_to_half(-std::numeric_limits<float>::max()), 0xFC00);
  EXPECT_EQ(moh::float_to_half(std::ldexp(1.0f, -24)), 0x0001);     // smallest subnormal
  EXPECT_EQ(moh::float_to_half(std::ldexp(1.0f, -14)), 0x0400);     // smallest normal
  EXPECT_EQ(moh::float_to_half(std::ldexp(1023.0f, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(moh::float_to_half(1e-30f), 0x0000);                    // underflow -> zero
  EXPECT_EQ(moh::float_to_half(-1e-30f), 0x8000);                   // ... keeping the sign
  EXPECT_EQ(moh::float_to_half(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(moh::float_to_half(-std::numeric_limits<float>::denorm_min()), 0x8000);
  // NaN stays NaN with its sign, also when the payload sits only in the dropped low bits.
  for (std::uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0x7F802000u}) {
    const std::uint16_t h = moh::float_to_half(bits_float(nan));
    EXPECT_EQ(h & 0x7C00, 0x7C00) << std::hex << nan;
    EXPECT_NE(h & 0x03FF, 0) << std::hex << nan;
    EXPECT_EQ(h >> 15, nan >> 31) << std::hex << nan;
    EXPECT_TRUE(std::isnan(moh::half_to_float(h)));
  }
}

TEST(Half, NarrowingRoundsTiesToEven) {
  const float u = std::ldexp(1.0f, -10);  // half's ulp at 1
  EXPECT_EQ(moh::float_to_half(1.0f + u / 2), 0x3C00);                      // tie -> even (down)
  EXPECT_EQ(moh::float_to_half(1.0f + 3 * u / 2), 0x3C02);                  // tie -> even (up)
  EXPECT_EQ(moh::float_to_half(std::nextafter(1.0f + u / 2, 2.0f)), 0x3C01);  // above the tie
  EXPECT_EQ(moh::float_to_half(std::nextafter(1.0f + 3 * u / 2, 0.0f)), 0x3C01);  // below the tie
  EXPECT_EQ(moh::float_to_half(-(1.0f + u / 2)), 0xBC00);
  EXPECT_EQ(moh::float_to_half(-(1.0f + 3 * u / 2)), 0xBC02);
  EXPECT_EQ(moh::float_to_half(2048.0f + 1.0f), 0x6800);  // 2049: tie between 2048 and 2050
  EXPECT_EQ(moh::float_to_half(2048.0f + 3.0f), 0x6802);  // 2051: tie between 2050 and 2052
  // The rounding carry moves into the exponent: just below 2 rounds up to 2.
  EXPECT_EQ(moh::float_to_half(2.0f - u / 4), 0x4000);
  // 65520 is halfway between 65504 (odd mantissa) and 65536: it rounds to infinity.
  EXPECT_EQ(moh::float_to_half(65520.0f), 0x7C00);
  EXPECT_EQ(moh::float_to_half(-65520.0f), 0xFC00);
  EXPECT_EQ(moh::float_to_half(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  // Subnormals: units of 2^-24; ties go to the even unit, including the tie at 2^-25 -> 0.
  const float unit = std::ldexp(1.0f, -24);
  EXPECT_EQ(moh::float_to_half(unit / 2), 0x0000);
  EXPECT_EQ(moh::float_to_half(-unit / 2), 0x8000);
  EXPECT_EQ(moh::float_to_half(std::nextafter(unit / 2, 1.0f)), 0x0001);
  EXPECT_EQ(moh::float_to_half(std::nextafter(unit / 2, 0.0f)), 0x0000);
  EXPECT_EQ(moh::float_to_half(3 * unit / 2), 0x0002);
  EXPECT_EQ(moh::float_to_half(5 * unit / 2), 0x0002);
  EXPECT_EQ(moh::float_to_half(7 * unit / 2), 0x0004);
  EXPECT_EQ(moh::float_to_half(std::nextafter(5 * unit / 2, 1.0f)), 0x0003);
  // Largest subnormal + half a unit ties to the smallest normal (even).
  EXPECT_EQ(moh::float_to_half(1023.5f * unit), 0x0400);
  EXPECT_EQ(moh::float_to_half(std::nextafter(1023.5f * unit, 0.0f)), 0x03FF);
}

TEST(Half, NarrowingMatchesANearestSearch) {
  // Every midpoint between neighbouring halves, and the floats just beside it.
  for (std::uint32_t h = 0; h < 0x7BFF; ++h) {
    const float mid = static_cast<float>(
        (half_reference(static_cast<std::uint16_t>(h)) + half_reference(static_cast<std::uint16_t>(h + 1))) / 2);
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      ASSERT_EQ(moh::float_to_half(v), nearest_half_reference(v)) << v;
      ASSERT_EQ(moh::float_to_half(-v), nearest_half_reference(-v)) << -v;
    }
  }
  // Random finite floats over the whole range, and denser near half's range.
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::uniform_int_distribution<std::uint32_t> near_bits(0x32000000u, 0x47FFFFFFu);
  for (int i = 0; i < 200000; ++i) {
    for (std::uint32_t bits : {any_bits(rng), near_bits(rng) | (any_bits(rng) & 0x80000000u)}) {
      const float v = bits_float(bits);
      if (!std::isfinite(v)) continue;
      ASSERT_EQ(moh::float_to_half(v), nearest_half_reference(v)) << std::hex << bits;
    }
  }
  // A sweep of the whole bit range at a fixed odd stride (every exponent, both signs).
  for (std::uint64_t bits = 0; bits <= 0xFFFFFFFFu; bits += 4099) {
    const float v = bits_float(static_cast<std::uint32_t>(bits));
    if (!std::isfinite(v)) continue;
    ASSERT_EQ(moh::float_to_half(v), nearest_half_reference(v)) << std::hex << bits;
  }
}

#if defined(__F16C__)
// The hardware conversion (F16C, round to nearest even) as a second, independent reference for
// every non-NaN float on a dense stride (NaNs differ on purpose: F16C sets the quiet bit, moh
// keeps the payload as it is).
TEST(Half, NarrowingMatchesF16C) {
  for (std::uint64_t bits = 0; bits <= 0xFFFFFFFFu; bits += 127) {
    const float v = bits_float(static_cast<std::uint32_t>(bits));
    if (std::isnan(v)) continue;
    const auto hw = static_cast<std::uint16_t>(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
    ASSERT_EQ(moh::float_to_half(v), hw) << std::hex << bits;
    ASSERT_EQ(float_bits(moh::half_to_float(hw)), float_bits(_cvtsh_ss(hw))) << std::hex << bits;
  }
}
#endif

TEST(Half, NaNKeepsItsSignAndTheTopPayloadBits) {
  // A float NaN with payload bits p (10, top) and low (13, dropped): the half is sign | 0x7C00 | p;
  // with p = 0 the NaN would read as infinity, so it becomes a quiet NaN (0x200) instead.
  check_nan_payloads(moh::float_to_half, moh::half_to_float,
                     {/*payloads=*/0x400u, /*shift=*/13, /*infinity=*/0x7C00u, /*quiet=*/0x200u,
                      /*low=*/{0u, 1u, 0x1000u, 0x1FFFu}});
}

// ---- bfloat16 ---------------------------------------------------------------------------------

TEST(BFloat16, KnownValues) {
  EXPECT_EQ(moh::bfloat16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(moh::bfloat16_to_float(0xC000), -2.0f);
  EXPECT_EQ(moh::bfloat16_to_float(0x4049), 3.140625f);
  EXPECT_EQ(moh::bfloat16_to_float(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal
  EXPECT_EQ(moh::bfloat16_to_float(0x0080), std::ldexp(1.0f, -126));  // smallest normal
  EXPECT_EQ(moh::bfloat16_to_float(0x7F7F), 255.0f * std::ldexp(1.0f, 120));  // largest finite
  EXPECT_EQ(moh::bfloat16_to_float(0x7F80), kInf);
  EXPECT_EQ(moh::bfloat16_to_float(0xFF80), -kInf);
  EXPECT_TRUE(std::signbit(moh::bfloat16_to_float(0x8000)));
  EXPECT_TRUE(std::isnan(moh::bfloat16_to_float(0x7FC0)));
  EXPECT_TRUE(std::isnan(moh::bfloat16_to_float(0x7F81)));
}

TEST(BFloat16, EveryPatternSurvivesWidenAndRound) {
  // Widening is the upper half of the float's bits exactly (NaN payloads included), and
  // narrowing gives back every pattern, NaNs and infinities included.
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const float f = moh::bfloat16_to_float(static_cast<std::uint16_t>(b));
    ASSERT_EQ(float_bits(f), b << 16);
    ASSERT_EQ(moh::float_to_bfloat16(f), b) << "bits 0x" << std::hex << b;
  }
}

TEST(BFloat16, RoundsToNearestEvenOnRandomBitPatterns) {
  std::mt19937 rng(7);
  int checked = 0;
  for (int i = 0; i < 1 << 20; ++i) {
    const std::uint32_t bits = rng();
    const float x = bits_float(bits);
    if (std::isnan(x) || std::isinf(x)) continue;
    ASSERT_EQ(moh::float_to_bfloat16(x), nearest_bfloat16(x)) << "bits 0x" << std::hex << bits;
    ++checked;
  }
  EXPECT_GT(checked, 1 << 19);
  // And a sweep of the whole bit range at a fixed odd stride.
  for (std::uint64_t bits = 0; bits <= 0xFFFFFFFFu; bits += 251) {
    const float x = bits_float(static_cast<std::uint32_t>(bits));
    if (!std::isfinite(x)) continue;
    ASSERT_EQ(moh::float_to_bfloat16(x), nearest_bfloat16(x)) << "bits 0x" << std::hex << bits;
  }
}

TEST(BFloat16, HandPickedTiesAndSpecialValues) {
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties to the even one, 1.
  EXPECT_EQ(moh::float_to_bfloat16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  EXPECT_EQ(moh::float_to_bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  // Just above the tie rounds up.
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x3F808001u)), 0x3F81);
  EXPECT_EQ(moh::float_to_bfloat16(std::numeric_limits<float>::max()), 0x7F80);  // overflow
  EXPECT_EQ(moh::float_to_bfloat16(-kInf), 0xFF80);
  EXPECT_EQ(moh::float_to_bfloat16(-0.0f), 0x8000);
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x00000001u)), 0x0000);  // tiny subnormal
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x00018000u)), 0x0002);  // subnormal tie, to even
  for (std::uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu})
    EXPECT_TRUE(std::isnan(moh::bfloat16_to_float(moh::float_to_bfloat16(bits_float(nan)))));
}

TEST(BFloat16, RoundsTiesToEven) {
  EXPECT_EQ(moh::float_to_bfloat16(1.0f), 0x3F80);
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x3F808000u)), 0x3F80);  // tie -> even (down)
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x3F818000u)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x3F808001u)), 0x3F81);  // above the tie
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x3F817FFFu)), 0x3F81);  // below the tie
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0xBF808000u)), 0xBF80);
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0xBF818000u)), 0xBF82);
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x3FFFFFFFu)), 0x4000);  // carry into the exponent
  EXPECT_EQ(moh::float_to_bfloat16(3.14159265f), 0x4049);
  // Overflow: beyond the largest bfloat16 (0x7F7F) by half an ulp or more -> infinity.
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x7F7F8000u)), 0x7F80);  // tie, 0x7F7F odd -> inf
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0xFF7F8000u)), 0xFF80);
  EXPECT_EQ(moh::float_to_bfloat16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(moh::float_to_bfloat16(-kInf), 0xFF80);
  EXPECT_EQ(moh::float_to_bfloat16(kInf), 0x7F80);
  // Subnormals round like everything else; ties to even.
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x00008000u)), 0x0000);
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x80008000u)), 0x8000);
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x00018000u)), 0x0002);
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x00008001u)), 0x0001);
  EXPECT_EQ(moh::float_to_bfloat16(bits_float(0x007F8000u)), 0x0080);  // to the smallest normal
  EXPECT_EQ(moh::float_to_bfloat16(-0.0f), 0x8000);
  EXPECT_EQ(moh::float_to_bfloat16(0.0f), 0x0000);
  // NaN stays NaN, also when its payload is only in the dropped bits.
  for (std::uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu}) {
    const std::uint16_t b = moh::float_to_bfloat16(bits_float(nan));
    EXPECT_TRUE(std::isnan(moh::bfloat16_to_float(b))) << std::hex << nan;
    EXPECT_EQ(b >> 15, nan >> 31) << std::hex << nan;
  }
}

TEST(BFloat16, MatchesDoubleRounding) {
  // Reference: round the float to 8 significant bits in double arithmetic (ties to even via
  // nearbyint in the default rounding mode), then compare values. Covers normals and subnormals.
  std::mt19937 rng(11);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 400000; ++i) {
    const float v = bits_float(any_bits(rng));
    if (!std::isfinite(v) || v == 0.0f) continue;
    int exponent;
    std::frexp(static_cast<double>(v), &exponent);
    const int quantum = std::max(exponent - 8, -133);  // bfloat16 ulp exponent (subnormals: 2^-133)
    const double want = std::ldexp(std::nearbyint(std::ldexp(static_cast<double>(v), -quantum)), quantum);
    const float got = moh::bfloat16_to_float(moh::float_to_bfloat16(v));
    if (std::fabs(want) >= std::ldexp(1.0, 128)) {
      ASSERT_TRUE(std::isinf(got)) << v;
      ASSERT_EQ(std::signbit(got), std::signbit(v)) << v;
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << std::hex << float_bits(v);
    }
  }
}

TEST(BFloat16, NaNKeepsItsSignAndTheTopPayloadBits) {
  // A float NaN keeps its upper 16 bits (sign, exponent, the top 7 payload bits); when those
  // payload bits are all zero the result would read as infinity, so the quiet bit is set.
  check_nan_payloads(moh::float_to_bfloat16, moh::bfloat16_to_float,
                     {/*payloads=*/0x80u, /*shift=*/16, /*infinity=*/0x7F80u, /*quiet=*/0x40u,
                      /*low=*/{0u, 1u, 0x8000u, 0xFFFFu}});
}

}  // namespace
