// Tests for moh/golden_case.hpp: every golden case under MOH_FIXTURES_DIR passes run_case<float>()
// and run_case<double>(); a hand-built case (expected y from a naive loop MHA written here) passes
// and fails once its y is wrong; malformed metadata throws moh::Error; an expected zero gate or
// head-mask entry that the layer computes as non-zero fails the exact-zero check; decode_from
// added to a prefill case still passes.
#include "moh/golden_case.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <filesystem>
#include <vector>

#include "reference/naive_blocks.hpp"

namespace {

using Bytes = std::vector<std::uint8_t>;
using moh::Index;

std::string fixtures_dir() {
#ifdef MOH_FIXTURES_DIR
  return MOH_FIXTURES_DIR;
#else
  return "";
#endif
}

/// Sorted *.safetensors paths under MOH_FIXTURES_DIR (empty if the folder is unset or missing).
std::vector<std::string> fixture_files() {
  std::vector<std::string> out;
  const std::string dir = fixtures_dir();
  std::error_code ec;
  if (dir.empty() || !std::filesystem::is_directory(dir, ec)) return out;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec))
    if (entry.path().extension() == ".safetensors") out.push_back(entry.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// Path of the named fixture, or "" (then the calling test skips).
std::string fixture(const std::string& name) {
  const std::string path = fixtures_dir() + "/" + name;
  std::error_code ec;
  return fixtures_dir().empty() || !std::filesystem::exists(path, ec) ? "" : path;
}

std::uint64_t header_length(const Bytes& b) {
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(b[i]) << (8 * i);
  return n;
}

/// The file with its JSON header replaced by edit(header); the data section is kept as is.
Bytes edit_header(const Bytes& file, const std::function<void(nlohmann::json&)>& edit) {
  const std::uint64_t n = header_length(file);
  nlohmann::json header = nlohmann::json::parse(file.begin() + 8, file.begin() + 8 + n);
  edit(header);
  const std::string text = header.dump();
  Bytes out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(text.size() >> (8 * i)));
  out.insert(out.end(), text.begin(), text.end());
  out.insert(out.end(), file.begin() + 8 + n, file.end());
  return out;
}

/// Reads / writes element i of an F32 tensor in the file's bytes.
float get_f32(const Bytes& file, const std::string& tensor, std::size_t i) {
  const moh::SafeTensors st = moh::SafeTensors::from_bytes(file);
  float v;
  std::memcpy(&v, st.raw(tensor) + 4 * i, 4);
  return v;
}
void set_f32(Bytes& file, const std::string& tensor, std::size_t i, float v) {
  const moh::SafeTensors st = moh::SafeTensors::from_bytes(file);
  const std::size_t offset = 8 + header_length(file) + st.info(tensor).begin + 4 * i;
  std::memcpy(file.data() + offset, &v, 4);
}

std::string describe(const moh::CaseResult& r) {
  std::string s = "layer " + r.layer + ":";
  for (const moh::CaseCheck& c : r.checks)
    s += " " + c.name + " (max error " + std::to_string(c.max_error) + ", tolerance " +
         std::to_string(c.tolerance) + (c.zeros_exact ? "" : ", expected zero computed non-zero") +
         (c.passed() ? ") ok;" : ") FAILED;");
  return s;
}

const moh::CaseCheck* find_check(const moh::CaseResult& r, const std::string& name) {
  for (const moh::CaseCheck& c : r.checks)
    if (c.name == name) return &c;
  return nullptr;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const moh::Error& e) {
    return e.what();
  }
  return "";
}

// ---- the shipped golden cases --------------------------------------------------------------------

template <class T>
void run_all_fixtures() {
  const std::vector<std::string> files = fixture_files();
  if (files.empty()) GTEST_SKIP() << "no *.safetensors under MOH_FIXTURES_DIR '" << fixtures_dir() << "'";
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    try {
      const moh::CaseResult r = moh::run_case<T>(moh::SafeTensors::open(path));
      EXPECT_TRUE(r.passed()) << path << ": " << describe(r);
      EXPECT_FALSE(r.checks.empty()) << path;
    } catch (const std::exception& e) {
      ADD_FAILURE() << path << " threw: " << e.what();
    }
  }
}

TEST(GoldenCase, EveryFixturePassesInFloat) { run_all_fixtures<float>(); }

TEST(GoldenCase, EveryFixturePassesInDouble) { run_all_fixtures<double>(); }

// ---- a hand-built case ----------------------------------------------------------------------------

struct HandCase {
  Bytes bytes;
  std::vector<float> y;  // expected output as stored
};

/// An "mha" case built here: B = 2, T = 4, D = 6, H = 2, d = 3, causal, with the last token of
/// sequence 1 padded. y comes from a naive double MHA written out below (SEMANTICS section 2).
HandCase hand_built_mha(const std::function<void(std::vector<float>&)>& corrupt_y = nullptr) {
  const Index B = 2, T = 4, D = 6, H = 2, d = 3;
  const moh::Matrix<float> W = moh_test::random_matrix<float>(3 * H * d, D, 1, 0.5);
  const moh::Matrix<float> bW = moh_test::random_matrix<float>(1, 3 * H * d, 2, 0.5);
  const moh::Matrix<float> O = moh_test::random_matrix<float>(D, H * d, 3, 0.5);
  const moh::Matrix<float> bO = moh_test::random_matrix<float>(1, D, 4, 0.5);
  const moh::Matrix<float> X = moh_test::random_matrix<float>(B * T, D, 5);
  const bool pad[B][T] = {{false, false, false, false}, {false, false, false, true}};

  std::vector<float> y;
  for (Index b = 0; b < B; ++b) {
    const moh::Matrix<double> qkv = moh_test::naive_linear(
        X.middleRows(b * T, T), W, std::vector<double>(bW.data(), bW.data() + bW.size()));
    moh::Matrix<double> concat(T, H * d);
    std::vector<Index> pos = {0, 1, 2, 3};
    std::vector<bool> padding(pad[b], pad[b] + T);
    for (Index h = 0; h < H; ++h) {
      const moh::Matrix<double> q = qkv.middleCols(h * d, d);
      const moh::Matrix<double> k = qkv.middleCols(H * d + h * d, d);
      const moh::Matrix<double> v = qkv.middleCols(2 * H * d + h * d, d);
      concat.middleCols(h * d, d) = moh_test::naive_attention(
          q, k, v, pos, 1.0 / std::sqrt(3.0), moh_test::NaiveMask{true, 0, padding});
    }
    const moh::Matrix<double> out =
        moh_test::naive_linear(concat, O, std::vector<double>(bO.data(), bO.data() + bO.size()));
    for (Index i = 0; i < out.size(); ++i) y.push_back(static_cast<float>(out.data()[i]));
  }
  if (corrupt_y) corrupt_y(y);

  // Write the file: weights, x, key_padding_mask (BOOL), y, metadata.
  nlohmann::json header = nlohmann::json::object();
  Bytes data;
  auto add = [&](const std::string& name, const std::string& dtype,
                 std::vector<std::int64_t> shape, const void* p, std::size_t n) {
    const std::size_t begin = data.size();
    const auto* bytes = static_cast<const std::uint8_t*>(p);
    data.insert(data.end(), bytes, bytes + n);
    header[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, data.size()}}};
  };
  add("in_proj_weight", "F32", {3 * H * d, D}, W.data(), 4 * W.size());
  add("in_proj_bias", "F32", {3 * H * d}, bW.data(), 4 * bW.size());
  add("out_proj.weight", "F32", {D, H * d}, O.data(), 4 * O.size());
  add("out_proj.bias", "F32", {D}, bO.data(), 4 * bO.size());
  add("x", "F32", {B, T, D}, X.data(), 4 * X.size());
  std::uint8_t mask_bytes[B * T];
  for (Index i = 0; i < B * T; ++i) mask_bytes[i] = pad[i / T][i % T] ? 1 : 0;
  add("key_padding_mask", "BOOL", {B, T}, mask_bytes, sizeof(mask_bytes));
  add("y", "F32", {B, T, D}, y.data(), 4 * y.size());
  header["__metadata__"] = {{"format", "moh-case/1"}, {"layer", "mha"},   {"embed_dim", "6"},
                            {"num_heads", "2"},        {"head_dim", "3"}, {"causal", "1"}};
  const std::string text = header.dump();
  HandCase c;
  for (int i = 0; i < 8; ++i) c.bytes.push_back(static_cast<std::uint8_t>(text.size() >> (8 * i)));
  c.bytes.insert(c.bytes.end(), text.begin(), text.end());
  c.bytes.insert(c.bytes.end(), data.begin(), data.end());
  c.y = y;
  return c;
}

TEST(GoldenCase, HandBuiltCasePassesAndWrongYFails) {
  const HandCase good = hand_built_mha();
  const moh::CaseResult ok = moh::run_case<float>(moh::SafeTensors::from_bytes(good.bytes, "hand"));
  EXPECT_TRUE(ok.passed()) << describe(ok);
  EXPECT_EQ(ok.layer, "mha");
  ASSERT_NE(find_check(ok, "y"), nullptr);
  EXPECT_LE(find_check(ok, "y")->max_error, 1e-6);

  // One entry off by 0.01 (tolerance is 1e-4 * max(1, max|y|), and |y| < 5 here).
  const HandCase bad = hand_built_mha([](std::vector<float>& y) { y[17] += 0.01f; });
  const moh::CaseResult r = moh::run_case<float>(moh::SafeTensors::from_bytes(bad.bytes, "hand"));
  EXPECT_FALSE(r.passed());
  const moh::CaseCheck* y = find_check(r, "y");
  ASSERT_NE(y, nullptr);
  EXPECT_FALSE(y->passed());
  EXPECT_NEAR(y->max_error, 0.01, 1e-4);
}

TEST(GoldenCase, NanExpectedValueFails) {
  // A NaN in an expected tensor can never be matched: |c - NaN| <= tol is false. (A corrupted
  // golden file must not pass silently.)
  const HandCase nan = hand_built_mha([](std::vector<float>& y) { y[3] = NAN; });
  const moh::CaseResult r = moh::run_case<float>(moh::SafeTensors::from_bytes(nan.bytes, "hand"));
  EXPECT_FALSE(r.passed()) << describe(r);
  // An infinite expected value fails as well instead of making the tolerance infinite.
  const HandCase inf = hand_built_mha([](std::vector<float>& y) { y[5] = INFINITY; });
  EXPECT_FALSE(moh::run_case<float>(moh::SafeTensors::from_bytes(inf.bytes, "hand")).passed());
}

// ---- malformed cases ---------------------------------------------------------------------------------

TEST(GoldenCase, MalformedMetadataThrows) {
  const HandCase base = hand_built_mha();
  auto run_edited = [&](const std::function<void(nlohmann::json&)>& edit) {
    const Bytes b = edit_header(base.bytes, edit);
    return error_of([&] { moh::run_case<float>(moh::SafeTensors::from_bytes(b, "edited")); });
  };
  // Sanity: an identity edit still passes.
  EXPECT_TRUE(moh::run_case<float>(moh::SafeTensors::from_bytes(
                                       edit_header(base.bytes, [](nlohmann::json&) {}), "same"))
                  .passed());

  std::string msg = run_edited([](nlohmann::json& h) { h["__metadata__"]["layer"] = "xyz"; });
  EXPECT_NE(msg.find("xyz"), std::string::npos) << msg;

  msg = run_edited([](nlohmann::json& h) { h["__metadata__"]["embed_dim"] = "abc"; });
  EXPECT_NE(msg.find("embed_dim"), std::string::npos) << msg;
  EXPECT_NE(msg.find("abc"), std::string::npos) << msg;
  for (const char* bad : {"12abc", "", " 6x", "1e3"}) {
    msg = run_edited([&](nlohmann::json& h) { h["__metadata__"]["num_heads"] = bad; });
    EXPECT_NE(msg.find("num_heads"), std::string::npos) << "'" << bad << "': " << msg;
  }
  msg = run_edited([](nlohmann::json& h) { h["__metadata__"]["causal"] = "2"; });
  EXPECT_NE(msg.find("causal"), std::string::npos) << msg;

  for (const char* key : {"num_heads", "embed_dim", "causal", "layer", "format", "head_dim"}) {
    msg = run_edited([&](nlohmann::json& h) { h["__metadata__"].erase(key); });
    EXPECT_NE(msg.find(key), std::string::npos) << "missing " << key << ": " << msg;
  }
  msg = run_edited([](nlohmann::json& h) { h["__metadata__"]["format"] = "moh-case/2"; });
  EXPECT_NE(msg.find("moh-case/2"), std::string::npos) << msg;
  // An expected tensor that is missing, or of the wrong size, is an error too.
  msg = run_edited([](nlohmann::json& h) { h.erase("y"); });
  EXPECT_NE(msg.find("'y'"), std::string::npos) << msg;
  msg = run_edited([](nlohmann::json& h) {
    h["y"]["shape"] = {2, 4, 3};
    h["y"]["data_offsets"][1] = h["y"]["data_offsets"][0].get<std::size_t>() + 4 * 24;
  });
  EXPECT_FALSE(msg.empty());
}

// Layer settings in the metadata that no layer can have are a moh::Error naming the setting,
// never a crash or an allocation the file cannot back.
TEST(GoldenCase, ImpossibleLayerSettingsThrow) {
  const HandCase base = hand_built_mha();
  auto error_with = [](const Bytes& file, const char* key, const std::string& value) {
    const Bytes b = edit_header(file, [&](nlohmann::json& h) { h["__metadata__"][key] = value; });
    return error_of([&] { moh::run_case<float>(moh::SafeTensors::from_bytes(b, "edited")); });
  };
  struct Bad { const char* key; std::string value; const char* mentions; };
  const std::vector<Bad> mha = {
      {"num_heads", "0", "num_heads"},
      {"num_heads", "-2", "num_heads"},
      {"num_heads", "4", "expected"},    // 3 * 4 * 3 query/key/value rows, the file has 18
      {"head_dim", "0", "divisible"},     // d = D / H needs H | D, and 6 / 4 is not whole
      {"embed_dim", "4000000000", "embed_dim"},
      {"embed_dim", "2147483648", "weights"},  // in range, but far beyond the file's values
      {"head_dim", "2147483648", "weights"},
  };
  for (const Bad& bad : mha) {
    std::string edited = std::string(bad.key) == "head_dim" && bad.value == "0" ? "4" : "";
    Bytes file = base.bytes;
    if (!edited.empty())  // num_heads 4 with head_dim 0
      file = edit_header(file, [&](nlohmann::json& h) { h["__metadata__"]["num_heads"] = edited; });
    const std::string msg = error_with(file, bad.key, bad.value);
    EXPECT_NE(msg.find(bad.mentions), std::string::npos) << bad.key << "=" << bad.value << ": " << msg;
  }

  auto fixture_bytes = [](const std::string& name) {
    const std::string path = fixture(name);
    return path.empty() ? Bytes() : read_bytes(path);
  };
  const Bytes moh = fixture_bytes("moh_shared_routed.safetensors");
  const Bytes moa = fixture_bytes("moa_basic.safetensors");
  const Bytes llama = fixture_bytes("moh_llama_decode.safetensors");
  if (moh.empty() || moa.empty() || llama.empty()) GTEST_SKIP() << "fixtures not available";
  const std::vector<std::pair<const Bytes*, Bad>> routed = {
      {&moh, {"shared_heads", "99", "shared_heads"}},
      {&moh, {"active_routed_heads", "99", "active_routed_heads"}},
      {&moh, {"shared_heads", "0", "shared_heads"}},  // with K = 0 too: no head ever active
      {&moa, {"top_k", "0", "top_k"}},
      {&moa, {"top_k", "99", "top_k"}},
      {&moa, {"num_experts", "0", "num_experts"}},
      {&moa, {"num_experts", "1000000", "weights"}},
      {&llama, {"num_kv_heads", "3", "num_kv_heads"}},
      {&llama, {"rope_theta", "-1", "rope_base"}},
      {&llama, {"rope_theta", "nan", "rope_theta"}},
      {&llama, {"decode_from", "100000", "decode_from"}},
  };
  for (const auto& [file, bad] : routed) {
    Bytes b = *file;
    if (std::string(bad.key) == "shared_heads" && bad.value == "0")
      b = edit_header(b, [](nlohmann::json& h) { h["__metadata__"]["active_routed_heads"] = "0"; });
    const std::string msg = error_with(b, bad.key, bad.value);
    EXPECT_NE(msg.find(bad.mentions), std::string::npos) << bad.key << "=" << bad.value << ": " << msg;
  }
}

TEST(GoldenCase, ExpectedZeroGateComputedNonZeroFailsExactZeroCheck) {
  const std::string path = fixture("moh_shared_routed.safetensors");
  if (path.empty()) GTEST_SKIP() << "fixture moh_shared_routed.safetensors not available";
  Bytes file = read_bytes(path);
  // Pick the first routed gate that is on (heads 0, 1 are shared; gates [2, 6, 8]).
  std::size_t pick = 0;
  for (std::size_t i = 0; i < 2 * 6 * 8; ++i)
    if (i % 8 >= 2 && get_f32(file, "gates", i) != 0.0f) {
      pick = i;
      break;
    }
  ASSERT_NE(pick, 0u);
  set_f32(file, "gates", pick, 0.0f);
  const moh::CaseResult r = moh::run_case<float>(moh::SafeTensors::from_bytes(file, "edited"));
  EXPECT_FALSE(r.passed());
  const moh::CaseCheck* g = find_check(r, "gates");
  ASSERT_NE(g, nullptr);
  EXPECT_FALSE(g->zeros_exact) << describe(r);
  EXPECT_TRUE(find_check(r, "y")->passed()) << describe(r);  // only the gates were edited
}

TEST(GoldenCase, ExpectedZeroHeadMaskComputedOneFails) {
  const std::string path = fixture("moh_llama_decode.safetensors");
  if (path.empty()) GTEST_SKIP() << "fixture moh_llama_decode.safetensors not available";
  Bytes file = read_bytes(path);
  // head_mask [2, 10, 8]; heads 0..3 are shared (always 1): turn one off in the expectation.
  ASSERT_EQ(get_f32(file, "head_mask", 8 * 7 + 1), 1.0f);
  set_f32(file, "head_mask", 8 * 7 + 1, 0.0f);
  const moh::CaseResult r = moh::run_case<float>(moh::SafeTensors::from_bytes(file, "edited"));
  EXPECT_FALSE(r.passed());
  const moh::CaseCheck* m = find_check(r, "head_mask");
  ASSERT_NE(m, nullptr);
  EXPECT_FALSE(m->zeros_exact);
  EXPECT_DOUBLE_EQ(m->max_error, 1.0);
}

TEST(GoldenCase, DecodeFromAddedToPrefillCaseStillPasses) {
  // moh_llama_prefill (T = 9) run as a prompt of P tokens and then one token per cache call must
  // give the same y and head_mask for every P.
  const std::string path = fixture("moh_llama_prefill.safetensors");
  if (path.empty()) GTEST_SKIP() << "fixture moh_llama_prefill.safetensors not available";
  const Bytes file = read_bytes(path);
  for (const char* P : {"0", "1", "4", "9"}) {
    const Bytes b = edit_header(file, [&](nlohmann::json& h) { h["__metadata__"]["decode_from"] = P; });
    const moh::CaseResult r = moh::run_case<float>(moh::SafeTensors::from_bytes(b, "edited"));
    EXPECT_TRUE(r.passed()) << "decode_from " << P << ": " << describe(r);
  }
  for (const char* P : {"10", "-1", "two"}) {
    const Bytes b = edit_header(file, [&](nlohmann::json& h) { h["__metadata__"]["decode_from"] = P; });
    const std::string msg =
        error_of([&] { moh::run_case<float>(moh::SafeTensors::from_bytes(b, "edited")); });
    EXPECT_NE(msg.find("decode_from"), std::string::npos) << P << ": " << msg;
  }
}

}  // namespace
