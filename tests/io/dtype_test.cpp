// Tests for moh/io/dtype.hpp: the element types of safetensors files (sizes, names, the dtype
// that holds a C++ type), little-endian loads and stores, the exact conversions between values
// (convert_value, narrow_to_float) and rounding to odd, which makes double -> half round once.
// (The 16-bit float conversions themselves, moh/float16.hpp, are tested in tests/float16_test.cpp.)
#include "moh/io/dtype.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "io/float16_reference.hpp"
#include "test_helpers.hpp"

namespace {

using moh_float16_test::bits_float;
using moh_float16_test::float_bits;
using moh_float16_test::half_reference;
using moh_float16_test::nearest_half_reference;

// ---- dtypes -------------------------------------------------------------------------------------

TEST(DType, SizesAndNames) {
  using moh::DType;
  const std::vector<std::pair<DType, std::size_t>> sizes = {
      {DType::F64, 8}, {DType::F32, 4}, {DType::F16, 2}, {DType::BF16, 2}, {DType::I64, 8},
      {DType::I32, 4}, {DType::I16, 2}, {DType::I8, 1},  {DType::U8, 1},   {DType::BOOL, 1}};
  for (const auto& [dtype, size] : sizes) EXPECT_EQ(moh::dtype_size(dtype), size);
  EXPECT_STREQ(moh::dtype_name(DType::BF16), "BF16");
  EXPECT_STREQ(moh::dtype_name(DType::BOOL), "BOOL");
  EXPECT_STREQ(moh::dtype_name(DType::U8), "U8");
}

TEST(DType, EveryNameParsesBackAndNothingElseDoes) {
  using moh::DType;
  for (DType d : {DType::F64, DType::F32, DType::F16, DType::BF16, DType::I64, DType::I32,
                  DType::I16, DType::I8, DType::U8, DType::BOOL}) {
    DType parsed = d == DType::F32 ? DType::F64 : DType::F32;
    ASSERT_TRUE(moh::detail::parse_dtype(moh::dtype_name(d), parsed)) << moh::dtype_name(d);
    EXPECT_EQ(parsed, d) << moh::dtype_name(d);
  }
  for (const char* bad : {"f32", "F8_E4M3", "", "BOOL ", "U16", "float"}) {
    DType out = DType::I8;
    EXPECT_FALSE(moh::detail::parse_dtype(bad, out)) << bad;
    EXPECT_EQ(out, DType::I8) << bad;  // left alone
  }
}

// Moved from safetensors_writer_test.cpp (dtype_for lives in io/dtype.hpp now).
TEST(DType, NativeDtypes) {
  using moh::DType;
  EXPECT_EQ(moh::dtype_for<float>(), DType::F32);
  EXPECT_EQ(moh::dtype_for<double>(), DType::F64);
  EXPECT_EQ(moh::dtype_for<std::int64_t>(), DType::I64);
  EXPECT_EQ(moh::dtype_for<long long>(), DType::I64);
  EXPECT_EQ(moh::dtype_for<std::int32_t>(), DType::I32);
  EXPECT_EQ(moh::dtype_for<std::int16_t>(), DType::I16);
  EXPECT_EQ(moh::dtype_for<std::int8_t>(), DType::I8);
  EXPECT_EQ(moh::dtype_for<std::uint8_t>(), DType::U8);
  EXPECT_EQ(moh::dtype_for<bool>(), DType::BOOL);
  static_assert(moh::dtype_for<float>() == DType::F32, "dtype_for is constexpr");
}

TEST(DType, TypeNamesForMessages) {
  EXPECT_STREQ(moh::detail::type_name<bool>(), "bool (0 or 1)");
  EXPECT_STREQ(moh::detail::type_name<float>(), "float");
  EXPECT_STREQ(moh::detail::type_name<double>(), "double");
  EXPECT_STREQ(moh::detail::type_name<std::int8_t>(), "int8");
  EXPECT_STREQ(moh::detail::type_name<std::uint8_t>(), "uint8");
  EXPECT_STREQ(moh::detail::type_name<std::int32_t>(), "int32");
  EXPECT_STREQ(moh::detail::type_name<std::uint64_t>(), "uint64");
  // Small integers print as numbers, not characters.
  EXPECT_EQ(moh::detail::concat(moh::detail::printable(std::int8_t(65))), "65");
  EXPECT_EQ(moh::detail::concat(moh::detail::printable(std::uint8_t(200))), "200");
  EXPECT_EQ(moh::detail::concat(moh::detail::printable(-2.5)), "-2.5");
}

TEST(DType, CheckedMultiply) {
  std::uint64_t out = 7;
  EXPECT_TRUE(moh::detail::checked_mul(3, 4, 12, out));
  EXPECT_EQ(out, 12u);
  out = 7;
  EXPECT_FALSE(moh::detail::checked_mul(3, 5, 12, out));
  EXPECT_EQ(out, 7u);  // left alone
  EXPECT_TRUE(moh::detail::checked_mul(0, ~std::uint64_t(0), 1, out));
  EXPECT_EQ(out, 0u);
  const std::uint64_t limit = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  EXPECT_FALSE(moh::detail::checked_mul(std::uint64_t(1) << 32, std::uint64_t(1) << 32, limit, out));
  EXPECT_FALSE(moh::detail::checked_mul(std::uint64_t(1) << 31, std::uint64_t(1) << 32, limit, out));
  EXPECT_TRUE(moh::detail::checked_mul(std::uint64_t(1) << 31, std::uint64_t(1) << 31, limit, out));
  EXPECT_EQ(out, std::uint64_t(1) << 62);
}

// ---- little-endian loads and stores -------------------------------------------------------------

TEST(DType, LoadsAndStoresLittleEndianAtAnyAlignment) {
  const std::uint8_t bytes[] = {0xAA, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0xBB};
  EXPECT_EQ(moh::detail::load_le<std::uint8_t>(bytes + 1), 0x01u);
  EXPECT_EQ(moh::detail::load_le<std::uint16_t>(bytes + 1), 0x0201u);
  EXPECT_EQ(moh::detail::load_le<std::uint32_t>(bytes + 1), 0x04030201u);  // odd address
  EXPECT_EQ(moh::detail::load_le<std::uint64_t>(bytes + 1), 0x0807060504030201ull);

  std::uint8_t out[10] = {};
  moh::detail::store_le<std::uint16_t>(out + 1, 0xABCD);
  EXPECT_EQ(out[1], 0xCD);
  EXPECT_EQ(out[2], 0xAB);
  EXPECT_EQ(out[3], 0x00);  // nothing beyond the value's bytes
  moh::detail::store_le<std::uint64_t>(out + 1, 0x0807060504030201ull);
  EXPECT_EQ(0, std::memcmp(out + 1, bytes + 1, 8));
  EXPECT_EQ(out[0], 0x00);
  EXPECT_EQ(out[9], 0x00);
  // Round trips of every width.
  std::mt19937_64 rng(3);
  for (int i = 0; i < 100; ++i) {
    const std::uint64_t v = rng();
    moh::detail::store_le<std::uint64_t>(out + 1, v);
    EXPECT_EQ(moh::detail::load_le<std::uint64_t>(out + 1), v);
    moh::detail::store_le<std::uint32_t>(out + 3, static_cast<std::uint32_t>(v));
    EXPECT_EQ(moh::detail::load_le<std::uint32_t>(out + 3), static_cast<std::uint32_t>(v));
    moh::detail::store_le<std::uint16_t>(out + 5, static_cast<std::uint16_t>(v));
    EXPECT_EQ(moh::detail::load_le<std::uint16_t>(out + 5), static_cast<std::uint16_t>(v));
  }
}

// ---- conversions between values -----------------------------------------------------------------

TEST(DType, NarrowToFloatRoundsWithoutUndefinedBehaviour) {
  const float inf = std::numeric_limits<float>::infinity();
  const float max = std::numeric_limits<float>::max();
  using moh::detail::narrow_to_float;
  EXPECT_EQ(narrow_to_float(0.1), 0.1f);
  EXPECT_EQ(narrow_to_float(1e300), inf);
  EXPECT_EQ(narrow_to_float(-1e300), -inf);
  EXPECT_EQ(narrow_to_float(static_cast<double>(max)), max);
  // Halfway between FLT_MAX and 2^128 ties to even, which is infinity; just below stays FLT_MAX.
  const double overflow = std::ldexp(1.0, 128) - std::ldexp(1.0, 103);
  EXPECT_EQ(narrow_to_float(overflow), inf);
  EXPECT_EQ(narrow_to_float(-overflow), -inf);
  EXPECT_EQ(narrow_to_float(std::nextafter(overflow, 0.0)), max);
  EXPECT_EQ(narrow_to_float(-std::nextafter(overflow, 0.0)), -max);
  EXPECT_EQ(narrow_to_float(std::nextafter(static_cast<double>(max), 1e300)), max);
  EXPECT_EQ(narrow_to_float(static_cast<double>(inf)), inf);
  EXPECT_TRUE(std::isnan(narrow_to_float(std::nan(""))));
  EXPECT_EQ(narrow_to_float(1e-300), 0.0f);
  EXPECT_TRUE(std::signbit(narrow_to_float(-1e-300)));
  EXPECT_EQ(narrow_to_float(std::ldexp(1.0, -149)), std::numeric_limits<float>::denorm_min());
}

TEST(DType, ConvertValueToBoolNeedsZeroOrOne) {
  using moh::detail::convert_value;
  bool b = false;
  EXPECT_TRUE(convert_value(1.0, b));
  EXPECT_TRUE(b);
  EXPECT_TRUE(convert_value(std::int64_t(0), b));
  EXPECT_FALSE(b);
  EXPECT_TRUE(convert_value(std::uint8_t(1), b));
  EXPECT_TRUE(b);
  for (double bad : {0.5, 2.0, -1.0, std::nan("")}) {
    b = true;
    EXPECT_FALSE(convert_value(bad, b)) << bad;
    EXPECT_TRUE(b) << bad;  // left alone
  }
  EXPECT_FALSE(convert_value(std::int32_t(-1), b));
  EXPECT_FALSE(convert_value(std::uint8_t(2), b));
}

TEST(DType, ConvertValueToFloatingRounds) {
  using moh::detail::convert_value;
  float f = 0;
  double d = 0;
  EXPECT_TRUE(convert_value(1e300, f));
  EXPECT_EQ(f, std::numeric_limits<float>::infinity());  // narrowed, never undefined
  EXPECT_TRUE(convert_value(0.1, f));
  EXPECT_EQ(f, 0.1f);
  EXPECT_TRUE(convert_value(0.1f, d));
  EXPECT_EQ(d, static_cast<double>(0.1f));  // widening is exact
  EXPECT_TRUE(convert_value((std::int64_t(1) << 53) + 1, d));
  EXPECT_EQ(d, 9007199254740992.0);  // ties to even
  EXPECT_TRUE(convert_value(std::numeric_limits<std::uint64_t>::max(), f));
  EXPECT_EQ(f, std::ldexp(1.0f, 64));
  EXPECT_TRUE(convert_value(true, f));
  EXPECT_EQ(f, 1.0f);
  EXPECT_TRUE(convert_value(std::nan(""), f));
  EXPECT_TRUE(std::isnan(f));
}

TEST(DType, ConvertValueFromFloatingToIntegerNeedsAnExactValue) {
  using moh::detail::convert_value;
  std::int8_t i8 = 5;
  EXPECT_TRUE(convert_value(127.0, i8));
  EXPECT_EQ(i8, 127);
  EXPECT_TRUE(convert_value(-128.0f, i8));
  EXPECT_EQ(i8, -128);
  EXPECT_TRUE(convert_value(-0.0, i8));
  EXPECT_EQ(i8, 0);
  for (double bad : {128.0, -129.0, 2.5, -0.5, std::nan(""), std::numeric_limits<double>::infinity(),
                     -std::numeric_limits<double>::infinity()}) {
    i8 = 5;
    EXPECT_FALSE(convert_value(bad, i8)) << bad;
    EXPECT_EQ(i8, 5) << bad;  // left alone
  }
  std::uint8_t u8 = 0;
  EXPECT_FALSE(convert_value(-1.0, u8));
  EXPECT_TRUE(convert_value(255.0f, u8));
  EXPECT_EQ(u8, 255);
  // The 64-bit edges: 2^63 is not an int64, 2^64 is not a uint64; -2^63 is an int64.
  std::int64_t i64 = 0;
  std::uint64_t u64 = 0;
  EXPECT_FALSE(convert_value(std::ldexp(1.0, 63), i64));
  EXPECT_TRUE(convert_value(-std::ldexp(1.0, 63), i64));
  EXPECT_EQ(i64, std::numeric_limits<std::int64_t>::min());
  EXPECT_TRUE(convert_value(std::nextafter(std::ldexp(1.0, 63), 0.0), i64));
  EXPECT_EQ(i64, std::int64_t(9223372036854774784));
  EXPECT_TRUE(convert_value(1e19, u64));
  EXPECT_EQ(u64, 10000000000000000000ull);
  EXPECT_FALSE(convert_value(std::ldexp(1.0, 64), u64));
  EXPECT_FALSE(convert_value(1e19, i64));
}

TEST(DType, ConvertValueBetweenIntegersIsRangeChecked) {
  using moh::detail::convert_value;
  std::int8_t i8 = 5;
  EXPECT_FALSE(convert_value(std::int32_t(300), i8));
  EXPECT_FALSE(convert_value(std::int32_t(-129), i8));
  EXPECT_FALSE(convert_value(std::uint8_t(128), i8));
  EXPECT_EQ(i8, 5);
  EXPECT_TRUE(convert_value(std::int64_t(-128), i8));
  EXPECT_EQ(i8, -128);
  std::uint8_t u8 = 5;
  EXPECT_FALSE(convert_value(std::int8_t(-1), u8));
  EXPECT_FALSE(convert_value(std::int64_t(256), u8));
  EXPECT_EQ(u8, 5);
  std::int64_t i64 = 0;
  EXPECT_FALSE(convert_value(std::uint64_t(1) << 63, i64));
  EXPECT_TRUE(convert_value(std::uint64_t(std::numeric_limits<std::int64_t>::max()), i64));
  EXPECT_EQ(i64, std::numeric_limits<std::int64_t>::max());
  std::uint64_t u64 = 0;
  EXPECT_FALSE(convert_value(std::int64_t(-1), u64));
  EXPECT_FALSE(convert_value(std::numeric_limits<std::int64_t>::min(), u64));
  EXPECT_TRUE(convert_value(std::numeric_limits<std::int64_t>::max(), u64));
  std::int16_t i16 = 0;
  EXPECT_TRUE(convert_value(std::uint8_t(255), i16));
  EXPECT_EQ(i16, 255);
  EXPECT_TRUE(convert_value(true, i16));
  EXPECT_EQ(i16, 1);
}

// ---- rounding to odd ------------------------------------------------------------------------------

TEST(DType, RoundToOddFloatKeepsAStickyLastBit) {
  using moh::detail::round_to_odd_float;
  EXPECT_EQ(round_to_odd_float(1.0), 1.0f);  // exact values stay
  EXPECT_EQ(round_to_odd_float(0.5), 0.5f);
  EXPECT_EQ(float_bits(round_to_odd_float(1.0 + std::ldexp(1.0, -30))), 0x3F800001u);
  EXPECT_EQ(float_bits(round_to_odd_float(1.0 - std::ldexp(1.0, -30))), 0x3F7FFFFFu);  // toward 0
  EXPECT_EQ(float_bits(round_to_odd_float(-(1.0 + std::ldexp(1.0, -30)))), 0xBF800001u);
  // An inexact value whose truncation is already odd keeps it.
  const double odd = static_cast<double>(bits_float(0x3F800001u)) + std::ldexp(1.0, -40);
  EXPECT_EQ(float_bits(round_to_odd_float(odd)), 0x3F800001u);
  // Out of range: the largest float (odd); infinities and NaN stay.
  EXPECT_EQ(round_to_odd_float(1e300), std::numeric_limits<float>::max());
  EXPECT_EQ(round_to_odd_float(-1e300), -std::numeric_limits<float>::max());
  EXPECT_EQ(round_to_odd_float(std::numeric_limits<double>::infinity()),
            std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(round_to_odd_float(std::nan(""))));
  // Every inexact conversion gives the odd one of the two floats around the value.
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(-1e6, 1e6);
  for (int i = 0; i < 10000; ++i) {
    const double v = u(rng);
    const float r = round_to_odd_float(v);
    if (static_cast<double>(static_cast<float>(v)) == v) continue;
    ASSERT_EQ(float_bits(r) & 1u, 1u) << v;
    ASSERT_LT(static_cast<double>(std::nextafter(r, -INFINITY)), v) << v;
    ASSERT_GT(static_cast<double>(std::nextafter(r, INFINITY)), v) << v;
  }
}

TEST(DType, RoundToOddDoubleFromIntegers) {
  using moh::detail::round_to_odd_double;
  EXPECT_EQ(round_to_odd_double(std::int64_t(0)), 0.0);
  EXPECT_EQ(round_to_odd_double(std::int64_t(-7)), -7.0);
  EXPECT_EQ(round_to_odd_double((std::int64_t(1) << 53) - 1), 9007199254740991.0);  // exact
  EXPECT_EQ(round_to_odd_double(std::int64_t(1) << 60), std::ldexp(1.0, 60));
  // 2^60 + 1: the dropped low bit becomes the sticky last bit of the 53-bit significand.
  EXPECT_EQ(round_to_odd_double((std::int64_t(1) << 60) + 1), std::ldexp(1.0, 60) + 256.0);
  EXPECT_EQ(round_to_odd_double(-(std::int64_t(1) << 60) - 1), -(std::ldexp(1.0, 60) + 256.0));
  EXPECT_EQ(round_to_odd_double(std::numeric_limits<std::int64_t>::min()), -std::ldexp(1.0, 63));
  EXPECT_EQ(round_to_odd_double(std::numeric_limits<std::uint64_t>::max()),
            std::ldexp(1.0, 64) - std::ldexp(1.0, 11));
  EXPECT_EQ(round_to_odd_double(std::int8_t(-128)), -128.0);
  EXPECT_EQ(round_to_odd_double(std::uint8_t(255)), 255.0);
}

TEST(DType, ToFloatForNarrowing) {
  using moh::detail::to_float_for_narrowing;
  EXPECT_EQ(float_bits(to_float_for_narrowing(bits_float(0x3F808000u))), 0x3F808000u);  // floats pass
  EXPECT_EQ(to_float_for_narrowing(true), 1.0f);
  EXPECT_EQ(to_float_for_narrowing(false), 0.0f);
  EXPECT_EQ(float_bits(to_float_for_narrowing(1.0 + std::ldexp(1.0, -30))), 0x3F800001u);
  EXPECT_EQ(to_float_for_narrowing(std::int32_t(-3)), -3.0f);
  // 2^60 + 2^52 + 1 is just above a bfloat16 tie: the sticky bit survives both roundings.
  const float f = to_float_for_narrowing((std::int64_t(1) << 60) + (std::int64_t(1) << 52) + 1);
  EXPECT_GT(static_cast<double>(f), std::ldexp(1.0, 60) + std::ldexp(1.0, 52));
  EXPECT_EQ(moh::float_to_bfloat16(f), 0x5D81);
  EXPECT_EQ(moh::float_to_bfloat16(to_float_for_narrowing((std::int64_t(1) << 60) + (std::int64_t(1) << 52))),
            0x5D80);  // on the tie: even
}

// ---- rounding once from double to half ----------------------------------------------------------

// Rounding to odd first makes double -> float -> half give the half nearest to the double.
TEST(DType, DoubleToHalfThroughRoundToOddRoundsOnce) {
  std::mt19937_64 rng(13);
  std::uniform_real_distribution<double> u(-70000.0, 70000.0);
  std::uniform_int_distribution<int> tiny(-30, 0);
  for (int i = 0; i < 200000; ++i) {
    const double v = i % 2 ? u(rng) : std::ldexp(u(rng) / 70000.0, tiny(rng));
    ASSERT_EQ(moh::float_to_half(moh::detail::to_float_for_narrowing(v)), nearest_half_reference(v))
        << v;
  }
  // Just above a tie of neighbouring halves: through a plain float the tie would round to even.
  for (std::uint32_t h = 0x0001; h < 0x7BFF; h += 7) {
    const double mid = (half_reference(static_cast<std::uint16_t>(h)) +
                        half_reference(static_cast<std::uint16_t>(h + 1))) / 2;
    for (double v : {mid + mid * std::ldexp(1.0, -40), mid - mid * std::ldexp(1.0, -40)})
      ASSERT_EQ(moh::float_to_half(moh::detail::to_float_for_narrowing(v)), nearest_half_reference(v))
          << v;
  }
}

}  // namespace
