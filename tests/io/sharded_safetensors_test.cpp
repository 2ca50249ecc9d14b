// Tests for moh::ShardedSafeTensors (io/sharded_safetensors.hpp): shards and an index written with
// moh::SafeTensorsWriter into a fresh temporary folder, read back through the TensorSource
// interface it shares with SafeTensors; one test per kind of bad index or shard (each must raise a
// moh::Error naming the problem).
#include "moh/io/sharded_safetensors.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "moh/io/safetensors.hpp"
#include "moh/io/safetensors_writer.hpp"
#include "moh/io/tensor_source.hpp"

#include "test_helpers.hpp"

namespace {

using moh_test::error_of;
using moh_test::Mentions;

namespace fs = std::filesystem;
using moh::DType;

/// Gives each test its own empty folder under the system temp folder, removed afterwards.
class ShardedSafeTensors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
    dir_ = fs::temp_directory_path() / ("moh_sharded_" + std::string(info->name()) + "_" +
                                        std::to_string(stamp) + "_" +
                                        std::to_string(std::random_device{}()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  void write_text(const std::string& name, const std::string& text) const {
    std::ofstream out(path(name), std::ios::binary | std::ios::trunc);
    out << text;
  }

  /// Three shards (one in a subfolder) and an index; "extra" sits in shard 2 but not in the map.
  std::string write_checkpoint() const {
    moh::Matrix<float> w(2, 3);
    w << 1, 2, 3, 4, 5, 6;
    moh::Vector<double> b(3);
    b << 0.5, -1.5, 2.0;
    moh::Tensor3<float> x(1, 2, 2);
    x.setValues({{{1, 2}, {3, 4}}});
    moh::Mask mask(1, 2);
    mask.setValues({{false, true}});

    moh::SafeTensorsWriter s1, s2, s3;
    s1.add("layer.0.w", w);
    s1.add("layer.0.b", b, DType::F32);
    s1.set_metadata("format", "pt");
    s2.add("layer.1.w16", w, DType::F16);
    s2.add("extra", std::vector<float>{9}, {1});
    s3.add("x", x, DType::BF16);
    s3.add("mask", mask);
    s3.add("ids", std::vector<std::int64_t>{3, -4}, {2});
    fs::create_directories(dir_ / "sub");
    s1.write(path("model-00001-of-00003.safetensors"));
    s2.write(path("model-00002-of-00003.safetensors"));
    s3.write(path("sub/model-00003-of-00003.safetensors"));
    write_text("model.safetensors.index.json", R"({
      "metadata": {"total_size": 1234, "format": "pt"},
      "weight_map": {
        "layer.0.w": "model-00001-of-00003.safetensors",
        "layer.0.b": "./model-00001-of-00003.safetensors",
        "layer.1.w16": "model-00002-of-00003.safetensors",
        "x": "sub/model-00003-of-00003.safetensors",
        "mask": "sub/model-00003-of-00003.safetensors",
        "ids": "sub//model-00003-of-00003.safetensors"
      },
      "some_future_key": [1, 2, 3]
    })");
    return path("model.safetensors.index.json");
  }

  /// One small shard "a.safetensors" holding tensor "t".
  void write_shard_a() const {
    moh::SafeTensorsWriter w;
    w.add("t", std::vector<float>{1, 2}, {2});
    w.write(path("a.safetensors"));
  }

  /// The error of opening an index with text `json` (with shard a.safetensors beside it).
  std::string index_error(const std::string& json) const {
    write_shard_a();
    write_text("bad.index.json", json);
    return error_of([&] { moh::ShardedSafeTensors::open(path("bad.index.json")); });
  }

  fs::path dir_;
};

/// The distinct files a source reads its tensors from.
std::set<std::string> files_of(const moh::TensorSource& source) {
  std::set<std::string> files;
  for (const std::string& name : source.names()) files.insert(source.file_of(name));
  return files;
}

/// Code templated on the source, as a loader would be.
template <class Source>
float sum_of_matrix(const Source& source, const std::string& name, moh::Index rows, moh::Index cols) {
  return source.template matrix<float>(name, rows, cols).sum();
}

TEST_F(ShardedSafeTensors, ReadsEveryTensorOfThreeShards) {
  const auto st = moh::ShardedSafeTensors::open(write_checkpoint());
  EXPECT_EQ(st.names(), (std::vector<std::string>{"ids", "layer.0.b", "layer.0.w", "layer.1.w16",
                                                  "mask", "x"}));
  EXPECT_EQ(files_of(st).size(), 3u);  // "./a" and "a" (and "sub//c", "sub/c") open once
  EXPECT_TRUE(st.contains("layer.0.w"));
  EXPECT_FALSE(st.contains("extra"));  // in a shard, but not in the weight map

  moh::Matrix<float> w(2, 3);
  w << 1, 2, 3, 4, 5, 6;
  EXPECT_EQ(st.matrix<float>("layer.0.w", 2, 3), w);
  EXPECT_EQ(st.matrix<float>("layer.1.w16", 2, 3), w);
  EXPECT_EQ(st.info("layer.1.w16").dtype, DType::F16);
  EXPECT_EQ(st.info("layer.0.b").dtype, DType::F32);
  EXPECT_EQ(st.vector<double>("layer.0.b", 3)(1), -1.5);
  EXPECT_EQ(st.values<float>("layer.0.b"), (std::vector<float>{0.5f, -1.5f, 2.0f}));
  EXPECT_EQ(st.values<float>("layer.0.b", {3}).size(), 3u);
  const moh::Tensor3<float> x = st.tensor3<float>("x");
  EXPECT_EQ(x.dimension(1), 2);
  EXPECT_EQ(x(0, 1, 0), 3.0f);
  const moh::Mask mask = st.mask("mask");
  EXPECT_FALSE(mask(0, 0));
  EXPECT_TRUE(mask(0, 1));
  EXPECT_EQ(st.values<std::int64_t>("ids"), (std::vector<std::int64_t>{3, -4}));
  EXPECT_EQ(st.raw("ids")[0], 3);

  EXPECT_EQ(st.source(), path("model.safetensors.index.json"));
  EXPECT_EQ(st.metadata_value("total_size"), "1234");
  EXPECT_EQ(st.metadata_value("format"), "pt");
  EXPECT_TRUE(st.has_metadata("total_size"));
  EXPECT_FALSE(st.has_metadata("missing"));
  EXPECT_TRUE(Mentions(error_of([&] { st.metadata_value("missing"); }),
                       {"metadata key 'missing'", "model.safetensors.index.json"}));
  // file_of names the shard a tensor lives in (shard_of is gone).
  EXPECT_TRUE(Mentions(st.file_of("x"), {"sub", "model-00003-of-00003.safetensors"}));
  EXPECT_EQ(st.file_of("x"), path("sub/model-00003-of-00003.safetensors"));
  EXPECT_EQ(st.file_of("ids"), st.file_of("x"));
  EXPECT_EQ(st.file_of("layer.0.b"), path("model-00001-of-00003.safetensors"));  // "./" dropped
  EXPECT_EQ(st.file_of("layer.0.w"), st.file_of("layer.0.b"));
  EXPECT_EQ(st.file_of("layer.1.w16"), path("model-00002-of-00003.safetensors"));
  // A tensor a shard holds beyond the weight map is not exposed.
  EXPECT_TRUE(moh::SafeTensors::open(st.file_of("layer.1.w16")).contains("extra"));
  EXPECT_TRUE(Mentions(error_of([&] { st.file_of("extra"); }), {"tensor 'extra' missing in"}));
}

TEST_F(ShardedSafeTensors, ReadErrorsNameTheShardFile) {
  const auto st = moh::ShardedSafeTensors::open(write_checkpoint());
  EXPECT_TRUE(Mentions(error_of([&] { st.matrix<float>("layer.1.w16", 3, 2); }),
                       {"tensor 'layer.1.w16'", "model-00002-of-00003.safetensors",
                        "expected shape [3, 2], got [2, 3]"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.values<float>("x", {2, 2}); }),
                       {"model-00003-of-00003.safetensors", "expected shape [2, 2]"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.tensor3<float>("layer.0.w"); }),
                       {"model-00001-of-00003.safetensors", "rank-3"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.values<std::int8_t>("layer.0.b"); }),
                       {"tensor 'layer.0.b'", "model-00001-of-00003.safetensors", "int8", "got 0.5"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.info("extra"); }),
                       {"tensor 'extra' missing in", "model.safetensors.index.json", "ids"}));
}

TEST_F(ShardedSafeTensors, SingleFileOpens) {
  write_shard_a();
  moh::SafeTensorsWriter w;
  const moh::Matrix<float> m = moh::Matrix<float>::Constant(2, 2, 1.5f);
  w.add("m", m);
  w.set_metadata("format", "moh-case/1");
  w.write(path("single.safetensors"));
  const auto st = moh::ShardedSafeTensors::open(path("single.safetensors"));
  EXPECT_EQ(st.names(), std::vector<std::string>{"m"});
  EXPECT_EQ(files_of(st).size(), 1u);
  EXPECT_EQ(st.source(), path("single.safetensors"));
  EXPECT_EQ(st.metadata_value("format"), "moh-case/1");
  EXPECT_EQ(st.matrix<float>("m", 2, 2).sum(), 6.0f);
  EXPECT_EQ(st.file_of("m"), path("single.safetensors"));
  EXPECT_TRUE(Mentions(error_of([&] { st.values<float>("nope"); }), {"tensor 'nope' missing"}));
  EXPECT_TRUE(Mentions(error_of([&] { st.matrix<float>("m", 3, 3); }),
                       {"tensor 'm' in " + path("single.safetensors"), "expected shape [3, 3]"}));
}

TEST_F(ShardedSafeTensors, TemplatedCodeReadsBothSources) {
  const auto sharded = moh::ShardedSafeTensors::open(write_checkpoint());
  const auto single = moh::SafeTensors::open(path("model-00001-of-00003.safetensors"));
  EXPECT_EQ(sum_of_matrix(sharded, "layer.0.w", 2, 3), 21.0f);
  EXPECT_EQ(sum_of_matrix(single, "layer.0.w", 2, 3), 21.0f);
  // Both are TensorSources: code that takes the base class reads either.
  const auto sum_of = [](const moh::TensorSource& source) {
    return source.matrix<float>("layer.0.w", 2, 3).sum();
  };
  EXPECT_EQ(sum_of(sharded), 21.0f);
  EXPECT_EQ(sum_of(single), 21.0f);
  // A copy of a sharded checkpoint shares the shards' bytes.
  const moh::ShardedSafeTensors copy = sharded;
  EXPECT_EQ(copy.raw("x"), sharded.raw("x"));
  EXPECT_EQ(copy.file_of("x"), sharded.file_of("x"));
}

TEST_F(ShardedSafeTensors, IndexWithoutMetadataAndWithEmptyWeightMap) {
  write_shard_a();
  write_text("plain.index.json", R"({"weight_map": {"t": "a.safetensors"}})");
  const auto st = moh::ShardedSafeTensors::open(path("plain.index.json"));
  EXPECT_TRUE(st.metadata().empty());
  EXPECT_EQ(st.values<float>("t"), (std::vector<float>{1, 2}));
  write_text("empty.index.json", R"({"weight_map": {}})");
  EXPECT_TRUE(moh::ShardedSafeTensors::open(path("empty.index.json")).names().empty());
}

TEST_F(ShardedSafeTensors, MissingShardFile) {
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": "a.safetensors", "u": "gone.safetensors"}})"),
                       {"safetensors index", "bad.index.json", "shard 'gone.safetensors'",
                        "for tensor 'u'", "cannot open", "No such file or directory"}));
}

TEST_F(ShardedSafeTensors, CorruptShardFile) {
  write_text("broken.safetensors", "not a safetensors file");
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": "broken.safetensors"}})"),
                       {"shard 'broken.safetensors'", "header length"}));
}

TEST_F(ShardedSafeTensors, TensorMissingInShard) {
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": "a.safetensors", "w": "a.safetensors"}})"),
                       {"weight_map['w']", "expected the tensor in shard", "a.safetensors",
                        "got a shard without it"}));
}

TEST_F(ShardedSafeTensors, ParentDirectoryShardNames) {
  for (const std::string shard : {"../a.safetensors", "sub/../../a.safetensors", "sub/../a.safetensors",
                                  "..", "x/.."}) {
    EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": ")" + shard + R"("}})"),
                         {"weight_map['t']", "no '..'", "got '" + shard + "'"}))
        << shard;
  }
}

TEST_F(ShardedSafeTensors, AbsoluteShardNames) {
  write_shard_a();
  const std::string absolute = path("a.safetensors");  // exists, but absolute names are refused
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": ")" + absolute + R"("}})"),
                       {"weight_map['t']", "relative to the index's folder", "absolute path", absolute}));
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": "/etc/passwd"}})"), {"absolute path '/etc/passwd'"}));
}

TEST_F(ShardedSafeTensors, ShardNamesThatAreNotFiles) {
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": ""}})"), {"weight_map['t']", "got \"\""}));
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": "."}})"), {"weight_map['t']", "folder"}));
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": "sub/"}})"), {"weight_map['t']", "folder"}));
}

TEST_F(ShardedSafeTensors, MalformedIndexJson) {
  EXPECT_TRUE(Mentions(index_error(""), {"safetensors index", "bad.index.json", "not valid JSON"}));
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": "a.safetensors"})"), {"not valid JSON"}));
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": 'a.safetensors'}})"), {"not valid JSON"}));
  EXPECT_TRUE(Mentions(index_error("{\"weight_map\": {\"t\xFF\": \"a.safetensors\"}}"),
                       {"index is not valid UTF-8", "0xff", "index offset 18"}));
  EXPECT_TRUE(Mentions(index_error("{\"x\":" + std::string(5000, '[') + std::string(5000, ']') + "}"),
                       {"index JSON nests too deeply", "64"}));
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": "a.safetensors", "t": "a.safetensors"}})"),
                       {"index repeats the key 't'"}));
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {}, "weight_map": {}})"), {"repeats the key 'weight_map'"}));
  EXPECT_TRUE(Mentions(index_error(R"(["a.safetensors"])"), {"index: expected a JSON object", "got array"}));
}

TEST_F(ShardedSafeTensors, WeightMapNotAnObject) {
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": ["a.safetensors"]})"),
                       {"weight_map: expected an object", "got array"}));
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": "a.safetensors"})"),
                       {"weight_map: expected an object", "got string"}));
  EXPECT_TRUE(Mentions(index_error(R"({"metadata": {}})"), {"expected a \"weight_map\" object", "got no"}));
}

TEST_F(ShardedSafeTensors, NonStringShardName) {
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": 3}})"),
                       {"weight_map['t']", "expected a shard file name (a string)", "got number 3"}));
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": null}})"), {"got null"}));
  EXPECT_TRUE(Mentions(index_error(R"({"weight_map": {"t": ["a.safetensors"]}})"), {"got array"}));
}

TEST_F(ShardedSafeTensors, MetadataNotAnObject) {
  EXPECT_TRUE(Mentions(index_error(R"({"metadata": [1], "weight_map": {"t": "a.safetensors"}})"),
                       {"metadata: expected an object", "got array"}));
}

TEST_F(ShardedSafeTensors, IndexFileProblems) {
  EXPECT_TRUE(Mentions(error_of([&] { moh::ShardedSafeTensors::open(path("none.index.json")); }),
                       {"cannot open safetensors index", "none.index.json", "No such file"}));
  fs::create_directories(dir_ / "folder.json");
  EXPECT_TRUE(Mentions(error_of([&] { moh::ShardedSafeTensors::open(path("folder.json")); }),
                       {"folder.json", "expected a regular file", "got a directory"}));
  // Larger than any accepted header (a sparse file: nothing is written or read).
  write_text("huge.index.json", "{");
  fs::resize_file(path("huge.index.json"), 100000001);
  EXPECT_TRUE(Mentions(error_of([&] { moh::ShardedSafeTensors::open(path("huge.index.json")); }),
                       {"huge.index.json", "index too large", "expected <= 100000000", "got 100000001"}));
}

}  // namespace
