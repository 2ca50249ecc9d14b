// Tests for moh::SafeTensors: round trips of every dtype, the accessors and their messages, and
// one test per kind of malformed file (each must raise moh::Error, never crash).
#include "moh/safetensors.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#if defined(MOH_FIXTURES_DIR)
#include <filesystem>
#endif

namespace {

using Bytes = std::vector<std::uint8_t>;

// ---- a tiny test-local writer ---------------------------------------------------------------

/// Appends `value`'s low `width` bytes, little-endian.
void put_le(Bytes& out, std::uint64_t value, int width) {
  for (int i = 0; i < width; ++i) out.push_back(static_cast<std::uint8_t>(value >> (8 * i)));
}

template <class T>
Bytes le_bytes(const std::vector<T>& values) {
  Bytes out;
  for (T v : values) {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));  // tests run on little-endian hosts
    put_le(out, bits, static_cast<int>(sizeof(T)));
  }
  return out;
}

Bytes u16_bytes(const std::vector<std::uint16_t>& bits) { return le_bytes(bits); }

/// A file from a header given as JSON text and the data section.
Bytes raw_file(const std::string& header, const Bytes& data = {}) {
  Bytes out;
  put_le(out, header.size(), 8);
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

struct Entry {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  Bytes data;
};

/// A well-formed file: the entries' data laid out back to back in the given order.
Bytes make_file(const std::vector<Entry>& entries,
                const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::json header = nlohmann::json::object();
  Bytes data;
  for (const Entry& e : entries) {
    const std::size_t begin = data.size();
    data.insert(data.end(), e.data.begin(), e.data.end());
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {begin, data.size()}}};
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  return raw_file(header.dump(), data);
}

/// A file with one tensor whose header entry is given verbatim (the data section is `data`).
Bytes one_entry(const std::string& entry_json, const Bytes& data) {
  return raw_file("{\"t\":" + entry_json + "}", data);
}

moh::SafeTensors load(const Bytes& bytes) { return moh::SafeTensors::from_bytes(bytes, "test.st"); }

/// Runs `f`, which must throw moh::Error; returns its message ("" and a failure otherwise).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const moh::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected moh::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected moh::Error, got no exception";
  return "";
}

std::string load_error(const Bytes& bytes) {
  return error_of([&] { load(bytes); });
}

::testing::AssertionResult Mentions(const std::string& message,
                                    const std::vector<std::string>& parts) {
  for (const std::string& part : parts) {
    if (message.find(part) == std::string::npos) {
      return ::testing::AssertionFailure() << "message \"" << message << "\" lacks \"" << part
                                           << "\"";
    }
  }
  return ::testing::AssertionSuccess();
}

/// binary16 decoded by the textbook formula, independent of the library's bit manipulation.
double half_reference(std::uint16_t h) {
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

// ---- dtypes and half precision ----------------------------------------------------------------

TEST(SafeTensorsDType, SizesAndNames) {
  using moh::DType;
  const std::vector<std::pair<DType, std::size_t>> sizes = {
      {DType::F64, 8}, {DType::F32, 4}, {DType::F16, 2}, {DType::BF16, 2}, {DType::I64, 8},
      {DType::I32, 4}, {DType::I16, 2}, {DType::I8, 1},  {DType::U8, 1},   {DType::BOOL, 1}};
  for (const auto& [dtype, size] : sizes) EXPECT_EQ(moh::dtype_size(dtype), size);
  EXPECT_STREQ(moh::dtype_name(DType::BF16), "BF16");
  EXPECT_STREQ(moh::dtype_name(DType::BOOL), "BOOL");
  EXPECT_STREQ(moh::dtype_name(DType::U8), "U8");
}

TEST(SafeTensorsHalf, KnownValues) {
  EXPECT_EQ(moh::half_to_float(0x3C00), 1.0f);
  EXPECT_EQ(moh::half_to_float(0xC000), -2.0f);
  EXPECT_EQ(moh::half_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(moh::half_to_float(0x0001), std::ldexp(1.0f, -24));        // smallest subnormal
  EXPECT_EQ(moh::half_to_float(0x03FF), 1023.0f * std::ldexp(1.0f, -24));  // largest subnormal
  EXPECT_EQ(moh::half_to_float(0x0400), std::ldexp(1.0f, -14));        // smallest normal
  EXPECT_EQ(moh::half_to_float(0x3555), 1365.0f / 4096.0f);            // ~1/3
  EXPECT_EQ(moh::half_to_float(0x0000), 0.0f);
  EXPECT_TRUE(std::signbit(moh::half_to_float(0x8000)));
  EXPECT_EQ(moh::half_to_float(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(moh::half_to_float(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(moh::half_to_float(0x7E00)));
  EXPECT_TRUE(std::isnan(moh::half_to_float(0x7C01)));  // signalling-style payload stays NaN
}

TEST(SafeTensorsHalf, EveryBitPatternMatchesTheFormula) {
  for (std::uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const float got = moh::half_to_float(static_cast<std::uint16_t>(bits));
    const double want = half_reference(static_cast<std::uint16_t>(bits));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << "bits 0x" << std::hex << bits;
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << "bits 0x" << std::hex << bits;
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << "bits 0x" << std::hex << bits;
    }
  }
}

TEST(SafeTensorsHalf, BFloat16KnownValues) {
  EXPECT_EQ(moh::bfloat16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(moh::bfloat16_to_float(0xC000), -2.0f);
  EXPECT_EQ(moh::bfloat16_to_float(0x4049), 3.140625f);
  EXPECT_EQ(moh::bfloat16_to_float(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal
  EXPECT_EQ(moh::bfloat16_to_float(0x7F80), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(moh::bfloat16_to_float(0x7FC0)));
}

// ---- round trips ------------------------------------------------------------------------------

TEST(SafeTensorsRoundTrip, F64) {
  const std::vector<double> v = {0.1, -1e300, 3.0, std::ldexp(1.0, -1074)};
  const auto st = load(make_file({{"a", "F64", {2, 2}, le_bytes(v)}}));
  EXPECT_EQ(st.values<double>("a"), v);
  EXPECT_EQ(st.info("a").dtype, moh::DType::F64);
  EXPECT_EQ(st.info("a").shape, (std::vector<std::int64_t>{2, 2}));
  // Narrowing to float rounds like IEEE: 1e300 becomes -infinity, not undefined behaviour.
  const auto f = st.values<float>("a");
  EXPECT_EQ(f[0], 0.1f);
  EXPECT_EQ(f[1], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(f[3], 0.0f);
}

TEST(SafeTensorsRoundTrip, F32AtAnUnalignedOffset) {
  // A 1-byte tensor first, so the F32 data starts at an odd offset.
  const std::vector<float> v = {1.5f, -0.25f, 1e-40f, 3.4e38f, 7.0f, -8.0f};
  const auto st = load(make_file({{"pad", "U8", {1}, {9}}, {"w", "F32", {2, 3}, le_bytes(v)}}));
  EXPECT_EQ(st.info("w").begin, 1u);
  EXPECT_EQ(st.values<float>("w"), v);
  const auto d = st.values<double>("w");
  for (std::size_t i = 0; i < v.size(); ++i) EXPECT_EQ(d[i], static_cast<double>(v[i]));
}

TEST(SafeTensorsRoundTrip, F16) {
  const auto st = load(make_file({{"h", "F16", {5}, u16_bytes({0x3C00, 0xC000, 0x7BFF, 0x0001, 0x3800})}}));
  const std::vector<float> want = {1.0f, -2.0f, 65504.0f, std::ldexp(1.0f, -24), 0.5f};
  EXPECT_EQ(st.values<float>("h"), want);
}

TEST(SafeTensorsRoundTrip, BF16) {
  const auto st = load(make_file({{"b", "BF16", {3}, u16_bytes({0x3F80, 0xC000, 0x4049})}}));
  const std::vector<double> want = {1.0, -2.0, 3.140625};
  EXPECT_EQ(st.values<double>("b"), want);
}

TEST(SafeTensorsRoundTrip, SignedIntegers) {
  const std::vector<std::int64_t> i64 = {std::numeric_limits<std::int64_t>::min(), -1, 0,
                                         std::numeric_limits<std::int64_t>::max()};
  const std::vector<std::int32_t> i32 = {-2147483647 - 1, -5, 2147483647};
  const std::vector<std::int16_t> i16 = {-32768, 12, 32767};
  const std::vector<std::int8_t> i8 = {-128, -1, 127};
  const auto st = load(make_file({{"i64", "I64", {4}, le_bytes(i64)},
                                  {"i32", "I32", {3}, le_bytes(i32)},
                                  {"i16", "I16", {3}, le_bytes(i16)},
                                  {"i8", "I8", {3}, le_bytes(i8)}}));
  EXPECT_EQ(st.values<std::int64_t>("i64"), i64);
  EXPECT_EQ(st.values<std::int32_t>("i32"), i32);
  EXPECT_EQ(st.values<std::int16_t>("i16"), i16);
  EXPECT_EQ(st.values<std::int8_t>("i8"), i8);
  EXPECT_EQ(st.values<float>("i8"), (std::vector<float>{-128.0f, -1.0f, 127.0f}));
  EXPECT_EQ(st.values<std::int64_t>("i16"), (std::vector<std::int64_t>{-32768, 12, 32767}));
}

TEST(SafeTensorsRoundTrip, U8AndBool) {
  const auto st = load(make_file({{"u", "U8", {3}, {0, 200, 255}}, {"m", "BOOL", {2, 2}, {0, 1, 1, 0}}}));
  EXPECT_EQ(st.values<int>("u"), (std::vector<int>{0, 200, 255}));
  EXPECT_EQ(st.values<std::uint8_t>("u"), (std::vector<std::uint8_t>{0, 200, 255}));
  EXPECT_EQ(st.values<bool>("m"), (std::vector<bool>{false, true, true, false}));
  EXPECT_EQ(st.values<float>("m"), (std::vector<float>{0, 1, 1, 0}));
}

TEST(SafeTensorsRoundTrip, ScalarAndEmptyTensors) {
  const auto st = load(make_file({{"s", "F32", {}, le_bytes(std::vector<float>{4.5f})},
                                  {"e", "F32", {0, 3}, {}}}));
  EXPECT_EQ(st.info("s").numel(), 1);
  EXPECT_EQ(st.values<float>("s"), std::vector<float>{4.5f});
  EXPECT_EQ(st.info("e").numel(), 0);
  EXPECT_TRUE(st.values<float>("e").empty());
  EXPECT_EQ(st.matrix<float>("e", 0, 3).rows(), 0);
}

TEST(SafeTensorsRoundTrip, OpenReadsAFileFromDisk) {
  const std::string path = ::testing::TempDir() + "moh_safetensors_roundtrip.safetensors";
  const Bytes bytes = make_file({{"x", "F32", {1, 2, 2}, le_bytes(std::vector<float>{1, 2, 3, 4})}},
                                {{"format", "moh-case/1"}});
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  const auto st = moh::SafeTensors::open(path);
  EXPECT_EQ(st.source(), path);
  EXPECT_EQ(st.metadata_value("format"), "moh-case/1");
  const auto x = st.tensor3<float>("x");
  EXPECT_EQ(x(0, 1, 0), 3.0f);
  std::remove(path.c_str());
}

// ---- conversions ------------------------------------------------------------------------------

TEST(SafeTensorsConvert, IntegerTargetsNeedExactValues) {
  const auto st = load(make_file({{"f", "F32", {2}, le_bytes(std::vector<float>{1.0f, 2.5f})},
                                  {"n", "F32", {1}, le_bytes(std::vector<float>{NAN})},
                                  {"big", "I32", {1}, le_bytes(std::vector<std::int32_t>{300})},
                                  {"neg", "I8", {1}, le_bytes(std::vector<std::int8_t>{-1})},
                                  {"huge", "F64", {1}, le_bytes(std::vector<double>{1e19})}}));
  EXPECT_TRUE(Mentions(error_of([&] { st.values<int>("f"); }),
                       {"tensor 'f'", "element 1", "int32", "got 2.5"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.values<int>("n"); }), {"tensor 'n'", "element 0"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.values<std::int8_t>("big"); }), {"int8", "got 300"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.values<std::uint8_t>("neg"); }), {"uint8", "got -1"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.values<std::int64_t>("huge"); }), {"int64"}));
  EXPECT_EQ(st.values<std::uint64_t>("huge"), std::vector<std::uint64_t>{10000000000000000000ull});
  EXPECT_EQ(st.values<std::int16_t>("big"), std::vector<std::int16_t>{300});
}

// ---- metadata, names, accessors ---------------------------------------------------------------

TEST(SafeTensorsAccess, Metadata) {
  const auto st = load(make_file({{"x", "U8", {1}, {1}}}, {{"format", "moh-case/1"}, {"layer", "mha"}}));
  EXPECT_EQ(st.metadata().size(), 2u);
  EXPECT_TRUE(st.has_metadata("layer"));
  EXPECT_FALSE(st.has_metadata("causal"));
  EXPECT_EQ(st.metadata_value("layer"), "mha");
  EXPECT_EQ(st.source(), "test.st");
  EXPECT_TRUE(Mentions(error_of([&] { st.metadata_value("causal"); }),
                       {"metadata key 'causal' missing", "test.st"}));
  EXPECT_TRUE(load(make_file({{"x", "U8", {1}, {1}}})).metadata().empty());
}

TEST(SafeTensorsAccess, NamesAreSortedAndMissingTensorsAreNamed) {
  const auto st = load(make_file({{"zeta", "U8", {1}, {1}}, {"alpha", "U8", {1}, {2}}, {"mid", "U8", {1}, {3}}}));
  EXPECT_EQ(st.names(), (std::vector<std::string>{"alpha", "mid", "zeta"}));
  EXPECT_TRUE(st.contains("mid"));
  EXPECT_FALSE(st.contains("__metadata__"));
  EXPECT_EQ(st.raw("zeta")[0], 1);
  EXPECT_EQ(st.raw("alpha")[0], 2);
  EXPECT_TRUE(Mentions(error_of([&] { st.info("beta"); }), {"tensor 'beta'", "missing", "test.st", "alpha"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.values<float>("beta"); }), {"tensor 'beta'"}));
}

TEST(SafeTensorsAccess, ShapeCheckedValuesNameBothShapes) {
  const auto st = load(make_file({{"qkv.weight", "F32", {48, 32}, Bytes(48 * 32 * 4, 0)}}));
  EXPECT_EQ(st.values<float>("qkv.weight", {48, 32}).size(), 48u * 32u);
  EXPECT_TRUE(Mentions(error_of([&] { st.values<float>("qkv.weight", {96, 32}); }),
                       {"tensor 'qkv.weight' in test.st: expected shape [96, 32], got [48, 32]"}));
}

TEST(SafeTensorsAccess, MatrixVectorTensor3) {
  const auto st = load(make_file({{"w", "F32", {2, 3}, le_bytes(std::vector<float>{1, 2, 3, 4, 5, 6})},
                                  {"b", "F64", {3}, le_bytes(std::vector<double>{7, 8, 9})},
                                  {"x", "F16", {2, 1, 2}, u16_bytes({0x3C00, 0x4000, 0x4200, 0x4400})}}));
  const moh::Matrix<float> w = st.matrix<float>("w", 2, 3);
  EXPECT_EQ(w(0, 2), 3.0f);
  EXPECT_EQ(w(1, 0), 4.0f);
  const moh::Vector<double> b = st.vector<double>("b", 3);
  EXPECT_EQ(b(2), 9.0);
  const moh::Tensor3<float> x = st.tensor3<float>("x");
  EXPECT_EQ(x.dimension(0), 2);
  EXPECT_EQ(x.dimension(2), 2);
  EXPECT_EQ(x(1, 0, 1), 4.0f);  // 0x4400
  EXPECT_EQ(x(0, 0, 1), 2.0f);  // 0x4000
  EXPECT_TRUE(Mentions(error_of([&] { st.matrix<float>("w", 3, 2); }), {"expected shape [3, 2], got [2, 3]"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.vector<float>("b", 4); }), {"expected shape [4], got [3]"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.vector<float>("w", 6); }), {"expected shape [6], got [2, 3]"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.tensor3<float>("w"); }), {"tensor 'w'", "rank-3", "got [2, 3]"}));
}

TEST(SafeTensorsAccess, Mask) {
  const auto st = load(make_file({{"m", "BOOL", {2, 3}, {1, 0, 0, 0, 1, 1}},
                                  {"f", "F32", {1, 2}, le_bytes(std::vector<float>{0.0f, 1.0f})},
                                  {"half", "F32", {1, 2}, le_bytes(std::vector<float>{0.5f, 1.0f})},
                                  {"r3", "BOOL", {1, 1, 1}, {1}}}));
  const moh::Mask m = st.mask("m");
  ASSERT_EQ(m.dimension(0), 2);
  ASSERT_EQ(m.dimension(1), 3);
  EXPECT_TRUE(m(0, 0));
  EXPECT_FALSE(m(0, 1));
  EXPECT_TRUE(m(1, 2));
  const moh::Mask f = st.mask("f");
  EXPECT_FALSE(f(0, 0));
  EXPECT_TRUE(f(0, 1));
  EXPECT_TRUE(Mentions(error_of([&] { st.mask("half"); }), {"tensor 'half'", "0 or 1", "got 0.5"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.mask("r3"); }), {"rank-2", "got [1, 1, 1]"}));
}

// ---- malformed files --------------------------------------------------------------------------

TEST(SafeTensorsMalformed, ShorterThanTheLengthPrefix) {
  EXPECT_TRUE(Mentions(load_error({}), {"test.st", "at least 8 bytes", "got 0"}));
  EXPECT_TRUE(Mentions(load_error({1, 0, 0, 0, 0}), {"at least 8 bytes", "got 5"}));
}

TEST(SafeTensorsMalformed, HeaderLengthBeyondTheFile) {
  Bytes bytes = raw_file("{}");
  bytes[0] = 40;  // claims 40 header bytes; the file has 2
  EXPECT_TRUE(Mentions(load_error(bytes), {"header length", "expected <= 2", "got 40"}));
}

TEST(SafeTensorsMalformed, AbsurdHeaderLength) {
  for (std::uint64_t length : {std::uint64_t(1) << 63, ~std::uint64_t(0), std::uint64_t(100000001)}) {
    Bytes bytes;
    put_le(bytes, length, 8);
    bytes.push_back('{');
    EXPECT_TRUE(Mentions(load_error(bytes), {"header length", "100000000", std::to_string(length)}));
  }
}

TEST(SafeTensorsMalformed, InvalidJson) {
  for (const std::string& header : {std::string(""), std::string("{"), std::string("{\"a\":}"),
                                    std::string("{} trailing"), std::string("{'a': 1}"),
                                    std::string("{\"a\":\"\x01\"}")}) {
    EXPECT_TRUE(Mentions(load_error(raw_file(header)), {"not valid JSON"})) << header;
  }
}

TEST(SafeTensorsMalformed, InvalidUtf8) {
  const std::vector<std::string> bad = {
      "\xFF",          // never valid
      "\xC0\x80",      // overlong NUL
      "\xED\xA0\x80",  // UTF-16 surrogate
      "\xE2\x82",      // truncated sequence
      "\xF4\x90\x80\x80",  // above U+10FFFF
      "\x80"};         // stray continuation byte
  for (const std::string& b : bad) {
    const std::string header = "{\"__metadata__\":{\"k\":\"" + b + "\"}}";
    EXPECT_TRUE(Mentions(load_error(raw_file(header)), {"UTF-8", "header offset 22"}));
  }
  // Valid multi-byte text is accepted.
  const auto st = load(raw_file("{\"__metadata__\":{\"k\":\"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\"}}"));
  EXPECT_EQ(st.metadata_value("k"), "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80");
}

TEST(SafeTensorsMalformed, DeepNestingIsRejectedWithoutRecursion) {
  EXPECT_TRUE(Mentions(load_error(raw_file(std::string(10000, '[') + std::string(10000, ']'))),
                       {"nests too deeply", "64"}));
  std::string objects;
  for (int i = 0; i < 10000; ++i) objects += "{\"a\":";
  EXPECT_TRUE(Mentions(load_error(raw_file(objects)), {"nests too deeply"}));
  // Brackets inside strings, even after escaped quotes, do not count as nesting.
  const std::string key = "\\\"" + std::string(200, '[');
  const auto st = load(raw_file("{\"__metadata__\":{\"" + key + "\":\"{{{{\"}}"));
  EXPECT_TRUE(st.has_metadata("\"" + std::string(200, '[')));
}

TEST(SafeTensorsMalformed, TopLevelNotAnObject) {
  EXPECT_TRUE(Mentions(load_error(raw_file("[]")), {"expected a JSON object", "got array"}));
  EXPECT_TRUE(Mentions(load_error(raw_file("42")), {"expected a JSON object", "got number"}));
  EXPECT_TRUE(Mentions(load_error(raw_file("\"x\"")), {"expected a JSON object", "got string"}));
  EXPECT_TRUE(Mentions(load_error(raw_file("null")), {"expected a JSON object", "got null"}));
}

TEST(SafeTensorsMalformed, EntryFieldsAndTypes) {
  const Bytes four(4, 0);
  EXPECT_TRUE(Mentions(load_error(one_entry("[1]", four)), {"tensor 't'", "expected an object", "got array"}));
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"U8","shape":[4]})", four)),
                       {"tensor 't'", "no 'data_offsets'"}));
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":1})", four)),
                       {"unexpected field 'x'"}));
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":4,"shape":[4],"data_offsets":[0,4]})", four)),
                       {"dtype: expected a string", "got number 4"}));
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"U8","shape":4,"data_offsets":[0,4]})", four)),
                       {"shape: expected an array", "got number 4"}));
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"U8","shape":[4],"data_offsets":[0]})", four)),
                       {"data_offsets: expected [begin, end]", "got array [0]"}));
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"U8","shape":[4],"data_offsets":[0,4.0]})", four)),
                       {"data_offsets: expected [begin, end]"}));
}

TEST(SafeTensorsMalformed, UnknownDtype) {
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]})", Bytes(2))),
                       {"tensor 't'", "unknown dtype", "got 'F8_E4M3'", "BF16"}));
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"f32","shape":[1],"data_offsets":[0,4]})", Bytes(4))),
                       {"got 'f32'"}));
}

TEST(SafeTensorsMalformed, NegativeDimension) {
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"U8","shape":[2,-3],"data_offsets":[0,0]})", {})),
                       {"shape[1]", "non-negative integer", "got number -3"}));
}

TEST(SafeTensorsMalformed, NonIntegerDimension) {
  for (const std::string dim : {"2.5", "2.0", "\"3\"", "true", "null", "1e30", "18446744073709551615"}) {
    EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"U8","shape":[)" + dim + R"(],"data_offsets":[0,0]})", {})),
                         {"shape[0]", "non-negative integer"}))
        << dim;
  }
}

TEST(SafeTensorsMalformed, OverflowingShape) {
  // 2^32 * 2^32 elements overflows; so does 2^62 elements of 4 bytes.
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]})", {})),
                       {"too large", "overflow"}));
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]})", {})),
                       {"too large"}));
  // A zero dimension does not hide an overflowing product of the others.
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]})", {})),
                       {"too large"}));
}

TEST(SafeTensorsMalformed, OffsetsOutsideTheData) {
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", Bytes(4))),
                       {"tensor 't'", "beyond the data", "expected <= 4", "got 8"}));
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,18446744073709551616]})", Bytes(4))),
                       {"data_offsets"}));
}

TEST(SafeTensorsMalformed, BeginAfterEnd) {
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"U8","shape":[2],"data_offsets":[4,2]})", Bytes(8))),
                       {"expected begin <= end", "got [4, 2]"}));
}

TEST(SafeTensorsMalformed, SizeDisagreesWithShape) {
  EXPECT_TRUE(Mentions(load_error(one_entry(R"({"dtype":"F32","shape":[2,3],"data_offsets":[0,20]})", Bytes(24))),
                       {"tensor 't'", "expected 24 bytes", "F32 [2, 3]", "got 20"}));
}

TEST(SafeTensorsMalformed, BoolByteOtherThanZeroOrOne) {
  EXPECT_TRUE(Mentions(load_error(make_file({{"m", "BOOL", {3}, {0, 1, 2}}})),
                       {"tensor 'm'", "BOOL element 2", "expected 0 or 1", "got 2"}));
}

TEST(SafeTensorsMalformed, MetadataMustMapStringsToStrings) {
  EXPECT_TRUE(Mentions(load_error(raw_file(R"({"__metadata__":{"format":"moh-case/1","n":3}})")),
                       {"__metadata__['n']", "expected a string", "got number 3"}));
  EXPECT_TRUE(Mentions(load_error(raw_file(R"({"__metadata__":["a"]})")),
                       {"__metadata__", "expected an object of strings", "got array"}));
}

TEST(SafeTensorsMalformed, OverlappingTensors) {
  const std::string header =
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})";
  EXPECT_TRUE(Mentions(load_error(raw_file(header, Bytes(8))), {"'a'", "'b'", "overlap"}));
}

TEST(SafeTensorsMalformed, DuplicateKeys) {
  const std::string header =
      R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})";
  EXPECT_TRUE(Mentions(load_error(raw_file(header, Bytes(2))), {"repeats the key 'a'"}));
}

TEST(SafeTensorsMalformed, NonexistentPath) {
  const std::string path = "/nonexistent/dir/missing.safetensors";
  EXPECT_TRUE(Mentions(error_of([&] { moh::SafeTensors::open(path); }), {"cannot open", path}));
}

// Every truncation and many single-byte corruptions of a valid file must load or throw
// moh::Error, never crash (run under the sanitizers to make this bite).
TEST(SafeTensorsMalformed, TruncationsAndCorruptionsNeverCrash) {
  const Bytes good = make_file({{"m", "BOOL", {2, 2}, {0, 1, 1, 0}},
                                {"w", "F16", {3}, u16_bytes({0x3C00, 0x7C00, 0x0001})}},
                               {{"format", "moh-case/1"}});
  const auto try_load = [](const Bytes& bytes) {
    try {
      const auto st = moh::SafeTensors::from_bytes(bytes);
      for (const std::string& name : st.names()) (void)st.values<double>(name);
      return true;
    } catch (const moh::Error&) {
      return false;
    }
  };
  ASSERT_TRUE(try_load(good));
  for (std::size_t n = 0; n < good.size(); ++n) {
    EXPECT_FALSE(try_load(Bytes(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)))) << n;
  }
  for (std::size_t i = 0; i < good.size(); ++i) {
    for (int v : {0x00, 0x01, 0x22, 0x5B, 0x7B, 0x7D, 0x80, 0xFF}) {
      Bytes bad = good;
      bad[i] = static_cast<std::uint8_t>(v);
      try_load(bad);  // either outcome is fine; crashing is not
    }
  }
}

// ---- the real golden cases ----------------------------------------------------------------

TEST(SafeTensorsFixtures, EveryFixtureOpens) {
#if defined(MOH_FIXTURES_DIR)
  namespace fs = std::filesystem;
  std::vector<std::string> paths;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(MOH_FIXTURES_DIR, ec)) {
    if (entry.path().extension() == ".safetensors") paths.push_back(entry.path().string());
  }
  if (paths.empty()) GTEST_SKIP() << "no .safetensors files in " << MOH_FIXTURES_DIR;
  for (const std::string& path : paths) {
    SCOPED_TRACE(path);
    const auto st = moh::SafeTensors::open(path);
    EXPECT_EQ(st.metadata_value("format"), "moh-case/1");
    ASSERT_TRUE(st.contains("x"));
    EXPECT_EQ(st.info("x").shape.size(), 3u);
    const moh::Tensor3<float> x = st.tensor3<float>("x");
    EXPECT_EQ(x.size(), st.info("x").numel());
    if (st.contains("key_padding_mask")) {
      const moh::Mask mask = st.mask("key_padding_mask");
      EXPECT_EQ(mask.dimension(0), x.dimension(0));
    }
  }
#else
  GTEST_SKIP() << "MOH_FIXTURES_DIR not defined";
#endif
}

}  // namespace
