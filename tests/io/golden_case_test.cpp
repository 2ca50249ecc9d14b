// Tests for moh/io/golden_case.hpp: every golden case in tests/data (MOH_FIXTURES_DIR) passes
// run_case<float>() and run_case<double>(), and none of the 11 shipped cases may be missing (a
// missing case fails, it is never skipped); a hand-built case (expected y from a naive loop MHA
// written here) passes and fails once its y is wrong; malformed metadata throws moh::Error; the
// layer's config comes from the metadata keys that are fields of the config (the configs'
// fields()), and a case with a tensor or a metadata key the runner does not use is refused,
// naming it; an expected zero gate or head-mask entry that the layer computes as non-zero fails
// the exact-zero check; decode_from added to a prefill case still passes.
#include "moh/io/golden_case.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "reference/naive_blocks.hpp"
#include "io/io_test_support.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;
using namespace moh_io_test;  // Bytes, temp_path, write_file, read_file
using moh_test::error_of;
using moh_test::Mentions;

/// The bytes of golden case `name`; a missing case is a test failure (and gives no bytes).
Bytes fixture_bytes(const std::string& name) {
  const std::string path = moh_test::fixture(name);
  return std::filesystem::is_regular_file(path) ? read_file(path) : Bytes();
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

/// The file with one more F32 tensor `name` of `shape` holding `values`, after the others' data.
Bytes with_tensor(const Bytes& file, const std::string& name, const std::vector<std::int64_t>& shape,
                  const std::vector<float>& values) {
  const std::size_t data_size = file.size() - 8 - header_length(file);
  Bytes out = edit_header(file, [&](nlohmann::json& h) {
    h[name] = {{"dtype", "F32"},
               {"shape", shape},
               {"data_offsets", {data_size, data_size + 4 * values.size()}}};
  });
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(values.data());
  out.insert(out.end(), bytes, bytes + 4 * values.size());
  return out;
}

/// The file with metadata `key` set to `value`.
Bytes with_metadata(const Bytes& file, const std::string& key, const std::string& value) {
  return edit_header(file, [&](nlohmann::json& h) { h["__metadata__"][key] = value; });
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

// ---- the shipped golden cases --------------------------------------------------------------------

/// The golden cases that ship with the repository; each must be there.
const std::vector<std::string> kCases = {
    "mha_basic.safetensors",         "mha_causal_padding.safetensors",
    "moa_basic.safetensors",         "moa_causal_padding.safetensors",
    "moh_all_active.safetensors",    "moh_head_dim_causal_padding.safetensors",
    "moh_llama_decode.safetensors",  "moh_llama_prefill.safetensors",
    "moh_routed_only.safetensors",   "moh_shared_routed.safetensors",
    "moh_single_shared.safetensors"};

TEST(GoldenCase, EveryShippedCaseIsThere) {
  for (const std::string& name : kCases) moh_test::fixture(name);  // a missing one fails
  std::vector<std::string> found;
  for (const std::string& path : moh_test::fixture_files())
    found.push_back(std::filesystem::path(path).filename().string());
  for (const std::string& name : kCases)
    EXPECT_NE(std::find(found.begin(), found.end(), name), found.end()) << name;
  EXPECT_GE(found.size(), kCases.size());
}

template <class T>
void run_all_fixtures() {
  std::vector<std::string> files = moh_test::fixture_files();  // none at all is a failure
  for (const std::string& name : kCases) {  // a shipped case that is missing fails by name
    const std::string path = moh_test::fixture(name);
    if (std::find(files.begin(), files.end(), path) == files.end()) files.push_back(path);
  }
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
/// sequence 1 padded. y comes from a naive double MHA written out below (docs/semantics.md §2).
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

  for (const char* key : {"num_heads", "embed_dim", "head_dim", "causal", "layer", "format"}) {
    msg = run_edited([&](nlohmann::json& h) { h["__metadata__"].erase(key); });
    EXPECT_NE(msg.find(key), std::string::npos) << "missing " << key << ": " << msg;
  }
  // head_dim is one of the keys FIXTURES.md lists for every case: without it the case is refused
  // (rather than run with d = D / H, which would hide a file that lost it).
  msg = run_edited([](nlohmann::json& h) { h["__metadata__"].erase("head_dim"); });
  EXPECT_TRUE(Mentions(msg, {"head_dim", "missing"})) << msg;
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

  const Bytes moh = fixture_bytes("moh_shared_routed.safetensors");
  const Bytes moa = fixture_bytes("moa_basic.safetensors");
  const Bytes llama = fixture_bytes("moh_llama_decode.safetensors");
  ASSERT_FALSE(moh.empty() || moa.empty() || llama.empty()) << "golden cases missing";
  const std::vector<std::pair<const Bytes*, Bad>> routed = {
      {&moh, {"shared_heads", "99", "shared_heads"}},
      {&moh, {"active_routed_heads", "99", "active_routed_heads"}},
      {&moh, {"shared_heads", "0", "shared_heads"}},  // with K = 0 too: no head ever active
      {&moa, {"top_k", "0", "top_k"}},
      {&moa, {"top_k", "99", "top_k"}},
      {&moa, {"num_experts", "0", "num_experts"}},
      {&moa, {"num_experts", "1000000", "weights"}},
      {&llama, {"num_kv_heads", "3", "num_kv_heads"}},
      {&llama, {"rope_theta", "-1", "rope_theta"}},  // the config field is rope_theta now
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
  const Bytes golden = fixture_bytes("moh_shared_routed.safetensors");
  ASSERT_FALSE(golden.empty()) << "golden case moh_shared_routed.safetensors missing";
  Bytes file = golden;
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
  const Bytes golden = fixture_bytes("moh_llama_decode.safetensors");
  ASSERT_FALSE(golden.empty()) << "golden case moh_llama_decode.safetensors missing";
  Bytes file = golden;
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
  const Bytes golden = fixture_bytes("moh_llama_prefill.safetensors");
  ASSERT_FALSE(golden.empty()) << "golden case moh_llama_prefill.safetensors missing";
  const Bytes file = golden;
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

// ---- what a case may hold ----------------------------------------------------------------------------

// A tensor the runner would not use (a bias this layer does not have, another layer's weight, a
// misspelt name) is an error naming it, not a case that passes without it.
TEST(GoldenCase, UnknownTensorIsAnError) {
  const HandCase base = hand_built_mha();
  ASSERT_TRUE(moh::run_case<float>(moh::SafeTensors::from_bytes(base.bytes, "hand")).passed());
  const auto run = [](const Bytes& b) {
    return error_of([&] { moh::run_case<float>(moh::SafeTensors::from_bytes(b, "edited")); });
  };
  std::string msg = run(with_tensor(base.bytes, "alibi_slopes", {2, 4, 4}, std::vector<float>(32, 0.0f)));
  EXPECT_TRUE(Mentions(msg, {"case edited", "tensor 'alibi_slopes'", "is not something this mha case runner uses",
                             "expected only [", "in_proj_weight", "key_padding_mask", "memory", "x", "y"}))
      << msg;
  msg = run(with_tensor(base.bytes, "wg.weight", {2, 6}, std::vector<float>(12, 0.0f)));
  EXPECT_TRUE(Mentions(msg, {"tensor 'wg.weight'", "mha case runner"})) << msg;
  msg = run(with_tensor(base.bytes, "out_proj.weigth", {1}, {0.0f}));
  EXPECT_TRUE(Mentions(msg, {"tensor 'out_proj.weigth'"})) << msg;

  // The same in the shipped cases of the other layer kinds.
  const Bytes moh = fixture_bytes("moh_shared_routed.safetensors");
  const Bytes llama = fixture_bytes("moh_llama_prefill.safetensors");
  const Bytes moa = fixture_bytes("moa_basic.safetensors");
  ASSERT_FALSE(moh.empty() || llama.empty() || moa.empty());
  msg = run(with_tensor(moh, "alibi_slopes", {1}, {0.0f}));
  EXPECT_TRUE(Mentions(msg, {"tensor 'alibi_slopes'", "moh case runner", "wg_1.weight", "aux_loss", "gates"})) << msg;
  msg = run(with_tensor(llama, "q_proj.bias", {64}, std::vector<float>(64, 0.0f)));  // LLaMA has none
  EXPECT_TRUE(Mentions(msg, {"tensor 'q_proj.bias'", "moh_llama case runner", "q_proj.weight", "head_mask"}))
      << msg;
  msg = run(with_tensor(moa, "cv_losss", {1}, {0.0f}));
  EXPECT_TRUE(Mentions(msg, {"tensor 'cv_losss'", "moa case runner", "cv_loss", "q_proj.w_gate"})) << msg;
  // An MHA case whose metadata turns its biases off holds biases the layer does not have.
  msg = run(with_metadata(base.bytes, "bias", "0"));
  EXPECT_TRUE(Mentions(msg, {"tensor 'in_proj_bias'", "is not something this mha case runner uses"})) << msg;
}

// A metadata key that is neither a field of the layer's config nor one the runner reads is an
// error naming it: a case that asks for something this runner does not do fails loudly.
TEST(GoldenCase, UnknownMetadataKeyIsAnError) {
  const HandCase base = hand_built_mha();
  const auto run = [](const Bytes& b) {
    return error_of([&] { moh::run_case<float>(moh::SafeTensors::from_bytes(b, "edited")); });
  };
  std::string msg = run(with_metadata(base.bytes, "dropout", "0.1"));
  EXPECT_TRUE(Mentions(msg, {"case edited", "metadata 'dropout'", "is not something this mha case runner reads",
                             "expected only [", "bias", "causal", "decode_from", "embed_dim", "format",
                             "head_dim", "layer", "num_heads", "num_kv_heads", "rope", "rope_theta",
                             "weight_storage"}))
      << msg;
  // Another layer kind's fields are unknown to this one.
  for (const char* key : {"top_k", "shared_heads", "router", "gating"}) {
    msg = run(with_metadata(base.bytes, key, "1"));
    EXPECT_TRUE(Mentions(msg, {std::string("metadata '") + key + "'", "mha case runner reads"})) << msg;
  }
  // The old name of rope_theta is refused, not silently ignored.
  const Bytes llama = fixture_bytes("moh_llama_decode.safetensors");
  ASSERT_FALSE(llama.empty());
  msg = run(with_metadata(llama, "rope_base", "500000.0"));
  EXPECT_TRUE(Mentions(msg, {"metadata 'rope_base'", "moh_llama case runner reads", "rope_theta",
                             "shared_heads", "active_routed_heads"}))
      << msg;
  const Bytes moa = fixture_bytes("moa_basic.safetensors");
  ASSERT_FALSE(moa.empty());
  msg = run(with_metadata(moa, "num_heads", "4"));  // MoA has experts, not heads
  EXPECT_TRUE(Mentions(msg, {"metadata 'num_heads'", "moa case runner reads", "num_experts", "top_k", "gating"}))
      << msg;
}

// The layer's config is read through the configs' fields(): every field, enums by name, and the
// values change what the layer computes.
TEST(GoldenCase, ConfigComesFromTheFieldsOfTheConfig) {
  const HandCase base = hand_built_mha();
  const auto result = [](const Bytes& b) {
    return moh::run_case<float>(moh::SafeTensors::from_bytes(b, "edited"));
  };
  const auto run = [](const Bytes& b) {
    return error_of([&] { moh::run_case<float>(moh::SafeTensors::from_bytes(b, "edited")); });
  };
  // weight_storage, an enum, by name: native is the default; bfloat16 rounds the weights, which
  // moves y beyond the tolerance; anything else is refused with the names it could be.
  EXPECT_TRUE(result(with_metadata(base.bytes, "weight_storage", "native")).passed());
  const moh::CaseResult bf16 = result(with_metadata(base.bytes, "weight_storage", "bfloat16"));
  EXPECT_FALSE(bf16.passed()) << describe(bf16);
  ASSERT_NE(find_check(bf16, "y"), nullptr);
  EXPECT_GT(find_check(bf16, "y")->max_error, find_check(bf16, "y")->tolerance);
  EXPECT_TRUE(Mentions(run(with_metadata(base.bytes, "weight_storage", "int4")),
                       {"metadata 'weight_storage'", "expected one of native, bfloat16", "got 'int4'"}));
  // Booleans are 0 or 1; bias = 1 is what the case has anyway.
  EXPECT_TRUE(result(with_metadata(base.bytes, "bias", "1")).passed());
  EXPECT_TRUE(Mentions(run(with_metadata(base.bytes, "bias", "yes")), {"metadata 'bias'", "expected an integer"}));
  EXPECT_TRUE(Mentions(run(with_metadata(base.bytes, "rope", "2")), {"metadata 'rope'", "expected 0 or 1"}));
  // num_kv_heads = num_heads is the default; 1 needs fewer key/value rows than the file has.
  EXPECT_TRUE(result(with_metadata(base.bytes, "num_kv_heads", "2")).passed());
  EXPECT_TRUE(Mentions(run(with_metadata(base.bytes, "num_kv_heads", "1")), {"in_proj_weight", "[12, 6]", "[18, 6]"}));

  // rope and rope_theta: an MHA case with RoPE turned on no longer matches; the LLaMA case only
  // matches with its own theta (10000 written either way).
  const Bytes mha = fixture_bytes("mha_basic.safetensors");
  const Bytes llama = fixture_bytes("moh_llama_prefill.safetensors");
  ASSERT_FALSE(mha.empty() || llama.empty());
  EXPECT_TRUE(result(with_metadata(mha, "rope", "0")).passed());
  EXPECT_FALSE(result(with_metadata(mha, "rope", "1")).passed());
  EXPECT_TRUE(result(with_metadata(llama, "rope_theta", "10000")).passed());
  const moh::CaseResult theta = result(with_metadata(llama, "rope_theta", "500000.0"));
  EXPECT_FALSE(theta.passed()) << describe(theta);
  // Numbers must be numbers.
  EXPECT_TRUE(Mentions(run(with_metadata(llama, "rope_theta", "ten")), {"metadata 'rope_theta'", "expected a number"}));
  // The MoH router kind, an enum: the LLaMA runner's query-norm router is its default; a learned
  // router needs weights the case does not have.
  EXPECT_TRUE(result(with_metadata(llama, "router", "query_norm")).passed());
  EXPECT_TRUE(Mentions(run(with_metadata(llama, "router", "clever")),
                       {"metadata 'router'", "expected one of learned, query_norm", "got 'clever'"}));
  EXPECT_TRUE(Mentions(run(with_metadata(llama, "router", "learned")), {"wg.weight"}));
  // The MoA gating, an enum: top_k_softmax gives other gates than the case's softmax.
  const Bytes moa = fixture_bytes("moa_basic.safetensors");
  ASSERT_FALSE(moa.empty());
  EXPECT_TRUE(result(with_metadata(moa, "gating", "softmax")).passed());
  EXPECT_FALSE(result(with_metadata(moa, "gating", "top_k_softmax")).passed());
  EXPECT_TRUE(Mentions(run(with_metadata(moa, "gating", "noisy")),
                       {"metadata 'gating'", "expected one of softmax, top_k_softmax"}));
}

// A "memory" tensor makes the case cross-attention: keys and values from the memory. With the
// memory equal to x (and the same causal alignment) it is the self-attention case again.
TEST(GoldenCase, MemoryMakesItCrossAttention) {
  const HandCase base = hand_built_mha();
  const moh::SafeTensors st = moh::SafeTensors::from_bytes(base.bytes);
  const std::vector<float> x = st.values<float>("x");
  const moh::CaseResult same =
      moh::run_case<float>(moh::SafeTensors::from_bytes(with_tensor(base.bytes, "memory", {2, 4, 6}, x), "cross"));
  EXPECT_TRUE(same.passed()) << describe(same);
  std::vector<float> other = x;
  for (float& v : other) v = -v;
  const moh::CaseResult different =
      moh::run_case<float>(moh::SafeTensors::from_bytes(with_tensor(base.bytes, "memory", {2, 4, 6}, other), "cross"));
  EXPECT_FALSE(different.passed());
  // The memory's width must be the layer's.
  const std::string msg = error_of([&] {
    moh::run_case<float>(moh::SafeTensors::from_bytes(
        with_tensor(base.bytes, "memory", {2, 4, 3}, std::vector<float>(24, 0.0f)), "cross"));
  });
  EXPECT_TRUE(Mentions(msg, {"memory"})) << msg;
}

// decode_from on an MHA case: the prompt in one call, then token by token through the cache.
TEST(GoldenCase, DecodeFromAddedToAnMhaCaseStillPasses) {
  const Bytes mha = fixture_bytes("mha_causal_padding.safetensors");  // causal, padded, T = 7
  ASSERT_FALSE(mha.empty());
  for (const char* P : {"0", "1", "3", "7"}) {
    const moh::CaseResult r =
        moh::run_case<float>(moh::SafeTensors::from_bytes(with_metadata(mha, "decode_from", P), "edited"));
    EXPECT_TRUE(r.passed()) << "decode_from " << P << ": " << describe(r);
  }
  const HandCase hand = hand_built_mha();  // T = 4, the last token of sequence 1 padded
  for (const char* P : {"0", "2", "4"}) {
    const moh::CaseResult r = moh::run_case<double>(
        moh::SafeTensors::from_bytes(with_metadata(hand.bytes, "decode_from", P), "edited"));
    EXPECT_TRUE(r.passed()) << "decode_from " << P << ": " << describe(r);
  }
}

}  // namespace
