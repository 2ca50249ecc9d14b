// Tests for moh::SafeTensorsWriter (io/safetensors_writer.hpp): round trips of every dtype through
// moh::SafeTensors, the exact byte layout, F16/BF16 rounding, exact integer conversions, and one
// test per error. (dtype_for, the native dtype of a C++ type, is tested in dtype_test.cpp.)
#include "moh/io/safetensors_writer.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "moh/io/safetensors.hpp"

#include "io/float16_reference.hpp"
#include "io/io_test_support.hpp"
#include "test_helpers.hpp"

namespace {

using moh_test::error_of;
using moh_test::Mentions;
using moh::DType;
using moh_float16_test::bits_float;
using namespace moh_io_test;  // Bytes, temp_path, write_file, read_file

moh::SafeTensors read_back(const moh::SafeTensorsWriter& w) {
  return moh::SafeTensors::from_bytes(w.to_bytes(), "written");
}

/// The raw little-endian bytes of tensor `name`.
Bytes raw_of(const moh::SafeTensors& st, const std::string& name) {
  const std::uint8_t* p = st.raw(name);
  return Bytes(p, p + st.info(name).nbytes());
}

std::uint16_t u16_at(const Bytes& b, std::size_t i) {
  return static_cast<std::uint16_t>(b[2 * i] | (b[2 * i + 1] << 8));
}

// ---- round trips ------------------------------------------------------------------------------

TEST(SafeTensorsWriter, RoundTripsEveryDtype) {
  const std::vector<float> f32 = {1.5f, -0.25f, 1e-40f, 3.4e38f, -0.0f, 7.0f};
  const std::vector<double> f64 = {0.1, -1e300, std::ldexp(1.0, -1074), 3.0};
  const std::vector<float> f16 = {1.0f, -2.0f, 65504.0f, std::ldexp(1.0f, -24), 0.5f,
                                  std::numeric_limits<float>::infinity()};
  const std::vector<float> bf16 = {1.0f, -2.0f, 3.140625f, std::ldexp(1.0f, -133), 1e38f};
  const std::vector<std::int64_t> i64 = {std::numeric_limits<std::int64_t>::min(), -1, 0,
                                         std::numeric_limits<std::int64_t>::max()};
  const std::vector<std::int32_t> i32 = {-2147483647 - 1, -5, 2147483647};
  const std::vector<std::int16_t> i16 = {-32768, 12, 32767};
  const std::vector<std::int8_t> i8 = {-128, -1, 127};
  const std::vector<std::uint8_t> u8 = {0, 200, 255};
  const bool mask[4] = {false, true, true, false};

  moh::SafeTensorsWriter w;
  w.add("f32", f32.data(), {2, 3}, DType::F32);
  w.add("f64", f64.data(), {4}, DType::F64);
  w.add("f16", f16.data(), {3, 2}, DType::F16);
  w.add("bf16", bf16.data(), {5}, DType::BF16);
  w.add("i64", i64.data(), {2, 2}, DType::I64);
  w.add("i32", i32.data(), {3}, DType::I32);
  w.add("i16", i16.data(), {3, 1}, DType::I16);
  w.add("i8", i8.data(), {1, 3}, DType::I8);
  w.add("u8", u8.data(), {3}, DType::U8);
  w.add("bool", mask, {2, 2}, DType::BOOL);
  const auto st = read_back(w);

  EXPECT_EQ(st.names(), (std::vector<std::string>{"bf16", "bool", "f16", "f32", "f64", "i16",
                                                  "i32", "i64", "i8", "u8"}));
  const std::vector<std::pair<std::string, DType>> dtypes = {
      {"f32", DType::F32}, {"f64", DType::F64}, {"f16", DType::F16}, {"bf16", DType::BF16},
      {"i64", DType::I64}, {"i32", DType::I32}, {"i16", DType::I16}, {"i8", DType::I8},
      {"u8", DType::U8},   {"bool", DType::BOOL}};
  for (const auto& [name, dtype] : dtypes) EXPECT_EQ(st.info(name).dtype, dtype) << name;
  EXPECT_EQ(st.info("f32").shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(st.info("i16").shape, (std::vector<std::int64_t>{3, 1}));

  EXPECT_EQ(st.values<float>("f32"), f32);
  EXPECT_TRUE(std::signbit(st.values<float>("f32")[4]));
  EXPECT_EQ(st.values<double>("f64"), f64);
  EXPECT_EQ(st.values<float>("f16"), f16);
  EXPECT_EQ(st.values<float>("bf16")[3], std::ldexp(1.0f, -133));
  EXPECT_EQ(st.values<float>("bf16")[2], 3.140625f);
  EXPECT_EQ(st.values<std::int64_t>("i64"), i64);
  EXPECT_EQ(st.values<std::int32_t>("i32"), i32);
  EXPECT_EQ(st.values<std::int16_t>("i16"), i16);
  EXPECT_EQ(st.values<std::int8_t>("i8"), i8);
  EXPECT_EQ(st.values<std::uint8_t>("u8"), u8);
  EXPECT_EQ(st.values<bool>("bool"), (std::vector<bool>{false, true, true, false}));
}

TEST(SafeTensorsWriter, ScalarsAndZeroSizeTensors) {
  const float scalar = 4.5f;
  const std::int64_t count = -7;
  moh::SafeTensorsWriter w;
  w.add("s", &scalar, {}, DType::F32);
  w.add("n", &count, {}, DType::I64);
  w.add("b", std::vector<bool>{true}, {}, DType::BOOL);
  w.add("e03", static_cast<const float*>(nullptr), {0, 3}, DType::F32);
  w.add("e30", std::vector<double>{}, {3, 0}, DType::F16);
  w.add("e0", std::vector<std::int8_t>{}, {0});
  w.add("r4", std::vector<std::int16_t>{1, 2, 3, 4, 5, 6}, {1, 2, 1, 3});
  const auto st = read_back(w);
  EXPECT_EQ(st.info("s").shape, std::vector<std::int64_t>{});
  EXPECT_EQ(st.values<float>("s"), std::vector<float>{4.5f});
  EXPECT_EQ(st.values<std::int64_t>("n"), std::vector<std::int64_t>{-7});
  EXPECT_EQ(st.values<bool>("b"), std::vector<bool>{true});
  EXPECT_EQ(st.info("e03").shape, (std::vector<std::int64_t>{0, 3}));
  EXPECT_EQ(st.info("e03").nbytes(), 0u);
  EXPECT_EQ(st.info("e30").shape, (std::vector<std::int64_t>{3, 0}));
  EXPECT_EQ(st.info("e30").dtype, DType::F16);
  EXPECT_EQ(st.info("e0").dtype, DType::I8);
  EXPECT_TRUE(st.values<float>("e0").empty());
  EXPECT_EQ(st.info("r4").shape, (std::vector<std::int64_t>{1, 2, 1, 3}));
  EXPECT_EQ(st.values<int>("r4"), (std::vector<int>{1, 2, 3, 4, 5, 6}));
}

TEST(SafeTensorsWriter, EigenOverloadsKeepShapeAndLayout) {
  moh::Matrix<float> m(2, 3);
  m << 1, 2, 3, 4, 5, 6;
  moh::Vector<double> v(3);
  v << 0.5, -1.5, 2.25;
  moh::Tensor3<float> t(2, 1, 3);
  for (Eigen::Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(i) * 0.5f;
  moh::Mask mask(2, 2);
  mask.setValues({{true, false}, {false, true}});
  moh::Matrix<std::int32_t> ids(1, 2);
  ids << -3, 9;

  moh::SafeTensorsWriter w;
  w.add("m", m);                  // F32 by default
  w.add("m16", m, DType::F16);    // converted on the way
  w.add("v", v);                  // F64
  w.add("t", t, DType::BF16);
  w.add("mask", mask);            // BOOL
  w.add("mask_u8", mask, DType::U8);
  w.add("ids", ids);              // I32
  const auto st = read_back(w);

  EXPECT_EQ(st.info("m").dtype, DType::F32);
  EXPECT_EQ(st.matrix<float>("m", 2, 3), m);
  EXPECT_EQ(st.matrix<float>("m16", 2, 3), m);
  EXPECT_EQ(st.info("v").dtype, DType::F64);
  EXPECT_EQ(st.vector<double>("v", 3), v);
  const moh::Tensor3<float> t2 = st.tensor3<float>("t");
  ASSERT_EQ(t2.dimension(0), 2);
  ASSERT_EQ(t2.dimension(1), 1);
  ASSERT_EQ(t2.dimension(2), 3);
  EXPECT_EQ(t2(1, 0, 2), 2.5f);
  EXPECT_EQ(t2(0, 0, 1), 0.5f);
  const moh::Mask mask2 = st.mask("mask");
  EXPECT_EQ(st.info("mask").dtype, DType::BOOL);
  EXPECT_TRUE(mask2(0, 0));
  EXPECT_FALSE(mask2(0, 1));
  EXPECT_TRUE(mask2(1, 1));
  EXPECT_EQ(st.values<int>("mask_u8"), (std::vector<int>{1, 0, 0, 1}));
  EXPECT_EQ(st.info("ids").dtype, DType::I32);
  EXPECT_EQ(st.matrix<std::int32_t>("ids", 1, 2), ids);
}

TEST(SafeTensorsWriter, Metadata) {
  moh::SafeTensorsWriter w;
  w.set_metadata("format", "pt");
  w.set_metadata("layer", "mha");
  w.set_metadata("layer", "moh");  // replaces
  w.set_metadata("note", "caf\xC3\xA9 \"quoted\" \\ {}");
  w.add("x", std::vector<std::uint8_t>{1}, {1});
  const auto st = read_back(w);
  EXPECT_EQ(st.metadata().size(), 3u);
  EXPECT_EQ(st.metadata_value("format"), "pt");
  EXPECT_EQ(st.metadata_value("layer"), "moh");
  EXPECT_EQ(st.metadata_value("note"), "caf\xC3\xA9 \"quoted\" \\ {}");
  // No metadata: no "__metadata__" entry at all; no tensors: an empty but valid file.
  moh::SafeTensorsWriter empty;
  EXPECT_TRUE(read_back(empty).metadata().empty());
  EXPECT_TRUE(read_back(empty).names().empty());
}

// ---- conversions ------------------------------------------------------------------------------

TEST(SafeTensorsWriter, FloatTargetsRound) {
  const std::vector<double> d = {0.1, 1e300, -1e300, std::nan("")};
  const std::vector<std::int64_t> big = {(std::int64_t(1) << 53) + 1, -3};
  moh::SafeTensorsWriter w;
  w.add("d", d, {4}, DType::F32);
  w.add("big", big, {2}, DType::F32);
  w.add("big64", big, {2}, DType::F64);
  const auto st = read_back(w);
  const auto f = st.values<float>("d");
  EXPECT_EQ(f[0], 0.1f);
  EXPECT_EQ(f[1], std::numeric_limits<float>::infinity());
  EXPECT_EQ(f[2], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(f[3]));
  EXPECT_EQ(st.values<float>("big"), (std::vector<float>{9007199254740992.0f, -3.0f}));
  EXPECT_EQ(st.values<double>("big64")[0], 9007199254740992.0);  // 2^53 + 1 ties to even
}

TEST(SafeTensorsWriter, HalfAndBFloat16RoundToNearestEven) {
  const float u = std::ldexp(1.0f, -10);
  const std::vector<float> f = {1.0f + u / 2, 1.0f + 3 * u / 2, std::nextafter(1.0f + u / 2, 2.0f),
                                65520.0f, 1e9f, -1e9f, std::ldexp(3.0f, -25), 1e-30f,
                                std::numeric_limits<float>::quiet_NaN(),
                                -std::numeric_limits<float>::infinity()};
  const std::vector<std::uint16_t> want_half = {0x3C00, 0x3C02, 0x3C01, 0x7C00, 0x7C00,
                                                0xFC00, 0x0002, 0x0000, 0x7E00, 0xFC00};
  const std::vector<float> b = {bits_float(0x3F808000u), bits_float(0x3F818000u),
                                bits_float(0x3F808001u), std::numeric_limits<float>::max(),
                                bits_float(0x00018000u), -0.0f};
  const std::vector<std::uint16_t> want_bf16 = {0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x0002, 0x8000};

  // From double, values just above a tie must round up: going through float first would land
  // exactly on the tie and round to even (down) instead.
  const std::vector<double> d = {1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40),
                                 1.0 + std::ldexp(1.0, -11),
                                 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40),
                                 65519.999999, 1e300};
  // From integers: 2^60 + 2^52 + 1 is just above a bfloat16 tie; through double it would be on it.
  const std::vector<std::int64_t> i = {(std::int64_t(1) << 60) + (std::int64_t(1) << 52) + 1,
                                       (std::int64_t(1) << 60) + (std::int64_t(1) << 52), 2049, 2051,
                                       -65520, std::numeric_limits<std::int64_t>::min()};

  moh::SafeTensorsWriter w;
  w.add("f_half", f, {10}, DType::F16);
  w.add("f_bf16", b, {6}, DType::BF16);
  w.add("d_half", d, {5}, DType::F16);
  w.add("d_bf16", d, {5}, DType::BF16);
  w.add("i_half", i, {6}, DType::F16);
  w.add("i_bf16", i, {6}, DType::BF16);
  w.add("bool_half", std::vector<bool>{true, false}, {2}, DType::F16);
  const auto st = read_back(w);

  const Bytes fh = raw_of(st, "f_half");
  for (std::size_t k = 0; k < want_half.size(); ++k) EXPECT_EQ(u16_at(fh, k), want_half[k]) << k;
  const Bytes fb = raw_of(st, "f_bf16");
  for (std::size_t k = 0; k < want_bf16.size(); ++k) EXPECT_EQ(u16_at(fb, k), want_bf16[k]) << k;

  const Bytes dh = raw_of(st, "d_half");
  EXPECT_EQ(u16_at(dh, 0), 0x3C01);  // above the tie: up
  EXPECT_EQ(u16_at(dh, 1), 0x3C00);  // on the tie: even
  EXPECT_EQ(u16_at(dh, 3), 0x7BFF);  // just below 65520: largest half
  EXPECT_EQ(u16_at(dh, 4), 0x7C00);  // overflow: infinity
  const Bytes db = raw_of(st, "d_bf16");
  EXPECT_EQ(u16_at(db, 2), 0x3F81);
  EXPECT_EQ(u16_at(db, 4), 0x7F80);

  const Bytes ib = raw_of(st, "i_bf16");
  EXPECT_EQ(u16_at(ib, 0), 0x5D81);  // 2^60 + 2^53
  EXPECT_EQ(u16_at(ib, 1), 0x5D80);  // tie: even, 2^60
  EXPECT_EQ(u16_at(ib, 5), 0xDF00);  // -2^63
  const Bytes ih = raw_of(st, "i_half");
  EXPECT_EQ(u16_at(ih, 2), 0x6800);  // 2049 -> 2048
  EXPECT_EQ(u16_at(ih, 3), 0x6802);  // 2051 -> 2052
  EXPECT_EQ(u16_at(ih, 4), 0xFC00);  // -65520 -> -infinity
  EXPECT_EQ(u16_at(ih, 0), 0x7C00);
  EXPECT_EQ(st.values<float>("bool_half"), (std::vector<float>{1.0f, 0.0f}));
}

TEST(SafeTensorsWriter, IntegerAndBoolTargetsNeedExactValues) {
  moh::SafeTensorsWriter w;
  const auto fails = [&](const std::function<void()>& add, const std::vector<std::string>& parts) {
    EXPECT_TRUE(Mentions(error_of(add), parts));
  };
  fails([&] { w.add("a", std::vector<float>{1.0f, 2.5f}, {2}, DType::I32); },
        {"tensor 'a'", "element 1", "I32", "int32", "got 2.5"});
  fails([&] { w.add("b", std::vector<double>{std::nan("")}, {1}, DType::I64); },
        {"tensor 'b'", "element 0", "I64"});
  fails([&] { w.add("c", std::vector<int>{300}, {1}, DType::I8); }, {"I8", "int8", "got 300"});
  fails([&] { w.add("d", std::vector<int>{-1}, {1}, DType::U8); }, {"U8", "uint8", "got -1"});
  fails([&] { w.add("e", std::vector<int>{0, 1, 2}, {3}, DType::BOOL); },
        {"element 2", "BOOL", "0 or 1", "got 2"});
  fails([&] { w.add("f", std::vector<float>{0.5f}, {1}, DType::BOOL); }, {"BOOL", "got 0.5"});
  fails([&] { w.add("g", std::vector<double>{1e19}, {1}, DType::I64); }, {"I64"});
  fails([&] { w.add("h", std::vector<float>{std::numeric_limits<float>::infinity()}, {1}, DType::I32); },
        {"I32", "got inf"});
  fails([&] { w.add("i", std::vector<std::uint64_t>{std::uint64_t(1) << 63}, {1}, DType::I64); },
        {"I64", "got 9223372036854775808"});
  // A failed add leaves nothing behind.
  for (const char* name : {"a", "b", "c", "d", "e", "f", "g", "h", "i"}) EXPECT_FALSE(w.contains(name));
  EXPECT_TRUE(read_back(w).names().empty());

  // Exact values convert.
  w.add("ok", std::vector<double>{-128.0, 127.0}, {2}, DType::I8);
  w.add("okb", std::vector<float>{0.0f, 1.0f}, {2}, DType::BOOL);
  w.add("oku", std::vector<std::int64_t>{255}, {1}, DType::U8);
  const auto st = read_back(w);
  EXPECT_EQ(st.values<int>("ok"), (std::vector<int>{-128, 127}));
  EXPECT_EQ(st.values<bool>("okb"), (std::vector<bool>{false, true}));
  EXPECT_EQ(st.values<int>("oku"), std::vector<int>{255});
}

// ---- errors -----------------------------------------------------------------------------------

TEST(SafeTensorsWriter, DuplicateNameIsAnError) {
  moh::SafeTensorsWriter w;
  w.add("x", std::vector<float>{1}, {1});
  EXPECT_TRUE(Mentions(error_of([&] { w.add("x", std::vector<float>{2}, {1}); }),
                       {"tensor 'x'", "expected a new name", "already added"}));
  EXPECT_EQ(read_back(w).values<float>("x"), std::vector<float>{1});
}

TEST(SafeTensorsWriter, ReservedMetadataNameIsAnError) {
  moh::SafeTensorsWriter w;
  EXPECT_TRUE(Mentions(error_of([&] { w.add("__metadata__", std::vector<float>{1}, {1}); }),
                       {"reserved", "got \"__metadata__\""}));
}

TEST(SafeTensorsWriter, EmptyNameIsAnError) {
  moh::SafeTensorsWriter w;
  EXPECT_TRUE(Mentions(error_of([&] { w.add("", std::vector<float>{1}, {1}); }),
                       {"expected a non-empty name", "got \"\""}));
}

TEST(SafeTensorsWriter, InvalidUtf8IsAnError) {
  moh::SafeTensorsWriter w;
  EXPECT_TRUE(Mentions(error_of([&] { w.add("bad\xFF", std::vector<float>{1}, {1}); }),
                       {"expected UTF-8 text", "offset 3"}));
  EXPECT_TRUE(Mentions(error_of([&] { w.set_metadata("k", "\xC0\x80"); }),
                       {"metadata value 'k'", "expected UTF-8 text"}));
  EXPECT_TRUE(Mentions(error_of([&] { w.set_metadata("\xED\xA0\x80", "v"); }),
                       {"metadata key", "expected UTF-8 text"}));
}

TEST(SafeTensorsWriter, DataSizeMustMatchShape) {
  moh::SafeTensorsWriter w;
  EXPECT_TRUE(Mentions(error_of([&] { w.add("x", std::vector<float>{1, 2, 3}, {2, 2}); }),
                       {"tensor 'x'", "does not match shape [2, 2]", "expected 4 values", "got 3"}));
  EXPECT_TRUE(Mentions(error_of([&] { w.add("s", std::vector<float>{}, {}); }),
                       {"shape []", "expected 1 values", "got 0"}));
  EXPECT_TRUE(Mentions(error_of([&] { w.add("n", static_cast<const float*>(nullptr), {2}, DType::F32); }),
                       {"tensor 'n'", "expected data for 2 elements", "null pointer"}));
}

TEST(SafeTensorsWriter, NegativeDimensionIsAnError) {
  moh::SafeTensorsWriter w;
  const float x = 0;
  EXPECT_TRUE(Mentions(error_of([&] { w.add("x", &x, {2, -3}, DType::F32); }),
                       {"tensor 'x'", "shape[1]", "non-negative", "got -3", "[2, -3]"}));
}

TEST(SafeTensorsWriter, OverflowingShapeIsAnError) {
  moh::SafeTensorsWriter w;
  const float x = 0;
  EXPECT_TRUE(Mentions(error_of([&] { w.add("x", &x, {std::int64_t(1) << 32, std::int64_t(1) << 32}, DType::U8); }),
                       {"tensor 'x'", "too large", "overflow"}));
  EXPECT_TRUE(Mentions(error_of([&] { w.add("y", &x, {0, std::int64_t(1) << 40, std::int64_t(1) << 40}, DType::U8); }),
                       {"tensor 'y'", "too large"}));
}

TEST(SafeTensorsWriter, WriteErrorNamesThePathAndTheSystemError) {
  moh::SafeTensorsWriter w;
  const std::string path = "/nonexistent/dir/out.safetensors";
  EXPECT_TRUE(Mentions(error_of([&] { w.write(path); }),
                       {"cannot create '" + path + ".tmp'", "No such file or directory", "errno"}));
  // Renaming onto a directory fails after the data was written; the temporary file is removed.
  const std::string dir = temp_path("target_dir");
  std::filesystem::create_directories(dir + "/inside");
  EXPECT_TRUE(Mentions(error_of([&] { w.write(dir); }), {"cannot rename", dir + ".tmp", "errno"}));
  EXPECT_FALSE(std::filesystem::exists(dir + ".tmp"));
  std::filesystem::remove_all(dir);
}

// ---- layout -----------------------------------------------------------------------------------

TEST(SafeTensorsWriter, ExactBytesOfASmallFile) {
  moh::SafeTensorsWriter w;
  w.add("b", std::vector<std::int16_t>{-2, 0x0102}, {2});
  w.add("a", std::vector<std::uint8_t>{1, 2}, {2});
  w.set_metadata("k", "v");
  const std::string header =
      R"({"__metadata__":{"k":"v"},"a":{"data_offsets":[0,2],"dtype":"U8","shape":[2]},)"
      R"("b":{"data_offsets":[2,6],"dtype":"I16","shape":[2]}}     )";
  ASSERT_EQ(header.size(), 136u);
  Bytes want = {136, 0, 0, 0, 0, 0, 0, 0};
  want.insert(want.end(), header.begin(), header.end());
  for (std::uint8_t byte : {1, 2, 0xFE, 0xFF, 0x02, 0x01}) want.push_back(byte);
  EXPECT_EQ(w.to_bytes(), want);
}

TEST(SafeTensorsWriter, LayoutIsTheStandardFormat) {
  moh::SafeTensorsWriter w;
  w.add("z.last", std::vector<float>{1.0f}, {1});
  w.add("a.first", std::vector<std::uint8_t>{1, 2, 3}, {3});
  w.add("m.mid", std::vector<double>{-2.0}, {1, 1});
  w.add("empty", std::vector<float>{}, {0});
  w.add("i", std::vector<std::int32_t>{0x01020304}, {1});
  w.set_metadata("format", "pt");
  const Bytes bytes = w.to_bytes();

  std::uint64_t n = 0;
  for (int k = 0; k < 8; ++k) n |= std::uint64_t(bytes[k]) << (8 * k);
  ASSERT_LE(8 + n, bytes.size());
  EXPECT_EQ(n % 8, 0u);                       // data starts 8-byte aligned
  EXPECT_EQ(bytes[8], '{');                   // readers check the header opens an object
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  const std::size_t close = header.find_last_of('}');
  EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos);  // padded with spaces
  EXPECT_LT(header.size() - close - 1, 8u);

  // Tensors are back to back in name order, from 0 to the end of the file, no gaps.
  const auto root = nlohmann::json::parse(header);
  const std::vector<std::string> order = {"a.first", "empty", "i", "m.mid", "z.last"};
  std::uint64_t expect_begin = 0;
  for (const std::string& name : order) {
    const auto& offsets = root.at(name).at("data_offsets");
    EXPECT_EQ(offsets[0].get<std::uint64_t>(), expect_begin) << name;
    expect_begin = offsets[1].get<std::uint64_t>();
  }
  EXPECT_EQ(8 + n + expect_begin, bytes.size());
  EXPECT_EQ(root.at("__metadata__").at("format"), "pt");

  // Little-endian data whatever the host: I32 0x01020304 and F32 1.0.
  const auto st = moh::SafeTensors::from_bytes(bytes);
  EXPECT_EQ(raw_of(st, "i"), (Bytes{0x04, 0x03, 0x02, 0x01}));
  EXPECT_EQ(raw_of(st, "z.last"), (Bytes{0x00, 0x00, 0x80, 0x3F}));
  EXPECT_EQ(raw_of(st, "m.mid"), (Bytes{0, 0, 0, 0, 0, 0, 0, 0xC0}));
}

TEST(SafeTensorsWriter, BytesAreDeterministic) {
  const std::vector<float> a = {1, 2, 3, 4};
  const std::vector<std::int64_t> b = {5, -6};
  moh::SafeTensorsWriter first, second;
  first.add("alpha", a, {2, 2}, DType::BF16);
  first.add("beta", b, {2});
  first.set_metadata("x", "1");
  first.set_metadata("y", "2");
  // Same content added in another order.
  second.set_metadata("y", "2");
  second.add("beta", b, {2});
  second.set_metadata("x", "1");
  second.add("alpha", a, {2, 2}, DType::BF16);
  EXPECT_EQ(first.to_bytes(), second.to_bytes());
  EXPECT_EQ(first.to_bytes(), first.to_bytes());

  const std::string p1 = temp_path("det_1");
  const std::string p2 = temp_path("det_2");
  first.write(p1);
  second.write(p2);
  EXPECT_EQ(read_file(p1), first.to_bytes());
  EXPECT_EQ(read_file(p1), read_file(p2));
  std::remove(p1.c_str());
  std::remove(p2.c_str());
}

TEST(SafeTensorsWriter, WriteThenOpen) {
  const std::string path = temp_path("roundtrip");
  moh::Matrix<float> w1(3, 2);
  w1 << 1, 2, 3, 4, 5, 6;
  {
    moh::SafeTensorsWriter w;
    w.add("old", std::vector<float>{0}, {1});
    w.write(path);
  }
  moh::SafeTensorsWriter w;
  w.add("w", w1);
  w.add("h", w1, DType::F16);
  w.set_metadata("format", "moh-case/1");
  w.write(path);  // replaces the earlier file
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  const auto st = moh::SafeTensors::open(path);
  EXPECT_EQ(st.names(), (std::vector<std::string>{"h", "w"}));
  EXPECT_EQ(st.matrix<float>("w", 3, 2), w1);
  EXPECT_EQ(st.matrix<double>("h", 3, 2), w1.cast<double>());
  EXPECT_EQ(st.metadata_value("format"), "moh-case/1");
  std::remove(path.c_str());
}

}  // namespace
