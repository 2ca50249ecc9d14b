// Tests for moh::SafeTensors (io/safetensors.hpp) and, through it, the TensorSource accessors
// (io/tensor_source.hpp): round trips of every dtype, opening files, the accessors and their
// messages, and one test per kind of malformed file (each must raise moh::Error, never crash).
// The dtype conversions, the strict JSON checks and the file mapping have tests of their own
// (dtype_test.cpp, json_test.cpp, mapped_file_test.cpp); here they are checked as the reader
// reports them.
#include "moh/io/safetensors.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "io/io_test_support.hpp"
#include "test_helpers.hpp"

namespace {

using moh_test::error_of;
using moh_test::Mentions;
using namespace moh_io_test;  // Bytes, temp_path, write_file, read_file

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

std::string load_error(const Bytes& bytes) {
  return error_of([&] { load(bytes); });
}

/// Success when a file of one tensor 't', with header entry `entry_json` and `data_bytes` zero bytes
/// of data, is refused with a message that contains every one of `parts`.
::testing::AssertionResult EntryRefused(const std::string& entry_json, std::size_t data_bytes,
                                        const std::vector<std::string>& parts) {
  return Mentions(load_error(one_entry(entry_json, Bytes(data_bytes))), parts);
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
  const std::string path = temp_path("roundtrip");
  const Bytes bytes = make_file({{"x", "F32", {1, 2, 2}, le_bytes(std::vector<float>{1, 2, 3, 4})}},
                                {{"format", "moh-case/1"}});
  write_file(path, bytes);
  const auto st = moh::SafeTensors::open(path);
  EXPECT_EQ(st.source(), path);
  EXPECT_EQ(st.metadata_value("format"), "moh-case/1");
  const auto x = st.tensor3<float>("x");
  EXPECT_EQ(x(0, 1, 0), 3.0f);
  std::remove(path.c_str());
}

// ---- opening files (mmap) -----------------------------------------------------------------------

/// A file holding every dtype, a scalar, an empty tensor and metadata.
Bytes mixed_file() {
  return make_file({{"pad", "U8", {3}, {7, 8, 9}},
                    {"w", "F32", {2, 3}, le_bytes(std::vector<float>{1, -2, 3.5f, 4, 5, 6})},
                    {"d", "F64", {2}, le_bytes(std::vector<double>{0.1, -1e300})},
                    {"h", "F16", {2}, u16_bytes({0x3C00, 0x7C00})},
                    {"b", "BF16", {1}, u16_bytes({0x4049})},
                    {"i", "I64", {1}, le_bytes(std::vector<std::int64_t>{-5})},
                    {"m", "BOOL", {1, 2}, {1, 0}},
                    {"s", "I32", {}, le_bytes(std::vector<std::int32_t>{42})},
                    {"e", "F32", {0, 4}, {}}},
                   {{"format", "moh-case/1"}});
}

/// Asserts that `a` and `b` hold the same tensors, bytes and metadata.
void expect_same_contents(const moh::SafeTensors& a, const moh::SafeTensors& b) {
  EXPECT_EQ(a.names(), b.names());
  EXPECT_EQ(a.metadata(), b.metadata());
  for (const std::string& name : a.names()) {
    SCOPED_TRACE(name);
    const moh::TensorInfo& x = a.info(name);
    const moh::TensorInfo& y = b.info(name);
    EXPECT_EQ(x.dtype, y.dtype);
    EXPECT_EQ(x.shape, y.shape);
    EXPECT_EQ(x.begin, y.begin);
    EXPECT_EQ(x.end, y.end);
    EXPECT_EQ(0, std::memcmp(a.raw(name), b.raw(name), x.nbytes()));
    const auto va = a.values<double>(name), vb = b.values<double>(name);
    ASSERT_EQ(va.size(), vb.size());
    for (std::size_t i = 0; i < va.size(); ++i) {
      if (std::isnan(va[i])) EXPECT_TRUE(std::isnan(vb[i])); else EXPECT_EQ(va[i], vb[i]);
    }
  }
}

TEST(SafeTensorsOpen, MappedFileEqualsFromBytes) {
  const std::string path = temp_path("mapped");
  const Bytes bytes = mixed_file();
  write_file(path, bytes);
  const auto mapped = moh::SafeTensors::open(path);
  const auto in_memory = moh::SafeTensors::from_bytes(bytes, path);
  expect_same_contents(mapped, in_memory);
  EXPECT_EQ(mapped.source(), path);
  EXPECT_EQ(mapped.matrix<float>("w", 2, 3)(0, 2), 3.5f);
  // Copies share the mapping: the tensor bytes of a copy are the very same bytes.
  const moh::SafeTensors copy = mapped;
  EXPECT_EQ(copy.raw("w"), mapped.raw("w"));
  std::remove(path.c_str());
}

TEST(SafeTensorsOpen, OutlivesTheScopeThatOpenedIt) {
  const std::string path = temp_path("outlive");
  write_file(path, mixed_file());
  std::vector<moh::SafeTensors> kept;
  {
    const auto st = moh::SafeTensors::open(path);
    kept.push_back(st);  // a cheap copy sharing the mapping
  }
  // The file may even disappear: the mapping keeps its bytes alive until the last copy goes.
  std::remove(path.c_str());
  moh::SafeTensors copy = kept.front();
  kept.clear();
  EXPECT_EQ(copy.values<float>("w"), (std::vector<float>{1, -2, 3.5f, 4, 5, 6}));
  EXPECT_EQ(copy.values<std::int32_t>("s"), std::vector<std::int32_t>{42});
  EXPECT_EQ(copy.metadata_value("format"), "moh-case/1");
  expect_same_contents(copy, moh::SafeTensors::from_bytes(mixed_file()));
}

TEST(SafeTensorsOpen, EmptyFileIsTooShort) {
  const std::string path = temp_path("empty");
  write_file(path, {});
  EXPECT_TRUE(Mentions(error_of([&] { moh::SafeTensors::open(path); }),
                       {"safetensors file " + path, "at least 8 bytes", "got 0"}));
  write_file(path, {1, 0, 0});
  EXPECT_TRUE(Mentions(error_of([&] { moh::SafeTensors::open(path); }), {"at least 8 bytes", "got 3"}));
  std::remove(path.c_str());
}

// The file errors of io/mapped_file.hpp (tested there) as open() reports them.
TEST(SafeTensorsOpen, FileErrorsNameThePath) {
  const std::string missing = "/nonexistent/dir/missing.safetensors";
  EXPECT_TRUE(Mentions(error_of([&] { moh::SafeTensors::open(missing); }),
                       {"cannot open safetensors file '" + missing + "'", "expected a readable file",
                        "No such file or directory"}));
  const std::string dir = ::testing::TempDir();
  EXPECT_TRUE(Mentions(error_of([&] { moh::SafeTensors::open(dir); }),
                       {"safetensors file '" + dir + "'", "expected a regular file", "got a directory"}));
#if defined(__unix__) || defined(__APPLE__)
  if (std::filesystem::exists("/dev/null")) {
    EXPECT_TRUE(Mentions(error_of([] { moh::SafeTensors::open("/dev/null"); }),
                         {"'/dev/null'", "expected a regular file", "got a character device"}));
  }
#endif
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

TEST(SafeTensorsAccess, FileOfInfoAndTheTensorSourceInterface) {
  const auto st = load(make_file({{"pad", "U8", {3}, {7, 8, 9}},
                                  {"w", "F32", {2, 3}, le_bytes(std::vector<float>{1, 2, 3, 4, 5, 6})}}));
  EXPECT_EQ(st.file_of("w"), "test.st");  // one file: the source itself
  EXPECT_EQ(st.file_of("pad"), st.source());
  const moh::TensorInfo& w = st.info("w");
  EXPECT_EQ(w.name, "w");
  EXPECT_EQ(w.dtype, moh::DType::F32);
  EXPECT_EQ(w.begin, 3u);
  EXPECT_EQ(w.end, 27u);
  EXPECT_EQ(w.nbytes(), 24u);
  EXPECT_EQ(w.numel(), 6);
  EXPECT_EQ(st.raw("w"), st.raw("pad") + 3);
  EXPECT_TRUE(Mentions(error_of([&] { st.file_of("nope"); }), {"tensor 'nope' missing in test.st"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.raw("nope"); }), {"tensor 'nope' missing in test.st"}));
  // Code that takes the base class reads the same tensors.
  const moh::TensorSource& source = st;
  EXPECT_EQ(source.values<float>("w"), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(source.matrix<double>("w", 2, 3)(1, 2), 6.0);
  EXPECT_EQ(source.names(), st.names());
  // Without a name, bytes are "<memory>" in messages.
  const auto unnamed = moh::SafeTensors::from_bytes(make_file({{"x", "U8", {1}, {1}}}));
  EXPECT_EQ(unnamed.source(), "<memory>");
  EXPECT_TRUE(Mentions(error_of([&] { unnamed.info("y"); }), {"tensor 'y' missing in <memory>"}));
}

TEST(SafeTensorsAccess, MissingTensorListsAtMostTwelveNames) {
  std::vector<Entry> entries;
  for (int i = 0; i < 15; ++i) entries.push_back({"t" + std::to_string(10 + i), "U8", {1}, {1}});
  const auto st = load(make_file(entries));
  const std::string msg = error_of([&] { st.info("nope"); });
  EXPECT_TRUE(Mentions(msg, {"tensor 'nope' missing in test.st: expected one of [t10, t11,", "t21, ...]"}));
  EXPECT_EQ(msg.find("t22"), std::string::npos) << msg;
}

// ---- malformed files --------------------------------------------------------------------------

TEST(SafeTensorsMalformed, ShorterThanTheLengthPrefix) {
  EXPECT_TRUE(Mentions(load_error({}), {"test.st", "at least 8 bytes", "got 0"}));
  EXPECT_TRUE(Mentions(load_error({1, 0, 0, 0, 0}), {"at least 8 bytes", "got 5"}));
}

TEST(SafeTensorsMalformed, TruncatedFile) {
  const Bytes good = make_file({{"w", "F32", {2, 2}, le_bytes(std::vector<float>{1, 2, 3, 4})}});
  const std::size_t header_end = good.size() - 16;
  // Cut inside the header: the length prefix claims more than is there.
  EXPECT_TRUE(Mentions(load_error(Bytes(good.begin(), good.begin() + 20)),
                       {"header length exceeds the file", "got " + std::to_string(header_end - 8)}));
  // Cut inside the data: the last tensor's offsets now reach past the end.
  EXPECT_TRUE(Mentions(load_error(Bytes(good.begin(), good.end() - 1)),
                       {"tensor 'w'", "beyond the data", "expected <= 15", "got 16"}));
  // Cut right after the header: no data at all.
  EXPECT_TRUE(Mentions(load_error(Bytes(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(header_end))),
                       {"beyond the data", "expected <= 0"}));
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

// The strict JSON checks of io/json.hpp (tested there with every kind of input) as the reader
// reports them: each names the file and the header.
TEST(SafeTensorsMalformed, HeaderIsParsedStrictly) {
  EXPECT_TRUE(Mentions(load_error(raw_file("{\"a\":}")),
                       {"safetensors file test.st: header is not valid JSON"}));
  EXPECT_TRUE(Mentions(load_error(raw_file("{\"__metadata__\":{\"k\":\"\xC0\x80\"}}")),
                       {"safetensors file test.st: header is not valid UTF-8", "header offset 22"}));
  EXPECT_TRUE(Mentions(load_error(raw_file(std::string(10000, '[') + std::string(10000, ']'))),
                       {"safetensors file test.st: header JSON nests too deeply", "64"}));
  EXPECT_TRUE(Mentions(load_error(raw_file("[]")),
                       {"safetensors file test.st: header: expected a JSON object", "got array"}));
  const std::string header =
      R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})";
  EXPECT_TRUE(Mentions(load_error(raw_file(header, Bytes(2))),
                       {"safetensors file test.st: header repeats the key 'a'"}));
  // Valid multi-byte text is accepted, and brackets in strings are not nesting.
  const auto st = load(raw_file("{\"__metadata__\":{\"k\":\"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\",\"\\\"" +
                                std::string(200, '[') + "\":\"{{{{\"}}"));
  EXPECT_EQ(st.metadata_value("k"), "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80");
  EXPECT_TRUE(st.has_metadata("\"" + std::string(200, '[')));
}

TEST(SafeTensorsMalformed, EntryFieldsAndTypes) {
  EXPECT_TRUE(EntryRefused("[1]", 4, {"tensor 't'", "expected an object", "got array"}));
  EXPECT_TRUE(EntryRefused(R"({"dtype":"U8","shape":[4]})", 4, {"tensor 't'", "no 'data_offsets'"}));
  EXPECT_TRUE(EntryRefused(R"({"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":1})", 4, {"unexpected field 'x'"}));
  EXPECT_TRUE(EntryRefused(R"({"dtype":4,"shape":[4],"data_offsets":[0,4]})", 4, {"dtype: expected a string", "got number 4"}));
  EXPECT_TRUE(EntryRefused(R"({"dtype":"U8","shape":4,"data_offsets":[0,4]})", 4, {"shape: expected an array", "got number 4"}));
  EXPECT_TRUE(EntryRefused(R"({"dtype":"U8","shape":[4],"data_offsets":[0]})", 4, {"data_offsets: expected [begin, end]", "got array [0]"}));
  EXPECT_TRUE(EntryRefused(R"({"dtype":"U8","shape":[4],"data_offsets":[0,4.0]})", 4, {"data_offsets: expected [begin, end]"}));
}

TEST(SafeTensorsMalformed, UnknownDtype) {
  EXPECT_TRUE(EntryRefused(R"({"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]})", 2, {"tensor 't'", "unknown dtype", "got 'F8_E4M3'", "BF16"}));
  EXPECT_TRUE(EntryRefused(R"({"dtype":"f32","shape":[1],"data_offsets":[0,4]})", 4, {"got 'f32'"}));
}

TEST(SafeTensorsMalformed, NegativeDimension) {
  EXPECT_TRUE(EntryRefused(R"({"dtype":"U8","shape":[2,-3],"data_offsets":[0,0]})", 0, {"shape[1]", "non-negative integer", "got number -3"}));
}

TEST(SafeTensorsMalformed, NonIntegerDimension) {
  for (const std::string dim : {"2.5", "2.0", "\"3\"", "true", "null", "1e30", "18446744073709551615"}) {
    EXPECT_TRUE(EntryRefused(R"({"dtype":"U8","shape":[)" + dim + R"(],"data_offsets":[0,0]})", 0, {"shape[0]", "non-negative integer"}))
        << dim;
  }
}

TEST(SafeTensorsMalformed, OverflowingShape) {
  // 2^32 * 2^32 elements overflows; so does 2^62 elements of 4 bytes.
  EXPECT_TRUE(EntryRefused(R"({"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]})", 0, {"too large", "overflow"}));
  EXPECT_TRUE(EntryRefused(R"({"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]})", 0, {"too large"}));
  // A zero dimension does not hide an overflowing product of the others.
  EXPECT_TRUE(EntryRefused(R"({"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]})", 0, {"too large"}));
}

TEST(SafeTensorsMalformed, OffsetsOutsideTheData) {
  EXPECT_TRUE(EntryRefused(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 4, {"tensor 't'", "beyond the data", "expected <= 4", "got 8"}));
  EXPECT_TRUE(EntryRefused(R"({"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,18446744073709551616]})", 4, {"data_offsets"}));
}

TEST(SafeTensorsMalformed, BeginAfterEnd) {
  EXPECT_TRUE(EntryRefused(R"({"dtype":"U8","shape":[2],"data_offsets":[4,2]})", 8, {"expected begin <= end", "got [4, 2]"}));
}

TEST(SafeTensorsMalformed, SizeDisagreesWithShape) {
  EXPECT_TRUE(EntryRefused(R"({"dtype":"F32","shape":[2,3],"data_offsets":[0,20]})", 24, {"tensor 't'", "expected 24 bytes", "F32 [2, 3]", "got 20"}));
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
  const std::vector<std::string> paths = moh_test::fixture_files();  // none is a failure
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
}

}  // namespace
